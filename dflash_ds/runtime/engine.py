"""The drafter's DeepSpeed engine: DS JSON resolution, the trainable module, AdamW and the LR schedule.

`build_drafter_engine` builds it as the trainer and `bench pipeline` use it; `export_drafter`
writes the HF export of its weights.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dflash_ds.components.acceptance import accepted_runs
from dflash_ds.components.fusion import set_fuse_mode
from dflash_ds.components.objective import TargetStates, drafter_objective
from dflash_ds.components.schedules import lr_at
from dflash_ds.config import Config
from dflash_ds.errors import DFlashError
from dflash_ds.models.drafter import DFlashDrafter
from dflash_ds.models.drafter_arch import DrafterArch
from dflash_ds.models.target import load_target_head, target_parts
from dflash_ds.runtime.checkpointing import choose_checkpointing

REPO_ROOT = Path(__file__).resolve().parents[2]


def resolve_ds_config(cfg: Config) -> Path:
    """`train.ds_config` if given, else ds_configs/zero{N}.json (cwd first, then the repo)."""
    if cfg.train.ds_config:
        path = Path(cfg.train.ds_config)
        if not path.is_file():
            raise DFlashError(f"--ds-config {path} does not exist")
        return path
    name = Path("ds_configs") / f"zero{cfg.train.zero_stage}.json"
    for base in (Path.cwd(), REPO_ROOT):
        if (base / name).is_file():
            return base / name
    raise DFlashError(f"DeepSpeed config {name} not found (looked in {Path.cwd()} and {REPO_ROOT}); "
                      f"pass --ds-config FILE")


def load_ds_config(path: Path, cfg: Config, bf16: bool, accumulation: int = 1,
                   load_universal: bool = False) -> dict[str, Any]:
    """Read the DS JSON and fill the fields the trainer owns (batching, clipping, precision, resharding)."""
    try:
        ds = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DFlashError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(ds, dict):
        raise DFlashError(f"{path}: top level must be an object")
    # A micro-batch is one routed batch; each drafter accumulates global_batch / D of them per step.
    ds["train_micro_batch_size_per_gpu"] = 1
    ds["gradient_accumulation_steps"] = int(accumulation)
    ds.pop("train_batch_size", None)
    ds["gradient_clipping"] = float(cfg.optim.grad_clip)
    ds["bf16"] = {"enabled": bool(bf16)}
    ds.pop("fp16", None)
    if bf16:
        _accumulate_in_fp32(ds, path)
    ds["zero_allow_untested_optimizer"] = True
    # save_checkpoint's tag all_reduce must stay inside the drafter group (docs/DESIGN.md §5).
    ds.setdefault("checkpoint", {})["tag_validation"] = "Ignore"
    ds["checkpoint"]["load_universal"] = bool(load_universal)  # resharded: runtime/resume.py
    ds.setdefault("steps_per_print", 10**9)
    # DeepSpeed's throughput timer (on and synchronized by default) calls the accelerator's synchronize() in
    # engine.forward and engine.step from its third step on when no dataloader is passed, as here: two full
    # device barriers per micro-step, which wait for every bridge receive posted ahead and, colocated, for the
    # next batch's target forward, so the overlap would gain nothing. The trainer times its steps itself.
    ds["timers"] = {**(ds.get("timers") or {}), "throughput": {"enabled": False, "synchronized": False}}
    return ds


def _accumulate_in_fp32(ds: dict[str, Any], path: Path) -> None:
    """bf16 runs accumulate gradients in fp32: DeepSpeed accumulates in the model dtype unless told.

    Each bf16 addition rounds to 8 bits of mantissa: summing the 8 micro-batches of the one-GPU
    recipe loses about 3 of them on the small components of the gradient. ZeRO-1 then uses the
    BF16 optimizer, ZeRO-2/3 an fp32 accumulation buffer (4 bytes per parameter on each rank's
    partition: 4 B x 1.05 B / D for a Qwen3-8B drafter). Measured on CPU, 8 bf16 micro-batches
    against the exact mean of their gradients (tests/test_runtime/test_accum_dtype.py): ZeRO-2/3
    6e-7 relative error (bf16 accumulation 8.0e-3), ZeRO-1 3.0e-3. ZeRO-0 has no such path in
    DeepSpeed (bf16 weights stepped and accumulated in bf16): refused with the way out.
    """
    stage = int((ds.get("zero_optimization") or {}).get("stage", 0))
    if stage == 0:
        raise DFlashError(f"{path}: ZeRO stage 0 with bf16 would accumulate gradients and step the weights in "
                          f"bf16 (DeepSpeed keeps no fp32 copy there); use ZeRO stage 1 or more (on one rank "
                          f"it shards nothing), or train in fp32 (--train.dtype fp32)")
    ds.setdefault("data_types", {})["grad_accum_dtype"] = "fp32"


class DrafterTrainModule(nn.Module):
    """What DeepSpeed wraps: the drafter plus the target's frozen embedding and LM head.

    The two frozen matrices are non-persistent buffers, not parameters: ZeRO never partitions
    or re-gathers them (the chunked loss calls the head many times per step), checkpoints do
    not carry them (1.2 GB each in bf16 for Qwen3-8B, 2.5 GB for Qwen3.6-27B), and DeepSpeed
    still moves them to the rank's device and casts them with the module. A tied head is one
    buffer.
    """

    def __init__(self, drafter: DFlashDrafter, embed: nn.Embedding, lm_head: nn.Linear) -> None:
        super().__init__()
        self.drafter = drafter
        embed_w, head_w = embed.weight.detach(), lm_head.weight.detach()
        self.register_buffer("embed_weight", embed_w, persistent=False)
        self.tied_head = head_w.data_ptr() == embed_w.data_ptr()
        if not self.tied_head:
            self.register_buffer("head_weight", head_w, persistent=False)
        self.sp_group = None  # topology.sequence_parallel > 1: this rank's group (set by build_drafter_engine)
        self.context_sharded = False  # and its batches hold only its shard of the context (fed by target ranks)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's token embedding."""
        return F.embedding(ids, self.embed_weight)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head: hidden states -> vocabulary logits, as one [tokens, H] x [H, V] product.

        A strided 3-D view (the est_tau walk's `hidden[:, :, 1:]` chunks) sent to F.linear as it is runs as a
        batched matmul over the weight expanded per row: on the CPU that copied the [V, H] head once per block
        (a 4-row walk of SmolLM2: 82 s, against 2 s flattened; docs/THROUGHPUT_CPU.md)."""
        weight = self.embed_weight if self.tied_head else self.head_weight
        if hidden.dim() <= 2:
            return F.linear(hidden, weight)
        return F.linear(hidden.reshape(-1, hidden.shape[-1]), weight).view(*hidden.shape[:-1], weight.shape[0])

    def forward(self, states: TargetStates, loss_cfg, anchor_seed: int = 0, noise_std: float = 0.0,
                noise_seed: int = 0, blocks: tuple | None = None):
        """The objective's (loss terms, statistics); with `blocks` = (anchors, valid, label ids), each of those
        blocks' accepted length instead (components/acceptance.accepted_runs: no loss, no noise)."""
        if blocks is not None:
            anchors, valid, label_ids = blocks
            return accepted_runs(self.drafter, self.embed, self.lm_head, states.context, states.input_ids, label_ids,
                                 states.loss_mask, states.lengths, anchors, valid, loss_cfg.chunk_blocks)
        dev = states.context.device
        anchor_gen = torch.Generator(device=dev).manual_seed(anchor_seed)  # anchors are drawn on the batch's device
        if self.sp_group is not None:
            return self._sequence_parallel(states, loss_cfg, anchor_gen, noise_std, noise_seed)
        return drafter_objective(self.drafter, self.embed, self.lm_head, states, loss_cfg,
                                 anchor_gen=anchor_gen, noise_std=noise_std, noise_seed=noise_seed)

    def _sequence_parallel(self, states: TargetStates, loss_cfg, anchor_gen, noise_std: float, noise_seed: int):
        """The objective over this rank's sequence-parallel group (distributed/sequence_parallel.sp_objective).

        Its loss is this rank's share of the group's loss times N: DeepSpeed averages gradients over all D ranks,
        and the group's N ranks are one of D / N data-parallel replicas, so N x (the shares' sum) / D is the mean
        over the replicas, as without sequence parallelism (and so is the reported loss, a mean over ranks)."""
        from dflash_ds.distributed.sequence_parallel import sp_objective

        terms, sums = sp_objective(self.drafter, self.embed, self.lm_head, states, loss_cfg, anchor_gen=anchor_gen,
                                   group=self.sp_group, noise_std=noise_std, noise_seed=noise_seed,
                                   context_sharded=self.context_sharded)
        terms.loss = terms.loss * dist.get_world_size(self.sp_group)
        return terms, sums

    def whole_context(self, context: torch.Tensor, width: int) -> torch.Tensor:
        """The context (or the final hidden) of `width` positions whole: `context` itself, or under sequence
        parallelism with a sent shard (`context_sharded`) the group's shards gathered and the padding cut (collective
        over the group). The walks (est_tau, validation) read every position of the rows they walk: [rows, S, F] on
        each rank of the group."""
        if not self.context_sharded:
            return context
        from dflash_ds.distributed.sequence_parallel import gather_shards

        return gather_shards(context, width, self.sp_group)


def warn_stale_build_locks(max_age_s: float = 600.0) -> list[Path]:
    """Torch waits forever on an op-build lock left by a killed build: name it instead of hanging silently."""
    import os
    import time

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    stale = [p for p in root.glob("*/*/lock") if time.time() - p.stat().st_mtime > max_age_s]
    for p in stale:
        print(f"warning: {p} is {int(time.time() - p.stat().st_mtime)}s old: a killed op build may have left it; "
              f"if DeepSpeed start-up hangs, delete it", flush=True)
    return stale


def disable_cpu_shm_allreduce() -> None:
    """Keep DeepSpeed's CPU shared-memory all-reduce op out of the process.

    On the CPU accelerator DeepSpeed JIT-builds `deepspeed_shm_comm` when its comm backend starts and
    each rank creates a 66 MiB `/dev/shm/deepspeed_allreduce_buffer_*` segment that is never
    unlinked: every run leaks RAM until the machine runs out (tmpfs is memory). Its start-up also
    spins forever waiting for a peer's segment if that peer died. Only `inference_all_reduce`
    uses it, which training never calls; the process-group all-reduce (gloo) is used instead.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def build_engine(module: DrafterTrainModule, cfg: Config, ds_config: dict[str, Any]):
    """deepspeed.initialize over the trainable drafter parameters only, with AdamW and warmup+cosine LR."""
    import deepspeed

    disable_cpu_shm_allreduce()
    warn_stale_build_locks()
    trainable = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                            weight_decay=cfg.optim.weight_decay)
    peak = cfg.optim.lr

    def factor(step: int) -> float:
        return lr_at(step, peak=peak, warmup_steps=cfg.optim.warmup_steps, total_steps=cfg.train.max_steps,
                     min_ratio=cfg.optim.min_lr_ratio) / peak

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=opt, lr_scheduler=sched, config=ds_config)
    from dflash_ds.runtime.checkpoint import use_safe_loading

    use_safe_loading(engine)  # DeepSpeed's TorchCheckpointEngine.load passes weights_only=False
    return engine


def gathered_drafter_state(engine) -> dict[str, torch.Tensor] | None:
    """The full drafter state dict on rank 0 (gathered under ZeRO-3); collective over the drafter group."""
    import deepspeed
    import torch.distributed as dist

    drafter = engine.module.drafter
    params = list(drafter.parameters())
    zero3 = engine.zero_optimization_stage() == 3
    ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=None) if zero3 else contextlib.nullcontext()
    with ctx:
        if dist.get_rank() != 0:
            return None
        # copied to the host in the training dtype, widened there: `.float()` first made an fp32 copy on the GPU
        # at every save (4.2 GB for the Qwen3-8B preset's drafter, 7.4 GB at Qwen3.6-27B's, beside the step's peak)
        return {k: v.detach().to("cpu", copy=True).float() for k, v in drafter.state_dict().items()
                if not k.startswith("rotary_emb.")}


def load_drafter(cfg: Config, arch: DrafterArch, resuming: bool = False) -> DFlashDrafter:
    """The drafter to train: --drafter's export, else a fresh one of the run's shape seeded by train.seed; when
    `resuming`, one left unfilled (`DFlashDrafter.empty`): the checkpoint's load fills every parameter (DeepSpeed's
    `load_module_strict`, or the universal folder's values); drawing the Qwen3-8B preset's 1.05 B seeded values
    first took 23-33 s on one CPU core of a 2-core VM (docs/BENCHMARKS.md), at every restart of every rank."""
    if resuming:
        return DFlashDrafter.empty(arch)
    if cfg.drafter:
        return DFlashDrafter.from_pretrained(cfg.drafter)
    drafter = DFlashDrafter.seeded(arch, cfg.train.seed)
    if cfg.model.init == "target":
        from dflash_ds.models.target_layers_init import copy_target_layers

        copy_target_layers(drafter, cfg.target)
    return drafter


def frozen_head(target: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The target's embedding and LM head modules: the drafter shares their tensors (no second copy)."""
    parts = target_parts(target)
    return parts.embed, parts.head


def build_drafter_engine(cfg: Config, arch: DrafterArch, dtype: torch.dtype, device: torch.device,
                         accumulation: int = 1, universal: bool = False, target: nn.Module | None = None,
                         num_drafters: int = 1, resuming: bool = False, sp_group=None):
    """The DeepSpeed engine over the drafter, with the target's frozen embedding and LM head.

    Those two are read from the target's safetensors, or shared with the loaded target (colocated). Activation
    checkpointing: the config's, else off where the GPU's free memory holds the step without it
    (runtime/checkpointing.py); `engine.module.checkpointing_reason` says which and why. `resuming`: the drafter
    is left unfilled for the checkpoint's load (`load_drafter`).
    """
    # decided first: the free memory is read before this rank's frozen head and drafter reach the device
    ckpt = choose_checkpointing(cfg, arch, device, colocated=target is not None, num_drafters=num_drafters)
    embed, head = frozen_head(target) if target is not None else load_target_head(cfg.target, dtype=dtype)
    drafter = load_drafter(cfg, arch, resuming).to(dtype)  # an export may be bf16 (a bf16 target's init)
    drafter.activation_checkpointing, drafter.checkpoint_layers = ckpt.on, ckpt.layers
    drafter.mask_backend = cfg.model.attention_backend
    set_fuse_mode(cfg.train.fuse)
    module = DrafterTrainModule(drafter, embed, head)
    module.sp_group = sp_group
    module.context_sharded = sp_group is not None and target is None  # target ranks send each rank its shard
    module.checkpointing_reason = ckpt.why
    fresh_from_target = not resuming and not cfg.drafter and cfg.model.init == "target"
    n, total = arch.num_hidden_layers, arch.num_target_layers
    module.init_note = (f"; the draft layers start as the target's layers {total - n}-{total - 1} of {total} "
                        f"(model.init: target)") if fresh_from_target else ""
    ds = load_ds_config(resolve_ds_config(cfg), cfg, bf16=dtype == torch.bfloat16, accumulation=accumulation,
                        load_universal=universal)
    return build_engine(module, cfg, ds)


def check_shared_head(engine, target: nn.Module) -> str | None:
    """A warning if the engine's frozen embedding / head are not the target's own tensors (a copy costs V x H x
    dtype bytes each: 1.24 GB per matrix for Qwen3-8B in bf16), else None."""
    embed, head = frozen_head(target)
    module = engine.module
    pairs = [(module.embed_weight, embed.weight)]
    if not module.tied_head:
        pairs.append((module.head_weight, head.weight))
    copied = [mine for mine, theirs in pairs if mine.data_ptr() != theirs.data_ptr()]
    if not copied:
        return None
    gb = sum(t.numel() * t.element_size() for t in copied) / 1e9
    return (f"the DeepSpeed engine holds its own copy of the target's embedding/LM head ({gb:.2f} GB more on "
            f"every rank than colocated training needs); is the target loaded in the run's dtype?")


def export_drafter(engine, arch: DrafterArch, dtype: torch.dtype, folder: Path, notes: dict | None = None) -> None:
    """The HF export in the training dtype (gathered on rank 0 under ZeRO-3; collective). `notes` go into its
    config.json as `dflash_ds_training` (what it trained on: eval reads the confidence head's target there; serving
    engines ignore the key)."""
    state_dict = gathered_drafter_state(engine)
    if state_dict is not None:
        # unfilled parameters, replaced by the gathered ones (no copy: a Qwen3-8B drafter's 4.2 GB fp32 once)
        export = DFlashDrafter.empty(arch)
        export.load_state_dict(state_dict, strict=False, assign=True)
        out = export.to(dtype).save_pretrained(folder)
        if notes:
            path = out / "config.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), "dflash_ds_training": notes}, indent=2,
                                       sort_keys=True) + "\n")
