"""Bad input and config: each is one clear error line, a non-zero exit, and no heavy work before it.

Most checks run in-process (config, validate_job, open_data, the CLI entry points); two torchrun
runs show the end-to-end shape (one error line per rank, no model loaded).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test_runtime"))  # shared torchrun helpers
from runtime_utils import REPO, free_port, torchrun, write_conversations  # noqa: E402

from dflash_ds.config import load_config  # noqa: E402
from dflash_ds.errors import DFlashError  # noqa: E402

TINY = REPO / "configs" / "tiny.yaml"
MISSING = "/nonexistent/dflash-target"


def write_dataset(path: Path, rows: list[list[int]]) -> Path:
    """A prepared-format Arrow dataset (input_ids, loss_mask, length) without running prepare."""
    import datasets

    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32")),
                                  "loss_mask": datasets.List(datasets.Value("int8")),
                                  "length": datasets.Value("int32")})
    datasets.Dataset.from_dict({"input_ids": rows, "loss_mask": [[0, 0] + [1] * (len(r) - 2) for r in rows],
                                "length": [len(r) for r in rows]}, features=features).save_to_disk(str(path))
    return path


def error_lines(text: str) -> list[str]:
    """Non-empty lines of a captured stream."""
    return [line for line in text.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def good_data(tmp_path_factory) -> Path:
    """A small valid prepared dataset (ids inside the tiny vocabulary)."""
    return write_dataset(tmp_path_factory.mktemp("good") / "data", [list(range(1, 40)), list(range(5, 70))])


@pytest.fixture(scope="module")
def no_template_target(tiny_target: Path, tmp_path_factory) -> Path:
    """The tiny target with its chat template removed (tokenizer_config.json and chat_template.jinja)."""
    folder = tmp_path_factory.mktemp("no_template") / "target"
    shutil.copytree(tiny_target, folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tok_cfg = folder / "tokenizer_config.json"
    tok_cfg.write_text(json.dumps({k: v for k, v in json.loads(tok_cfg.read_text()).items()
                                   if k != "chat_template"}))
    return folder


# --- config -----------------------------------------------------------------------------------

@pytest.mark.parametrize("file_data, argv, message", [
    ({}, ["--loss.gama", "3"], "config: unknown key loss.'gama'; did you mean 'gamma'?"),
    ({"optim": {"lrr": 0.1}}, [], "config: unknown key optim.'lrr'; did you mean 'lr'?"),
    ({"trian": {}}, [], "config: unknown key 'trian'; did you mean 'train'?"),
    ({}, ["--loss.gamma", "-1"], "config: loss.gamma = -1.0 must be > 0"),
    ({}, ["--train.zero_stage", "4"], "config: train.zero_stage = 4 must be 0, 1, 2 or 3"),
    ({}, ["--optim.lr", "fast"], "config: optim.lr = 'fast' must be a finite number"),
    ({"train": {"max_steps": 2.5}}, [], "config: train.max_steps = 2.5 must be an integer"),
    ({"data": {"max_length": 4096, "token_budget": 1024}}, [],
     "config: data.max_length = 4096 must be <= data.token_budget = 1024"),
])
def test_bad_config_through_train_entry(tmp_path, capsys, monkeypatch, file_data, argv, message):
    from dflash_ds import train

    monkeypatch.delenv("RANK", raising=False)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(json.dumps(file_data))  # JSON is YAML
    rc = train.main(["--config", str(cfg), *argv])
    err = error_lines(capsys.readouterr().err)
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("dflash-ds train (rank ?): error: ") and message in err[0], err


def test_config_file_that_is_not_a_mapping(tmp_path, capsys):
    from dflash_ds import train

    cfg = tmp_path / "run.yaml"
    cfg.write_text("- a\n- b\n")
    assert train.main(["--config", str(cfg)]) == 2
    assert f"config file {cfg}: top level must be a mapping" in capsys.readouterr().err


# --- hostfile ---------------------------------------------------------------------------------

def check_hostfile(path: Path) -> subprocess.CompletedProcess:
    """`dflash-ds check-hostfile PATH` as a user runs it."""
    return subprocess.run([sys.executable, "-m", "dflash_ds", "check-hostfile", str(path)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)


@pytest.mark.parametrize("text, message", [
    ("localhost\n", "{f}:1: host 'localhost' has no slots (expected 'localhost slots=N', N = GPUs on it)"),
    ("node0 slots=8\nnode1 slots=0\n", "{f}:2: slots=0 for host 'node1' is not a positive integer"),
    ("node0 slots=eight\n", "{f}:1: slots=eight for host 'node0' is not a positive integer"),
    ("node0 slots=-2\n", "{f}:1: slots=-2 for host 'node0' is not a positive integer"),
    ("node0 gpus=8\n", "{f}:1: expected 'slots=N' after host 'node0', got 'gpus=8'"),
    ("slots=8\n", "{f}:1: missing host name before 'slots=8' (expected 'HOST slots=N')"),
    ("node0 slots=8 node1 slots=8\n", "{f}:1: unexpected text 'node1 slots=8' after 'node0 slots=8'"),
    ("node0 slots=8\n# second node\nnode0 slots=8\n", "{f}:3: duplicate host 'node0' (first listed on line 1)"),
    ("# no hosts yet\n\n", "hostfile {f} lists no hosts (expected one 'HOST slots=N' line per node)"),
])
def test_malformed_hostfile(tmp_path, text, message):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(text)
    r = check_hostfile(hostfile)
    assert r.returncode == 2
    assert error_lines(r.stderr) == [f"dflash-ds check-hostfile: error: {message.format(f=hostfile)}"], r.stderr


def test_missing_hostfile(tmp_path):
    r = check_hostfile(tmp_path / "nope")
    assert r.returncode == 2
    assert f"hostfile {tmp_path / 'nope'} does not exist" in r.stderr


def test_good_hostfile_lists_hosts(tmp_path):
    from dflash_ds.distributed.hostfile import parse_hostfile

    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\n  node0 slots=8   # first\n\nnode1\tslots=4\n")
    assert parse_hostfile(hostfile) == [("node0", 8), ("node1", 4)]
    r = check_hostfile(hostfile)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["node0 slots=8", "node1 slots=4",
                                     f"check-hostfile: 2 host(s), 12 slots in total ({hostfile})"]
    assert check_hostfile(REPO / "hostfile").returncode == 0  # the committed example stays valid


@pytest.mark.parametrize("good", [False, True])
def test_launch_script_checks_the_hostfile_first(tmp_path, good):
    """launch/train_deepspeed.sh refuses a malformed hostfile before `deepspeed` runs (a stub records a call)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub, called = bin_dir / "deepspeed", tmp_path / "deepspeed_called"
    stub.write_text(f'#!/bin/sh\necho "$@" > {called}\n')
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=2\nnode1 slots=2\n" if good else "node0 slots=2\nnode1 slots=two\n")
    env = dict(os.environ, HOSTFILE=str(hostfile), NO_SSH="1", MASTER_PORT=str(free_port()),
               PATH=os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    r = subprocess.run(["bash", str(REPO / "launch/train_deepspeed.sh"), "--config", str(TINY)],
                       capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    if good:
        assert r.returncode == 0, r.stderr
        assert f"--hostfile {hostfile} --no_ssh" in called.read_text()
    else:
        assert r.returncode == 2
        assert f"{hostfile}:2: slots=two for host 'node1' is not a positive integer" in r.stderr
        assert not called.exists()  # deepspeed never started


# --- layout -----------------------------------------------------------------------------------

@pytest.mark.parametrize("topology, world, local, message", [
    ({"targets_per_node": 1}, 5, 2, "world size 5 is not a multiple of 2 ranks per node"),
    ({"targets_per_node": 2}, 4, 2, "--targets-per-node 2 leaves 0 drafter ranks on a node of 2"),
    ({"targets_per_node": 1}, 4, None, "--targets-per-node 1 needs the number of ranks per node"),
    ({"num_target_ranks": 4}, 4, 4, "--num-target-ranks 4 leaves 0 drafter ranks in a world of 4"),
    ({"num_target_ranks": 1}, 1, 1, "a world of 1 rank(s) cannot hold a target and a drafter"),
])
def test_layout_that_does_not_fit_the_world(topology, world, local, message):
    from dflash_ds.runtime.launch import job_layout

    with pytest.raises(DFlashError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        job_layout(load_config(None, {"topology": topology}), world, local)


def test_per_node_layout_that_fits():
    from dflash_ds.runtime.launch import job_layout

    layout = job_layout(load_config(None, {"topology": {"targets_per_node": 1}}), 6, 3)
    assert (layout.target_ranks, layout.drafter_ranks) == ([2, 5], [0, 1, 3, 4])


# --- target folder, data, chat template -------------------------------------------------------

def test_missing_target_folder(good_data, tmp_path):
    from dflash_ds.runtime.launch import validate_job

    cfg = load_config(TINY, {"target": MISSING, "data": {"path": str(good_data)}})
    with pytest.raises(DFlashError, match=f"^target folder {MISSING} does not exist$"):
        validate_job(cfg, 3, 3)
    (tmp_path / "empty").mkdir()
    cfg = load_config(TINY, {"target": str(tmp_path / "empty"), "data": {"path": str(good_data)}})
    with pytest.raises(DFlashError, match="has no config.json"):
        validate_job(cfg, 3, 3)


def test_missing_target_through_train_entry_makes_no_group(good_data, tmp_path, capsys, monkeypatch):
    """Under a launcher's env, the train entry fails in validation: no process group, no model."""
    from dflash_ds import train
    from dflash_ds.runtime import launch

    def no_group(*a, **k):
        raise AssertionError("a process group was created before validation failed")

    monkeypatch.setattr(launch, "init_role_groups", no_group)
    for key, value in {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(key, value)
    rc = train.main(["--config", str(TINY), "--target", MISSING, "--data", str(good_data),
                     "--output-dir", str(tmp_path / "run"), "--no-wandb"])
    assert rc == 2
    assert error_lines(capsys.readouterr().err) == [
        f"dflash-ds train (rank 0): error: target folder {MISSING} does not exist"]
    assert not (tmp_path / "run").exists()


def test_missing_target_torchrun_every_rank_fails_before_loading(good_data, tmp_path):
    r = torchrun(2, ["--config", str(TINY), "--target", MISSING, "--data", str(good_data),
                     "--output-dir", str(tmp_path / "run"), "--no-wandb"], timeout=120, cwd=tmp_path)
    assert r.returncode != 0
    # torchrun stops the other ranks as soon as one exits, so not every rank may get to print.
    errors = [line for line in r.stderr.splitlines() if "dflash-ds train (rank" in line]
    assert errors and all(line.endswith(f": error: target folder {MISSING} does not exist") for line in errors), \
        r.stderr[-3000:]
    assert "Loading weights" not in r.stderr + r.stdout
    assert not (tmp_path / "run").exists()


def test_trainer_does_not_need_a_chat_template(no_template_target, good_data):
    """Training reads prepared token ids: only prepare / regenerate / eval (JSONL prompts) need a template."""
    from dflash_ds.runtime.launch import validate_job

    validate_job(load_config(TINY, {"target": str(no_template_target), "data": {"path": str(good_data)}}), 2, 2)


def test_prepare_without_chat_template(no_template_target, tmp_path, capsys):
    from dflash_ds import cli

    src = write_conversations(tmp_path / "conv.jsonl", 4)
    rc = cli.main(["prepare", "--target", str(no_template_target), "--data", str(src), "--out", str(tmp_path / "out")])
    assert rc == 2
    assert error_lines(capsys.readouterr().err) == [
        f"dflash-ds prepare: error: --target {no_template_target}: the tokenizer has no chat_template"]
    assert not (tmp_path / "out").exists()


def test_regenerate_without_chat_template_loads_no_model(no_template_target, tmp_path, capsys, monkeypatch):
    import transformers

    from dflash_ds import cli

    def no_model(*a, **k):
        raise AssertionError("the target model was loaded before the chat template was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_model)
    src = write_conversations(tmp_path / "conv.jsonl", 4)
    rc = cli.main(["regenerate", "--target", str(no_template_target), "--data", str(src),
                   "--out", str(tmp_path / "regen.jsonl")])
    assert rc == 2
    assert error_lines(capsys.readouterr().err) == [
        f"dflash-ds regenerate: error: --target {no_template_target}: the tokenizer has no chat_template"]


def test_eval_jsonl_prompts_without_chat_template_loads_no_model(no_template_target, tmp_path, capsys, monkeypatch):
    from dflash_ds import cli
    from dflash_ds.models import target as target_mod

    def no_model(*a, **k):
        raise AssertionError("the target model was loaded before the prompts were rendered")

    monkeypatch.setattr(target_mod, "load_target", no_model)
    drafter = tmp_path / "drafter"
    assert cli.main(["init-drafter", "--target", str(no_template_target), "--out", str(drafter),
                     "--num-layers", "1", "--block-size", "4"]) == 0
    src = write_conversations(tmp_path / "conv.jsonl", 4)
    capsys.readouterr()
    rc = cli.main(["eval", "--target", str(no_template_target), "--drafter", str(drafter), "--data", str(src)])
    assert rc == 2
    assert error_lines(capsys.readouterr().err) == [
        f"dflash-ds eval: error: --target {no_template_target}: the tokenizer has no chat_template"]


@pytest.mark.parametrize("how", ["saved_empty", "filtered_to_nothing"])
def test_empty_dataset(tmp_path, how):
    import datasets

    from dflash_ds.data.stream import open_data

    empty = tmp_path / "empty"
    if how == "saved_empty":  # no Arrow file at all: datasets.load_from_disk itself would crash
        write_dataset(empty, [])
    else:  # an Arrow file with zero rows
        write_dataset(tmp_path / "full", [[1, 2, 3]])
        datasets.load_from_disk(str(tmp_path / "full")).filter(lambda r: False).save_to_disk(str(empty))
    with pytest.raises(DFlashError) as info:
        open_data(load_config(TINY, {"data": {"path": str(empty)}}), 2, 512)
    assert str(info.value) == f"data folder {empty} holds no rows (were all rows dropped by prepare?)"


def test_prepare_with_every_row_dropped_writes_nothing(tiny_target, tmp_path, capsys):
    from dflash_ds import cli

    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join([
        '{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok"}]}',
        '{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "no"}]}',
        '{"conversations": [',
    ]) + "\n")
    out = tmp_path / "prepared"
    rc = cli.main(["prepare", "--target", str(tiny_target), "--data", str(src), "--out", str(out)])
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # datasets' progress aside
    assert rc == 2
    assert err == [f"dflash-ds prepare: error: no rows kept from {src}: 3 read, dropped too_few_loss_tokens=2 "
                   f"(e.g. {src}:1), malformed_json=1 (e.g. {src}:3)"], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # no output, no work folders


def test_token_id_outside_the_vocabulary(tmp_path):
    from dflash_ds.data.stream import open_data

    data = write_dataset(tmp_path / "data", [list(range(1, 40)), [1, 2, 10**6, 3, 4]])
    with pytest.raises(DFlashError) as info:
        open_data(load_config(TINY, {"data": {"path": str(data)}}), 2, 512)
    assert str(info.value) == (f"data folder {data}: token id 1000000 >= the target vocabulary size 512 "
                               f"(prepared with another tokenizer?)")


def test_token_id_outside_the_vocabulary_torchrun(tiny_target, tmp_path):
    """open_data runs before any process group: every rank names the id, none loads a model."""
    data = write_dataset(tmp_path / "data", [list(range(1, 40)), [1, 2, 10**6, 3, 4]])
    r = torchrun(2, ["--config", str(TINY), "--target", str(tiny_target), "--data", str(data),
                     "--output-dir", str(tmp_path / "run"), "--no-wandb"], timeout=120, cwd=tmp_path)
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if "dflash-ds train (rank" in line]
    assert errors and all("token id 1000000 >= the target vocabulary size 512" in e for e in errors), \
        r.stderr[-3000:]
    assert "Loading weights" not in r.stderr + r.stdout
    assert not (tmp_path / "run").exists()


# --- resume -----------------------------------------------------------------------------------

def fake_checkpoint(folder: Path, arch: dict, complete: bool = True) -> Path:
    """A checkpoint folder with trainer_state.json (and COMPLETE) but no shards: enough for the checks."""
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"step": 10, "cursor": {"epoch": 0, "batch_index": 20},
                                                           "arch": arch}))
    if complete:
        (folder / "COMPLETE").write_text("10\n")
    return folder


