"""Every command and benchmark documents every flag, and the top-level help names every benchmark."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys

import pytest

from dflash_ds.bench.cli import BENCHMARKS
from dflash_ds.cli import COMMANDS

PARSERS = {f"dflash-ds {name}": module for name, (module, _) in COMMANDS.items() if name != "bench"}
PARSERS.update({f"dflash-ds bench {name}": module for name, (module, _) in BENCHMARKS.items()})


def undocumented(parser: argparse.ArgumentParser) -> list[str]:
    """Flags of `parser` (and of its subparsers) without a help text."""
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                missing += undocumented(sub)
        elif action.option_strings and action.help != argparse.SUPPRESS and not (action.help or "").strip():
            missing.append("/".join(action.option_strings))
    return missing


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_every_flag_has_help(command):
    parser = argparse.ArgumentParser(prog=command)
    importlib.import_module(PARSERS[command]).add_arguments(parser)
    assert not undocumented(parser), f"{command}: flags without --help text: {undocumented(parser)}"


def test_top_level_help_names_every_command_and_benchmark():
    out = subprocess.run([sys.executable, "-m", "dflash_ds.cli", "--help"], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert all(name in out for name in COMMANDS), out
    # argparse may wrap the list inside a hyphenated name ("target-" / "load"): compare without the whitespace
    bench_line = "".join(out.split("bench", 1)[1].split("eval")[0].split())
    assert all(name in bench_line for name in BENCHMARKS), bench_line
