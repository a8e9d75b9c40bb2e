"""`dflash-ds bench context-falloff`: held-out tau by context length, a drafter trained short vs one trained long.

Issue 56, point 4, on a tiny target that holds at 32K: the quality target (tiny/quality.py) built with a sliding
window in every layer and trained on conversations of several exchanges, so its answers (copy, repeat or swap the
prompt's words) are right at any depth of a conversation. The bench measures its teacher-forced accuracy on the
answers of a held-out conversation by context bucket first, and stops if it is below `--min-accuracy` anywhere
(tau would then measure the target's failure, not the drafter's). The drafters read every context position (full
attention); per seed:

- `base`: a fresh drafter, `--steps` steps on conversations of at most `--short` tokens (default 2,048),
  `--length // --short` of them a step;
- `short`: the base, `--long-steps` more steps on the same short rows at `--long-lr` (a tenth of `--lr`: where the
  base's schedule ended);
- `long`: the base, `--long-steps` more steps on conversations of at most `--length` tokens (default 32,768), one a
  step: the same steps, anchors a step (`--anchors`: one long row's, or spread evenly over the short rows), lr and
  total tokens as `short`.

A drafter trained on long rows from the start does not learn in these budgets (300 steps of one 32K row: tau
1.01, where 300 steps of 16 2K rows reach 1.67): at init its attention is spread over every context position, and
the answer's prompt is 1/32K of it; long-context training goes on from a short start, as the target models' own
long-context extension does. Each drafter is then served by dflash-ds's decoder (eval/speculative.py, greedy,
outputs checked equal to plain greedy decoding) on held-out prompts whose contexts fill each bucket of
`eval.summary.CONTEXT_EDGES` up to `--length`: a conversation cut before its last answer, `--per-bucket` of them a
bucket. The rows are the target's own text: the answer the target gives greedily to the conversation before it
(the accuracy above), not short rows concatenated with copies.

On a real target (SmolLM2's 8K window) the rows are its own prepared answers and long conversations instead:
`--short-data`, `--long-data`, `--held-out` (bench/context_falloff_data.py).

Cost on 2 CPU cores: the target forward runs in 4,096-position chunks (`TargetSession.prefill`; a sliding
window's mask then spans the chunk, not the whole row: one 32K forward is 38.6 s and 6 GB); a step on one 32K row
takes about 4.4 s, on 16 rows of 2K about 0.6 s.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from dflash_ds.bench.context_falloff_data import Sources, answer_accuracy, data_sources
from dflash_ds.errors import DFlashError

# The target's window and its dialogue rows' length: `make-tiny-target --quality --sliding-window 128`.
DEFAULT_TARGET = {"sliding_window": 128, "row_tokens": 384}
COLUMNS = {"base": "short rows, --steps", "short": "short rows, + --long-steps", "long": "then long rows, --long-steps"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `dflash-ds bench context-falloff`."""
    parser.add_argument("--out", required=True, help="output folder: result.json, table.md, the drafters, and the "
                        "target when --target is not given")
    parser.add_argument("--target", default=None, help="a long-context quality target folder (default: built into "
                        "OUT/target: `make_quality_target` with a 128-position sliding window, then rows of 384 "
                        "tokens; about 75 s)")
    parser.add_argument("--length", type=int, default=32768, help="the long drafter's rows and the longest context "
                        "evaluated, in tokens (default 32768)")
    parser.add_argument("--short", type=int, default=2048, help="the short drafter's rows, in tokens (default 2048)")
    parser.add_argument("--rows", type=int, default=4, help="long training rows (the short drafter gets the same "
                        "tokens in rows of --short; default 4)")
    parser.add_argument("--steps", type=int, default=300, help="AdamW steps on short rows, from a fresh drafter: the "
                        "base both go on from (default 300)")
    parser.add_argument("--long-steps", type=int, default=100, help="steps each drafter goes on from the base: one on "
                        "short rows, the other on long rows (default 100)")
    parser.add_argument("--anchors", type=int, default=256, help="anchors a step: one long row's, or spread evenly "
                        "over the short rows (default 256)")
    parser.add_argument("--long-lr", type=float, default=3e-4, help="peak learning rate of both continuations (default "
                        "3e-4, the base's last: its cosine ends at a tenth of --lr; at 3e-3 a fresh AdamW on one "
                        "long row a step undoes the base in 10 steps, loss 1.86 -> 4.1)")
    parser.add_argument("--layers", type=int, default=2, help="drafter layers (default 2)")
    parser.add_argument("--block-size", type=int, default=8, help="drafter block size (default 8)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    parser.add_argument("--seeds", default="0,1", help="comma-separated seeds of the drafters' init, anchors and row "
                        "order (default 0,1); the spread over them is reported")
    parser.add_argument("--per-bucket", type=int, default=2, help="held-out prompts per context bucket (default 2)")
    parser.add_argument("--max-new-tokens", type=int, default=40, help="tokens decoded per prompt (default 40: an "
                        "answer is 18-34 tokens)")
    parser.add_argument("--min-accuracy", type=float, default=0.99, help="the target's teacher-forced accuracy on "
                        "answers required in every bucket (default 0.99)")
    real = parser.add_argument_group("a real target's own data (bench/context_falloff_data.py): all three folders "
                                     "and --target; --short and --rows are then not read")
    real.add_argument("--short-data", default=None, help="prepared folder of short rows the target answered (the "
                      "base's and the short continuation's)")
    real.add_argument("--long-data", default=None, help="prepared folder of long conversations the target answered "
                      "(`long-conversations`, `regenerate`, `prepare`): the long continuation's, one a step")
    real.add_argument("--held-out", default=None, help="prepared folder of held-out long conversations: cut before an "
                      "answer once per context bucket")
    real.add_argument("--short-batch", type=int, default=8, help="short rows a step (default 8; --anchors spread "
                      "over them)")
    real.add_argument("--mask-token-id", type=int, default=None, help="the drafter's mask token (a target without "
                      "one needs it: 16 on SmolLM2)")
    real.add_argument("--init", choices=("random", "target"), default="random", help="draft layers start random or "
                      "as the target's last (the trainer's model.init; default random)")


