"""The DFlash2 fields of a drafter's shape, of its export's `dflash_config` and of a run's config.

Names are the serving engines' (vLLM 0.32 `qwen3_dflash2.py` reads them from `dflash_config`). vLLM
requires `conv_kernel_size`, `conv_group_size`, `selector_rank` and `selector_top_k` (no defaults
there); `output_multiplier` (1.0), `final_logit_softcapping` (0 = none) and `input_embedding_scale`
(1.0) are optional. Each is a run's model.* field too, and `DFlash2Loss` holds the kind's loss.* fields: this
module declares them, their one source of defaults (config_kinds.py adds them to the run's config). The defaults
are dflash-ds's; why each, at the real shape:

- conv_kernel_size 2: the two-tap convolution of the DFlash2 write-up (position i reads i and i - 1).
- conv_group_size 64: one dynamic coefficient per 64 channels. kernel_projection is
  H x (2 * taps * H / group): at Qwen3-8B (H 4096) 4096 x 256 = 1,048,576 per conv, two convs per
  layer, 5 layers -> 10.5 M parameters (1% of the ~1.05 B drafter). Must divide the hidden size.
- selector_rank 64: the two codebooks are vocab x rank each: Qwen3-8B 2 x 151,936 x 64 = 19.4 M
  parameters, Qwen3.6-27B 2 x 248,320 x 64 = 31.8 M (docs/MEMORY.md has the bytes).
- selector_top_k 8: candidates per draft position; the edge tensor per block is
  (block - 1) x K x K x rank floats in training (15 x 8 x 8 x 64 = 61,440 per block).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from dflash_ds.errors import DFlashError
from dflash_ds.models.kinds import KindSpec, MemoryTerms, register

def saved_h(opts: "DFlash2Options") -> float:
    """H-wide values one DFlash2 layer saves per block token beyond a DFlash layer's (docs/MEMORY.md): per sublayer
    the convolved input its projections keep and the sublayer's output the second convolution keeps (models/
    grouped_conv.py keeps its input and deltas only), and the kernel projection's 2 x taps x groups deltas:
    4 + 4 taps / group = 4.125 at the defaults. Measured with saved-tensor hooks (tests/test_core/test_fusion.py);
    autograd's own backward of the eager convolution kept 8.125."""
    return 4 + 4 * opts.conv_kernel_size / opts.conv_group_size


@dataclass
class DFlash2Options:
    """Shape of the DFlash2 parts: the grouped dynamic convolutions and the candidate selector."""

    conv_kernel_size: int = 2
    """Taps of each in-block convolution (2: position i reads i and i - 1; never across a block boundary)."""
    conv_group_size: int = 64
    """Channels sharing one dynamic conv coefficient (must divide the hidden size)."""
    selector_rank: int = 64
    """Rank of the selector's predecessor/successor codebooks (2 x vocab x rank parameters; docs/MEMORY.md)."""
    selector_top_k: int = 8
    """Candidates per draft position (the target head's top-K of the drafter's hidden state) that the selector
    walks over."""
    output_multiplier: float = 1.0
    """Scale of the candidates' logits (unary scores) before the soft cap."""
    final_logit_softcapping: float = 0.0
    """Unary scores are cap * tanh(logit / cap); 0 = no cap."""
    input_embedding_scale: float = 1.0
    """Multiplies the embedded block inputs (written to the export only when not 1)."""

    def check(self, hidden_size: int, vocab_size: int, where: str = "") -> "DFlash2Options":
        """One clear error naming the field that cannot build a drafter of this width and vocabulary."""
        where = f"{where}." if where else ""
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if int(getattr(self, name)) < 1:
                raise DFlashError(f"{where}{name} = {getattr(self, name)}: must be >= 1")
        if hidden_size % self.conv_group_size:
            raise DFlashError(f"{where}conv_group_size = {self.conv_group_size} must divide the hidden size "
                              f"{hidden_size}")
        if self.selector_top_k > vocab_size:
            raise DFlashError(f"{where}selector_top_k = {self.selector_top_k} exceeds the vocabulary ({vocab_size})")
        if self.output_multiplier <= 0:
            raise DFlashError(f"{where}output_multiplier = {self.output_multiplier}: must be > 0 (vLLM's top-K "
                              "reduction refuses a non-positive scale)")
        if self.final_logit_softcapping < 0:
            raise DFlashError(f"{where}final_logit_softcapping = {self.final_logit_softcapping}: must be >= 0")
        return self

    def to_config(self) -> dict[str, Any]:
        """The keys this adds to the export's dflash_config."""
        out = asdict(self)
        if out["input_embedding_scale"] == 1.0:
            del out["input_embedding_scale"]
        return out

    def to_export(self, cfg: dict[str, Any], block_size: int) -> None:
        """Its keys in the export's dflash_config, where vLLM also reads block_size (the export's block)."""
        cfg["dflash_config"].update(block_size=block_size, **self.to_config())

    @classmethod
    def from_export(cls, cfg: dict[str, Any], where: str) -> "DFlash2Options":
        """Read them back from an export's config.json."""
        return cls.from_config(cfg["dflash_config"], where)

    @classmethod
    def from_config(cls, dcfg: dict[str, Any], where: str) -> "DFlash2Options":
        """Read them back from a dflash_config (the four the engines require must be there)."""
        required = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
        missing = [k for k in required if k not in dcfg]
        if missing:
            raise DFlashError(f"{where}: dflash_config of a DFlash2DraftModel lacks {missing}")
        kw: dict[str, Any] = {k: int(dcfg[k]) for k in required}
        for f in fields(cls):
            if f.name not in kw and dcfg.get(f.name) is not None:
                kw[f.name] = float(dcfg[f.name])
        return cls(**kw)

    @classmethod
    def from_model_config(cls, model: Any) -> "DFlash2Options | None":
        """From a run's `model.*` section: None for another kind."""
        return SPEC.options_from_model(model)


