"""`dflash-ds train-step`: a few single-device training steps of the DFlash core.

A smoke test of the core without any process group: the target writes its own greedy
continuations of random prompts, captures its hidden states as a target rank does
(`runtime/sources.capture_batch`), and the drafter trains on them with the trainer's forward
(`runtime/step.forward`: the same module, loss and seeded anchors; batch id = step, so each step
draws new anchors) and a plain AdamW instead of DeepSpeed.
"""

from __future__ import annotations

import argparse
import time

import torch

from dflash_ds.components.loss import metrics_from_sums
from dflash_ds.config import LossConfig
from dflash_ds.data.loader import Batch
from dflash_ds.errors import DFlashError
from dflash_ds.models.drafter import DFlashDrafter
from dflash_ds.models.target import load_target
from dflash_ds.runtime.engine import DrafterTrainModule
from dflash_ds.runtime.sources import capture_batch
from dflash_ds.runtime.step import forward


def target_batch(target, layer_ids: list[int], *, batch: int, prompt_len: int, new_tokens: int,
                 seed: int) -> dict[str, torch.Tensor]:
    """Greedy target continuations of random prompts and their captured states, loss mask on the continuation."""
    gen = torch.Generator().manual_seed(seed)
    vocab = target.config.vocab_size
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=gen).to(target.device)
    with torch.no_grad():
        ids = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, prompt_len:] = 1
    lengths = torch.full((batch,), ids.shape[1], device=ids.device)
    # No data plan here: the batch has no spec or cursor, only its tensors.
    loaded = Batch(ids, loss_mask, torch.ones_like(ids), lengths, spec=None, cursor=None)
    return capture_batch(target, loaded, layer_ids, keep_last=True, device=ids.device)


def drafter_step(module: DrafterTrainModule, opt: torch.optim.Optimizer, tensors: dict, loss_cfg: LossConfig,
                 seed: int, step: int, dtype: torch.dtype):
    """One optimizer step on the batch with the trainer's forward; returns (loss terms, statistics)."""
    terms, sums = forward(module, tensors, loss_cfg, seed, step, 0.0, dtype)
    opt.zero_grad()
    terms.loss.backward()
    opt.step()
    return terms, sums


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="local HF folder of the target model")
    p.add_argument("--drafter", required=True, help="drafter export folder (from init-drafter)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--gamma", type=float, default=7.0, help="position decay gamma (default 7)")
    p.add_argument("--batch", type=int, default=4, help="sequences per batch (default 4)")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and anchors (default 0)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                   help="dtype of the target and the drafter (default fp32; bf16 on GPU)")


def run(args: argparse.Namespace) -> int:
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise DFlashError(f"--device {args.device}: torch sees no CUDA GPU")
    dtype = DTYPES[args.dtype]
    target = load_target(args.target, dtype=dtype, device=args.device)
    drafter = DFlashDrafter.from_pretrained(args.drafter, device=args.device).to(dtype).train()
    tensors = target_batch(target, drafter.arch.target_layer_ids, batch=args.batch, prompt_len=8, new_tokens=56,
                           seed=args.seed)
    module = DrafterTrainModule(drafter, target.get_input_embeddings(), target.get_output_embeddings())
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, betas=(0.9, 0.95))
    loss_cfg = LossConfig(gamma=args.gamma, num_anchors=16)
    for step in range(args.steps):
        t0 = time.perf_counter()
        terms, sums = drafter_step(module, opt, tensors, loss_cfg, args.seed, step, dtype)
        m = metrics_from_sums(sums)
        print(f"step {step}: loss {terms.loss.item():.4f}  acc {m['accuracy']:.3f}  tau {m['tau']:.2f}  "
              f"({time.perf_counter() - t0:.2f}s)", flush=True)
    return 0