def run(args: argparse.Namespace) -> int:
    """Build or load the target (or read a real target's prepared data), check it holds, train both drafters per
    seed, evaluate, write the table."""
    seeds = _ints(args.seeds, "--seeds")
    out = Path(args.out)
    clock = time.perf_counter()
    if args.long_data or args.short_data or args.held_out:
        src = data_sources(args)
    else:
        src = _tiny_sources(args, out)
    print("target's teacher-forced accuracy on answers by context: "
          + ", ".join(f"{k} {v:.4f}" for k, v in src.accuracy.items()), flush=True)
    low = {k: v for k, v in src.accuracy.items() if v < args.min_accuracy}
    if low:
        raise DFlashError(f"{src.target_dir}: the target answers below --min-accuracy {args.min_accuracy} at "
                          f"{', '.join(f'{k} ({v:.3f})' for k, v in low.items())}: tau there would measure the "
                          "target, not the drafter (a full-attention target trained on short rows fails past them; "
                          "build one with a sliding window: `dflash-ds make-tiny-target --quality "
                          "--sliding-window 128`; with --held-out, the answers are not this target's greedy ones)")
    out.mkdir(parents=True, exist_ok=True)
    references = [_greedy(src.target, p, args.max_new_tokens) for p in src.prompts]
    flags = {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float)) or v is None}
    result = {"target": str(src.target_dir), "accuracy": src.accuracy, "args": flags,
              "prompt_tokens": [len(p) for p in src.prompts], "runs": {}}
    for seed in seeds:
        short = src.short(seed)
        base = train(src, short, args, args.steps, seed, out / f"base-seed{seed}", src.short_per_step)
        print(f"trained base seed {seed} ({time.perf_counter() - clock:.0f} s)", flush=True)
        drafters = {"base": base}
        for name, states, per_step in (("short", short, src.short_per_step), ("long", src.long(seed),
                                                                                  src.long_per_step)):
            drafters[name] = train(src, states, args, args.long_steps, seed, out / f"{name}-seed{seed}", per_step,
                                   start=base, lr=args.long_lr)
            print(f"trained {name} seed {seed} ({time.perf_counter() - clock:.0f} s)", flush=True)
        for name, drafter in drafters.items():
            taus = serve(src.target, drafter, src.prompts, references, args, f"{name} seed {seed}")
            result["runs"][f"{name}/seed{seed}"] = taus
            print(f"{name} seed {seed}: tau {taus['tau']:.3f}; by context "
                  + ", ".join(f"{k} {b['tau']:.3f}" for k, b in taus["tau_by_context"].items())
                  + f" ({time.perf_counter() - clock:.0f} s)", flush=True)
    table = falloff_table(result["runs"], seeds)
    result["seconds"] = round(time.perf_counter() - clock, 1)
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "table.md").write_text(table + "\n")
    print(table)
    return 0


