"""`dflash-ds make-tiny-target`: a small, seeded Qwen3 causal LM (or `--family`) plus a locally trained tokenizer.

Tests, benchmarks and the CPU demo need a real HF target folder without network access. The
tokenizer is a byte-level BPE trained here on a deterministic generated corpus, so the same
arguments always give byte-identical files.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
from pathlib import Path

from dflash_ds.errors import DFlashError

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END, MASK_TOKEN]

# Qwen-style ChatML, without tools or reasoning blocks.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_SUBJECTS = ["the cat", "a dog", "my friend", "the teacher", "our team", "the model", "a student",
             "the old man", "this robot", "the river", "a small bird", "the engineer", "your sister",
             "the city", "a farmer", "the computer", "every child", "the train", "a doctor", "the sun"]
_VERBS = ["sees", "likes", "builds", "finds", "writes", "reads", "moves", "helps", "opens", "keeps",
          "makes", "takes", "wants", "knows", "learns", "plays with", "looks at", "thinks about",
          "runs to", "talks to"]
_OBJECTS = ["the red ball", "a long letter", "the green house", "some water", "the big tree",
            "a new book", "the blue car", "an apple", "the window", "a short story", "the garden",
            "a bright lamp", "the old bridge", "a warm coat", "the number seven", "a simple answer",
            "the next step", "a quiet room", "the first line", "a paper map"]
_ADVERBS = ["today", "every day", "in the morning", "at night", "again", "slowly", "quickly",
            "with care", "after lunch", "before dinner", "on monday", "right now"]
_QUESTIONS = ["What is {o}?", "Why does {s} like {o}?", "Can you describe {o}?",
              "How many {n} are there?", "Tell me about {s}.", "Where is {o}?",
              "Write a sentence about {s}.", "Explain why {s} {v} {o}."]
_SYLLABLES = ["ka", "lo", "mi", "ter", "su", "ran", "do", "vel", "ni", "bor", "qua", "zen", "pi", "hal",
              "mor", "ex", "tu", "gri", "sha", "wen", "ob", "lis", "cra", "fu", "den", "yo", "im", "pra"]
_NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def generate_corpus(num_lines: int = 6000, seed: int = 1234) -> list[str]:
    """Deterministic English-like lines: plain sentences, questions, and role-prefixed chat snippets."""
    rng = random.Random(seed)
    lines = []
    # Invented names give BPE enough distinct words to reach vocabularies of a few thousand tokens.
    names = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))).capitalize() for _ in range(1500)]
    for i in range(num_lines):
        if i % 2:
            a, b = rng.choice(names), rng.choice(names)
            lines.append(f"{a} met {b} near {rng.choice(_OBJECTS)} {rng.choice(_ADVERBS)}.")
            continue
        s, v, o = rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)
        sentence = f"{s.capitalize()} {v} {o} {rng.choice(_ADVERBS)}."
        kind = (i // 2) % 4
        if kind == 0:
            lines.append(sentence)
        elif kind == 1:
            q = rng.choice(_QUESTIONS).format(s=s, v=v, o=o, n=rng.choice(_NUMBERS))
            lines.append(f"user\n{q}\nassistant\n{sentence} {rng.choice(_NUMBERS).capitalize()} times.")
        elif kind == 2:
            lines.append(f"system\nYou are a helpful assistant.\n{sentence}")
        else:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            lines.append(f"{sentence} {a} + {b} = {a + b}, and {s} said: \"{o}!\"")
    return lines


def tiny_prompts(num: int = 64, seed: int = 0) -> list[dict]:
    """Deterministic OpenAI-form prompt rows (`{"id", "messages"}`, one user turn) for demos and tests."""
    rng = random.Random(seed)
    rows = []
    for i in range(num):
        s, v, o = rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS)
        question = rng.choice(_QUESTIONS).format(s=s, v=v, o=o, n=rng.choice(_NUMBERS))
        rows.append({"id": f"tiny-{seed}-{i}", "messages": [{"role": "user", "content": question}]})
    return rows


def build_tokenizer(vocab_size: int):
    """Train a byte-level BPE with the ChatML specials and wrap it as a PreTrainedTokenizerFast."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    min_vocab = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_vocab:
        raise DFlashError(f"--vocab-size {vocab_size} is too small: a byte-level BPE needs at least {min_vocab}")
    texts = generate_corpus()

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        mask_token=MASK_TOKEN,
        additional_special_tokens=[IM_START],
        model_max_length=2048,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


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


# Shape flags of the seeded Qwen3 target (the other families are written at their toy shape, models/families.py).
QWEN3_SHAPE = dict(layers=4, hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256, max_position=2048,
                   init_std=0.02)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the make-tiny-target flags."""
    from dflash_ds.models.families import FAMILIES

    d = QWEN3_SHAPE
    parser.add_argument("--out", required=True, help="output folder (HF format); must be empty or absent")
    parser.add_argument("--family", choices=list(FAMILIES), default="qwen3",
                        help="architecture (default qwen3); the other families are written at a fixed toy shape "
                             "(4 layers, hidden 64), so the shape flags below are qwen3 only")
    parser.add_argument("--layers", type=int, default=None, help=f"number of decoder layers (default {d['layers']})")
    parser.add_argument("--hidden", type=int, default=None, help=f"hidden size (default {d['hidden']})")
    parser.add_argument("--heads", type=int, default=None, help=f"attention heads (default {d['heads']})")
    parser.add_argument("--kv-heads", type=int, default=None, help=f"key/value heads, GQA (default {d['kv_heads']})")
    parser.add_argument("--head-dim", type=int, default=None, help=f"per-head dimension (default {d['head_dim']})")
    parser.add_argument("--intermediate", type=int, default=None,
                        help=f"MLP intermediate size (default {d['intermediate']})")
    parser.add_argument("--vocab-size", type=int, default=512, help="tokenizer and model vocabulary size, specials included")
    parser.add_argument("--max-position", type=int, default=None,
                        help=f"max position embeddings / tokenizer max length (default {d['max_position']})")
    parser.add_argument("--seed", type=int, default=0, help="torch seed for the random weights")
    parser.add_argument("--init-std", type=float, default=None,
                        help=f"std of the random weights (default {d['init_std']}; larger = peakier distributions)")
    parser.add_argument("--force", action="store_true", help="overwrite files in a non-empty --out folder")


def run(args: argparse.Namespace) -> int:
    """CLI entry: build the tiny target and print a summary."""
    from dflash_ds.models.families import make_tiny_family
    from dflash_ds.models.target import read_target_config

    given = {k: getattr(args, k) for k in QWEN3_SHAPE if getattr(args, k) is not None}
    if args.family == "qwen3":
        out = make_tiny_target(args.out, **{**QWEN3_SHAPE, **given}, vocab_size=args.vocab_size, seed=args.seed,
                               force=args.force)
    elif given:
        raise DFlashError(f"--{next(iter(given)).replace('_', '-')} applies to --family qwen3 only "
                          f"(--family {args.family} is written at its toy shape)")
    else:
        out = make_tiny_family(args.out, args.family, vocab_size=args.vocab_size, seed=args.seed, force=args.force)
    config = read_target_config(out)  # the text config, also for a vision-language wrapper
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        n_params = sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())
    print(f"tiny target ({args.family}): {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
          f"vocab {config['vocab_size']}, {n_params:,} parameters")
    for path in sorted(out.iterdir()):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
        print(f"  wrote {path} ({path.stat().st_size:,} bytes, sha256 {digest})")
    return 0


def _prod(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
