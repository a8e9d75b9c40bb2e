"""The DFlash drafter: a small block-diffusion transformer over target context features.

Single-device model code: it imports no process group. The parameter names and
the export folder match the public reference `DFlashDraftModel` (DESIGN §2), so
SGLang, vLLM and the reference code load what `save_pretrained` writes.

Two forwards share the weights:
- `forward_train` runs every anchor block of a batch in one pass under a
  block-sparse mask (block j sees context positions < anchor_j and its own
  tokens, bidirectionally; never other blocks);
- `forward_infer` is the reference's: context features of positions < anchor,
  then one block, no mask, optionally with a cache of the context keys/values.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from dflash_ds.errors import DFlashError

try:  # block-sparse attention on GPU; CPU uses a dense boolean mask with SDPA
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # pragma: no cover - older torch
    flex_attention = None
    create_block_mask = None

SAFETENSORS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
MASK_BACKENDS = ("auto", "dense", "flex")

_compiled_flex = None


def _flex_attention(q, k, v, block_mask, enable_gqa: bool) -> torch.Tensor:
    """flex_attention, compiled once on GPU (eager flex materialises every score and is slow)."""
    global _compiled_flex
    if not q.is_cuda:
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DESIGN §2 rule: one draft layer -> [L // 2]; else n ids spread evenly over [1, L-3]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


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

    @property
    def rope_theta(self) -> float:
        """Base of the rotary embedding."""
        return float(self.rope_parameters.get("rope_theta", 10000.0))

    def to_hf_config(self):
        """A transformers Qwen3Config carrying the same fields (for the rotary embedding and loaders)."""
        from transformers import Qwen3Config

        return Qwen3Config(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps, max_position_embeddings=self.max_position_embeddings,
            rope_parameters=dict(self.rope_parameters), attention_bias=self.attention_bias,
            hidden_act=self.hidden_act, tie_word_embeddings=False,
        )

    def to_json_dict(self) -> dict[str, Any]:
        """The export config.json: a Qwen3 config plus the DFlash fields (DESIGN §2)."""
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
        })
        cfg.pop("transformers_version", None)
        return cfg

    @classmethod
    def from_json_dict(cls, cfg: dict[str, Any], where: str = CONFIG_NAME) -> "DrafterArch":
        """Parse an export config.json; errors name the missing field."""
        try:
            dcfg = cfg["dflash_config"]
            rope = cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
            n_layers = int(cfg["num_hidden_layers"])
            return cls(
                hidden_size=int(cfg["hidden_size"]), intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=n_layers, num_attention_heads=int(cfg["num_attention_heads"]),
                num_key_value_heads=int(cfg["num_key_value_heads"]),
                head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]),
                vocab_size=int(cfg["vocab_size"]), rms_norm_eps=float(cfg["rms_norm_eps"]),
                max_position_embeddings=int(cfg["max_position_embeddings"]), rope_parameters=dict(rope),
                block_size=int(cfg["block_size"]), num_target_layers=int(cfg["num_target_layers"]),
                mask_token_id=int(dcfg["mask_token_id"]),
                target_layer_ids=list(dcfg.get("target_layer_ids")
                                      or default_target_layer_ids(int(cfg["num_target_layers"]), n_layers)),
                attention_bias=bool(cfg.get("attention_bias", False)), hidden_act=cfg.get("hidden_act", "silu"),
            )
        except KeyError as exc:
            raise DFlashError(f"{where}: missing field {exc.args[0]!r} of a DFlash drafter config") from None


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 (as Qwen3)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, L, D]; cos/sin [B, L, D]."""
    return x * cos.unsqueeze(1) + _rotate_half(x) * sin.unsqueeze(1)