def _tiny_sources(args: argparse.Namespace, out: Path) -> Sources:
    """The built-in long-context quality target (built into OUT/target unless --target), its accuracy by bucket on
    a held-out dialogue, held-out dialogue prompts per bucket, and fresh dialogues per seed."""
    from transformers import AutoTokenizer

    from dflash_ds.models.target import load_target
    from dflash_ds.tiny.quality import make_quality_target

    if not 0 < args.short < args.length or args.length % args.short:
        raise DFlashError(f"--short {args.short} must divide --length {args.length} and be smaller")
    if args.anchors % (args.length // args.short):
        raise DFlashError(f"--anchors {args.anchors} must divide evenly over the {args.length // args.short} short "
                          "rows a step")
    target_dir = Path(args.target) if args.target else out / "target"
    if not args.target and not (target_dir / "config.json").is_file():
        print(f"building the long-context quality target into {target_dir}", flush=True)
        make_quality_target(target_dir, **DEFAULT_TARGET, log_every=100)
    target = load_target(target_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    total = args.rows * args.length
    return Sources(target, target_dir, target_accuracy(target, tokenizer, args.length),
                   held_out_prompts(tokenizer, args.length, args.per_bucket),
                   short=lambda seed: training_states(target, tokenizer, args.short, total, seed, args.layers),
                   long=lambda seed: training_states(target, tokenizer, args.length, total, seed, args.layers),
                   short_per_step=args.length // args.short)


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise DFlashError(f"{flag} {text!r}: expected comma-separated integers") from None


def target_accuracy(target, tokenizer, length: int, seed: int = 7) -> dict[str, float]:
    """`answer_accuracy` on the answers of one held-out conversation of `length` tokens."""
    from dflash_ds.tiny.quality import dialogue

    _, ids, spans = dialogue(random.Random(f"falloff-accuracy-{seed}"), tokenizer, length)
    mask = [0] * len(ids)
    for a, b in spans:
        mask[a:b] = [1] * (b - a)
    return answer_accuracy(target, [(ids, mask)])


def held_out_prompts(tokenizer, length: int, per_bucket: int) -> list[list[int]]:
    """Per bucket edge E up to `length` (512, 1K, ...), `per_bucket` held-out conversations of at most E tokens, each
    cut before its last answer: a prompt of E less one exchange or so, whose decode steps fall in the bucket below E."""
    from dflash_ds.eval.summary import CONTEXT_EDGES
    from dflash_ds.tiny.quality import dialogue

    rng = random.Random("falloff-held-out")
    prompts = []
    for edge in [e for e in CONTEXT_EDGES if e <= length]:
        for _ in range(per_bucket):
            _, ids, spans = dialogue(rng, tokenizer, edge)
            prompts.append(ids[: spans[-1][0]])  # through the last answer's header
    return prompts


def training_states(target, tokenizer, row_tokens: int, total_tokens: int, seed: int, draft_layers: int):
    """`TargetStates` of conversations of at most `row_tokens` tokens, `total_tokens // row_tokens` of them (fresh
    exchanges of the training generator, distinct from the held-out ones), the loss on every answer; the context is
    the target's features by chunked prefill. No final hidden: the loss is cross-entropy on the data's tokens."""
    import torch

    from dflash_ds.components.objective import TargetStates
    from dflash_ds.eval.speculative import TargetSession
    from dflash_ds.models.drafter_arch import default_target_layer_ids
    from dflash_ds.tiny.quality import dialogue

    rng = random.Random(f"falloff-train-{seed}")
    n = total_tokens // row_tokens
    layer_ids = default_target_layer_ids(target.config.num_hidden_layers, draft_layers)
    ids = torch.zeros(n, row_tokens, dtype=torch.long)
    loss_mask = torch.zeros_like(ids)
    lengths = torch.zeros(n, dtype=torch.long)
    context = torch.zeros(n, row_tokens, len(layer_ids) * target.config.hidden_size)
    for r in range(n):
        _, row, spans = dialogue(rng, tokenizer, row_tokens)
        ids[r, : len(row)] = torch.tensor(row)
        for a, b in spans:
            loss_mask[r, a:b] = 1
        lengths[r] = len(row)
        with TargetSession(target, layer_ids) as tgt:
            context[r, : len(row)] = tgt.prefill(row)[1]
    return TargetStates(ids, loss_mask, lengths, context, None)


def train(src: Sources, states, args: argparse.Namespace, steps: int, seed: int, out_dir: Path, per_step: int,
          start=None, lr: float | None = None):
    """A drafter trained `steps` steps on `states` (`tiny/context_check.train_drafter`: the real objective, AdamW, the
    trainer's schedule), from `start` when given; `per_step` rows a step and `--anchors` a step, spread evenly."""
    from dflash_ds.config import LossConfig
    from dflash_ds.tiny.context_check import AblationConfig, train_drafter

    cfg = AblationConfig(train_prompts=states.input_ids.shape[0], batch=per_step, steps=steps, lr=lr or args.lr,
                         num_anchors=args.anchors // per_step, num_layers=args.layers, block_size=args.block_size,
                         seed=seed, mask_token_id=src.mask_token_id, layers_from_target=src.layers_from_target)
    return train_drafter(src.target, src.target_dir, [], cfg, out_dir, states=states, start=start,
                         loss_cfg=LossConfig(num_anchors=cfg.num_anchors))


def serve(target, drafter, prompts: list[list[int]], references: list[list[int]], args: argparse.Namespace,
          name: str) -> dict:
    """The drafter served greedily by dflash-ds's decoder on every prompt, each output checked equal to its greedy
    reference; `summarize`'s tau and tau_by_context."""
    from dflash_ds.eval.speculative import eos_token_ids, speculative_generate, summarize

    eos = eos_token_ids(target)
    outs = []
    for prompt, reference in zip(prompts, references):
        o = speculative_generate(target, prompt, drafter=drafter, max_new_tokens=args.max_new_tokens, eos_ids=eos)
        if o.tokens != reference:
            raise DFlashError(f"{name}: speculative decoding differs from greedy decoding on a prompt of "
                              f"{len(prompt)} tokens")
        outs.append(o)
    s = summarize(outs, args.block_size)
    return {"tau": s["tau"], "tau_by_context": s["tau_by_context"]}


def _greedy(target, prompt: list[int], max_new_tokens: int) -> list[int]:
    from dflash_ds.eval.speculative import eos_token_ids, greedy_generate

    return greedy_generate(target, prompt, max_new_tokens, eos_token_ids(target))


def falloff_table(runs: dict[str, dict], seeds: list[int]) -> str:
    """Markdown: per context bucket, each drafter's tau as the mean over seeds with its min-max."""
    def cell(name: str, bucket: str | None) -> str:
        vals = [runs[f"{name}/seed{s}"]["tau"] if bucket is None else runs[f"{name}/seed{s}"]["tau_by_context"]
                .get(bucket, {}).get("tau") for s in seeds]
        vals = [v for v in vals if v is not None]
        if not vals:
            return "-"
        return f"{statistics.mean(vals):.3f} ({min(vals):.3f}-{max(vals):.3f})" if len(vals) > 1 else f"{vals[0]:.3f}"

    buckets = list(runs[f"long/seed{seeds[0]}"]["tau_by_context"])
    names = ("base", "short", "long")
    lines = ["| context | " + " | ".join(COLUMNS[n] for n in names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| {b} | " + " | ".join(cell(n, b) for n in names) + " |" for b in buckets]
    lines.append("| all | " + " | ".join(cell(n, None) for n in names) + " |")
    return "\n".join(lines)