@pytest.mark.parametrize("key, saved", [("block_size", 16), ("target_layer_ids", [0, 3]), ("num_hidden_layers", 5),
                                        ("head_dim", 64)])
def test_resume_checkpoint_that_differs_from_the_config(tiny_target, tmp_path, key, saved):
    from dflash_ds.runtime import checkpoint as ckpt
    from dflash_ds.runtime.resume import check_resume_state as _check_resume_state
    from dflash_ds.runtime.job import resolve_arch

    arch = resolve_arch(load_config(TINY, {"target": str(tiny_target)}))
    now = getattr(arch, key)
    assert now != saved
    fields = {k: getattr(arch, k) for k in ("block_size", "target_layer_ids", "num_hidden_layers",
                                            "hidden_size", "vocab_size")}
    folder = fake_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000010", {**fields, key: saved})
    assert ckpt.resolve_resume("auto", tmp_path / "run") == folder
    path = ckpt.resolve_resume(str(folder), tmp_path / "run")
    _check_resume_state({"arch": fields}, arch, path)  # the run's own shape passes
    with pytest.raises(DFlashError) as info:
        _check_resume_state(ckpt.read_state(path), arch, path)
    assert str(info.value) == f"checkpoint {folder} has {key} = {saved} but this run has {now}"


def test_resume_from_a_partial_or_unreadable_checkpoint(tmp_path):
    from dflash_ds.runtime import checkpoint as ckpt

    run = tmp_path / "run"
    partial = fake_checkpoint(run / "checkpoints" / "step_00000010.partial", {}, complete=False)
    with pytest.raises(DFlashError) as info:
        ckpt.resolve_resume(str(partial), run)
    assert str(info.value) == (f"--resume {partial}: {partial} is not a complete checkpoint "
                               f"(no COMPLETE or trainer_state.json)")
    with pytest.raises(DFlashError, match=f"^--resume {run}: no complete checkpoint under {run / 'checkpoints'}$"):
        ckpt.resolve_resume(str(run), tmp_path / "other")
    assert ckpt.resolve_resume("auto", run) is None  # auto with only a partial save: a fresh start
    torn = fake_checkpoint(run / "checkpoints" / "step_00000020", {})
    (torn / "trainer_state.json").write_text('{"step": 2')
    with pytest.raises(DFlashError, match=f"^{torn / 'trainer_state.json'}: unreadable trainer state"):
        ckpt.read_state(ckpt.resolve_resume(str(torn), run))


