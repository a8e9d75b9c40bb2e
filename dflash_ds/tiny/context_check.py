"""Does a drafter's acceptance come from the target's context? Train one in-process and take the context away.

On a target (the quality target, tiny/quality.py) a drafter is trained briefly on the target's own greedy
answers, then held-out tau is measured by real speculative decoding (eval/speculative.py) for
- `normal`: the drafter as trained;
- `zero_fc`: the same drafter with `fc` zeroed, so it reads no target context at all (the anchor token only);
- `shifted`: a drafter trained the same way but with the context one position late (the target's hidden
  states of position t-1 presented as those of t: an off-by-one in the training pipeline), measured as
  served, with the context where it belongs.
Where the context matters, both ablations cut tau far below the normal drafter's (docs/QUALITY.md).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from dflash_ds.components.objective import TargetStates, drafter_objective
from dflash_ds.config import LossConfig
from dflash_ds.eval.speculative import eos_token_ids, greedy_generate, speculative_generate, summarize
from dflash_ds.models.drafter import DFlashDrafter
from dflash_ds.models.target import capture_hidden


@dataclass
class AblationConfig:
    """How much training and evaluation the check spends (the defaults take about a minute on 2 cores)."""

    train_prompts: int = 512  # conversations whose greedy answers train the drafter
    batch: int = 64  # sequences per step (a seeded shuffle, epoch after epoch)
    eval_prompts: int = 16  # held-out prompts (another seed of the prompt generator)
    max_new_tokens: int = 32  # per answer, in training and in evaluation
    steps: int = 300  # AdamW steps
    lr: float = 3e-3
    num_anchors: int = 4  # anchors per sequence per step
    num_layers: int = 2  # drafter layers
    block_size: int = 8
    seed: int = 0  # drafter init and anchor draws
    mask_token_id: int | None = None  # None: init-drafter's choice (a target without a mask token needs one)
    layers_from_target: bool = False  # the draft layers start as the target's last (the trainer's model.init: target)


def encode_prompts(tokenizer, rows: list[dict]) -> list[list[int]]:
    """Chat-template prompt ids (generation header included) of OpenAI-form rows."""
    texts = [tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False) for r in rows]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


@torch.no_grad()
def greedy_answers(target, prompts: list[list[int]], max_new_tokens: int, eos_ids: list[int],
                   batch: int = 64) -> list[list[int]]:
    """Greedy answers of many prompts, batched by prompt length (HF generate); each cut after its first eos.

    Training data only (a batched forward may differ from a single one in the last bits); the held-out
    references come from eval's `greedy_generate`, one prompt at a time.
    """
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(i)
    answers: list[list[int]] = [[] for _ in prompts]
    for length, members in by_length.items():
        for lo in range(0, len(members), batch):
            rows = members[lo: lo + batch]
            ids = torch.tensor([prompts[i] for i in rows])
            out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, eos_token_id=eos_ids, pad_token_id=target.config.pad_token_id)
            for i, row in zip(rows, out[:, length:].tolist()):
                cut = next((k + 1 for k, t in enumerate(row) if t in eos_ids), len(row))
                answers[i] = row[:cut]
    return answers


def target_states(target, seqs: list[tuple[list[int], list[int]]], layer_ids: list[int],
                  shift: int = 0) -> TargetStates:
    """The training batch of (prompt, answer) pairs; `shift` > 0 presents position t-shift's features as t's."""
    length = max(len(p) + len(a) for p, a in seqs)
    ids = torch.zeros(len(seqs), length, dtype=torch.long)
    loss_mask = torch.zeros_like(ids)
    for i, (p, a) in enumerate(seqs):
        ids[i, : len(p) + len(a)] = torch.tensor(p + a)
        loss_mask[i, len(p): len(p) + len(a)] = 1
    device = target.get_input_embeddings().weight.device  # the states live where the target runs
    ids, loss_mask = ids.to(device), loss_mask.to(device)
    context, last = capture_hidden(target, ids, None, layer_ids)
    if shift:
        context = torch.cat([torch.zeros_like(context[:, :shift]), context[:, :-shift]], dim=1)
    lengths = torch.tensor([len(p) + len(a) for p, a in seqs], device=device)
    return TargetStates(ids, loss_mask, lengths, context, last)


def train_drafter(target, target_dir: str | Path, seqs: list[tuple[list[int], list[int]]], cfg: AblationConfig,
                  out_dir: str | Path, shift: int = 0, *, options=None, loss_cfg: LossConfig | None = None,
                  states: TargetStates | None = None, start: DFlashDrafter | None = None,
                  on_step: Callable[[int, DFlashDrafter, torch.Tensor, torch.Tensor | None], None] | None = None,
                  ) -> DFlashDrafter:
    """A fresh drafter trained `cfg.steps` AdamW steps of the real objective (components/objective.py).

    `options`: a kind's (models/kinds.py; None = DFlash); `loss_cfg`: the loss (default: LossConfig's with
    `cfg.num_anchors`); `states`: the target's features of `seqs` when already computed (`target_states`, on the
    device to train on; its rows are the training rows then, and `seqs` is not read); `on_step(step, drafter,
    label_tokens, loss)` after each step (step counts from 1;
    `label_tokens`: a device scalar of the label positions trained so far, `loss` the step's (detached): read only
    by who needs them); also once before the first step, with step 0 and no loss. `start`: a trained drafter to go
    on from (a copy; its schedule starts again, warmup included) instead of a fresh one.
    """
    from dflash_ds.tools.init_drafter import init_drafter

    # Trained in fp32 whatever the export's dtype (a bf16 target's drafter is saved in bf16): AdamW on bf16 weights
    # loses small updates.
    if start is not None:
        drafter = copy.deepcopy(start).float()
    else:
        drafter = init_drafter(target_dir, out_dir, num_layers=cfg.num_layers, block_size=cfg.block_size,
                               mask_token_id=cfg.mask_token_id, seed=cfg.seed, force=True, options=options,
                               layers_from_target=cfg.layers_from_target).float()
    if states is None:
        states = target_states(target, seqs, drafter.arch.target_layer_ids, shift)
    device = states.context.device
    drafter.to(device)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    # The trainer's schedule (docs/DESIGN.md §3): linear warmup, cosine decay to a tenth of the peak.
    warmup = max(1, cfg.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.45 * (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps))))
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    loss_cfg = loss_cfg or LossConfig(num_anchors=cfg.num_anchors)
    gen = torch.Generator().manual_seed(cfg.seed)
    order = torch.empty(0, dtype=torch.long)
    labels = torch.zeros((), dtype=torch.long, device=device)
    drafter.train()
    if on_step is not None:
        on_step(0, drafter, labels, None)
    for step in range(cfg.steps):
        if len(order) < cfg.batch:
            order = torch.cat([order, torch.randperm(states.input_ids.shape[0], generator=gen)])
        rows, order = order[: cfg.batch].to(device), order[cfg.batch:]
        batch = TargetStates(*(None if t is None else t[rows] for t in (
            states.input_ids, states.loss_mask, states.lengths, states.context, states.last_hidden)))
        terms, _ = drafter_objective(drafter, embed, head, batch, loss_cfg,
                                     anchor_gen=torch.Generator().manual_seed(cfg.seed * 100_003 + step))
        opt.zero_grad()
        terms.loss.backward()
        opt.step()
        sched.step()
        if on_step is not None:
            labels += terms.valid.sum()
            on_step(step + 1, drafter, labels, terms.loss.detach())
    return drafter.eval()


def held_out_tau(target, drafter: DFlashDrafter, prompts: list[list[int]], references: list[list[int]],
                 max_new_tokens: int) -> dict:
    """`summarize` of speculative decoding over `prompts`; raises if an output differs from its greedy reference."""
    eos = eos_token_ids(target)
    outs = []
    for prompt, reference in zip(prompts, references):
        out = speculative_generate(target, prompt, drafter=drafter, max_new_tokens=max_new_tokens, eos_ids=eos)
        if out.tokens != reference:
            raise RuntimeError("speculative decoding differs from greedy decoding")
        outs.append(out)
    return summarize(outs, drafter.arch.block_size)


def context_ablation(target_dir: str | Path, work_dir: str | Path, cfg: AblationConfig | None = None,
                     prompt_rows: Callable[..., list[dict]] | None = None,
                     run_map: Callable[[Callable, list], list] | None = None) -> dict:
    """Held-out tau of the normal, zeroed-fc and shifted-context drafters, and seconds per phase.

    `prompt_rows(num, seed)` gives prompt rows (default: `quality_prompts`); training uses seed 1000 + cfg.seed,
    evaluation seed 0, so the held-out prompts never train. `run_map(work, parts)`: how the two trainings (normal,
    shifted; each with its evaluations) run, e.g. one forked process each (default: in order, here).
    """
    from transformers import AutoTokenizer

    from dflash_ds.models.target import load_target
    from dflash_ds.tiny.quality import quality_prompts

    cfg = cfg or AblationConfig()
    prompt_rows = prompt_rows or quality_prompts
    work = Path(work_dir)
    clock = time.perf_counter()
    target = load_target(target_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    eos = eos_token_ids(target)
    train = encode_prompts(tokenizer, prompt_rows(cfg.train_prompts, seed=1000 + cfg.seed))
    held_out = encode_prompts(tokenizer, prompt_rows(cfg.eval_prompts, seed=0))
    seqs = list(zip(train, greedy_answers(target, train, cfg.max_new_tokens, eos)))
    references = [greedy_generate(target, p, cfg.max_new_tokens, eos) for p in held_out]
    seconds = {"answers": time.perf_counter() - clock}

    def one(run: tuple[str, int]) -> tuple[dict, dict]:
        name, shift = run
        taus, clock = {}, time.perf_counter()
        drafter = train_drafter(target, target_dir, seqs, cfg, work / name, shift=shift)
        secs = {f"train_{name}": time.perf_counter() - clock}
        clock = time.perf_counter()
        taus[name] = held_out_tau(target, drafter, held_out, references, cfg.max_new_tokens)
        if name == "normal":
            with torch.no_grad():
                drafter.fc.weight.zero_()
            taus["zero_fc"] = held_out_tau(target, drafter, held_out, references, cfg.max_new_tokens)
        secs[f"eval_{name}"] = time.perf_counter() - clock
        return taus, secs

    result: dict = {}
    for taus, secs in (run_map or _in_order)(one, [("normal", 0), ("shifted", 1)]):
        result.update(taus)
        seconds.update(secs)
    result["seconds"] = seconds
    return result


def _in_order(work: Callable, parts: list) -> list:
    return [work(part) for part in parts]
