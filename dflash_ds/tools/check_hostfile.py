"""`dflash-ds check-hostfile FILE`: validate a deepspeed hostfile before a multi-node launch.

launch/train_deepspeed.sh runs it first, so a malformed hostfile fails with `file:line` before
the deepspeed launcher starts ssh sessions or ranks.
"""

from __future__ import annotations

import argparse

from dflash_ds.distributed.hostfile import parse_hostfile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the check-hostfile arguments."""
    parser.add_argument("hostfile", metavar="FILE", help="deepspeed hostfile: one 'HOST slots=N' line per node")


def run(args: argparse.Namespace) -> int:
    """CLI entry: print each host with its slots and the total; errors exit non-zero."""
    hosts = parse_hostfile(args.hostfile)
    for host, slots in hosts:
        print(f"{host} slots={slots}")
    print(f"check-hostfile: {len(hosts)} host(s), {sum(s for _, s in hosts)} slots in total ({args.hostfile})")
    return 0
