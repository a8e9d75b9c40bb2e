"""The DSpark fields of a drafter's shape, of its export's config.json and of a run's config.

Names and places are vLLM 0.32's (`qwen3_dspark.py`, `config/speculative.py`, `spec_decode/dspark/`):
`markov_rank`, `enable_confidence_head` and `confidence_head_with_markov` are top-level config keys; the
DFlash keys stay in `dflash_config`, which vLLM reads first. dflash-ds trains DSpark in the DFlash block
layout (`[anchor, MASK x (B-1)]`, the anchor is the bonus token, positions 1..B-1 predict), so the export
says `sample_from_anchor: false` (vLLM's DSpark speculator otherwise defaults to DeepSpec's
anchor-as-first layout, where every one of N query positions predicts the next token). That layout is what
lets a trained DFlash drafter warm-start a DSpark one, drafting exactly as before at step 0.

DeepSpec's layout (`sample_from_anchor` true or absent, read in vLLM's `spec_decode/dspark/speculator.py` and
the `SAMPLE_FROM_ANCHOR` branch of `_prepare_dflash_inputs_kernel`): its config's block_size N is N query
tokens `[anchor, MASK x (N-1)]` at positions a..a+N-1, query i predicting the token at a+i+1. It loads here as
`sample_from_anchor: true` with block_size N + 1 inside dflash-ds (N drafts, as in the DFlash layout):
models/dspark.py runs the backbone on the first N tokens of the block and hands query i's state to draft slot
i + 1, so the loss, the Markov chain, eval and training read it unchanged; an export writes block_size N back.

The run's model.* fields are DSparkOptions' (all but `sample_from_anchor`, an export's), its loss.* fields DSparkLoss':
this module declares them, their one source of defaults (config_kinds.py adds them to the run's config).

Defaults, at the real shape:
- markov_rank 256 (DeepSpec's Qwen3 configs): markov_w1 (target vocab x r) + markov_w2 (draft vocab x r) =
  2 x 151,936 x 256 = 77.8 M parameters at Qwen3-8B (7% of a 5-layer 1.05 B drafter; 1.24 GB of fp32
  AdamW state with master weights), 2 x 248,320 x 256 = 127.1 M at Qwen3.6-27B. Serving reads one w1 row
  and all of w2 per drafted position: 151,936 x 256 x 2 bytes = 78 MB of bf16 per position, the same
  order as the LM head's own 1.24 GB read once per block (vLLM's `dspark_draft_topk` gathers k rows only).
- enable_confidence_head true, confidence_head_with_markov true (DeepSpec's config): one logit from
  [h, w1[prev]] (H + r inputs, 4,353 parameters at Qwen3-8B).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from dflash_ds.errors import DFlashError
from dflash_ds.models.kinds import KindSpec, MemoryTerms, register

# Top-level keys of a DSpark export beside the DFlash ones: fixed by the block layout dflash-ds trains.
LAYOUT_KEYS = {"sample_from_anchor": False, "dspark_bonus_anchor": True}

# DeepSpec's DSpark recipe (DeepSeek's DeepSpec: `deepspec/modeling/dspark/loss.py`,
# `config/dspark/dspark_qwen3_4b_online.py`): what `model.kind: dspark` trains unless the file or a flag sets a
# field (config.load_config; the run prints it and each field it departs from). 0.1 CE + 0.9 ||p - q||_1 + 1.0
# BCE of the confidence, decay gamma 4, 7 drafts a block (block_size 8 here: the anchor plus 7; DeepSpec's block 7
# is 7 query slots, the anchor predicting the first), 5 layers, rank 256, lr 6e-4. Not carried: its global batch of
# 512 sequences (train.global_batch counts micro-batches here), and its confidence target: DeepSpec's BCE aims at
# sampled acceptance, this recipe keeps the greedy hit, what vLLM's default serving (draft_sample_method greedy,
# T = 0) accepts (`--loss.confidence_target sampled` for DeepSpec's).
RECIPE_NAME = "deepspec"
RECIPE = {"model.block_size": 8, "model.num_layers": 5, "model.markov_rank": 256,
          "model.enable_confidence_head": True, "model.confidence_head_with_markov": True,
          "loss.gamma": 4.0, "loss.lk": "l1", "loss.lk_weight": 0.9, "loss.labels": "data",
          "loss.confidence_weight": 1.0, "loss.confidence_target": "greedy", "optim.lr": 6e-4}


@dataclass
class DSparkOptions:
    """Shape of the DSpark parts: the Markov head and the confidence head."""

    markov_rank: int = 256
    """Rank r of the Markov head: markov_w1 (vocab x r) embeds the previous token, markov_w2 (vocab x r) maps
    it to a logit bias (2 x vocab x r parameters: 77.8 M at Qwen3-8B)."""
    enable_confidence_head: bool = True
    """Build the confidence head (a sigmoid estimate that each drafted token is accepted; eval --confidence-stop)."""
    confidence_head_with_markov: bool = True
    """The confidence head also reads the previous token's Markov embedding beside the hidden state."""
    sample_from_anchor: bool = False
    """DeepSpec's anchor-as-first layout (module doc): read from an export, never a run's model.* field."""

    def check(self, hidden_size: int, vocab_size: int, where: str = "") -> "DSparkOptions":
        """One clear error naming the field that cannot build a drafter."""
        where = f"{where}." if where else ""
        if int(self.markov_rank) < 1:
            raise DFlashError(f"{where}markov_rank = {self.markov_rank}: must be >= 1")
        return self

    def to_config(self) -> dict[str, Any]:
        """The top-level keys this adds to the export's config.json."""
        layout = {"sample_from_anchor": True, "dspark_bonus_anchor": False} if self.sample_from_anchor else LAYOUT_KEYS
        return {**asdict(self), **layout}

    def to_export(self, cfg: dict[str, Any], block_size: int) -> None:
        """Its keys at the top level, where vLLM reads them; DeepSpec's layout writes its block_size back (module doc)."""
        cfg["dflash_config"].update(block_size=block_size)
        cfg.update(self.to_config())
        if self.sample_from_anchor:  # DeepSpec's block_size counts query slots: the drafts
            cfg["block_size"] = cfg["dflash_config"]["block_size"] = block_size - 1

    @classmethod
    def from_export(cls, cfg: dict[str, Any], where: str) -> "DSparkOptions":
        """Read them back from an export's config.json."""
        return cls.from_config(cfg, where)

    @property
    def export_block_offset(self) -> int:
        """DeepSpec's anchor-as-first block_size N is N drafts: N + 1 here, the anchor included (module doc)."""
        return 1 if self.sample_from_anchor else 0

    def checkpoint_dict(self) -> dict[str, Any]:
        """What a checkpoint records: the layout only when it is DeepSpec's (older checkpoints compare equal)."""
        return {k: v for k, v in asdict(self).items() if k != "sample_from_anchor" or v}

    @classmethod
    def from_config(cls, cfg: dict[str, Any], where: str) -> "DSparkOptions":
        """Read them back from a config.json (markov_rank must be there; the heads' switches default off, as
        vLLM reads them)."""
        if cfg.get("markov_rank") is None:
            raise DFlashError(f"{where}: config of a Qwen3DSparkModel lacks 'markov_rank'")
        if (cfg.get("draft_vocab_size") or cfg["vocab_size"]) != cfg["vocab_size"]:
            raise DFlashError(f"{where}: a reduced draft vocabulary (draft_vocab_size) is not supported here")
        return cls(markov_rank=int(cfg["markov_rank"]),
                   enable_confidence_head=bool(cfg.get("enable_confidence_head", False)),
                   confidence_head_with_markov=bool(cfg.get("confidence_head_with_markov", False)),
                   # vLLM's default when the key is absent: DeepSpec's anchor-as-first layout
                   sample_from_anchor=bool(cfg.get("sample_from_anchor", True)))

    @classmethod
    def from_model_config(cls, model: Any) -> "DSparkOptions | None":
        """From a run's `model.*` section (or init-drafter's flags): None unless the kind is dspark."""
        return SPEC.options_from_model(model)


