"""No model load asks transformers for Hub kernels unless the config opts in (docs/DESIGN.md §9).

transformers >= 5.2x kernelizes every model it loads (`PreTrainedModel.set_use_kernels(True)`) unless the caller
passes `use_kernels=False`; on CUDA that fetches kernels from the Hub (offline: the load fails). CPU loads call the
same `set_use_kernels`, so the value every load passes is visible here without a GPU.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# from_pretrained of classes that are not transformers models (no kernels): tokenizers, configs, our drafter
NOT_MODELS = {"AutoTokenizer", "AutoConfig", "DFlashDrafter"}


@pytest.fixture
def kernel_requests(monkeypatch) -> list[bool]:
    """Every use_kernels value a transformers model load hands to set_use_kernels, in order."""
    from transformers import PreTrainedModel

    seen: list[bool] = []
    original = PreTrainedModel.set_use_kernels

    def record(self, use_kernels, *args, **kwargs):
        seen.append(bool(use_kernels))
        if use_kernels:  # what the fetch would do on CUDA; on CPU kernelize is a no-op, so fail loudly instead
            raise RuntimeError("Hub kernels requested")
        return original(self, use_kernels, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "set_use_kernels", record)
    return seen


def test_every_load_path_passes_use_kernels_false(tiny_target, kernel_requests):
    """load_target (training, eval, benches) and regenerate's generator load with kernels off; the config's opt-in
    reaches transformers."""
    from dflash_ds.config import TrainConfig
    from dflash_ds.data.regenerate import Generator
    from dflash_ds.models.target import load_target

    assert TrainConfig().target_hub_kernels is False
    load_target(tiny_target)
    load_target(tiny_target, attn_implementation="eager")
    Generator(tiny_target, max_new_tokens=4, temperature=0.0, top_p=1.0, seed=0, device="cpu")
    assert kernel_requests == [False, False, False]
    with pytest.raises(RuntimeError, match="Hub kernels requested"):
        load_target(tiny_target, hub_kernels=True)
    assert kernel_requests[-1] is True


def test_no_model_load_without_use_kernels():
    """Every `X.from_pretrained(...)` of a transformers model class in dflash_ds/ passes use_kernels explicitly."""
    missing = []
    for path in sorted((REPO / "dflash_ds").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "from_pretrained"):
                continue
            owner = node.func.value
            name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
            if name in NOT_MODELS or name == "cls" and path.name == "drafter.py":
                continue
            if not any(k.arg == "use_kernels" for k in node.keywords):
                missing.append(f"{path.relative_to(REPO)}:{node.lineno} {ast.unparse(node.func)}")
    assert not missing, "model loads without use_kernels (transformers then kernelizes from the Hub):\n" + \
        "\n".join(missing)
