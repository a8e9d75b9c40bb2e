"""The frozen target: local HF folder checks, loading, the adapter that finds its parts, and hidden-state capture.

Only the outputs of the decoder layers in `target_layer_ids` and the final (normed)
hidden state are kept, through forward hooks: every layer's output and the vocabulary
logits are never materialised together.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_ds.errors import DFlashError, read_json_file


def read_target_config(path: str | Path) -> dict[str, Any]:
    """The text-model view of a local target's config.json: `text_config` merged over the top level.

    Vision-language wrappers (Qwen3.5/3.6) keep the decoder's shapes under `text_config`; every caller wants
    those (hidden size, layers, vocabulary), so this returns them at the top level, like a plain causal LM's.
    """
    path = Path(path)
    if not path.is_dir():
        raise DFlashError(f"target folder {path} does not exist")
    cfg_path = path / "config.json"
    cfg = read_json_file(cfg_path, f"target folder {path} has no config.json (expected a local HF model folder)")
    model_type = cfg.get("model_type")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        import transformers

        raise DFlashError(f"{cfg_path}: model_type {model_type!r} has no causal-LM class in transformers "
                          f"{transformers.__version__} (AutoModelForCausalLM cannot load it)")
    text = {**cfg, **(cfg.get("text_config") or {})}
    # A wrapper may state the tie flag only at its top level; the text config's own value wins when present.
    text["tie_word_embeddings"] = bool((cfg.get("text_config") or {}).get("tie_word_embeddings",
                                                                           cfg.get("tie_word_embeddings", False)))
    where = f"{cfg_path} (text_config)" if "text_config" in cfg else str(cfg_path)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if key not in text:
            raise DFlashError(f"{where}: missing field {key!r}")
    return text


ATTENTION_IMPLEMENTATIONS = ("auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")


def load_target(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                attn_implementation: str = "auto", tp_size: int = 1, hub_kernels: bool = False) -> nn.Module:
    """Load the target causal LM straight onto `device` in `dtype`, frozen and in eval mode.

    `device_map` places each tensor on the rank's device as it is read from the safetensors: no
    rank stages the whole model in host RAM first (a Qwen3.6-27B is 54 GB in bf16: eight colocated
    ranks staging it would need 432 GB of host memory). `attn_implementation` ("auto": transformers'
    choice, sdpa on most models) selects the attention kernels; `describe_target` says which run.

    `tp_size` > 1: this rank holds 1/tp_size of the target, sharded over the default process group (which
    must have tp_size ranks: a replica's group, distributed/topology.py) by the model's own tensor-parallel
    plan (transformers' `DistributedConfig(tp_size)`: attention heads and MLP columns/rows split, MoE experts'
    matrices split, not replicated). Each rank reads only its slices from the safetensors, with pread
    (`_pread_slices`: nothing of the file is mapped into the rank). Every rank of the
    replica must run every forward; each gets the whole (all-reduced) hidden states.

    `hub_kernels` (train.target_hub_kernels): let transformers kernelize the model with kernels it fetches from
    the Hugging Face Hub (`kernels` package). Off by default: transformers >= 5.2x turns it on for every model
    loaded on CUDA, which downloads and runs third-party code on each rank, and fails offline (docs/DESIGN.md §9).
    """
    from transformers import AutoModelForCausalLM

    read_target_config(path)
    if attn_implementation not in ATTENTION_IMPLEMENTATIONS:
        raise DFlashError(f"target attention implementation {attn_implementation!r}: expected one of "
                          f"{', '.join(ATTENTION_IMPLEMENTATIONS)}")
    extra = {} if attn_implementation == "auto" else {"attn_implementation": attn_implementation}
    files: list = []
    if tp_size > 1:
        extra["distributed_config"] = _tensor_parallel_config(path, tp_size)
        extra["state_dict"], files = _pread_slices(Path(path))
    else:
        extra["device_map"] = torch.device(device)
    try:
        if tp_size > 1:  # the class itself: the auto class deep-copies its kwargs (slices too) and wants a folder
            cls, config = _causal_lm_class_and_config(path)
            model = cls.from_pretrained(None, config=config, dtype=dtype, use_kernels=hub_kernels, **extra)
        else:
            # use_kernels always explicit: transformers' default is on (see above)
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True,
                                                         use_kernels=hub_kernels, **extra)
    except (ImportError, ValueError, AssertionError, RuntimeError) as exc:
        if tp_size > 1 and not isinstance(exc, ImportError):
            raise DFlashError(f"target {path}: cannot shard it over {tp_size} ranks with transformers' tensor "
                              f"parallelism ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from exc
        if attn_implementation == "auto" or attn_implementation not in str(exc):
            raise
        raise DFlashError(f"target {path}: attention implementation {attn_implementation} is not available "
                          f"here ({str(exc).splitlines()[0]})") from None
    finally:
        for f in files:
            f.__exit__(None, None, None)
    target_parts(model, str(path))  # a target the drafter cannot read fails now, not mid-run
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _causal_lm_class_and_config(path: str | Path) -> tuple[type, Any]:
    """The causal-LM class AutoModelForCausalLM picks for the folder, and the config it gives that class.

    A vision-language wrapper (Qwen3.5/3.6) maps to a text-only class that takes the text config; the wrapper's
    quantization config goes with it, as the auto class does.
    """
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    text_class = config.sub_configs.get("text_config")
    if text_class is not None and getattr(cls, "config_class", None) is text_class:
        quantization = getattr(config, "quantization_config", None)
        config = config.get_text_config()
        if quantization is not None:
            config.quantization_config = quantization
    return cls, config


def _pread_slices(path: Path) -> tuple[dict[str, Any], list]:
    """Every tensor of the folder's safetensors as a lazy slice read with pread, and the open files.

    transformers' own loader memory-maps the files: a rank reading its half of a row-major matrix (a rowwise
    split takes part of every row) faults in the pages around each row, and the kernel's read-around brings the
    other half's pages with them, all counted in the rank's resident set (measured on Qwen3-8B-shaped layers:
    74% of the file mapped by each of 2 ranks). pread copies only the bytes of the slice asked for.
    """
    from safetensors import safe_open

    slices, files = {}, []
    try:
        for file in sorted(set(_tensor_index(path).values())):
            f = safe_open(str(file), framework="pt", device="cpu", backend="pread")
            files.append(f)
            slices.update({k: f.get_slice(k) for k in f.keys()})
    except Exception:
        for f in files:
            f.__exit__(None, None, None)
        raise
    return slices, files


def _tensor_parallel_config(path: str | Path, tp_size: int):
    """transformers' DistributedConfig for `tp_size` ranks, after the checks that give a clear error first."""
    import torch.distributed as dist
    from transformers.distributed.configuration_utils import DistributedConfig

    if not dist.is_initialized() or dist.get_world_size() != tp_size:
        have = dist.get_world_size() if dist.is_initialized() else "no"
        raise DFlashError(f"target {path}: sharding over {tp_size} ranks needs a default process group of {tp_size} "
                          f"ranks (a target replica's), found {have}")
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(str(path), local_files_only=True).get_text_config()
    tp_plan = getattr(text, "base_model_tp_plan", None) or {}
    ep_plan = getattr(text, "base_model_ep_plan", None) or {}
    cfg = read_target_config(path)
    if any("self_attn" in rule for rule in tp_plan):
        for key in ("num_attention_heads", "num_key_value_heads"):
            heads = cfg.get(key)
            if isinstance(heads, int) and heads % tp_size:
                raise DFlashError(f"{Path(path) / 'config.json'}: {key} = {heads} is not divisible by "
                                  f"topology.target_parallel {tp_size}: tensor parallelism splits whole heads")
    if ep_plan and not any("experts" in rule for rule in tp_plan):
        # The family's tensor-parallel plan leaves its experts whole (gpt-oss: only the embedding is split):
        # its expert-parallel plan gives each rank 1/k of the experts, every rank running the replica's batch.
        return DistributedConfig(tp_size=tp_size, ep_size=tp_size, ep_implementation="all_reduce")
    if not tp_plan:
        raise DFlashError(f"target {path}: model type {cfg.get('model_type')!r} has no tensor-parallel plan in "
                          f"transformers, so it cannot be sharded over topology.target_parallel {tp_size} ranks")
    return DistributedConfig(tp_size=tp_size)


