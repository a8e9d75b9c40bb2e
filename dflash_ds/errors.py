"""The one exception type users see: a clear, single-line message and a non-zero exit."""


class DFlashError(Exception):
    """A user-facing error (bad input, bad config, bad layout). The CLI prints it as one line."""

    exit_code = 2


def read_json_file(path, missing: str) -> dict:
    """A JSON file (a model folder's config.json): `missing` is the error if absent; bad JSON names file and line."""
    import json
    from pathlib import Path

    path = Path(path)
    if not path.is_file():
        raise DFlashError(missing)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DFlashError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
