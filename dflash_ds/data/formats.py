"""Conversation input formats: where rows come from (JSONL / JSON / Parquet) and how a row becomes messages.

Two row shapes are accepted and normalised to OpenAI-style `[{"role", "content"}]`:

- ShareGPT: `{"conversations": [{"from": "human"|"user"|"gpt"|"assistant"|"system", "value": str}]}`
- OpenAI:   `{"messages": [{"role": "system"|"user"|"assistant", "content": str}]}`

Every row carries a location `(file, line)`: the 1-based line number for JSONL, the 1-based
record number for JSON arrays and Parquet, so a bad row is always reported as `file:line`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Iterator

from dflash_ds.errors import DFlashError

# Drop reasons, in the order they are checked. Stable strings: they appear in manifest.json.
MALFORMED_JSON = "malformed_json"
MISSING_FIELD = "missing_field"
UNKNOWN_ROLE = "unknown_role"
EMPTY_CONVERSATION = "empty_conversation"
NO_ASSISTANT_TURN = "no_assistant_turn"
BAD_TOKEN_IDS = "bad_token_ids"  # a regenerated row's `token_ids` / `finish_reasons` do not fit its turns
SPECIAL_TOKEN_IN_CONTENT = "special_token_in_content"
TEMPLATE_ERROR = "template_error"
OVERLONG = "overlong"
TOO_FEW_LOSS_TOKENS = "too_few_loss_tokens"
NO_USER_TURN = "no_user_turn"  # regenerate only: nothing to answer
DUPLICATE_ID = "duplicate_id"  # regenerate only: ids key the resume, so they must be unique
DROP_REASONS = [MALFORMED_JSON, MISSING_FIELD, UNKNOWN_ROLE, EMPTY_CONVERSATION, NO_ASSISTANT_TURN,
                BAD_TOKEN_IDS, SPECIAL_TOKEN_IN_CONTENT, TEMPLATE_ERROR, OVERLONG, TOO_FEW_LOSS_TOKENS]

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}
OPENAI_ROLES = {"system", "user", "assistant"}
SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet"}


class RowError(Exception):
    """A row that cannot be used; `reason` is one of DROP_REASONS, `detail` says what exactly."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def file_kind(path: str | Path) -> str:
    """'jsonl', 'json' or 'parquet' from the file suffix; DFlashError for anything else."""
    p = Path(path)
    kind = SUFFIXES.get(p.suffix.lower())
    if kind is None:
        raise DFlashError(f"{p}: unsupported data file type '{p.suffix}' (expected .jsonl, .json or .parquet)")
    if not p.is_file():
        raise DFlashError(f"{p}: data file not found")
    return kind


def iter_raw_rows(path: str | Path) -> Iterator[tuple[int, str]]:
    """Yield `(line, raw_json_text)` for every record of a data file, streaming where the format allows."""
    p = Path(path)
    kind = file_kind(p)
    if kind == "jsonl":
        yield from _iter_jsonl(p)
    elif kind == "parquet":
        import pyarrow.parquet as pq

        n = 0
        for batch in pq.ParquetFile(p).iter_batches(batch_size=1024):
            for record in batch.to_pylist():
                n += 1
                yield n, json.dumps(record, ensure_ascii=False, default=str)
    else:
        # A JSON array must be parsed whole; files named .json that are really JSONL are common.
        text = p.read_text(encoding="utf-8")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            if exc.msg == "Extra data":
                yield from _iter_jsonl(p)
                return
            raise DFlashError(f"{p}:{exc.lineno}: malformed JSON: {exc.msg}") from None
        if isinstance(data, dict) and ("conversations" in data or "messages" in data):
            data = [data]
        if not isinstance(data, list):
            raise DFlashError(f"{p}: expected a JSON array of conversations, got {type(data).__name__}")
        for i, record in enumerate(data, start=1):
            yield i, json.dumps(record, ensure_ascii=False)


def _iter_jsonl(p: Path) -> Iterator[tuple[int, str]]:
    # Blank lines are not records (a trailing newline is not a row); everything else is, even garbage.
    with open(p, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                yield lineno, line


def parse_row(raw: str) -> dict[str, Any]:
    """json.loads one record; RowError(malformed_json) if it is not a JSON object."""
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise RowError(MALFORMED_JSON, f"{exc.msg} at column {exc.colno}") from None
    if not isinstance(record, dict):
        raise RowError(MALFORMED_JSON, f"expected a JSON object, got {type(record).__name__}")
    return record


def _text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    # OpenAI content may be a list of parts; only text parts make sense for a text-only target.
    if isinstance(value, list) and all(isinstance(v, dict) and v.get("type") == "text" for v in value):
        return "".join(str(v.get("text", "")) for v in value)
    raise RowError(MISSING_FIELD, f"{where} must be a string, got {type(value).__name__}")


def to_messages(record: dict[str, Any], require_assistant: bool = True) -> list[dict[str, str]]:
    """Normalise a ShareGPT or OpenAI record to `[{"role", "content"}]`; RowError on any defect."""
    if "messages" in record:
        turns, role_key, text_key, form = record["messages"], "role", "content", "messages"
    elif "conversations" in record:
        turns, role_key, text_key, form = record["conversations"], "from", "value", "conversations"
    else:
        raise RowError(MISSING_FIELD, "row has neither 'messages' nor 'conversations'")
    if not isinstance(turns, list):
        raise RowError(MISSING_FIELD, f"'{form}' must be a list, got {type(turns).__name__}")
    if not turns:
        raise RowError(EMPTY_CONVERSATION, f"'{form}' is empty")
    messages = []
    for i, turn in enumerate(turns):
        where = f"{form}[{i}]"
        if not isinstance(turn, dict):
            raise RowError(MISSING_FIELD, f"{where} must be an object, got {type(turn).__name__}")
        for key in (role_key, text_key):
            if key not in turn:
                raise RowError(MISSING_FIELD, f"{where} has no '{key}'")
        raw_role = turn[role_key]
        if form == "messages":
            role = raw_role if raw_role in OPENAI_ROLES else None
        else:
            role = SHAREGPT_ROLES.get(raw_role) if isinstance(raw_role, str) else None
        if role is None:
            raise RowError(UNKNOWN_ROLE, f"{where}.{role_key} = {raw_role!r}")
        message = {"role": role, "content": _text(turn[text_key], f"{where}.{text_key}")}
        reasoning = turn.get("reasoning_content")
        if role == "assistant" and isinstance(reasoning, str) and reasoning:
            message["reasoning_content"] = reasoning  # a server's reasoning parser split it off; templates render it
        messages.append(message)
    if require_assistant and not any(m["role"] == "assistant" for m in messages):
        raise RowError(NO_ASSISTANT_TURN, f"'{form}' has no assistant turn")
    return messages


def row_id(record: dict[str, Any], source: str | Path, line: int) -> str:
    """The row's own `id` if it has one, else a short stable hash of `file:line`."""
    rid = record.get("id")
    if isinstance(rid, (str, int)) and not isinstance(rid, bool) and str(rid):
        return str(rid)
    return hashlib.sha1(f"{Path(source).name}:{line}".encode()).hexdigest()[:16]