def held_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of parameters this rank holds, bytes of the whole model): equal unless the model is sharded."""
    local = sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in model.parameters())
    return local, sum(p.nbytes for p in model.parameters())


# Kernels of the Gated DeltaNet (linear-attention) layers of Qwen3.5/3.6 and Qwen3-Next: without them
# transformers runs a pure-torch fallback that is far slower.
LINEAR_ATTENTION_KERNELS = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d"}


def describe_target(model: nn.Module) -> str:
    """One line for the log: dtype, device, which attention implementation runs, and linear-attention kernels."""
    import importlib.util

    p = next(model.parameters())
    text = model.config.get_text_config()
    line = (f"target {type(model).__name__}: {str(p.dtype).removeprefix('torch.')} on {p.device}, attention "
            f"{getattr(model.config, '_attn_implementation', None) or 'default'}")
    if "linear_attention" in (getattr(text, "layer_types", None) or []):
        have = [pip for mod, pip in LINEAR_ATTENTION_KERNELS.items() if importlib.util.find_spec(mod)]
        missing = [pip for pip in LINEAR_ATTENTION_KERNELS.values() if pip not in have]
        line += ("; Gated DeltaNet layers use the fast kernels (" + ", ".join(have) + ")" if not missing else
                 f"; Gated DeltaNet layers run the slow pure-torch fallback ({', '.join(missing)} not installed: "
                 f"pip install {' '.join(missing)})")
    return line


@dataclass
class TargetParts:
    """What the drafter needs of a causal LM, found through the model's own structure."""

    body: nn.Module  # the text decoder: forward(input_ids, attention_mask) -> last_hidden_state after the final norm
    layers: nn.ModuleList  # its decoder layers, in order (hooks read their outputs)
    embed: nn.Module  # token embedding
    head: nn.Module  # LM head (vocabulary logits of the final hidden)