@dataclass
class DFlash2Loss:
    """The DFlash2 loss.* fields: the selector term's weight and targets (models/dflash2_loss.py)."""

    selector_weight: float = 1.0
    """Weight of the selector term (K-way CE over the candidates given the gold predecessor)."""
    selector_detach: bool = False
    """Train the selector on detached hidden states (no selector gradient into the backbone)."""
    selector_gold: str = "swap"
    """Where the head's top-K misses the gold token (10-15% of positions on the tiny targets): swap (the gold
    replaces the K-th, weakest, candidate: every position trains, as speculators does) or drop (those positions
    carry no selector term, as NeMo does; a strict top-K, SpecForge's, has no gold to aim at there)."""
    selector_warmup_steps: int = 0
    """The selector weight ramps linearly from 1/N to full over the first N optimizer steps (0 = off)."""


def selector_warmup(loss: Any, step: int) -> Any:
    """The loss settings of optimizer step `step`: loss.selector_weight ramped over loss.selector_warmup_steps
    (components/schedules.ramp_at); `loss` itself outside the warm-up."""
    from dflash_ds.components.schedules import ramp_at

    warm = loss.selector_warmup_steps
    if warm <= 0 or step >= warm:
        return loss
    return replace(loss, selector_weight=loss.selector_weight * ramp_at(step, warm))


def option_names() -> list[str]:
    """The DFlash2 field names (config model.*, init-drafter flags, dflash_config keys)."""
    return [f.name for f in fields(DFlash2Options)]


def conv_params(hidden_size: int, num_layers: int, opts: DFlash2Options) -> int:
    """Parameters of all convolutions: 2 per layer, each base (2, taps, H) + projection H x 2*taps*H/group."""
    taps, groups = opts.conv_kernel_size, hidden_size // opts.conv_group_size
    return num_layers * 2 * (2 * taps * hidden_size + hidden_size * 2 * taps * groups)


def selector_params(hidden_size: int, vocab_size: int, opts: DFlash2Options) -> int:
    """Parameters of the selector: two vocab x rank codebooks and the H x rank hidden projection."""
    return 2 * vocab_size * opts.selector_rank + hidden_size * opts.selector_rank


def memory_terms(opts: DFlash2Options, hidden_size: int, vocab_size: int) -> MemoryTerms:
    """memory/model.py's DFlash2 terms: the convs in each layer, the selector in Psi, the convs' saved values,
    and the K x rank codebook rows the selector loss keeps per label position for backward (its top-K vocabulary
    chunks run without grad after the DFlash loss's chunks are freed, below that moment)."""
    return MemoryTerms(layer_params=conv_params(hidden_size, 1, opts),
                       head_params=selector_params(hidden_size, vocab_size, opts), grads_name="selector_grads",
                       saved_h=saved_h(opts), loss_name="selector_edges",
                       loss_position_values=opts.selector_top_k * opts.selector_rank)


def warm_start_parts(drafter: Any) -> None:
    """A zero successor codebook (the convolutions start at identity): every edge score is 0, so the walk takes the
    best unary candidate, the backbone's argmax (models/warm_start.py)."""
    import torch

    if drafter.arch.options.input_embedding_scale != 1.0:
        raise DFlashError("a warm start needs input_embedding_scale 1 (another scale changes the backbone's "
                          "inputs, so the drafts would change)")
    with torch.no_grad():
        drafter.candidate_selector.successor_codebook.zero_()


def fused_parts(opts: DFlash2Options, hidden_size: int, rows: int, block_size: int, make: Any) -> dict[str, Any]:
    """`bench fuse`'s case of the kind: one grouped convolution over `rows` block tokens (models/dflash2.py)."""
    from dflash_ds.models.dflash2 import grouped_conv

    taps, groups = opts.conv_kernel_size, hidden_size // opts.conv_group_size
    rows -= rows % block_size
    x, delta, base = make(rows, hidden_size), make(rows, taps, groups), make(taps, hidden_size)
    return {f"conv [{rows} x {hidden_size}, {taps} taps, {groups} groups]": (grouped_conv, (x, delta, base, block_size))}


SPEC = register(KindSpec(
    name="dflash2", architecture="DFlash2DraftModel",
    summary="grouped convolutions + candidate selector; DFlash2DraftModel export",
    options=DFlash2Options, model_fields=tuple(option_names()), loss_options=DFlash2Loss, loss_at=selector_warmup,
    rules=(*((f"model.{name}", "must be >= 1", lambda v: v >= 1)
             for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")),
           ("model.output_multiplier", "must be > 0", lambda v: v > 0),
           ("model.final_logit_softcapping", "must be >= 0 (0 = no cap)", lambda v: v >= 0),
           ("model.input_embedding_scale", "must be > 0", lambda v: v > 0),
           ("loss.selector_weight", "must be >= 0", lambda v: v >= 0),
           ("loss.selector_gold", "must be swap or drop", lambda v: v in ("swap", "drop")),
           ("loss.selector_warmup_steps", "must be >= 0", lambda v: v >= 0)),
    drafter_module="dflash_ds.models.dflash2", loss_module="dflash_ds.models.dflash2_loss", vllm_method="dflash",
    vllm_v2_only=True,
    memory=memory_terms, warm_start=warm_start_parts, fused_parts=fused_parts))