class DrafterAttention(nn.Module):
    """Queries from the block; keys/values from [context, block]; q/k norms and RoPE as Qwen3."""

    def __init__(self, arch: DrafterArch) -> None:
        super().__init__()
        h, nh, nkv, d = arch.hidden_size, arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, d
        self.q_proj = nn.Linear(h, nh * d, bias=arch.attention_bias)
        self.k_proj = nn.Linear(h, nkv * d, bias=arch.attention_bias)
        self.v_proj = nn.Linear(h, nkv * d, bias=arch.attention_bias)
        self.o_proj = nn.Linear(nh * d, h, bias=arch.attention_bias)
        self.q_norm = RMSNorm(d, arch.rms_norm_eps)
        self.k_norm = RMSNorm(d, arch.rms_norm_eps)

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of context features [B, S, H] -> two [B, kv_heads, S, D] (cacheable)."""
        b, s, _ = ctx.shape
        k = self.k_norm(self.k_proj(ctx).view(b, s, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(ctx).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return _rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, mask: Any) -> torch.Tensor:
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, q_len, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        k = torch.cat([ctx_k, k], dim=2)
        v = torch.cat([ctx_v, v], dim=2)
        if mask is not None and not isinstance(mask, torch.Tensor):  # a flex_attention BlockMask
            out = _flex_attention(q, k, v, mask, enable_gqa=self.num_kv_heads != self.num_heads)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                 enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DrafterMLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, arch: DrafterArch) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.up_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    """Pre-norm decoder layer whose attention also reads the context keys/values."""

    def __init__(self, arch: DrafterArch) -> None:
        super().__init__()
        self.self_attn = DrafterAttention(arch)
        self.mlp = DrafterMLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def _layer_step(layer: "DrafterLayer", x, cos, sin, ctx, ccos, csin, mask) -> torch.Tensor:
    """One draft layer over the blocks, with the context keys/values it reads."""
    ctx_k, ctx_v = layer.self_attn.context_kv(ctx, ccos, csin)
    return layer(x, cos, sin, ctx_k, ctx_v, mask)


class DFlashDrafter(nn.Module):
    """The drafter: fc + hidden_norm over concatenated target layers, decoder layers, final norm.

    The token embedding and the LM head are the target's (frozen) and are passed in, not owned.
    """

    def __init__(self, arch: DrafterArch) -> None:
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        self.arch = arch
        self.layers = nn.ModuleList([DrafterLayer(arch) for _ in range(arch.num_hidden_layers)])
        self.fc = nn.Linear(len(arch.target_layer_ids) * arch.hidden_size, arch.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        # transformers' rotary embedding understands every rope_type a target config may carry.
        self.rotary_emb = Qwen3RotaryEmbedding(arch.to_hf_config())
        # Training mask: "auto" = flex_attention BlockMask on GPU, dense boolean + SDPA on CPU.
        self.mask_backend = "auto"
        # Recompute each layer in backward (set by the trainer from model.activation_checkpointing).
        self.activation_checkpointing = False

    @property
    def block_size(self) -> int:
        return self.arch.block_size

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Seeded normal init of the linear weights; norms at one."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                    p.fill_(1.0)
                elif p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
                else:
                    p.zero_()

    def _cos_sin(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary_emb(x, position_ids)

    def project_context(self, context_features: torch.Tensor) -> torch.Tensor:
        """Concatenated target layer outputs [B, S, n*H] -> drafter context [B, S, H]."""
        return self.hidden_norm(self.fc(context_features))

    def _run_layers(self, x, pos, ctx, ctx_pos, mask) -> torch.Tensor:
        cos, sin = self._cos_sin(x, pos)
        ccos, csin = self._cos_sin(x, ctx_pos)
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        for layer in self.layers:
            if recompute:
                # Only the layer's input is kept; its activations (and the context keys/values)
                # are recomputed in backward.
                x = torch.utils.checkpoint.checkpoint(_layer_step, layer, x, cos, sin, ctx, ccos, csin, mask,
                                                      use_reentrant=False)
            else:
                x = _layer_step(layer, x, cos, sin, ctx, ccos, csin, mask)
        return self.norm(x)

    def forward_train(self, context_features: torch.Tensor, block_embeds: torch.Tensor,
                      anchors: torch.Tensor) -> torch.Tensor:
        """All anchor blocks of a batch in one pass.

        context_features [B, S, n*H]; block_embeds [B, A, bs, H] (embed of [x_a, MASK, ...]);
        anchors [B, A] (position of each block's first token; padding anchors may be 0).
        Returns final-normed hidden states [B, A, bs, H].
        """
        b, s, _ = context_features.shape
        _, a, bs, h = block_embeds.shape
        ctx = self.project_context(context_features)
        x = block_embeds.reshape(b, a * bs, h)
        offs = torch.arange(bs, device=anchors.device)
        pos = (anchors[:, :, None] + offs).reshape(b, a * bs)
        ctx_pos = torch.arange(s, device=anchors.device).expand(b, s)
        if self.mask_backend not in MASK_BACKENDS:
            raise DFlashError(f"mask_backend must be one of {MASK_BACKENDS}, got {self.mask_backend!r}")
        use_flex = self.mask_backend == "flex" or (self.mask_backend == "auto" and x.is_cuda)
        if use_flex and create_block_mask is None:
            raise DFlashError("mask_backend 'flex' needs torch.nn.attention.flex_attention (torch >= 2.5)")
        mask = self.block_mask(anchors, s, bs, use_flex=use_flex)
        return self._run_layers(x, pos, ctx, ctx_pos, mask).view(b, a, bs, h)

    @staticmethod
    def block_mask(anchors: torch.Tensor, ctx_len: int, bs: int, use_flex: bool = False) -> Any:
        """Block-sparse mask: block j sees context < anchor_j and its own bs tokens (DESIGN §3).

        Dense boolean [B, 1, A*bs, S + A*bs] for SDPA, or a flex_attention BlockMask on GPU.
        """
        b, a = anchors.shape
        if use_flex and create_block_mask is not None:
            def mask_mod(bi, hi, q, kv):
                blk = q // bs
                in_ctx = kv < ctx_len
                return (in_ctx & (kv < anchors[bi, blk])) | (~in_ctx & ((kv - ctx_len) // bs == blk))
            return create_block_mask(mask_mod, b, None, a * bs, ctx_len + a * bs, device=anchors.device)
        q_blk = torch.arange(a * bs, device=anchors.device) // bs  # [Q]
        ctx_ok = torch.arange(ctx_len, device=anchors.device)[None, None, :] < anchors.repeat_interleave(bs, 1)[:, :, None]
        own = (q_blk[:, None] == q_blk[None, :]).expand(b, -1, -1)
        return torch.cat([ctx_ok, own], dim=2).unsqueeze(1)

    def forward_infer(self, context_features: torch.Tensor | None, block_embeds: torch.Tensor, start: int,
                      cache: "DrafterCache | None" = None) -> torch.Tensor:
        """Reference inference forward for one block at positions start..start+bs-1.

        context_features [B, C, n*H] are the features of positions start-C..start-1 that the cache
        (if given) does not hold yet; without a cache C must equal start. Returns [B, bs, H].
        """
        b, bs, h = block_embeds.shape
        dev = block_embeds.device
        pos = torch.arange(start, start + bs, device=dev).expand(b, bs)
        cos, sin = self._cos_sin(block_embeds, pos)
        new_len = 0 if context_features is None else context_features.shape[1]
        if new_len:
            ctx = self.project_context(context_features)
            ccos, csin = self._cos_sin(block_embeds, torch.arange(start - new_len, start, device=dev).expand(b, new_len))
        x = block_embeds
        for i, layer in enumerate(self.layers):
            if new_len:
                k, v = layer.self_attn.context_kv(ctx, ccos, csin)
            else:
                k = v = block_embeds.new_zeros(b, layer.self_attn.num_kv_heads, 0, layer.self_attn.head_dim)
            if cache is not None:
                k, v = cache.extend(i, k, v)
            x = layer(x, cos, sin, k, v, None)
        if cache is not None and cache.length != start:
            raise ValueError(f"drafter cache holds {cache.length} positions, block starts at {start}")
        return self.norm(x)

    # ---- export format -------------------------------------------------------------------------
    def save_pretrained(self, out_dir: str | Path) -> Path:
        """Write config.json and model.safetensors in the reference layout (DESIGN §2), in the weights' dtype."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        cfg = self.arch.to_json_dict()
        # The weights' dtype: serving engines take it under --dtype auto (SGLang turns a float32
        # config into float16); transformers 4.x loaders read torch_dtype.
        dtype = str(next(self.parameters()).dtype).removeprefix("torch.")
        cfg["dtype"] = cfg["torch_dtype"] = dtype
        (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()
                   if not k.startswith("rotary_emb.")}
        save_file(tensors, str(out / SAFETENSORS_NAME), metadata={"format": "pt"})
        return out

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu") -> "DFlashDrafter":
        """Load an export folder (safetensors only: never unpickles)."""
        from safetensors.torch import load_file

        path = Path(path)
        arch = read_drafter_arch(path)
        model = cls(arch)
        weights = path / SAFETENSORS_NAME
        if not weights.is_file():
            raise DFlashError(f"drafter folder {path} has no {SAFETENSORS_NAME}")
        state = load_file(str(weights))
        expected = {k for k in model.state_dict() if not k.startswith("rotary_emb.")}
        missing, unexpected = expected - state.keys(), state.keys() - expected
        if missing or unexpected:
            raise DFlashError(f"{weights}: tensor names do not match the drafter config "
                              f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")
        model.load_state_dict(state, strict=False)
        return model.to(device)


def read_drafter_arch(path: str | Path) -> DrafterArch:
    """Read the DrafterArch of an export folder, with errors naming the file."""
    cfg_path = Path(path) / CONFIG_NAME
    if not cfg_path.is_file():
        raise DFlashError(f"drafter folder {path} has no {CONFIG_NAME}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise DFlashError(f"{cfg_path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    return DrafterArch.from_json_dict(cfg, str(cfg_path))


class DrafterCache:
    """Per-layer keys/values of the context positions already seen (inference only)."""

    def __init__(self, num_layers: int) -> None:
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else self.k[0].shape[2]

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new context keys/values of one layer and return the whole cached context."""
        if self.k[layer] is not None:
            k = torch.cat([self.k[layer], k], dim=2)
            v = torch.cat([self.v[layer], v], dim=2)
        self.k[layer], self.v[layer] = k, v
        return k, v