@dataclass
class DSparkLoss:
    """The DSpark loss.* fields: the confidence head's term (models/dspark_loss.py)."""

    confidence_weight: float = 1.0
    """Weight of the confidence head's BCE against its target (loss.confidence_target)."""
    confidence_target: str = "greedy"
    """What the confidence head learns to predict. greedy (the default: vLLM serves greedily unless asked
    otherwise): whether the drafter's argmax (Markov bias included, teacher-forced) equals the label (loss.labels),
    what greedy serving accepts; sampled (DeepSpec's): the acceptance rate of a sampled draft, alpha = 1 - 0.5
    ||p - q||_1 (detached; needs the target's distribution: loss.lk or loss.kl_weight, else the greedy hit stands
    in), what serving with sampled drafts (draft_sample_method probabilistic) accepts."""


def option_names() -> list[str]:
    """The DSpark field names a run sets (config model.*, init-drafter flags); the layout comes from an export."""
    return [f.name for f in fields(DSparkOptions) if f.name != "sample_from_anchor"]


def dspark_params(hidden_size: int, vocab_size: int, opts: DSparkOptions) -> int:
    """Parameters of the Markov head (2 x vocab x rank) and the confidence head (inputs + bias)."""
    conf = hidden_size + (opts.markov_rank if opts.confidence_head_with_markov else 0) + 1
    return 2 * vocab_size * opts.markov_rank + (conf if opts.enable_confidence_head else 0)


