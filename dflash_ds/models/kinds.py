"""The drafter kinds: one `KindSpec` per kind, the one place the rest of dflash-ds asks what differs between them.

A kind is DFlash's backbone plus parts of its own (docs/DESIGN.md §2, §11, §12). Its module (models/dflash2_arch.py,
models/dspark_arch.py) defines the options dataclass of those parts and calls `register(KindSpec(...))`; its
drafter module defines the `DFlashDrafter` subclass. Everything outside models/ and components/ reads the spec
(the export's architecture, how vLLM serves it, its config fields and their rules, its loss schedule, its loss
terms and metrics, its memory terms, its recipe) instead of branching on the kind's name; how a drafter drafts
(`sequential`, `has_confidence_head`, `draft_tables`: models/drafter.py) its class answers. Adding a kind: write its
module and name it in BUILTIN_MODULES (or import it before use: tests/test_models/test_kind_registry.py registers a
toy kind from a file of its own). This module and the kinds' arch modules import no torch: the config reads them
(config_kinds.py).

A kind declares its own config fields in its module, once, with their types, defaults and docstrings: its model.*
fields are fields of its options dataclass (named in `KindSpec.model_fields`), its loss.* fields those of a small
dataclass of their own (`KindSpec.loss_options`); config_kinds.py adds them to the run's model.* and loss.*
sections, where they are set, validated (`KindSpec.rules`), documented and recorded like DFlash's own.

The options dataclass (`KindSpec.options`, held by `DrafterArch.options`) provides:
- `check(hidden_size, vocab_size)`: one clear error naming a field that cannot build a drafter;
- `to_export(cfg, block_size)`: add its keys to the export's config.json (a dict, changed in place);
- `from_export(cfg, where)` (classmethod): read them back from a config.json;
- optionally `export_block_offset` (block slots the export's block_size does not count: 0 when absent) and
  `checkpoint_dict()` (what a checkpoint records; `dataclasses.asdict` when absent).

A kind's own loss terms and metrics live in its loss module (`KindSpec.loss_module`: models/dflash2_loss.py,
models/dspark_loss.py), which defines
- `SUMS`: the names of its additive statistics (summed over a log window and the drafters: runtime/step_metrics.py);
- `loss_terms(drafter, at: DraftedPositions, loss) -> KindTerms`: what it adds to one micro-step's DFlash loss
  (components/objective.py; `loss`: the step's loss.* settings, its own fields among them);
- `metrics(sums) -> dict`: its record's metrics from the window's summed SUMS, named as metrics.jsonl and W&B show
  them ({} when the window has none).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable

DFLASH = "dflash"  # the backbone every kind extends; the kind of a DrafterArch without options

# The modules that register the built-in kinds beyond DFlash, loaded on the first question to the registry.
BUILTIN_MODULES = ("dflash_ds.models.dflash2_arch", "dflash_ds.models.dspark_arch")


@dataclass(frozen=True)
class MemoryTerms:
    """What a kind adds to memory/model.py's count of one micro-step, as plain numbers of its shape."""

    layer_params: int = 0
    """Parameters each draft layer adds (DFlash2: its two convolutions)."""
    head_params: int = 0
    """Parameters outside the layers (DFlash2's selector, DSpark's heads): in Psi, their gradients made first in
    backward (the loss's backward)."""
    grads_name: str = ""
    """The name of those gradients' term in bench memory's backward phase."""
    saved_h: float = 0.0
    """H-wide values of the run dtype each draft layer saves per block token (DFlash2: 4.125 at its defaults)."""
    loss_name: str = ""
    """The name of the kind's term in bench memory's loss phase."""
    loss_chunk_copies: float = 0.0
    """Buffers of one LM-head chunk's [c, K, V] entries, of the run dtype, the kind's loss holds beside the head's."""
    loss_position_values: float = 0.0
    """Values of the run dtype the kind's loss keeps per label position."""
    loss_fixed_bytes: float = 0.0
    """Bytes the kind's loss holds whatever the batch (DSpark: markov_w2's fp32 gradient accumulator)."""
    flops_per_position: float = 0.0
    """Matmul FLOPs (forward + backward) the kind adds per label position beyond DFlash's count."""

    @property
    def has_loss_term(self) -> bool:
        """Whether the kind's loss holds anything beyond DFlash's."""
        return bool(self.loss_chunk_copies or self.loss_position_values or self.loss_fixed_bytes)


@dataclass
class DraftedPositions:
    """What a kind's loss reads of one micro-step (components/objective.py): N blocks of L drafted positions, every
    row's anchors flattened (torch tensors; this module imports no torch)."""

    hidden: Any
    """[N, L, H] the drafter's final-normed states of the drafted positions."""
    labels: Any
    """[N, L] long: each position's label (negative where there is none)."""
    valid: Any
    """[N, L] bool: the positions that carry a label."""
    anchor_ids: Any
    """[N] long: each block's anchor token (the token before position 0)."""
    lm_head: Any
    """The target's LM head (frozen): [..., H] -> vocabulary logits."""


