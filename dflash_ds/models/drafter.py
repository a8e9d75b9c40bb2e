"""The DFlash drafter: a small block-diffusion transformer over target context features.

Single-device model code: it imports no process group. The parameter names and
the export folder match the public reference `DFlashDraftModel` (docs/DESIGN.md §2), so
SGLang, vLLM and the reference code load what `save_pretrained` writes.

Two forwards share the weights:
- `forward_train` runs every anchor block of a batch in one pass under a
  block-sparse mask (block j sees context positions < anchor_j and its own
  tokens, bidirectionally; never other blocks);
- `forward_infer` is the reference's: context features of positions < anchor,
  then one block, no mask, optionally with a cache of the context keys/values.
Sliding-window layers (`arch.layer_types`) narrow both: causal inside the block and
a window of `sliding_window` positions counting the query (see models/drafter_arch.py
for where that was read in the serving engines). The mask, and the compiled flex_attention
with its bound on compiled graphs, are in models/block_mask.py.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from dflash_ds.errors import DFlashError
from dflash_ds.models.block_mask import (
    FLEX_COMPILE, MASK_BACKENDS, create_block_mask, dense_block_mask, flex_block_mask, flex_shapes, run_flex,
)
from dflash_ds.models.drafter_arch import (  # noqa: F401 - re-exported: the drafter's public names
    CONFIG_NAME, FULL, SAFETENSORS_NAME, SLIDING, DrafterArch, default_target_layer_ids, read_drafter_arch,
)
from dflash_ds.models.drafter_cache import DrafterCache  # noqa: F401 - re-exported
from dflash_ds.models.drafting import BlockDraft
from dflash_ds.models.kinds import kind_spec
from dflash_ds.models.layer_ops import rms_norm, rope, swiglu


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 (as Qwen3)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)  # models/layer_ops.py: compiled on CUDA (train.fuse)


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
        k = rope(self.k_norm(self.k_proj(ctx).view(b, s, self.num_kv_heads, self.head_dim)), cos, sin)
        v = self.v_proj(ctx).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return k.transpose(1, 2), v

    def block_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Queries, keys and values of the block tokens x [B, L, H]: [B, heads, L, D] each (keys as the context's)."""
        q = rope(self.q_norm(self.q_proj(x).view(*x.shape[:2], self.num_heads, self.head_dim)), cos, sin)
        return (q.transpose(1, 2), *self.context_kv(x, cos, sin))

    @staticmethod
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
        """q [B, heads, L, D] over k, v [B, kv_heads, S, D] (grouped when fewer) -> [B, heads, L, D]."""
        flex = mask is not None and not isinstance(mask, torch.Tensor)  # a flex_attention BlockMask
        attention = run_flex if flex else F.scaled_dot_product_attention
        return attention(q, k, v, mask, enable_gqa=k.shape[1] != q.shape[1])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, mask: Any) -> torch.Tensor:
        q, k, v = self.block_qkv(x, cos, sin)
        out = self.attend(q, torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2), mask)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))


class DrafterMLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, arch: DrafterArch) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.up_proj = nn.Linear(arch.hidden_size, arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


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
    `DFlashDrafter(arch)` builds the class of `arch.kind` (dflash2: models/dflash2.DFlash2Drafter),
    so every caller that builds or loads a drafter gets the right one without asking for it.
    """

    kind = "dflash"
    layer_cls: type = DrafterLayer
    _by_kind: dict[str, type] = {}  # kind -> class; subclasses register themselves (imported by __new__)
    # How the kind drafts, asked of its class (nobody probes a drafter for a part); DFlash: a block's argmax at once.
    sequential = False
    has_confidence_head = False  # its BlockDraft carries a confidence head's probabilities (eval's --confidence-stop)

    def draft_tables(self) -> Any:
        """What `draft_tokens` reads of its kind's parts, read once for a caller drafting many chunks (None: none)."""
        return None

    def draft_tokens(self, hidden, lm_head, anchor_ids, temperature=0.0, generator=None, tables=None) -> BlockDraft:
        """A sequential kind's draft of final-normed hidden states [N, L, H] after anchors [N] (models/drafting.py)."""
        raise NotImplementedError(f"a {self.kind} drafter drafts a block at once: it is not `sequential`")

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        DFlashDrafter._by_kind[cls.kind] = cls

    def __new__(cls, arch: DrafterArch | None = None, *args, **kwargs):
        if cls is DFlashDrafter and arch is not None:
            cls = DFlashDrafter._class_of(arch)
        return super().__new__(cls)

    @staticmethod
    def _class_of(arch: DrafterArch) -> type["DFlashDrafter"]:
        if arch.kind == DFlashDrafter.kind:
            return DFlashDrafter
        module = kind_spec(arch.kind).drafter_module
        if arch.kind not in DFlashDrafter._by_kind and module:
            importlib.import_module(module)  # its class registers itself
        if arch.kind not in DFlashDrafter._by_kind:
            raise DFlashError(f"no drafter class registered for kind {arch.kind!r}")
        return DFlashDrafter._by_kind[arch.kind]

    @classmethod
    def empty(cls, arch: DrafterArch, device: str | torch.device = "cpu") -> "DFlashDrafter":
        """A drafter of `arch` (its kind's class), its parameters allocated on `device` for a caller that fills them
        all next (`seeded`, a state dict): built on the meta device, torch's default init is skipped (one CPU core's
        kaiming-uniform draws: 25 s for the Qwen3-8B preset drafter's 1.05 B parameters here, every start and load)."""
        klass = DFlashDrafter._class_of(arch) if cls is DFlashDrafter else cls  # imported outside the meta device
        with torch.device("meta"):
            model = klass(arch)
        model.to_empty(device=device)
        model._make_rope(device)  # buffers are computed, not loaded: made again (on the CPU, then moved)
        return model

    @classmethod
    def seeded(cls, arch: DrafterArch, seed: int, device: str | torch.device = "cpu") -> "DFlashDrafter":
        """A new drafter of `arch` with `init_weights(seed)`: on the CPU the same numbers as building it and calling
        that; on a GPU drawn there (the benches: no 1 B normal draws on one CPU core), by the GPU's generator."""
        model = cls.empty(arch, device)
        model.init_weights(seed)
        return model

    def __init__(self, arch: DrafterArch) -> None:
        super().__init__()
        self.arch = arch
        self.layers = nn.ModuleList([self.layer_cls(arch) for _ in range(arch.num_hidden_layers)])
        self.fc = nn.Linear(len(arch.target_layer_ids) * arch.hidden_size, arch.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self._make_rope()
        # training mask (model.attention_backend): auto = flex BlockMask on GPU, dense + SDPA on CPU; dense/flex force it
        self.mask_backend = "auto"
        # Recompute the first `checkpoint_layers` layers (None: all) in backward when `activation_checkpointing`
        # (the trainer sets both: model.activation_checkpointing, model.checkpoint_layers; runtime/checkpointing.py).
        self.activation_checkpointing = False
        self.checkpoint_layers: int | None = None

    def _make_rope(self, device: str | torch.device = "cpu") -> None:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        # transformers' rotary embedding understands every rope_type a target config may carry (on the CPU, even
        # inside `empty`'s meta device: a rope_type's init may read its tensors' values).
        with torch.device("cpu"):
            self.rotary_emb = Qwen3RotaryEmbedding(self.arch.to_hf_config()).to(device)
        # fp32 copies of the RoPE frequency buffers, restored after every cast (see `_apply`).
        self._rope_fp32 = {name: buf.detach().clone().float() for name, buf in self.rotary_emb.named_buffers()}

    @property
    def block_size(self) -> int:
        return self.arch.block_size

    def _apply(self, fn, recurse: bool = True):
        # `.to(torch.bfloat16)` (the trainer, DeepSpeed's bf16 cast, eval, bench) casts every floating buffer, the
        # RoPE frequencies too: in bf16 they are 0.37% off, a phase error of 0.59 rad at position 512 and 2.4 rad at
        # 2047. SGLang and vLLM rotate with fp32 frequencies, so training must too: after any cast the buffers are
        # the fp32 originals again, on the buffers' device.
        super()._apply(fn, recurse)
        for name, original in self._rope_fp32.items():
            buf = getattr(self.rotary_emb, name)
            if buf.dtype != torch.float32:
                setattr(self.rotary_emb, name, original.to(buf.device))
        return self

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Seeded normal init of the linear weights; norms at one (drawn by a generator of the weights' device)."""
        gen = torch.Generator(device=next(self.parameters()).device).manual_seed(seed)
        for name, p in self.named_parameters():
            with torch.no_grad():
                if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                    p.fill_(1.0)
                elif p.dim() == 2 and p.dtype == torch.float32:  # drawn in place: no temporaries at 1 B parameters
                    torch.randn(p.shape, generator=gen, out=p.data).mul_(std)
                elif p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
                else:
                    p.zero_()

    def _cos_sin(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary_emb(x, position_ids)

    def project_context(self, context_features: torch.Tensor) -> torch.Tensor:
        """Concatenated target layer outputs [B, S, n*H] -> drafter context [B, S, H]."""
        return self.hidden_norm(self.fc(context_features))

    def _run_layers(self, x, pos, ctx, ctx_pos, masks: dict[str, Any]) -> torch.Tensor:
        cos, sin = self._cos_sin(x, pos)
        ccos, csin = self._cos_sin(x, ctx_pos)
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        n = len(self.layers) if self.checkpoint_layers is None else self.checkpoint_layers
        for i, (layer, kind) in enumerate(zip(self.layers, self.arch.layer_types)):
            mask = masks[kind]
            if recompute and i < n:  # only its input is kept; its activations and context K/V recomputed
                x = torch.utils.checkpoint.checkpoint(_layer_step, layer, x, cos, sin, ctx, ccos, csin, mask,
                                                      use_reentrant=False)
            else:
                x = _layer_step(layer, x, cos, sin, ctx, ccos, csin, mask)
        return self.norm(x)

    def forward_train(self, context_features: torch.Tensor, block_embeds: torch.Tensor,
                      anchors: torch.Tensor, pad: bool | None = None) -> torch.Tensor:
        """All anchor blocks of a batch in one pass.

        context_features [B, S, n*H]; block_embeds [B, A, bs, H] (embed of [x_a, MASK, ...]);
        anchors [B, A] (position of each block's first token; padding anchors may be 0).
        Returns final-normed hidden states [B, A, bs, H]. `pad` (None: on the flex path, as
        FLEX_COMPILE.pad says) runs the batch at `flex_shapes` (S to a multiple of 128, A to a
        minimum), which bounds flex's compiled graphs (models/block_mask.py); the padded context
        positions are never visible and the padded blocks are dropped, so the result is the same.
        """
        if self.mask_backend not in MASK_BACKENDS:
            raise DFlashError(f"mask_backend must be one of {MASK_BACKENDS}, got {self.mask_backend!r}")
        use_flex = self.mask_backend == "flex" or (self.mask_backend == "auto" and block_embeds.is_cuda)
        if use_flex and create_block_mask is None:
            raise DFlashError("mask_backend 'flex' needs torch.nn.attention.flex_attention (torch >= 2.5)")
        b, s, _ = context_features.shape
        _, a, bs, h = block_embeds.shape
        ctx = self.project_context(context_features)
        if pad is None:
            pad = use_flex and FLEX_COMPILE.pad
        s_pad, a_pad = flex_shapes(s, a, bs) if pad else (s, a)
        if s_pad != s:
            ctx = F.pad(ctx, (0, 0, 0, s_pad - s))
        if a_pad != a:  # padding anchors are 0: such a block sees no context, only its own (zero) tokens
            block_embeds = F.pad(block_embeds, (0, 0, 0, 0, 0, a_pad - a))
            anchors = F.pad(anchors, (0, a_pad - a))
        x = block_embeds.reshape(b, a_pad * bs, h)
        offs = torch.arange(bs, device=anchors.device)
        pos = (anchors[:, :, None] + offs).reshape(b, a_pad * bs)
        ctx_pos = torch.arange(s_pad, device=anchors.device).expand(b, s_pad)
        # One mask per layer type present (built once, shared by the layers of that type).
        masks = {kind: self.block_mask(anchors, s_pad, bs, use_flex=use_flex,
                                       sliding_window=self.arch.sliding_window if kind == SLIDING else None)
                 for kind in set(self.arch.layer_types)}
        out = self._run_layers(x, pos, ctx, ctx_pos, masks).view(b, a_pad, bs, h)
        return out[:, :a] if a_pad != a else out

    @staticmethod
    def block_mask(anchors: torch.Tensor, ctx_len: int, bs: int, use_flex: bool = False,
                   sliding_window: int | None = None) -> Any:
        """Block-sparse mask: block j sees context < anchor_j and its own bs tokens (docs/DESIGN.md §3).

        With `sliding_window` W (a sliding layer) the query at offset o of block j (position
        anchor_j + o) sees only keys at positions in (anchor_j + o - W, anchor_j + o]: causal
        inside the block, the window counting the query itself, as the serving engines run it.
        Dense boolean [B, 1, A*bs, S + A*bs] for SDPA, or a flex_attention BlockMask on GPU.
        """
        if not (use_flex and create_block_mask is not None):
            return dense_block_mask(anchors, ctx_len, bs, sliding_window)
        return flex_block_mask(anchors, ctx_len, bs, sliding_window)  # from the block structure: no dense mask

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
        for i, (layer, kind) in enumerate(zip(self.layers, self.arch.layer_types)):
            if new_len:
                k, v = layer.self_attn.context_kv(ctx, ccos, csin)
            else:
                k = v = block_embeds.new_zeros(b, layer.self_attn.num_kv_heads, 0, layer.self_attn.head_dim)
            if cache is not None:
                k, v = cache.extend(i, k, v)
            mask = None  # full attention: the whole context and the whole block
            if kind == SLIDING:
                k, v, mask = self._sliding_infer(k, v, start, bs)
            x = layer(x, cos, sin, k, v, mask)
        if cache is not None and cache.length != start:
            raise ValueError(f"drafter cache holds {cache.length} positions, block starts at {start}")
        return self.norm(x)

    def _sliding_infer(self, k: torch.Tensor, v: torch.Tensor, start: int, bs: int):
        """A sliding layer's context keys/values (the last W-1 positions, all any query can see) and its mask.

        k/v hold context positions start-C..start-1; the query at start+o sees keys at positions
        in (start + o - W, start + o]: [bs, kept + bs] boolean, causal inside the block.
        """
        w = int(self.arch.sliding_window)
        keep = min(k.shape[2], max(w - 1, 0))
        k, v = k[:, :, k.shape[2] - keep:], v[:, :, v.shape[2] - keep:]
        qpos = torch.arange(start, start + bs, device=k.device)[:, None]
        kpos = torch.arange(start - keep, start + bs, device=k.device)[None, :]
        return k, v, (kpos <= qpos) & (kpos > qpos - w)

    # ---- export format -------------------------------------------------------------------------
    def save_pretrained(self, out_dir: str | Path) -> Path:
        """Write config.json and model.safetensors in the reference layout (docs/DESIGN.md §2), in the weights' dtype."""
        from safetensors.torch import save_file

        (out := Path(out_dir)).mkdir(parents=True, exist_ok=True)
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
        model = cls.empty(read_drafter_arch(path))  # every parameter is loaded below (checked)
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

