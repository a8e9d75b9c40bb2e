"""The target's tokenizer as every data stage needs it: loaded once, with a chat template, and its special tokens.

`prepare`, `regenerate` and `eval` read conversations through the same tokenizer checks.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path

from dflash_ds.data import formats
from dflash_ds.errors import DFlashError


@lru_cache(maxsize=4)
def load_tokenizer(target: str):
    """The target's tokenizer, loaded once per process (map workers each load their own)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    if not Path(target).is_dir():
        raise DFlashError(f"--target {target}: not a folder (a local HF model folder is required)")
    try:
        tok = AutoTokenizer.from_pretrained(target)
    except (OSError, ValueError) as exc:
        raise DFlashError(f"--target {target}: cannot load a tokenizer ({str(exc).splitlines()[0]})") from None
    if not tok.chat_template:
        raise DFlashError(f"--target {target}: the tokenizer has no chat_template")
    if not tok.is_fast:
        raise DFlashError(f"--target {target}: a fast tokenizer (tokenizer.json) is required for offsets")
    return tok


def special_token_pattern(tok) -> re.Pattern | None:
    """Regex matching the tokenizer's *special* added tokens (Qwen3's non-special <think> may appear in text)."""
    specials = sorted((t.content for t in tok.added_tokens_decoder.values() if t.special), key=len, reverse=True)
    return re.compile("|".join(map(re.escape, specials))) if specials else None


def check_special_tokens(pattern: re.Pattern | None, messages: list[dict[str, str]]) -> None:
    """RowError if a message's text holds a special token string (it would be encoded as the control token)."""
    for i, m in enumerate(messages if pattern else []):
        if found := pattern.search(m["content"]):
            raise formats.RowError(formats.SPECIAL_TOKEN_IN_CONTENT, f"message {i} ({m['role']}) contains {found.group()!r}")
