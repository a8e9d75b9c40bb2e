"""Strict config: defaults, files, overrides, unknown keys with suggestions, rule violations."""

from pathlib import Path

import pytest

from dflash_ds.config import Config, field_docs, load_config, parse_overrides
from dflash_ds.errors import DFlashError

REPO = Path(__file__).resolve().parents[2]


def test_defaults_and_tiny_config():
    cfg = load_config()
    assert cfg.loss.gamma == 7.0 and cfg.model.block_size == 16 and cfg.optim.beta2 == 0.95
    tiny = load_config(REPO / "configs/tiny.yaml")
    assert tiny.model.block_size >= 2 and tiny.data.max_length <= tiny.data.token_budget


def test_every_field_has_a_doc():
    import dataclasses

    docs = field_docs(Config)
    leaves = []

    def walk(obj, prefix):
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if dataclasses.is_dataclass(v):
                walk(v, prefix + f.name + ".")
            else:
                leaves.append(prefix + f.name)

    walk(Config(), "")
    missing = [k for k in leaves if not docs.get(k)]
    assert not missing, missing


def test_overrides_parse_and_apply(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("loss:\n  gamma: 4\ntrain:\n  max_steps: 5\n")
    cfg = load_config(f, ["--loss.gamma", "5.5", "--train.seed=3", "--model.target_layer_ids", "[1, 2]"])
    assert cfg.loss.gamma == 5.5 and cfg.train.seed == 3 and cfg.train.max_steps == 5
    assert cfg.model.target_layer_ids == [1, 2]
    assert parse_overrides(["--wandb.enabled", "false"]) == {"wandb": {"enabled": False}}


@pytest.mark.parametrize("overrides, message", [
    (["--loss.gama", "3"], "unknown key loss.'gama'; did you mean 'gamma'?"),
    (["--trian.seed", "3"], "unknown key 'trian'; did you mean 'train'?"),
    (["--model.block_size", "1"], "model.block_size = 1 must be >= 2"),
    (["--loss.gamma", "0"], "loss.gamma = 0.0 must be > 0"),
    (["--optim.lr", "-1e-4"], "optim.lr = -0.0001 must be > 0"),
    (["--train.zero_stage", "4"], "train.zero_stage = 4 must be 0, 1, 2 or 3"),
    (["--train.max_steps", "ten"], "train.max_steps = 'ten' must be an integer"),
    (["--data.max_length", "9000", "--data.token_budget", "4096"], "data.max_length = 9000 must be <="),
    (["--topology.colocate", "true", "--topology.targets_per_node", "2"],
     "topology.colocate = true runs the target on every rank: topology.targets_per_node = 2 cannot be combined"),
    (["--topology.colocate_overlap", "true"], "topology.colocate_overlap = true needs topology.colocate = true"),
])
def test_bad_config_errors_name_field(overrides, message):
    with pytest.raises(DFlashError) as err:
        load_config(None, overrides)
    assert message in str(err.value)


def test_bad_file_errors(tmp_path):
    with pytest.raises(DFlashError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("loss: [1, 2\n")
    with pytest.raises(DFlashError, match="bad.yaml: cannot parse"):
        load_config(bad)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("loss: 3\n")
    with pytest.raises(DFlashError, match="loss must be a mapping"):
        load_config(wrong)


@pytest.mark.parametrize("overrides, message", [
    ({"model": {"num_layers": 3, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}},
     "model.layer_types has 2 entries but model.num_layers = 3"),
    ({"model": {"num_layers": 2, "layer_types": ["sliding_attention", "full_attention"]}},
     "model.layer_types has sliding_attention layers: set model.sliding_window"),
    ({"model": {"num_layers": 1, "layer_types": ["local_attention"]}},
     "model.layer_types = ['local_attention'] entries must be full_attention or sliding_attention"),
    ({"model": {"sliding_window": 0}}, "model.sliding_window = 0 must be >= 1"),
    ({"model": {"checkpoint_layers": 0}}, "model.checkpoint_layers = 0 must be >= 1"),
    ({"model": {"num_layers": 3, "checkpoint_layers": 4}},
     "model.checkpoint_layers = 4 must be <= model.num_layers = 3"),
    ({"model": {"checkpoint_layers": 2, "activation_checkpointing": False}},
     "model.checkpoint_layers = 2 recomputes layers, but model.activation_checkpointing = false"),
])
def test_layer_type_errors_name_the_field(overrides, message):
    with pytest.raises(DFlashError) as err:
        load_config(None, overrides)
    assert message in str(err.value)


def test_layer_types_load():
    cfg = load_config(None, ["--model.num_layers", "2", "--model.layer_types", "[sliding_attention, full_attention]",
                             "--model.sliding_window", "2048"])
    assert cfg.model.layer_types == ["sliding_attention", "full_attention"] and cfg.model.sliding_window == 2048
    assert load_config().model.layer_types is None  # default: all full attention
