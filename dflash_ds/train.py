"""`python -m dflash_ds.train --config FILE [flags] [--section.key value ...]`

Started by torchrun or the deepspeed launcher, one rank per GPU (CPU processes with gloo
when there is no GPU). The layout decides which ranks run the target and which train the
drafter; everything is validated before any model is loaded.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import textwrap
import traceback

# Short aliases (flag, config field, type, help). Every field also takes --section.key VALUE (parse_overrides);
# --help lists them all from the config dataclasses' field docs (config_fields_help).
FLAGS = [
    ("--target", "target", str, "local HF folder of the frozen target model"),
    ("--data", "data.path", str, "prepared dataset folder (dflash-ds prepare)"),
    ("--drafter", "drafter", str, "start from this exported drafter instead of a fresh init"),
    ("--output-dir", "train.output_dir", str, "run folder: metrics.jsonl, checkpoints, exports"),
    ("--max-steps", "train.max_steps", int, "optimizer steps to run"),
    ("--seed", "train.seed", int, "seed of data order, anchors, noise and init"),
    ("--resume", "train.resume", str, "auto (latest complete checkpoint), none, or a checkpoint path"),
    ("--zero-stage", "train.zero_stage", int, "DeepSpeed ZeRO stage 0..3 (ds_configs/zero{N}.json)"),
    ("--ds-config", "train.ds_config", str, "explicit DeepSpeed JSON (overrides --zero-stage)"),
    ("--global-batch", "train.global_batch", int, "micro-batches per optimizer step over all drafters; each of D "
     "drafters accumulates global_batch / D (default: the checkpoint's, else one per drafter)"),
    ("--gamma", "loss.gamma", float, "position decay gamma of the loss"),
    ("--num-target-ranks", "topology.num_target_ranks", int, "ranks that run the target (the last ones)"),
    ("--targets-per-node", "topology.targets_per_node", int, "per-node layout: the last N local ranks are targets, each feeding the drafters of its own node"),
    ("--target-parallel", "topology.target_parallel", int, "ranks that hold one copy of the target between them "
     "(tensor parallel on one node; `dflash-ds plan` picks it): for a target larger than one GPU"),
    ("--wandb-project", "wandb.project", str, "W&B project"),
    ("--wandb-run-name", "wandb.run_name", str, "W&B run name"),
]


class _HelpFormatter(argparse.HelpFormatter):
    """Wraps help at spaces only (never inside `1e-4` or `non-finite`), with a wider flag column."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 34, width=None) -> None:
        super().__init__(prog, indent_increment, max_help_position, width)

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False, break_long_words=False)


class _TrainParser(argparse.ArgumentParser):
    """Parses exactly like ArgumentParser; its help also lists every config field (`--section.key`)."""

    def format_help(self) -> str:
        return super().format_help() + "\n" + config_fields_help(self.formatter_class(prog=self.prog))


def config_fields_help(formatter: argparse.HelpFormatter) -> str:
    """Every config field, by section: its --section.key flag, value form, doc (config.field_docs) and default.

    Help text only: the flags are not argparse arguments, they reach parse_overrides unparsed."""
    from dflash_ds.config import Config
    from dflash_ds.config_parse import describe_fields

    cfg = Config()
    sections: dict[str, list[argparse.Action]] = {}
    for section, dotted, metavar, default, doc in describe_fields(cfg):
        text = f"{doc} (default: {default})".replace("%", "%%")
        action = argparse.Action([f"--{dotted}"], dest=dotted, metavar=metavar, help=text)
        sections.setdefault(section, []).append(action)
    for section, actions in sections.items():
        klass = type(getattr(cfg, section)) if section else Config
        title = f"config section {section}" if section else "config top-level fields"
        formatter.start_section(f"{title} ({klass.__name__})")
        formatter.add_text((klass.__doc__ or "").strip().splitlines()[0].replace("%", "%%"))
        formatter.add_arguments(actions)
        formatter.end_section()
    return formatter.format_help()


