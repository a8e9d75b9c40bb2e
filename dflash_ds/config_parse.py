"""Reading config files and `--section.key value` overrides into typed dataclasses.

Generic over any tree of dataclasses: nothing here imports dflash_ds.config (which re-exports
these helpers), so there is no import cycle. A section's fields are those of its class as built (config_kinds.py
adds the drafter kinds' fields to model.* and loss.*). Also describes every field as a command-line flag
(metavar, default, doc) for `python -m dflash_ds.train --help`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from dflash_ds.errors import DFlashError


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _unknown_key(key: str, valid: list[str], where: str) -> DFlashError:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(sorted(valid))}"
    return DFlashError(f"config: unknown key {where}{key!r}{hint}")


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Check/convert one leaf value to the field's declared type."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, getattr(types, "UnionType", None)):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], name)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise DFlashError(f"config: {name} = {value!r} must be a list")
        return [_coerce(v, args[0], f"{name}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise DFlashError(f"config: {name} = {value!r} must be true or false")
    if tp is int:
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
            raise DFlashError(f"config: {name} = {value!r} must be an integer")
        return int(value)
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise DFlashError(f"config: {name} = {value!r} must be a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise DFlashError(f"config: {name} = {value!r} must be a string")
        return str(value)
    return value


def _apply(obj: Any, data: dict[str, Any], where: str = "") -> None:
    types_ = _field_types(type(obj))
    for key, value in data.items():
        if key not in types_:
            raise _unknown_key(key, list(types_), where)
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise DFlashError(f"config: {where}{key} must be a mapping of its fields")
            _apply(current, value, f"{where}{key}.")
        else:
            setattr(obj, key, _coerce(value, types_[key], f"{where}{key}"))


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Parse a YAML or JSON config file into a dict (errors name the file)."""
    path = Path(path)
    if not path.is_file():
        raise DFlashError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) if path.suffix in (".yaml", ".yml") else json.loads(path.read_text())
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise DFlashError(f"config file {path}: cannot parse: {str(exc).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise DFlashError(f"config file {path}: top level must be a mapping")
    return data


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """Turn ['--optim.lr', '1e-3', '--train.seed=3'] into a nested dict (values parsed as YAML scalars)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(items):
        item = items[i]
        if not item.startswith("--"):
            raise DFlashError(f"override {item!r} must look like --section.key VALUE")
        key = item[2:]
        if "=" in key:
            key, raw = key.split("=", 1)
        else:
            if i + 1 >= len(items):
                raise DFlashError(f"override --{key} needs a value")
            i += 1
            raw = items[i]
        value = yaml.safe_load(raw) if raw != "" else ""
        node = out
        parts = key.replace("-", "_").split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
        i += 1
    return out


def source_field_docs(klass: type) -> dict[str, str]:
    """Field name -> the docstring beside it in `klass`'s own body; a class made at run time (config_kinds.py), which
    has no source, carries them in `_field_docs`."""
    import ast
    import inspect
    import textwrap

    if "_field_docs" in klass.__dict__:
        return dict(klass._field_docs)  # type: ignore[attr-defined]
    body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body  # type: ignore[attr-defined]
    return {node.target.id: str(nxt.value.value) for node, nxt in zip(body, body[1:])  # type: ignore[attr-defined]
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)}


def class_field_docs(cls: type) -> dict[str, str]:
    """Dotted field name -> its doc, for the fields of `cls()` (nested dataclasses too, as `cls()` builds them: a
    config section holds the registered kinds' fields, config_kinds.py)."""
    docs: dict[str, str] = {}

    def walk(obj: Any, prefix: str) -> None:
        own = source_field_docs(type(obj))
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
            elif f.name in own:
                docs[prefix + f.name] = own[f.name]

    walk(cls(), "")
    return docs


def metavar(tp: Any) -> str:
    """One-token placeholder for a field's command-line value: INT, FLOAT, STR, true|false, [INT,...]|null."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, getattr(types, "UnionType", None)):
        inner = [metavar(a) for a in args if a is not type(None)]
        return "|".join(inner + (["null"] if type(None) in args else []))
    if origin is list:
        return f"[{metavar(args[0])},...]"
    if tp is bool:
        return "true|false"
    return {int: "INT", float: "FLOAT", str: "STR"}.get(tp, getattr(tp, "__name__", str(tp)).upper())


def format_value(value: Any) -> str:
    """A value as it would be typed after --section.key (YAML): null, true, 0.0006, "", runs/dflash, [1, 2]."""
    if isinstance(value, str):
        plain = value and not any(c.isspace() for c in value)
        try:
            plain = plain and yaml.safe_load(value) == value
        except yaml.YAMLError:
            plain = False
        return value if plain else json.dumps(value)
    return json.dumps(value) if value is None or isinstance(value, (bool, list, dict)) else repr(value)


def describe_fields(obj: Any) -> list[tuple[str, str, str, str, str]]:
    """(section, dotted, metavar, default, doc) of every leaf field of a dataclass instance, in declaration
    order; section is "" for top-level fields, else the nested dataclass' field name."""
    docs = class_field_docs(type(obj))
    out: list[tuple[str, str, str, str, str]] = []

    def walk(node: Any, prefix: str, section: str) -> None:
        for name, tp in _field_types(type(node)).items():
            value = getattr(node, name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{name}.", f"{prefix}{name}")
            else:
                dotted = prefix + name
                out.append((section, dotted, metavar(tp), format_value(value), docs.get(dotted, "")))

    walk(obj, "", "")
    return out
