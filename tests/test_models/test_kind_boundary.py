"""The boundary of a kind (models/kinds.py): components/, runtime/ and eval/ ask a drafter's class how it drafts
(`sequential`, `has_confidence_head`, `draft_tables`: models/drafter.py) and its kind's spec for the rest (its loss
module, `head_target`); they never probe a drafter for a kind's part (getattr / hasattr) nor read a kind's loss.*
field. A kind with its own parts and loss then touches no shared file (tests/test_models/test_kind_registry.py)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import textwrap
from pathlib import Path

from dflash_ds.models import kinds


def test_no_drafter_probed_and_no_kind_loss_field_outside_models() -> None:
    """components/, runtime/ and eval/ ask a drafter's class (`sequential`, `has_confidence_head`, `draft_tables`) and
    its kind's spec (its loss module, `head_target`): no getattr / hasattr on a drafter or for a part a kind's drafter
    class adds (nor that part read as an attribute), and no kind's loss.* field named, code or comment."""
    from dflash_ds.models.drafter import DFlashDrafter
    from dflash_ds.models.drafting import BlockDraft

    package = Path(__file__).resolve().parents[2] / "dflash_ds"
    parts: set[str] = set()  # what each kind's drafter class adds to DFlashDrafter: methods, modules, attributes
    for spec in kinds.kind_specs():
        if spec.drafter_module:
            importlib.import_module(spec.drafter_module)
            klass = DFlashDrafter._by_kind[spec.name]
            parts |= {n for n in vars(klass) if not n.startswith("_")}
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
            parts |= {t.attr for node in ast.walk(tree) if isinstance(node, ast.Assign) for t in node.targets
                      if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    parts -= set(dir(DFlashDrafter)) | set(BlockDraft._fields) | {"kind", "layer_cls"}  # the interface's own names
    assert {"markov_head", "candidate_selector", "confidence_head", "confidence_logits"} <= parts, parts
    fields = {f.name for spec in kinds.kind_specs() if spec.loss_options for f in dataclasses.fields(spec.loss_options)}
    assert {"selector_weight", "selector_gold", "confidence_weight", "confidence_target"} <= fields, fields
    named = re.compile(r"\b(" + "|".join(map(re.escape, sorted(fields))) + r")\b")
    hits = []
    for path in sorted(p for folder in ("components", "runtime", "eval") for p in (package / folder).rglob("*.py")):
        where, text = path.relative_to(package), path.read_text()
        hits += [f"{where}:{n}: {line.strip()}" for n, line in enumerate(text.splitlines(), 1) if named.search(line)]
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Attribute) and node.attr in parts:
                hits.append(f"{where}:{node.lineno}: .{node.attr}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr",
                                                                                                   "hasattr"):
                what, name = ast.unparse(node.args[0]), node.args[1] if len(node.args) > 1 else None
                if "drafter" in what or isinstance(name, ast.Constant) and name.value in parts:
                    hits.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    assert not hits, "\n".join(hits)
