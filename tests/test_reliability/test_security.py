"""Nothing user-supplied is unpickled, and secrets never reach logs, metrics.jsonl or saved configs."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest
import torch

from dflash_ds.config import load_config, to_dict
from dflash_ds.errors import DFlashError
from dflash_ds.runtime import checkpoint as ckpt
from dflash_ds.runtime.monitor import REQUIRED_KEYS, Monitor, scrub_secrets

PACKAGE = Path(__file__).resolve().parents[2] / "dflash_ds"
ENV_SECRET = "sk-env-7f3a9c"
CFG_SECRET = "sk-cfg-51d2e8"
UNPICKLERS = {("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"), ("dill", "load"),
              ("dill", "loads"), ("joblib", "load"), ("cloudpickle", "load"), ("cloudpickle", "loads")}


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and isinstance(node.func.value, ast.Name):
            yield node, node.func.value.id, node.func.attr


def _kwarg(call: ast.Call, name: str):
    return next((k.value for k in call.keywords if k.arg == name), None)


def test_package_never_unpickles():
    """Every torch.load passes weights_only=True; no pickle/dill/joblib loads; no np.load(allow_pickle=True)."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        where = lambda n: f"{path.relative_to(PACKAGE.parent)}:{n.lineno}"  # noqa: E731
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in {"pickle", "dill", "joblib", "cloudpickle"} \
                    and any(a.name in {"load", "loads", "Unpickler"} for a in node.names):
                bad.append(f"{where(node)}: from {node.module} import an unpickler")
        for call, owner, attr in _calls(tree):
            if (owner, attr) in UNPICKLERS:
                bad.append(f"{where(call)}: {owner}.{attr}")
            weights_only = _kwarg(call, "weights_only")
            if (owner, attr) == ("torch", "load") and not (isinstance(weights_only, ast.Constant)
                                                            and weights_only.value is True):
                bad.append(f"{where(call)}: torch.load without weights_only=True")
            allow = _kwarg(call, "allow_pickle")
            if owner in {"np", "numpy"} and attr == "load" and not (isinstance(allow, ast.Constant)
                                                                    and allow.value is False):
                bad.append(f"{where(call)}: np.load may unpickle (pass allow_pickle=False)")
    assert not bad, "\n".join(bad)


def test_deepspeed_shard_loads_weights_only(tmp_path):
    """What DeepSpeed's ZeRO shards hold (tensors, loss scaler, stage enum, slice map) loads weights-only."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    shard = {"zero_stage": ZeroStageEnum.gradients, "loss_scaler": LossScaler(1.0), "ds_version": "0.19.8",
             "param_slice_mappings": [{"w": fragment_address(numel=4, start=0)}],
             "optimizer_state_dict": {"state": {0: {"exp_avg": torch.ones(4)}}, "param_groups": [{"lr": 1e-3}]}}
    torch.save(shard, tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    got = ckpt.safe_torch_load(tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt", map_location="cpu")
    assert got["zero_stage"] is ZeroStageEnum.gradients and got["loss_scaler"].cur_scale == 1.0
    assert got["param_slice_mappings"][0]["w"] == fragment_address(numel=4, start=0)
    assert torch.equal(got["optimizer_state_dict"]["state"][0]["exp_avg"], torch.ones(4))


class _Payload:
    """Pickles to a call of os.mkdir: what a hostile checkpoint would run on a plain torch.load."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_hostile_shard_is_refused_not_run(tmp_path):
    marker = tmp_path / "pwned"
    shard = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.zeros(1)}, "extra": _Payload(marker)}, shard)
    with pytest.raises(DFlashError) as info:
        ckpt.safe_torch_load(shard)
    assert str(info.value).startswith(f"checkpoint shard {shard}: refused to unpickle")
    assert "it holds posix.mkdir, which a weights-only load does not allow" in str(info.value)
    assert len(str(info.value).splitlines()) == 1
    assert not marker.exists()


def test_use_safe_loading_replaces_the_engine_loader():
    class CheckpointEngine:
        def load(self, path, map_location=None):
            raise AssertionError("DeepSpeed's own loader (weights_only=False) was used")

    engine = type("Engine", (), {"checkpoint_engine": CheckpointEngine()})()
    ckpt.use_safe_loading(engine)
    assert engine.checkpoint_engine.load is ckpt.safe_torch_load


def test_drafter_export_without_safetensors_is_refused(tiny_target, tmp_path):
    """An export folder carrying only a pickle (pytorch_model.bin) is an error, never torch.load-ed."""
    from dflash_ds.tools.init_drafter import init_drafter
    from dflash_ds.models.drafter import DFlashDrafter

    export = tmp_path / "drafter"
    init_drafter(tiny_target, export, num_layers=1, block_size=4)
    (export / "model.safetensors").unlink()
    torch.save({"extra": _Payload(tmp_path / "pwned")}, export / "pytorch_model.bin")
    with pytest.raises(DFlashError, match=f"drafter folder {export} has no model.safetensors"):
        DFlashDrafter.from_pretrained(export)
    assert not (tmp_path / "pwned").exists()


