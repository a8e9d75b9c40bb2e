"""Constants shared by the trainer tests (importable, unlike conftest.py)."""

from runtime_utils import REPO

STEPS = 20
COMMON = ["--config", str(REPO / "configs/tiny.yaml"), "--max-steps", str(STEPS), "--train.save_interval", "10",
          "--train.log_interval", "5", "--data.token_budget", "1024", "--train.timeout_s", "90"]
