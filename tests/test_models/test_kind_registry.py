"""One registry entry per drafter kind (models/kinds.py): a toy fourth kind, written to a file of its own and imported,
trains through the trainer's forward, exports under its architecture and loads back, validates as a config and
plans with its own memory terms, declares a model.* and loss.* fields that a run sets like DFlash's own
(config_kinds.py), and adds its own loss term and metric (its loss module: here the same file) that the objective
adds and metrics.jsonl logs, with no edit to any other file; and no kind is named outside models/ and components/
(tests/test_models/test_kind_boundary.py: nor a drafter probed for a kind's part, nor a kind's loss field read)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from dflash_ds.models import kinds

# The whole kind: its options, its loss fields, its drafter class and its spec. A low-rank residual on the drafter's
# hidden states (toy_up starts at zero: the kind drafts as DFlash at step 0 until training moves it); model.toy_rank
# is its rank, loss.toy_gamma a position decay of its own that its loss_at hook puts in place of loss.gamma, and
# loss.toy_weight the weight of its own loss term (the residual's mean square at the labelled positions), whose sums
# it logs as the metric toy_penalty (its loss module, KindSpec.loss_module: this file).
TOY_MODULE = '''
from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from dflash_ds.errors import DFlashError
from dflash_ds.models.drafter import DFlashDrafter
from dflash_ds.models.kinds import KindSpec, KindTerms, MemoryTerms, register


@dataclass
class ToyOptions:
    toy_rank: int = 3
    """Rank of the low-rank residual."""

    def check(self, hidden_size: int, vocab_size: int) -> "ToyOptions":
        if self.toy_rank < 1:
            raise DFlashError(f"toy_rank = {self.toy_rank}: must be >= 1")
        return self

    def to_export(self, cfg: dict, block_size: int) -> None:
        cfg["toy_rank"] = self.toy_rank

    @classmethod
    def from_export(cls, cfg: dict, where: str) -> "ToyOptions":
        return cls(toy_rank=int(cfg["toy_rank"]))


@dataclass
class ToyLoss:
    toy_weight: float = 0.0
    """Weight of the toy's penalty on its residual's size (0 = none)."""
    toy_gamma: float = 0.0
    """Position decay of the toy's runs in place of loss.gamma (0 = loss.gamma's)."""


def loss_at(loss, step: int):
    return replace(loss, gamma=loss.toy_gamma) if loss.toy_gamma > 0 else loss


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


SUMS = ("toy_penalty_sum", "toy_positions")


def loss_terms(drafter, at, loss) -> KindTerms:
    if not loss.toy_weight > 0:
        return KindTerms()

    def finish(terms):
        size = drafter.toy_up(drafter.toy_down(at.hidden)).pow(2).mean(-1) * at.valid
        sums = {"toy_penalty_sum": size.sum().detach(), "toy_positions": at.valid.sum().float()}
        return loss.toy_weight * size.sum() / sums["toy_positions"].clamp(min=1), sums

    return KindTerms(finish=finish)


def metrics(sums: dict) -> dict:
    n = float(sums.get("toy_positions", 0.0))
    return {"toy_penalty": float(sums["toy_penalty_sum"]) / n} if n > 0 else {}


def memory_terms(opts: ToyOptions, hidden: int, vocab: int) -> MemoryTerms:
    return MemoryTerms(head_params=2 * hidden * opts.toy_rank, grads_name="toy_grads", loss_name="toy_buffer",
                       loss_position_values=opts.toy_rank, flops_per_position=12 * hidden * opts.toy_rank)


def warm_start(drafter) -> None:
    drafter.toy_up.weight.data.zero_()


SPEC = register(KindSpec(name="toy", architecture="ToyDraftModel", summary="a low-rank residual (test)",
                         options=ToyOptions, model_fields=("toy_rank",), loss_options=ToyLoss, loss_at=loss_at,
                         loss_module=__name__, vllm_method="dflash", memory=memory_terms, warm_start=warm_start,
                         rules=(("model.block_size", "must be <= 64 for a toy", lambda v: v <= 64),
                                ("model.toy_rank", "must be >= 1", lambda v: v >= 1),
                                ("loss.toy_gamma", "must be >= 0 (0 = loss.gamma)", lambda v: v >= 0))))
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
    losses = [float(drafter_step(module, opt, tensors, LossConfig(gamma=7.0, num_anchors=8, toy_weight=0.1), 0, step,
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


def test_toy_kind_fields_are_config_fields(toy, tiny_target: Path, tmp_path: Path) -> None:
    """The toy's model.toy_rank and loss.toy_gamma, declared in its module only: set from a file and as overrides,
    checked by its rules and strictly, documented and recorded like DFlash's fields, and they reach the drafter
    (its options, as the job builds it) and the loss (the step's loss settings, through its loss_at hook)."""
    from dflash_ds.config import Config, LossConfig, field_docs, load_config, to_dict
    from dflash_ds.errors import DFlashError
    from dflash_ds.models.drafter import DFlashDrafter
    from dflash_ds.models.target import load_target
    from dflash_ds.runtime.engine import DrafterTrainModule
    from dflash_ds.runtime.job import resolve_arch
    from dflash_ds.runtime.step import forward, loss_at
    from dflash_ds.tools.train_step import target_batch

    run = tmp_path / "toy.yaml"
    run.write_text(f"target: {tiny_target}\nmodel:\n  kind: toy\n  num_layers: 1\n  block_size: 4\n  toy_rank: 2\n"
                   "loss:\n  num_anchors: 8\n  toy_gamma: 3.0\n")
    cfg = load_config(run)
    assert (cfg.model.toy_rank, cfg.loss.toy_gamma) == (2, 3.0)
    over = load_config(run, ["--model.toy_rank", "5", "--loss.toy_gamma=0.5"])
    assert (over.model.toy_rank, over.loss.toy_gamma) == (5, 0.5)
    assert (Config().model.toy_rank, LossConfig().toy_gamma) == (3, 0.0)  # the toy module's defaults
    assert LossConfig(toy_gamma=2.0).toy_gamma == 2.0 and dataclasses.replace(cfg.loss, gamma=1.0).toy_gamma == 3.0

    for overrides, message in ((["--loss.toy_gamma", "-1"], "loss.toy_gamma = -1.0 must be >= 0 (0 = loss.gamma)"),
                               (["--model.toy_rank", "0"], "model.toy_rank = 0 must be >= 1"),
                               (["--loss.toy_gama", "1"], "unknown key loss.'toy_gama'; did you mean 'toy_gamma'?"),
                               (["--model.toy_rank", "two"], "model.toy_rank = 'two' must be an integer")):
        with pytest.raises(DFlashError, match=re.escape(message)):
            load_config(run, overrides)
    with pytest.raises(DFlashError, match="model.toy_rank = 2 is a toy field but model.kind = 'dflash' ignores it"):
        load_config(None, {"model": {"toy_rank": 2}})

    docs = field_docs()
    assert docs["model.toy_rank"] == "toy: rank of the low-rank residual."
    assert docs["loss.toy_gamma"] == "toy: position decay of the toy's runs in place of loss.gamma (0 = loss.gamma's)."
    record = to_dict(cfg)
    assert record["model"]["toy_rank"] == 2 and record["loss"]["toy_gamma"] == 3.0
    assert list(record["loss"])[-1] == "toy_gamma"  # the kinds' fields after DFlash's, registered last

    # the drafter: the job's shape carries the toy's options from model.*
    arch = resolve_arch(cfg)
    drafter = DFlashDrafter(arch)
    assert arch.options == toy.ToyOptions(toy_rank=2) and drafter.toy_down.out_features == 2

    # the loss: the step's settings take loss.toy_gamma as the decay, and the trainer's forward computes with it
    step_loss = loss_at(cfg, 0)
    assert step_loss == dataclasses.replace(cfg.loss, gamma=3.0) and loss_at(over, 0).gamma == 0.5
    assert loss_at(load_config(run, ["--loss.toy_gamma", "0"]), 0).gamma == 7.0  # 0: loss.gamma's
    target = load_target(tiny_target)
    tensors = target_batch(target, arch.target_layer_ids, batch=2, prompt_len=8, new_tokens=24, seed=0)
    module = DrafterTrainModule(drafter, target.get_input_embeddings(), target.get_output_embeddings())
    drafter.init_weights(0)
    with torch.no_grad():
        losses = [float(forward(module, tensors, loss, 0, 0, 0.0, torch.float32)[0].loss)
                  for loss in (step_loss, dataclasses.replace(cfg.loss, gamma=3.0), cfg.loss)]
    assert losses[0] == losses[1] != losses[2]


def test_a_kind_field_may_not_take_a_name_already_there(toy) -> None:
    """A kind declaring a field that a section or another kind has already: one clear error, the registry unharmed."""
    from dflash_ds.config import Config
    from dflash_ds.errors import DFlashError

    @dataclasses.dataclass
    class Clash:
        gamma: float = 1.0
        """A second loss.gamma."""

    kinds.register(kinds.KindSpec("clash", "ClashDraftModel", "a clash (test)", loss_options=Clash, vllm_method="x"))
    try:
        with pytest.raises(DFlashError, match="drafter kind 'clash' declares loss.gamma, a field of LossConfig"):
            Config()
    finally:
        kinds.unregister("clash")
    assert Config().loss.toy_gamma == 0.0


def test_no_kind_is_named_outside_models_and_components() -> None:
    """Outside models/ and components/ (and the registry in models/kinds.py) dflash-ds asks a kind's spec, never its
    name: no source line names a registered kind (its name, any case, as in its architecture) but dflash, the
    backbone."""
    package = Path(__file__).resolve().parents[2] / "dflash_ds"
    names = [name for name in kinds.kind_names() if name != kinds.DFLASH]
    assert {"dflash2", "dspark"} <= set(names)
    named = re.compile("|".join(map(re.escape, names)), re.IGNORECASE)
    hits = [f"{path.relative_to(package)}:{n}: {line.strip()}" for path in sorted(package.rglob("*.py"))
            if path.relative_to(package).parts[0] not in ("models", "components")
            for n, line in enumerate(path.read_text().splitlines(), 1) if named.search(line)]
    assert not hits, "\n".join(hits)


def test_toy_kind_adds_its_loss_term_and_logs_its_metric(toy, tiny_target: Path, tmp_path: Path) -> None:
    """The toy's own term (its loss module's `loss_terms`): the objective adds loss.toy_weight x the penalty its sums
    hold, over the same label positions as the DFlash loss; its metric (`metrics`) reaches metrics.jsonl and W&B's
    names through the metric window, beside DFlash's, and no other kind's."""
    from dflash_ds.config import load_config
    from dflash_ds.models.drafter import DFlashDrafter
    from dflash_ds.models.target import load_target
    from dflash_ds.runtime.engine import DrafterTrainModule
    from dflash_ds.runtime.job import resolve_arch
    from dflash_ds.runtime.monitor import Monitor, wandb_flatten
    from dflash_ds.runtime.step import forward
    from dflash_ds.runtime.step_metrics import MetricWindow
    from dflash_ds.tools.train_step import target_batch

    run = tmp_path / "toy.yaml"
    run.write_text(f"target: {tiny_target}\nmodel:\n  kind: toy\n  num_layers: 1\n  block_size: 4\n"
                   "loss:\n  num_anchors: 8\n  toy_weight: 0.5\n")
    cfg = load_config(run)
    drafter = DFlashDrafter(resolve_arch(cfg))
    drafter.init_weights(0)  # toy_up drawn, not zero: the residual has a size
    target = load_target(tiny_target)
    tensors = target_batch(target, drafter.arch.target_layer_ids, batch=2, prompt_len=8, new_tokens=24, seed=0)
    module = DrafterTrainModule(drafter, target.get_input_embeddings(), target.get_output_embeddings())
    with torch.no_grad():  # the same anchors (seed, batch id) with the term off and on
        (off, off_sums), (on, on_sums) = (forward(module, tensors, dataclasses.replace(cfg.loss, toy_weight=w), 0, 0,
                                                  0.0, torch.float32) for w in (0.0, 0.5))
    penalty = float(on_sums["toy_penalty_sum"]) / float(on_sums["toy_positions"])
    assert penalty > 0 and float(on_sums["toy_positions"]) == float(off_sums["valid_positions"]) > 0
    assert float(off_sums["toy_positions"]) == 0  # off: the kind's statistics are there, zero
    assert float(on.loss) == pytest.approx(float(off.loss) + 0.5 * penalty, rel=1e-6)

    window = MetricWindow(num_buckets=1, num_positions=drafter.arch.block_size - 1, num_drafters=1, drafter=0)
    meta = {"real_tokens": 10, "padded_tokens": 12, "num_seqs": 2, "tgt_batch_per_s": 1.0, "tgt_forward_s": 0.1,
            "bucket": 0}
    for sums in (on_sums, off_sums):  # a window of two micro-steps: its sums add up
        window.add_step(float(on.loss), sums, meta, 0, 1.0, 1e-3, 0.0)
    record = window.reduce().record(1, 0, 1.0, 2, 1, 1, 10, 0.1)
    assert record["toy_penalty"] == pytest.approx(penalty) and record["accuracy"] >= 0
    assert "selector_accuracy" not in record and "confidence_ece" not in record  # other kinds': no positions
    monitor = Monitor(tmp_path / "run", 10, config={}, use_wandb=False, wandb_project="", wandb_run_name="")
    monitor.log(record)
    monitor.close()
    logged = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert logged["toy_penalty"] == pytest.approx(penalty)
    assert wandb_flatten(record)["train/toy_penalty"] == pytest.approx(penalty)


def test_a_kind_without_vllm_method_is_an_error_naming_it() -> None:
    """vLLM picks its speculator by the method: a kind that names none is refused, not served as "dflash"."""
    with pytest.raises(ValueError, match=r"drafter kind 'mute' \(MuteDraftModel\) names no vllm_method"):
        kinds.register(kinds.KindSpec("mute", "MuteDraftModel", "no method (test)"))
    assert "mute" not in kinds.kind_names()


def test_toy_kind_plans_with_its_own_terms(toy, capsys) -> None:
    from dflash_ds.cli import main
    from dflash_ds.memory import model as mm
    from dflash_ds.memory.shapes import drafter_shape
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
