"""The drafter kinds' own config fields: model.* and loss.* hold them beside DFlash's, declared in the kind's module.

A kind declares each of its fields once, in its own module, with its type, default and docstring: its model.*
fields are fields of its options dataclass (`KindSpec.options`, named in `KindSpec.model_fields`), its loss.*
fields those of a small dataclass of their own (`KindSpec.loss_options`); models/kinds.py has the spec.
config.py declares DFlash's fields only, in `DrafterConfig` and `LossConfig`, both a `KindSection`: constructing
one (`Config()`, `DrafterConfig()`, `LossConfig(selector_weight=0.5)`) makes an instance of its section class as
the registry stands, a dataclass subclass of the declared class with every registered kind's fields after its own,
made once per set of kinds (the pattern of `DFlashDrafter(arch)`, which builds the kind's subclass).

So a kind's field is a field like DFlash's for attribute access (`cfg.model.selector_rank`), `dataclasses.replace`
and `asdict`, strict loading and its closest-key suggestions (config_parse.py), `--help` and `field_docs` (its
docstring after the kind's name: "<kind>: ..."), and `to_dict`: the same flat keys in YAML files, overrides,
checkpoints and exports' `dflash_ds_training`. A kind registered after this module was imported (the toy kind of
tests/test_models/test_kind_registry.py) is in every section built after it. Two kinds may not declare one name.

Nothing here imports dflash_ds.config (no cycle); the registry is read when a section is first built, so importing
the config loads no kind (and the kinds' arch modules no torch).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from dflash_ds.config_parse import source_field_docs
from dflash_ds.errors import DFlashError

# (declared class, the kinds' field sets) -> its section class
_MADE: dict[tuple, type] = {}


class KindSection:
    """A config section the drafter kinds add fields to: `class LossConfig(KindSection, section="loss")`."""

    section = ""  # which of a kind's field sets it takes: "model" or "loss" (KindSpec.section_fields)

    def __init_subclass__(cls, section: str = "", **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if section:
            cls.section = section

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # the declared class builds its section class, whose __init__ then takes the kinds' fields too
        made = cls if "declared" in cls.__dict__ else section_class(cls)
        return super().__new__(made)

    def __reduce__(self) -> tuple:
        # a section class has no importable name: pickle and copy rebuild it from the declared class
        return type(self).declared, (), dict(self.__dict__)  # type: ignore[attr-defined]


def section_class(declared: type) -> type:
    """`declared` (a KindSection dataclass) with every registered kind's fields of its section after its own."""
    from dflash_ds.models.kinds import kind_specs  # here: importing the config loads no kind

    parts = tuple((spec.name, *spec.section_fields(declared.section)) for spec in kind_specs())
    key = (declared, tuple(part for part in parts if part[2]))
    if key not in _MADE:
        _MADE[key] = _make(declared, key[1])
    return _MADE[key]


def _make(declared: type, parts: tuple[tuple[str, type, tuple[str, ...]], ...]) -> type:
    """The section class of `declared` and the kinds' (name, dataclass, field names)."""
    owner = {f.name: declared.__name__ for f in dataclasses.fields(declared)}
    fields, docs = [], source_field_docs(declared)
    for kind, source, names in parts:
        hints, own_docs = typing.get_type_hints(source), source_field_docs(source)
        for f in dataclasses.fields(source):
            if f.name not in names:
                continue
            if f.name in owner:
                raise DFlashError(f"drafter kind {kind!r} declares {declared.section}.{f.name}, a field of "
                                  f"{owner[f.name]} already")
            owner[f.name] = f"drafter kind {kind!r}"
            fields.append((f.name, hints[f.name], dataclasses.field(default=f.default,
                                                                    default_factory=f.default_factory)))
            doc = own_docs.get(f.name, "")
            if doc:  # "<kind>: rank of ..." (an acronym keeps its case)
                docs[f.name] = f"{kind}: {doc[0].lower() if doc[1:2].islower() else doc[0]}{doc[1:]}"
    namespace = {"__module__": declared.__module__, "__qualname__": declared.__qualname__,
                 "__doc__": declared.__doc__, "declared": declared, "_field_docs": docs}
    return dataclasses.make_dataclass(declared.__name__, fields, bases=(declared,), namespace=namespace)
