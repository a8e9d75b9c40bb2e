"""One registry entry per drafter kind (models/kinds.py): a toy fourth kind, written to a file of its own and imported,
trains through the trainer's forward, exports under its architecture and loads back, validates as a config and
plans with its own memory terms, with no edit to any other file."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from dflash_ds.models import kinds

# The whole kind: its options, its drafter class and its spec. A low-rank residual on the drafter's hidden states
# (toy_up starts at zero: the kind drafts as DFlash at step 0 until training moves it).
TOY_MODULE = '''
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from dflash_ds.errors import DFlashError
from dflash_ds.models.drafter import DFlashDrafter
from dflash_ds.models.kinds import KindSpec, MemoryTerms, register


@dataclass
class ToyOptions:
    toy_rank: int = 3

    def check(self, hidden_size: int, vocab_size: int) -> "ToyOptions":
        if self.toy_rank < 1:
            raise DFlashError(f"toy_rank = {self.toy_rank}: must be >= 1")
        return self

    def to_export(self, cfg: dict, block_size: int) -> None:
        cfg["toy_rank"] = self.toy_rank

    @classmethod
    def from_export(cls, cfg: dict, where: str) -> "ToyOptions":
        return cls(toy_rank=int(cfg["toy_rank"]))


class ToyDrafter(DFlashDrafter):
    kind = "toy"

    def __init__(self, arch) -> None:
        super().__init__(arch)
        self.toy_down = nn.Linear(arch.hidden_size, arch.options.toy_rank, bias=False)
        self.toy_up = nn.Linear(arch.options.toy_rank, arch.hidden_size, bias=False)

    def forward_train(self, context_features, block_embeds, anchors, pad=None):
        hidden = super().forward_train(context_features, block_embeds, anchors, pad)
        return hidden + self.toy_up(self.toy_down(hidden))

    def forward_infer(self, context_features, block_embeds, start, cache=None):
        hidden = super().forward_infer(context_features, block_embeds, start, cache)
        return hidden + self.toy_up(self.toy_down(hidden))


def memory_terms(opts: ToyOptions, hidden: int, vocab: int) -> MemoryTerms:
    return MemoryTerms(head_params=2 * hidden * opts.toy_rank, grads_name="toy_grads", loss_name="toy_buffer",
                       loss_position_values=opts.toy_rank, flops_per_position=12 * hidden * opts.toy_rank)


def warm_start(drafter) -> None:
    drafter.toy_up.weight.data.zero_()


SPEC = register(KindSpec(name="toy", architecture="ToyDraftModel", summary="a low-rank residual (test)",
                         options=ToyOptions, memory=memory_terms, warm_start=warm_start,
                         rules=(("model.block_size", "must be <= 64 for a toy", lambda v: v <= 64),)))
'''


@pytest.fixture
def toy(tmp_path: Path):
    """The toy kind's module, imported from tmp_path; unregistered afterwards (the other tests see three kinds)."""
    from dflash_ds.models.drafter import DFlashDrafter

    path = tmp_path / "toy_kind.py"
    path.write_text(TOY_MODULE)
    spec = importlib.util.spec_from_file_location("toy_kind", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["toy_kind"] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("toy_kind", None)
        DFlashDrafter._by_kind.pop("toy", None)
        if "toy" in kinds.kind_names():
            kinds.unregister("toy")


def test_toy_kind_trains_exports_and_loads_back(toy, tiny_target: Path, tmp_path: Path) -> None:
    from dflash_ds.cli import main
    from dflash_ds.config import Config, validate
    from dflash_ds.errors import DFlashError
    from dflash_ds.models.drafter import DFlashDrafter
    from dflash_ds.models.target import load_target
    from dflash_ds.runtime.checkpoint import arch_record
    from dflash_ds.runtime.engine import DrafterTrainModule
    from dflash_ds.serving.vllm_server import speculative_config
    from dflash_ds.tools.train_step import drafter_step, target_batch
    from dflash_ds.config import LossConfig

    assert kinds.kind_names() == ["dflash", "dflash2", "dspark", "toy"]
    # init-drafter's --kind choices come from the registry
    out = tmp_path / "toy"
    assert main(["init-drafter", "--target", str(tiny_target), "--out", str(out), "--num-layers", "1",
                 "--block-size", "4", "--kind", "toy"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["ToyDraftModel"] and cfg["toy_rank"] == 3
    drafter = DFlashDrafter.from_pretrained(out)
    assert type(drafter) is toy.ToyDrafter and drafter.arch.kind == "toy"
    assert drafter.arch.options == toy.ToyOptions(3) and arch_record(drafter.arch)["toy_options"] == {"toy_rank": 3}
    assert speculative_config(out) == {"method": "dflash", "model": str(out), "num_speculative_tokens": 3}

    # trains through the trainer's forward (runtime/step.forward, as train-step): the loss falls, the toy part moves
    target = load_target(tiny_target)
    tensors = target_batch(target, drafter.arch.target_layer_ids, batch=2, prompt_len=8, new_tokens=40, seed=0)
    module = DrafterTrainModule(drafter.train(), target.get_input_embeddings(), target.get_output_embeddings())
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    before = drafter.toy_up.weight.detach().clone()
    losses = [float(drafter_step(module, opt, tensors, LossConfig(gamma=7.0, num_anchors=8), 0, step,
                                 torch.float32)[0].loss.detach()) for step in range(4)]
    assert losses[-1] < losses[0], losses
    assert not torch.equal(drafter.toy_up.weight, before)

    # the trained export carries the architecture and loads back to the same weights
    trained = tmp_path / "trained"
    drafter.save_pretrained(trained)
    back = DFlashDrafter.from_pretrained(trained)
    assert json.loads((trained / "config.json").read_text())["architectures"] == ["ToyDraftModel"]
    assert type(back) is toy.ToyDrafter and torch.equal(back.toy_up.weight, drafter.toy_up.weight)

    # config: model.kind toy validates, with the kind's own rule
    run = Config()
    run.model.kind = "toy"
    validate(run)
    run.model.block_size = 128
    with pytest.raises(DFlashError, match="model.block_size = 128 must be <= 64 for a toy"):
        validate(run)


def test_toy_kind_plans_with_its_own_terms(toy, capsys) -> None:
    from dflash_ds.bench import memory_model as mm
    from dflash_ds.bench.memory import drafter_shape
    from dflash_ds.cli import main
    from dflash_ds.models.drafter import DFlashDrafter
    from dflash_ds.models.drafter_arch import DrafterArch
    from dflash_ds.models.presets import PRESETS

    preset, rank = PRESETS["qwen3-8b"], 3
    base, toy_shape = (drafter_shape(preset, 4096, 5, 16, kind=k) for k in ("dflash", "toy"))
    assert mm.drafter_params(toy_shape) - mm.drafter_params(base) == 2 * 4096 * rank
    step = mm.StepShape(batch=8, seq_len=2048, anchors_per_row=256, chunk_blocks=64, dtype_bytes=2,
                        checkpointing=True, dense_mask=False, cuda=True)
    positions = 8 * 256 * 15
    terms = mm.micro_step_terms(toy_shape, step)
    assert terms["loss"]["toy_buffer"] == positions * rank * 2
    assert terms["backward"]["toy_grads"] == 2 * 4096 * rank * 2
    assert "toy_buffer" not in mm.micro_step_terms(base, step)["loss"]
    added_flops = mm.micro_step_flops(toy_shape, step, 1e6) - mm.micro_step_flops(base, step, 1e6)
    assert added_flops == positions * 12 * 4096 * rank

    # the memory terms count the real module's parameters (a toy spec that miscounted fails here)
    small = drafter_shape(preset, 256, 2, 16, kind="toy")
    arch = DrafterArch(hidden_size=256, intermediate_size=small.intermediate, num_hidden_layers=2,
                       num_attention_heads=small.heads, num_key_value_heads=small.kv_heads, head_dim=small.head_dim,
                       vocab_size=small.vocab, rms_norm_eps=1e-6, max_position_embeddings=4096,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6}, block_size=16,
                       num_target_layers=36, mask_token_id=0, target_layer_ids=[1, 34], options=toy.ToyOptions())
    with torch.device("meta"):
        drafter = DFlashDrafter(arch)
    assert drafter.kind == "toy" and sum(p.numel() for p in drafter.parameters()) == mm.drafter_params(small)

    # plan capacity: --kind toy is a choice and its figures carry the toy's parameters (ZeRO-2 over 4 ranks)
    argv = ("plan", "--gpus", "4", "--target-tok-per-s", "28000", "--drafter-tok-per-s", "7000",
            "--target-params-b", "8.2", "--json")
    plans = {}
    for kind in ("dflash", "toy"):
        capsys.readouterr()
        assert main([*argv, "--kind", kind]) == 0
        plans[kind] = json.loads(capsys.readouterr().out)["colocated"]["memory"]["drafter"]
    added = 2 * 4096 * rank
    assert plans["toy"]["params"] - plans["dflash"]["params"] == added
    zero2 = plans["toy"]["terms"]["model_states_zero2"] - plans["dflash"]["terms"]["model_states_zero2"]
    assert zero2 == pytest.approx(2 * added + 14 * added / 4)