def build_parser() -> argparse.ArgumentParser:
    """Flags of the training entry point; any other `--section.key value` is a config override."""
    p = _TrainParser(prog="python -m dflash_ds.train", description=__doc__.splitlines()[0],
                     formatter_class=_HelpFormatter,
                     epilog="Every config field below can be set with --section.key VALUE or --section.key=VALUE, "
                            "VALUE read as YAML (e.g. --optim.lr 3e-4, --model.target_layer_ids '[1, 2]', "
                            "--wandb.enabled false). Precedence: defaults < --config file < the short flags "
                            "above < --section.key overrides. Fields are defined in dflash_ds/config.py (a drafter "
                            "kind's own, in its module: dflash_ds/config_kinds.py).")
    p.add_argument("--config", help="YAML/JSON run config (defaults: dflash_ds/config.py)")
    short = p.add_argument_group("short flags (each sets the config field named in brackets)")
    for flag, dotted, tp, help_text in FLAGS:
        short.add_argument(flag, type=tp, default=None, help=f"{help_text} [--{dotted}]")
    short.add_argument("--no-wandb", action="store_true", help="do not log to W&B [--wandb.enabled false]")
    short.add_argument("--colocate", action="store_true",
                       help="colocated training: every rank runs the target forward and trains the drafter; works "
                            "on one GPU; --num-target-ranks / --targets-per-node are not used "
                            "[--topology.colocate true]")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def config_from_args(argv: list[str]):
    """Config = defaults < --config file < named flags < --section.key overrides."""
    from dflash_ds.config import load_config

    args, rest = build_parser().parse_known_args(argv)
    overrides: dict = {}
    for flag, dotted, _, _ in FLAGS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            node = overrides
            parts = dotted.split(".")
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            node[parts[-1]] = value
    if args.no_wandb:
        overrides.setdefault("wandb", {})["enabled"] = False
    if args.colocate:
        if args.num_target_ranks is not None or args.targets_per_node is not None:
            from dflash_ds.errors import DFlashError

            raise DFlashError("--colocate runs the target on every rank: drop --num-target-ranks / --targets-per-node")
        overrides.setdefault("topology", {})["colocate"] = True
    from dflash_ds.config import parse_overrides

    extra = parse_overrides(rest)
    _merge(overrides, extra)
    return load_config(args.config, overrides)


def _merge(into: dict, other: dict) -> None:
    for k, v in other.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = v


STACKS_SIGNAL = signal.SIGUSR2


def _stacks_on_signal() -> None:
    """`kill -USR2 PID` prints every thread's Python stack of that rank to its stderr and it goes on (a rank that
    seems stuck: where it waits). Written by the interpreter to fd 2 directly: file names, lines and function names
    only, no values, so nothing for the redaction filter to hide."""
    import faulthandler

    faulthandler.register(STACKS_SIGNAL, file=sys.__stderr__, all_threads=True)


def main(argv: list[str] | None = None, as_rank: bool = False) -> int:
    """Validate everything cheap, then join the role groups and run this rank's role; `as_rank`: this process is the
    rank (python -m dflash_ds.train), whose output is filtered and whose files take train.umask."""
    from dflash_ds.errors import DFlashError
    from dflash_ds.redact import redact, redact_stdio

    argv = sys.argv[1:] if argv is None else argv
    rank = os.environ.get("RANK", "?")
    try:
        cfg = config_from_args(argv)  # first: --help and config errors need no torch
        if as_rank:
            # Under every launcher (torchrun, SLURM, deepspeed with or without ssh) a rank's own prints are
            # filtered from here on, before torch or DeepSpeed is imported and before any file is written. Rank 0
            # runs W&B, which copies the console as it is written (output.log, the cloud): its copier goes under
            # the filter, so it copies filtered text (on top, it was seen copying a secret as printed).
            from dflash_ds.config_rules import umask_of

            w_and_b = cfg.wandb.enabled and rank == "0"
            _stacks_on_signal()
            redact_stdio(["wandb.sdk.lib.console_capture"] if w_and_b else [])
            os.umask(umask_of(cfg.train.umask))
        from dflash_ds.runtime.launch import run_job

        return run_job(cfg)
    except DFlashError as exc:  # an error may quote a flag's value: a secret's shows as *** (dflash_ds/redact.py)
        print(redact(f"dflash-ds train (rank {rank}): error: {exc}"), file=sys.stderr, flush=True)
        return exc.exit_code
    except Exception as exc:  # noqa: BLE001 - name the rank, then fail non-zero
        print(redact(traceback.format_exc()), file=sys.stderr, end="", flush=True)
        print(redact(f"dflash-ds train (rank {rank}): failed: {type(exc).__name__}: {exc}"), file=sys.stderr,
              flush=True)
        return 1


if __name__ == "__main__":
    status = main(as_rank=True)
    if status == 0:  # a finished job: no teardown (process_exit.py)
        from dflash_ds.process_exit import exit_now

        exit_now(status)
    # A stop (75) or a failure keeps the interpreter's exit: when one rank leaves with 75, torchrun SIGTERMs the
    # others, and rank 0 (the store's host) then leaves at once; a target still in its last step needs the
    # store until it has checked out, and the stopped ranks' teardown is the time it has (a quick exit there
    # cost the target its store in tests/test_runtime/test_reliability_table.py).
    raise SystemExit(status)