def target_parts(model: nn.Module, name: str = "target") -> TargetParts:
    """Decoder body, layer list, embedding and LM head of any HF causal LM (vision-language wrappers included)."""
    body = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    # A wrapper loaded as itself (not as its causal LM) answers with its multimodal model: descend to the text part.
    while body is not None and hasattr(body, "language_model"):
        body = body.language_model
    if body is None or body is model:
        raise DFlashError(f"{name}: {type(model).__name__} has no text decoder (get_decoder() / .model)")
    n_layers = model.config.get_text_config().num_hidden_layers
    layers = getattr(body, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        # Older layouts name the list differently (h, blocks): the one ModuleList of the configured depth.
        lists = [m for m in body.children() if isinstance(m, nn.ModuleList) and len(m) == n_layers]
        layers = lists[0] if len(lists) == 1 else None
    if layers is None or len(layers) != n_layers:
        raise DFlashError(f"{name}: no decoder layer list of {n_layers} layers found in {type(body).__name__}")
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embed is None or head is None:
        missing = "token embedding (get_input_embeddings)" if embed is None else "LM head (get_output_embeddings)"
        raise DFlashError(f"{name}: {type(model).__name__} has no {missing}")
    return TargetParts(body=body, layers=layers, embed=embed, head=head)


def decoder_layers(target: nn.Module) -> nn.ModuleList:
    """The decoder layer list of the target's text decoder."""
    return target_parts(target).layers


def capture_hidden(target: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the target body once; return (concat of layer_ids outputs [B, S, n*H], final hidden [B, S, H]).

    Layer i's output is `hidden_states[i + 1]` of an HF forward; the final hidden is after the
    model's last norm, so `lm_head(final)` are the target's logits. The LM head itself is not run.
    """
    layers, last = capture_layers(target, input_ids, attention_mask, layer_ids)
    return torch.cat(layers, dim=-1), last


def capture_layers(target: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   layer_ids: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`capture_hidden` before the concatenation: the outputs of layer_ids (in that order) and the final hidden.

    The caller concatenates them where it wants the context, e.g. straight into a send buffer.
    """
    parts = target_parts(target)
    layers = parts.layers
    captured: dict[int, torch.Tensor] = {}
    hooks = []

    def keep(idx: int):
        def hook(_mod, _inp, out):
            captured[idx] = out[0] if isinstance(out, tuple) else out
        return hook

    for idx in sorted(set(layer_ids)):
        if not 0 <= idx < len(layers):
            raise DFlashError(f"target layer id {idx} is outside the target's {len(layers)} layers")
        hooks.append(layers[idx].register_forward_hook(keep(idx)))
    try:
        # inference_mode: no autograd bookkeeping at all; the captured tensors are only read (copied into a
        # send buffer, concatenated, or fed to the frozen head), never saved for a backward.
        with torch.inference_mode():
            out = parts.body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return [captured[i] for i in layer_ids], out.last_hidden_state


def _tensor_index(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file of a (possibly sharded) HF folder."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: path / v for k, v in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise DFlashError(f"target folder {path} has no model.safetensors(.index.json): only safetensors are loaded")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt", backend="pread") as f:  # the header only: nothing mapped
        return {k: single for k in f.keys()}


def _find_weight(index: dict[str, Path], suffix: str, path: Path, required: bool = True) -> str | None:
    """The one tensor name ending in `suffix` (the shallowest, when deeper copies exist); errors name the keys."""
    hits = [k for k in index if k == suffix or k.endswith("." + suffix)]
    if not hits:
        if required:
            raise DFlashError(f"target folder {path}: no tensor named *{suffix} in its safetensors")
        return None
    # Released checkpoints keep the body under a prefix (`model.language_model.` in Qwen3.5/3.6) and may add a
    # deeper copy for multi-token-prediction modules (`model.layers.61.embed_tokens.weight` in DeepSeek-V3):
    # the body's is the shallowest one.
    depth = min(k.count(".") for k in hits)
    best = [k for k in hits if k.count(".") == depth]
    if len(best) > 1:
        raise DFlashError(f"target folder {path}: ambiguous {suffix}: {', '.join(sorted(best))} all qualify")
    return best[0]


def load_target_head(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[nn.Embedding, nn.Linear]:
    """Only the target's token embedding and LM head (frozen), read from its safetensors.

    Drafter ranks need these two and nothing else of the target.
    """
    from safetensors import safe_open

    path = Path(path)
    cfg = read_target_config(path)
    index = _tensor_index(path)

    def read(name: str) -> torch.Tensor:
        with safe_open(str(index[name]), framework="pt") as f:
            return f.get_tensor(name).to(dtype)

    embed_name = _find_weight(index, "embed_tokens.weight", path)
    head_name = _find_weight(index, "lm_head.weight", path, required=False)
    if head_name is None and not cfg["tie_word_embeddings"]:
        raise DFlashError(f"target folder {path}: no *lm_head.weight in its safetensors and tie_word_embeddings "
                          f"is false in config.json")
    embed_w = read(embed_name)
    # A tied head is the embedding matrix itself, whether or not the checkpoint also stores a copy.
    head_w = embed_w if head_name is None or cfg["tie_word_embeddings"] else read(head_name)
    want = (int(cfg["vocab_size"]), int(cfg["hidden_size"]))
    checked = [(embed_name, embed_w)] + ([] if head_w is embed_w else [(head_name, head_w)])
    for name, w in checked:
        if tuple(w.shape) != want:
            raise DFlashError(f"target folder {path}: {name} has shape {list(w.shape)}, expected "
                              f"[{want[0]}, {want[1]}] (vocab_size, hidden_size of config.json)")
    embed = nn.Embedding(embed_w.shape[0], embed_w.shape[1], _weight=embed_w)
    head = nn.Linear(head_w.shape[1], head_w.shape[0], bias=False, device="meta")
    # A tied head shares the embedding's tensor (one V x H matrix in memory, not two).
    head.weight = embed.weight if head_w is embed_w else nn.Parameter(head_w)
    for p in (*embed.parameters(), *head.parameters()):
        p.requires_grad_(False)
    return embed, head