def test_model_fields_that_contradict_the_drafter(tiny_target, tmp_path):
    """--drafter's config.json fixes the shape: a model.* field set to another value is an error, not ignored."""
    from dflash_ds import cli
    from dflash_ds.runtime.job import resolve_arch

    drafter = tmp_path / "drafter"
    assert cli.main(["init-drafter", "--target", str(tiny_target), "--out", str(drafter), "--num-layers", "2",
                     "--block-size", "8"]) == 0
    base = {"target": str(tiny_target), "drafter": str(drafter)}
    arch = resolve_arch(load_config(TINY, base))  # tiny.yaml asks for 2 layers of block 8: the drafter's shape
    assert (arch.num_hidden_layers, arch.block_size) == (2, 8)
    assert resolve_arch(load_config(None, base)).num_hidden_layers == 2  # defaults: nothing asked
    for model, message in (({"num_layers": 3}, "model.num_layers = 3 but --drafter .* has num_hidden_layers = 2"),
                           ({"block_size": 4}, "model.block_size = 4 but --drafter .* has block_size = 8"),
                           ({"target_layer_ids": [0, 2]}, r"model.target_layer_ids = \[0, 2\] but --drafter .* has "
                                                          r"target_layer_ids = \[1, 2\]")):
        with pytest.raises(DFlashError, match=message):
            resolve_arch(load_config(TINY, dict(base, model=model)))
    # DFlash2 fields: checked against a dflash2 folder, refused on a dflash folder (both were ignored)
    with pytest.raises(DFlashError, match="model.selector_top_k = 16 but --drafter .* is a dflash drafter"):
        resolve_arch(load_config(TINY, dict(base, model={"selector_top_k": 16})))
    drafter2 = tmp_path / "drafter2"
    assert cli.main(["init-drafter", "--target", str(tiny_target), "--out", str(drafter2), "--num-layers", "2",
                     "--block-size", "8", "--kind", "dflash2", "--selector-top-k", "4"]) == 0
    base2 = dict(base, drafter=str(drafter2))
    assert resolve_arch(load_config(TINY, dict(base2, model={"selector_top_k": 4}))).options.selector_top_k == 4
    with pytest.raises(DFlashError, match=r"model.selector_top_k = 16 but --drafter .*drafter2 has selector_top_k = 4"):
        resolve_arch(load_config(TINY, dict(base2, model={"kind": "dflash2", "selector_top_k": 16})))
    # without --drafter, a DFlash2 field under model.kind dflash is a config error; the defaults load
    from dflash_ds.config_rules import kind_fields
    from dflash_ds.models.dflash2_arch import option_names
    assert set(kind_fields()["dflash2"]) == set(option_names())
    with pytest.raises(DFlashError, match=r"^config: model.selector_top_k = 16 is a dflash2 field but model.kind = "
                                          r"'dflash' ignores it"):
        load_config(TINY, {"model": {"selector_top_k": 16}})
    assert load_config(TINY, {"model": {"kind": "dflash2", "selector_top_k": 16}}).model.selector_top_k == 16