def _record(step: int) -> dict:
    record = {k: 0.5 for k in REQUIRED_KEYS}
    record.update(step=step, epoch=0, bucket_pct=[1.0], accuracy_per_position=[0.5])
    return record


def test_secrets_stay_out_of_metrics_wandb_and_console(tmp_path, monkeypatch, capsys):
    """WANDB_API_KEY in the env and a credential-looking config key: neither appears in any file of the run."""
    monkeypatch.setenv("WANDB_API_KEY", ENV_SECRET)
    monkeypatch.setenv("HF_TOKEN", ENV_SECRET)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = {**to_dict(load_config()), "hub": {"hf_token": CFG_SECRET}, "wandb": {"api_key": CFG_SECRET}}
    for use_wandb in (False, True):
        out = tmp_path / f"run_wandb_{use_wandb}"
        monitor = Monitor(out, 2, config=config, use_wandb=use_wandb, wandb_project="p", wandb_run_name="r")
        monitor.log(_record(1))
        monitor.close()
        files = [p for p in out.rglob("*") if p.is_file()]
        assert (out / "metrics.jsonl") in files and (not use_wandb or any(p.suffix == ".wandb" for p in files))
        for p in files:
            data = p.read_bytes()
            assert ENV_SECRET.encode() not in data and CFG_SECRET.encode() not in data, p
    captured = capsys.readouterr()
    assert ENV_SECRET not in captured.out + captured.err and CFG_SECRET not in captured.out + captured.err


def test_saved_config_holds_no_secrets(monkeypatch):
    """The config saved in trainer_state.json / W&B is built from the dataclasses: no env value enters it."""
    for key in ("WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.setenv(key, ENV_SECRET)
    saved = json.dumps(scrub_secrets(to_dict(load_config(None, {"wandb": {"project": "p"}}))))
    assert ENV_SECRET not in saved
    scrubbed = scrub_secrets({"wandb": {"api_key": CFG_SECRET}, "hf_token": CFG_SECRET, "password": CFG_SECRET})
    assert CFG_SECRET not in json.dumps(scrubbed)


def test_a_secret_in_a_config_file_is_rejected_without_echoing_it(tmp_path):
    """Credentials are not config fields: a file that holds one fails, and the message does not repeat the value."""
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"wandb:\n  api_key: {CFG_SECRET}\n")
    with pytest.raises(DFlashError) as info:
        load_config(cfg)
    assert "unknown key wandb.'api_key'" in str(info.value) and CFG_SECRET not in str(info.value)


def test_scrub_keeps_ordinary_fields():
    scrubbed = scrub_secrets(to_dict(load_config()))
    assert scrubbed["data"]["token_budget"] == 16384 and scrubbed["model"]["mask_token_id"] is None


def test_a_rank_takes_the_configured_umask_and_filters_what_it_prints(tmp_path, monkeypatch, capsys):
    """train.main(as_rank=True), as `python -m dflash_ds.train` runs under every launcher: train.umask is set before
    any file is written, and what the rank prints afterwards shows a secret as *** (W&B's console copy too: a
    manual check found it copied the raw text when imported after the filter); a bare 027 (YAML's number 23) is
    refused rather than read as another mask."""
    import subprocess
    import sys

    from dflash_ds import train

    with pytest.raises(DFlashError, match=r"train.umask = '23' must be an octal mask"):
        load_config(None, ["--train.umask", "027"])
    assert load_config(None, ["--train.umask", "'077'"]).train.umask == "077"
    masks: list[int] = []
    monkeypatch.setattr(os, "umask", lambda mask: masks.append(mask) or 0o022)  # this process's stays as it is
    monkeypatch.setenv("WANDB_API_KEY", ENV_SECRET)
    monkeypatch.setenv("RANK", "0")  # rank 0 runs W&B: its console copier is imported first, under the filter
    saved = sys.stdout, sys.stderr
    try:
        rc = train.main(["--train.umask", "0o077", "--target", str(tmp_path / "none")], as_rank=True)
        print(f"WANDB_API_KEY={CFG_SECRET} and {ENV_SECRET}", flush=True)
    finally:
        sys.stdout, sys.stderr = saved
    out = capsys.readouterr()
    assert rc == 2 and masks == [0o077] and "dflash-ds train (rank 0): error:" in out.err
    assert out.out == "WANDB_API_KEY=*** and ***\n" and "wandb.sdk.lib.console_capture" in sys.modules
    # What W&B's copier (the callbacks a run installs) receives once it sits under the filter.
    code = ("import sys\nfrom dflash_ds.redact import redact_stdio\n"
            "redact_stdio(['wandb.sdk.lib.console_capture'])\nfrom wandb.sdk.lib import console_capture\n"
            "got = []\nconsole_capture.capture_stdout(lambda s, n: got.append(s))\n"
            f"print('--api-key {CFG_SECRET}', flush=True)\nsys.__stderr__.write(repr(got))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)})
    assert r.stdout == "--api-key ***\n" and r.stderr.endswith("['--api-key ***\\n']"), r.stderr[-2000:]
