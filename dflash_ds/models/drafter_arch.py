"""The drafter's shape (`DrafterArch`) and its export config.json (docs/DESIGN.md §2).

Attention layer types follow the serving engines' DFlash loaders (read in SGLang's
`python/sglang/srt/models/dflash.py` + `speculative/dflash_utils.py`, vLLM's
`vllm/model_executor/models/qwen3_dflash.py`, SpecForge's DFlash training masks):

- `full_attention` (the default): a block query sees every context position < the block's
  first position and all tokens of its own block, in both directions (SGLang: ENCODER_ONLY;
  vLLM: causal=False).
- `sliding_attention`: causal inside the block, and a window of `sliding_window` positions
  that counts the query itself: the query at position p sees keys at positions k with
  p - sliding_window < k <= p, context and block alike (SGLang: DECODER with
  window_left = sliding_window - 1, "HF sliding windows include the current token"; vLLM:
  causal for layer_types[i] == "sliding_attention", flash-attn window (sliding_window - 1, 0)).
  SpecForge trains the same mask; it leaves the window out inside the block (a no-op while
  sliding_window >= block_size), here it applies there too, as in the engines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_ds.errors import DFlashError, read_json_file
from dflash_ds.models import kinds

SAFETENSORS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int, *,
                             from_target: bool = False) -> list[int]:
    """docs/DESIGN.md §2 rule (one draft layer -> [L // 2]; else n ids spread over [1, L-3]), distinct on shallow targets.

    Real depths keep the public rule exactly (36 layers, 5 draft layers -> [1, 9, 17, 25, 33];
    64 layers -> [1, 16, 31, 46, 61], SpecForge's Qwen3.6-27B ids). It repeats ids once L < n + 3
    (4 layers, 2 draft layers -> [1, 1]); then the span widens to [1, L-2], [1, L-1], [0, L-1],
    the first that holds n distinct ids (4 layers, 2 draft layers -> [1, 2]).

    `from_target` (the draft layers start as the target's last n, `model.init: target`): the ids end at L-n-1, the
    input of the first copied layer, which `fc` passes through (models/target_layers_init.py), spread from 1 where
    [1, L-n-1] holds n distinct ids (SmolLM2's 30 layers: 2 -> [1, 27], 4 -> [1, 9, 17, 25]; Qwen3-8B's 36, 5 ->
    [1, 8, 16, 23, 30]; one draft layer -> [L-2]); a shallower target keeps the rule above.
    """
    n_t, n = num_target_layers, num_draft_layers
    if n_t < 1 or n < 1:
        raise DFlashError(f"target layer ids: need >= 1 target and draft layer, got {n_t} and {n}")
    last = n_t - n - 1
    if from_target and n == 1 and last >= 0:
        return [last]
    if from_target and n > 1 and last - 1 >= n - 1:
        return [int(round(1 + i * (last - 1) / (n - 1))) for i in range(n)]
    if n == 1:
        return [n_t // 2]
    if n > n_t:
        raise DFlashError(f"{n} draft layers read {n} distinct target layers by default, but the target has "
                          f"only {n_t}: set model.target_layer_ids (ids may repeat) or fewer model.num_layers")
    for start, end in ((1, n_t - 3), (1, n_t - 2), (1, n_t - 1), (0, n_t - 1)):
        # A step of >= 1 between the spread points rounds to distinct integers.
        if end - start >= n - 1:
            return [int(round(start + i * (end - start) / (n - 1))) for i in range(n)]
    raise AssertionError("unreachable: [0, L-1] holds L >= n ids")  # pragma: no cover


def resolve_layer_types(layer_types: list[str] | None, num_layers: int, sliding_window: int | None,
                        where: str = "layer_types") -> list[str]:
    """One attention type per draft layer (None/empty = all full); errors name `where`."""
    if not layer_types:
        return [FULL] * num_layers
    types = list(layer_types)
    bad = sorted({t for t in types if t not in LAYER_TYPES})
    if bad:
        raise DFlashError(f"{where}: unknown layer types {bad}; each must be one of {list(LAYER_TYPES)}")
    if len(types) != num_layers:
        raise DFlashError(f"{where} has {len(types)} entries but the drafter has {num_layers} layers")
    if SLIDING in types and (sliding_window is None or sliding_window < 1):
        raise DFlashError(f"{where} has sliding_attention layers: sliding_window must be >= 1, "
                          f"got {sliding_window!r}")
    return types


@dataclass
class DrafterArch:
    """Everything that fixes the drafter's shape; mirrors the export config.json."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_parameters: dict[str, Any]
    block_size: int
    num_target_layers: int
    mask_token_id: int
    target_layer_ids: list[int]
    attention_bias: bool = False
    hidden_act: str = "silu"
    extra: dict[str, Any] = field(default_factory=dict)
    layer_types: list[str] | None = None
    """Per draft layer "full_attention" or "sliding_attention"; None = all full (normalised to a list)."""
    sliding_window: int | None = None
    """Window of the sliding layers, counting the query itself (HF convention)."""
    options: Any = None
    """The parts of the drafter's kind beyond DFlash: an instance of its KindSpec.options (models/kinds.py, e.g.
    models/dspark_arch.DSparkOptions), which fixes the kind; None = a DFlash drafter."""

    def __post_init__(self) -> None:
        self.layer_types = resolve_layer_types(self.layer_types, self.num_hidden_layers, self.sliding_window)
        kinds.kind_of_options(self.options)  # a clear error for options of no registered kind
        if self.options is not None:
            self.options.check(self.hidden_size, self.vocab_size)
        if SLIDING not in self.layer_types:
            self.sliding_window = None  # meaningless without a sliding layer; keeps exports canonical

    @property
    def rope_theta(self) -> float:
        """Base of the rotary embedding."""
        return float(self.rope_parameters.get("rope_theta", 10000.0))

    @property
    def kind(self) -> str:
        """The kind its options fix (models/kinds.py): dflash without any."""
        return kinds.kind_of_options(self.options)

    @property
    def has_sliding(self) -> bool:
        """Whether any draft layer uses sliding-window attention."""
        return SLIDING in self.layer_types

    def to_hf_config(self):
        """A transformers Qwen3Config carrying the same fields (for the rotary embedding and loaders)."""
        from transformers import Qwen3Config

        return Qwen3Config(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps, max_position_embeddings=self.max_position_embeddings,
            rope_parameters=dict(self.rope_parameters), attention_bias=self.attention_bias,
            hidden_act=self.hidden_act, tie_word_embeddings=False, layer_types=list(self.layer_types),
            # Qwen3Config drops sliding_window unless use_sliding_window is set.
            use_sliding_window=self.has_sliding, sliding_window=self.sliding_window,
        )

    def to_json_dict(self) -> dict[str, Any]:
        """The export config.json: a Qwen3 config plus the DFlash fields (docs/DESIGN.md §2)."""
        cfg = self.to_hf_config().to_dict()
        cfg.update(self.extra)
        cfg.update({
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            # Older loaders read rope_theta at the top level.
            "rope_theta": self.rope_theta,
            "dtype": "float32" if cfg.get("dtype") is None else cfg["dtype"],
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.has_sliding,
        })
        if self.options is not None:  # the kind's architecture and keys (its options class says where)
            cfg["architectures"] = [kinds.kind_spec(self.kind).architecture]
            self.options.to_export(cfg, self.block_size)
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type != "default":
            # transformers-4.x loaders (and SGLang's get_rope_config on them) read only rope_scaling.
            scaling = {k: v for k, v in self.rope_parameters.items() if k != "rope_theta"}
            cfg["rope_scaling"] = {**scaling, "rope_type": rope_type, "type": rope_type}
        cfg.pop("transformers_version", None)
        return cfg

    @classmethod
    def from_json_dict(cls, cfg: dict[str, Any], where: str = CONFIG_NAME) -> "DrafterArch":
        """Parse an export config.json; errors name the missing field."""
        try:
            dcfg = cfg["dflash_config"]
            rope = cfg.get("rope_parameters")
            if not rope:  # a transformers-4.x config: rope_theta at the top, scaling in rope_scaling
                rope = {k: v for k, v in (cfg.get("rope_scaling") or {}).items() if k != "type"}
                rope.setdefault("rope_type", (cfg.get("rope_scaling") or {}).get("type", "default"))
                rope["rope_theta"] = cfg["rope_theta"]
            n_layers = int(cfg["num_hidden_layers"])
            window = cfg.get("sliding_window")
            spec = kinds.kind_spec(kinds.kind_of_architecture(cfg.get("architectures")) or kinds.DFLASH)
            options = None if spec.options is None else spec.options.from_export(cfg, where)
            # a block_size that does not count every slot (DeepSpec's anchor-as-first layout: dspark_arch)
            block = int(cfg["block_size"]) + getattr(options, "export_block_offset", 0)
            return cls(
                hidden_size=int(cfg["hidden_size"]), intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=n_layers, num_attention_heads=int(cfg["num_attention_heads"]),
                num_key_value_heads=int(cfg["num_key_value_heads"]),
                head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]),
                vocab_size=int(cfg["vocab_size"]), rms_norm_eps=float(cfg["rms_norm_eps"]),
                max_position_embeddings=int(cfg["max_position_embeddings"]), rope_parameters=dict(rope),
                block_size=block, num_target_layers=int(cfg["num_target_layers"]),
                mask_token_id=int(dcfg["mask_token_id"]),
                target_layer_ids=list(dcfg.get("target_layer_ids")
                                      or default_target_layer_ids(int(cfg["num_target_layers"]), n_layers)),
                attention_bias=bool(cfg.get("attention_bias", False)), hidden_act=cfg.get("hidden_act", "silu"),
                layer_types=cfg.get("layer_types"), sliding_window=None if window is None else int(window),
                options=options,
            )
        except KeyError as exc:
            hint = kinds.convert_hint_of(cfg)  # a checkpoint in its authors' layout: what converts it
            raise DFlashError(f"{where}: missing field {exc.args[0]!r} of a DFlash drafter config"
                              + (f"; {hint}" if hint else "")) from None
        except DFlashError as exc:
            raise DFlashError(f"{where}: {exc}") from None


def read_drafter_arch(path: str | Path) -> DrafterArch:
    """Read the DrafterArch of an export folder, with errors naming the file."""
    cfg_path = Path(path) / CONFIG_NAME
    cfg = read_json_file(cfg_path, f"drafter folder {path} has no {CONFIG_NAME}")
    return DrafterArch.from_json_dict(cfg, str(cfg_path))