@dataclass
class KindTerms:
    """What a kind adds to one micro-step's loss (its loss module's `loss_terms`; nothing when left empty)."""

    dflash_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the DFlash loss (components/loss.chunked_dflash_loss): `logit_bias` (DSpark's Markov
    bias), `top_k` (the head's top-K it keeps, `LossTerms.candidates`: DFlash2's selector reads them)."""
    finish: Callable[[Any], tuple[Any, dict[str, Any]]] | None = None
    """(the DFlash loss's LossTerms) -> (its weighted term, added to the loss, or None; its SUMS of this step)."""


@dataclass(frozen=True)
class KindSpec:
    """One drafter kind: what differs from DFlash, for every caller outside the kind's own modules."""

    name: str
    """model.kind, init-drafter --kind, bench memory --kind."""
    architecture: str
    """The export's config.json `architectures` entry: what the serving engines load the kind by."""
    summary: str
    """What the kind adds to DFlash, for --help."""
    options: type | None = None
    """The dataclass of the kind's own arch fields (module doc); None = nothing beyond DFlash."""
    model_fields: tuple[str, ...] = ()
    """The fields of `options` a run sets as model.* fields (config_kinds.py); also init-drafter's flags."""
    loss_options: type | None = None
    """The dataclass of its own loss.* fields, each of its fields one (config_kinds.py); None = none."""
    loss_at: Callable[[Any, int], Any] | None = None
    """(a run's loss.* section, optimizer step) -> the loss settings of that step (runtime/step.loss_at): how the
    kind schedules its own loss.* fields (DFlash2: its selector weight's warm-up); None = as the run sets them.
    Every run's settings pass through it, whatever the run's kind (with --drafter the folder, not model.kind,
    names it): its fields at their defaults must change nothing."""
    rules: tuple[tuple[str, str, Callable[[Any], bool]], ...] = ()
    """(dotted field, rule text, predicate) of its model.* and loss.* fields, checked with config_rules' own."""
    drafter_module: str | None = None
    """The module defining its DFlashDrafter subclass, imported on the first build of the kind."""
    loss_module: str | None = None
    """The module of its own loss terms and metrics (`SUMS`, `loss_terms`, `metrics`: module doc), imported on first
    use (`kind_loss`); None = DFlash's loss alone."""
    head_target: Callable[[dict[str, Any]], str] | None = None
    """(an export's recorded loss.* settings, `dflash_ds_training.loss`; {} without them) -> what its confidence head
    trained for, "sampled" or "greedy" acceptance: eval judges the head on it; None = the kind has no such head."""
    vllm_method: str | None = None
    """vLLM 0.32's speculative `method` (DFlash2 rides on "dflash": vLLM picks its speculator by architecture).
    Required: an entry without it is an error, not "dflash" (vLLM would take a new architecture for DFlash's)."""
    vllm_v2_only: bool = False
    """vLLM 0.32 serves it only on its V2 model runner (Triton drafting kernels: a GPU)."""
    vllm_anchor_first_by_default: bool = False
    """vLLM reads a config without `sample_from_anchor` as anchor-as-first (block_size drafts, not block_size - 1)."""
    memory: Callable[[Any, int, int], MemoryTerms] | None = None
    """(options, hidden, vocab) -> its MemoryTerms; None = none."""
    fused_parts: Callable[[Any, int, int, int, Callable], dict[str, Any]] | None = None
    """(options, hidden, block tokens, block size, make(*shape, grad=True) -> a random tensor) -> {part: (fn, args)}:
    its own functions that train.fuse compiles (components/fusion.py), at that shape, for `bench fuse`; None = none."""
    warm_start: Callable[[Any], None] | None = None
    """Sets a drafter of the kind, its backbone copied from a DFlash export, to draft as that export (zero / identity
    parts; models/warm_start.py); None = the kind cannot be warm-started."""
    foreign_architectures: tuple[str, ...] = ()
    """Other `architectures` names that checkpoints of the kind in its authors' own layout carry."""
    convert_hint: str = ""
    """The command that turns a checkpoint in its authors' layout (no `dflash_config`) into an export: a config
    error on such a folder names it (`convert_hint_of`)."""
    recipe_name: str = "none"
    """The name of its own recipe (config.load_config applies it under the run's file and flags)."""
    recipe: dict[str, Any] = field(default_factory=dict)
    """Its recipe: dotted config field -> value; empty = the plain defaults."""

    def options_from_model(self, model: Any) -> Any:
        """Its options from a run's model.* section (or init-drafter's flags); None for another kind or none."""
        if self.options is None or getattr(model, "kind", DFLASH) != self.name:
            return None
        return self.options(**{name: getattr(model, name) for name in self.model_fields})

    def section_fields(self, section: str) -> tuple[type | None, tuple[str, ...]]:
        """(the dataclass declaring them, their names) of its own fields of config section "model" or "loss"."""
        if section == "model":
            return self.options, self.model_fields
        if section == "loss" and self.loss_options is not None:
            return self.loss_options, tuple(f.name for f in dataclasses.fields(self.loss_options))
        return None, ()

    def default_options(self) -> Any:
        """Its options at their defaults (None for a kind without options)."""
        return None if self.options is None else self.options()


_SPECS: dict[str, KindSpec] = {}
_BY_OPTIONS: dict[type, str] = {}
_loaded = False


def register(spec: KindSpec) -> KindSpec:
    """Add a kind (its name, architecture and options class must be new, its vllm_method set); returns the spec."""
    _load_builtins()
    if not spec.vllm_method:
        raise ValueError(f"drafter kind {spec.name!r} ({spec.architecture}) names no vllm_method: set the speculative "
                         "method vLLM serves its architecture by (KindSpec.vllm_method)")
    taken = [s.name for s in _SPECS.values() if spec.name == s.name or spec.architecture == s.architecture]
    if taken or (spec.options is not None and spec.options in _BY_OPTIONS):
        raise ValueError(f"drafter kind {spec.name!r} ({spec.architecture}) clashes with registered kind {taken}")
    _SPECS[spec.name] = spec
    if spec.options is not None:
        _BY_OPTIONS[spec.options] = spec.name
    return spec


def unregister(name: str) -> None:
    """Remove a kind (tests that register one of their own)."""
    spec = _SPECS.pop(name)
    _BY_OPTIONS.pop(spec.options, None)


def _load_builtins() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        _SPECS.setdefault(DFLASH, KindSpec(DFLASH, "DFlashDraftModel", "the DFlash drafter (z-lab's reference)",
                                           vllm_method="dflash"))
        for module in BUILTIN_MODULES:
            importlib.import_module(module)


def kind_specs() -> list[KindSpec]:
    """Every registered kind: dflash, the built-in ones in BUILTIN_MODULES' order, then others as registered."""
    _load_builtins()

    def rank(spec: KindSpec) -> int:  # a built-in module imported first registers the others inside its import
        module = getattr(spec.options, "__module__", None)
        return (-1 if spec.name == DFLASH else BUILTIN_MODULES.index(module) if module in BUILTIN_MODULES
                else len(BUILTIN_MODULES))

    return sorted(_SPECS.values(), key=rank)


def kind_names() -> list[str]:
    """The registered kinds' names (choices of --kind, model.kind)."""
    return [s.name for s in kind_specs()]


def kind_spec(name: str) -> KindSpec:
    """The spec of kind `name`; a clear error for a kind nobody registered."""
    from dflash_ds.errors import DFlashError

    _load_builtins()
    if name not in _SPECS:
        raise DFlashError(f"unknown drafter kind {name!r}: one of {', '.join(_SPECS)}")
    return _SPECS[name]


def kind_of_options(options: Any) -> str:
    """The kind whose options `options` are (None: dflash)."""
    _load_builtins()
    if options is None:
        return DFLASH
    if type(options) not in _BY_OPTIONS:
        raise TypeError(f"{type(options).__name__} are the options of no registered drafter kind")
    return _BY_OPTIONS[type(options)]


def kind_of_architecture(architectures: list[str] | None) -> str | None:
    """The kind whose export architecture is listed (None when none is)."""
    return next((s.name for s in kind_specs() if s.architecture in (architectures or [])), None)


def convert_hint_of(cfg: dict[str, Any]) -> str:
    """For a config.json that is no export (no `dflash_config`) of a kind with a converter: the command to run
    ("" otherwise)."""
    names = cfg.get("architectures") or []
    if "dflash_config" in cfg:
        return ""
    return next((s.convert_hint for s in kind_specs()
                 if s.convert_hint and ({s.architecture, *s.foreign_architectures} & set(names))), "")


def kind_loss(kind: str) -> ModuleType | None:
    """The loss module of kind `kind` (`KindSpec.loss_module`), imported; None for a kind without one."""
    module = kind_spec(kind).loss_module
    return None if module is None else importlib.import_module(module)


def kind_losses() -> list[ModuleType]:
    """Every registered kind's loss module, in `kind_specs`' order (the same on every rank)."""
    return [importlib.import_module(s.loss_module) for s in kind_specs() if s.loss_module is not None]


def kind_recipe(kind: str) -> tuple[str, dict]:
    """(name, fields) of the kind's own recipe; ("none", {}) for a kind without one."""
    spec = kind_spec(kind)
    return spec.recipe_name, dict(spec.recipe)


def options_dict(options: Any) -> dict[str, Any] | None:
    """The options as a checkpoint records them (None for none)."""
    if options is None:
        return None
    record = getattr(options, "checkpoint_dict", None)
    return record() if record is not None else dataclasses.asdict(options)