def memory_terms(opts: DSparkOptions, hidden_size: int, vocab_size: int) -> MemoryTerms:
    """memory/model.py's DSpark terms: both heads in Psi (the Markov head 2 x V x r); the loss adds the bias
    product e @ w2^T into the head's own output buffer (one GEMM with beta = 1: no [c, K, V] buffer of its own),
    and holds markov_w2's [V, r] fp32 gradient accumulator and the teacher-forced Markov embeddings of every label
    position (P x r). At Qwen3-8B, r 256, bf16: 0.16 GB + P x 512 bytes. (Added beside the head's output as a
    sum, it held 2 more chunk buffers, 0.58 GB there: measured at width 256 on CPU, fp32, the loss peak fell by
    exactly one, 0.58 GB, and the step by a fifth.)"""
    return MemoryTerms(head_params=dspark_params(hidden_size, vocab_size, opts), grads_name="markov_grads",
                       loss_name="markov_bias", loss_position_values=opts.markov_rank,
                       loss_fixed_bytes=4 * vocab_size * opts.markov_rank)


def warm_start_parts(drafter: Any) -> None:
    """markov_w2 = 0: the Markov bias is 0 and the chain drafts the backbone's argmax (the confidence head drafts
    nothing; models/warm_start.py)."""
    import torch

    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.zero_()


def head_target(loss: dict[str, Any]) -> str:
    """What the confidence head trained for: loss.confidence_target as the export recorded it, else sampled (DeepSpec's,
    and this trainer's before the field existed)."""
    return str(loss.get("confidence_target", "sampled"))


SPEC = register(KindSpec(
    name="dspark", architecture="Qwen3DSparkModel",
    summary="Markov head + confidence head; Qwen3DSparkModel export",
    options=DSparkOptions, model_fields=tuple(option_names()), loss_options=DSparkLoss,
    rules=(("model.markov_rank", "must be >= 1", lambda v: v >= 1),
           ("loss.confidence_weight", "must be >= 0", lambda v: v >= 0),
           ("loss.confidence_target", "must be sampled or greedy", lambda v: v in ("sampled", "greedy"))),
    drafter_module="dflash_ds.models.dspark", loss_module="dflash_ds.models.dspark_loss", vllm_method="dspark",
    vllm_v2_only=True,
    vllm_anchor_first_by_default=True, foreign_architectures=("DSparkDraftModel",),
    convert_hint="a DeepSpec-layout checkpoint is converted first: dflash-ds convert-deepspec SRC --out DIR "
                 "[--target TARGET]", head_target=head_target, memory=memory_terms, warm_start=warm_start_parts,
    recipe_name=RECIPE_NAME, recipe=RECIPE))
