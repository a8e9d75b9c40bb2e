"""Constants shared by the trainer tests (importable, unlike conftest.py)."""

from runtime_utils import REPO, per_batch

STEPS = 20
COMMON = ["--config", str(REPO / "configs/tiny.yaml"), "--max-steps", str(STEPS), "--train.save_interval", "10",
          "--train.log_interval", "5", "--data.token_budget", "1024", "--train.timeout_s", "90"]
# train.heartbeat_timeout_s of the multi-host fault tests (a link cut, a killed SLURM node): each ends within 2
HEARTBEAT_S = 10


def assert_reference_losses(out, ref_out):
    """A run's per-batch records are the reference's (conftest.py: 1 target + 2 drafters on one host): every batch
    once, at the reference's step, its loss within 1e-4."""
    got, want = per_batch(out), per_batch(ref_out)
    assert sorted(got) == sorted(want) == list(range(2 * STEPS))
    for b, rec in want.items():
        assert got[b]["step"] == rec["step"] and abs(got[b]["loss"] - rec["loss"]) < 1e-4, (b, got[b], rec)
