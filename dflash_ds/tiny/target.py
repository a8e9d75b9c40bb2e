"""A small, seeded Qwen3 causal LM with the tiny tokenizer, saved as a real HF folder.

Tests, benchmarks and the CPU demo need a target folder without network access; the same
arguments always give byte-identical files.
"""

from __future__ import annotations

from pathlib import Path

from dflash_ds.errors import DFlashError
from dflash_ds.tiny.tokenizer import build_tokenizer

def make_tiny_target(
    out_dir: str | Path,
    layers: int = 4,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    intermediate: int = 256,
    vocab_size: int = 512,
    max_position: int = 2048,
    seed: int = 0,
    init_std: float = 0.02,
    force: bool = False,
) -> Path:
    """Write a seeded random-init Qwen3ForCausalLM (fp32) and its tokenizer to `out_dir`; return the path.

    The model vocab equals `vocab_size` (the BPE reaches it up to ~3.5k tokens on the built-in corpus; past
    that the config keeps `vocab_size` and the extra ids are never produced). lm_head rows of tokens that
    decode to no valid text are zeroed, see `silence_unprintable`.
    """
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if heads % kv_heads:
        raise DFlashError(f"--heads {heads} must be a multiple of --kv-heads {kv_heads}")

    out = prepare_out_dir(out_dir, force)
    tokenizer = build_tokenizer(vocab_size)
    tokenizer.model_max_length = max_position
    # The trainer may stop short of vocab_size on a small corpus; the model vocab must cover every id.
    model_vocab = max(vocab_size, len(tokenizer))
    config = Qwen3Config(
        vocab_size=model_vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        initializer_range=init_std,
        dtype="float32",
    )
    torch.manual_seed(seed)
    return save_tiny(Qwen3ForCausalLM(config), tokenizer, out)


def save_tiny(model, tokenizer, out: Path) -> Path:
    """Write a freshly built tiny model (fp32, eval) and its tokenizer to `out` in the HF format."""
    import torch

    model = model.to(torch.float32).eval()
    silence_unprintable(model, tokenizer)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def prepare_out_dir(out_dir: str | Path, force: bool) -> Path:
    """The output folder, created; a non-empty one only with `force` (its files are then removed)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise DFlashError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise DFlashError(f"--out {out} is not empty; pass --force to overwrite")
    out.mkdir(parents=True, exist_ok=True)
    for child in out.iterdir():
        if child.is_file():
            child.unlink()
    return out


def silence_unprintable(model, tokenizer) -> None:
    """Zero the LM-head rows of tokens that decode to no valid text (an untied head only)."""
    # A random LM happily emits lone UTF-8 bytes (>= 0x80) and control specials; their text decodes
    # to U+FFFD and re-tokenizes differently, so regenerated data would no longer match what the
    # target produced. A zero lm_head row gives logit 0 while the best random logit is > 0, so greedy
    # decoding never picks them. <|im_end|> keeps its random row so generations can end.
    import torch

    # Ids past the tokenizer (when BPE stopped short of --vocab-size) have no text at all.
    head = model.get_output_embeddings()
    if head.weight is model.get_input_embeddings().weight:
        return  # a tied head would zero the embeddings too
    vocab = head.weight.shape[0]
    silenced = [i for i in range(vocab) if i != tokenizer.eos_token_id
                and (i >= len(tokenizer) or i in tokenizer.all_special_ids or "\ufffd" in tokenizer.decode([i]))]
    with torch.no_grad():
        head.weight[silenced] = 0.0
