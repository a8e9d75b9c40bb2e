"""Monitoring on global rank 0: metrics.jsonl, W&B mirror, live status line.

`metrics.jsonl` holds one flat object per log interval; W&B receives the same values,
namespaced `train/…`, `pipeline/…`, `batch/…`. A missing wandb package or a failed
`wandb.init` prints one warning and training goes on.
"""

from __future__ import annotations

import json
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from dflash_ds.distributed.credentials import is_secret_name

# metric key -> W&B namespace
NAMESPACES = {
    **{k: "train" for k in ("loss", "accuracy", "avg_streak", "tau", "top4_accuracy", "top8_accuracy",
                            "tree_streak4", "tree_streak8", "lr", "noise_std", "grad_norm", "accuracy_per_position",
                            "skipped_steps", "epoch", "est_tau", "est_tau_pooled", "est_tau_walked",
                            "est_tau_base")},
    **{k: "val" for k in ("val_est_tau", "val_est_tau_pooled", "val_tau")},
    **{k: "pipeline" for k in ("tgt_batch_per_sec", "dft_batch_per_sec", "tok_per_sec", "hs_queue_depth", "eta_s",
                               "tgt_forward_s", "recv_wait_s", "step_time_s")},
    **{k: "batch" for k in ("avg_seq_len", "padding_efficiency", "bucket_pct", "real_tokens", "padded_tokens",
                            "anchors", "label_positions")},
    **{k: "memory" for k in ("peak_mem_gb", "peak_mem_gb_per_rank")},
}

REQUIRED_KEYS = ("step", "epoch", "loss", "accuracy", "avg_streak", "tau", "top4_accuracy", "top8_accuracy",
                 "tree_streak4", "tree_streak8", "lr", "noise_std", "grad_norm", "tgt_batch_per_sec",
                 "dft_batch_per_sec", "tok_per_sec", "hs_queue_depth", "avg_seq_len", "padding_efficiency",
                 "bucket_pct", "eta_s", "anchors", "label_positions", "peak_mem_gb")


def wandb_flatten(record: dict[str, Any]) -> dict[str, Any]:
    """metrics.jsonl record -> W&B dict with namespaced keys (lists/dicts flattened with '/')."""
    out: dict[str, Any] = {}
    for key, value in record.items():
        if key == "step":
            continue
        name = f"{NAMESPACES.get(key, 'train')}/{key}"
        if isinstance(value, dict):
            out.update({f"{name}/{k}": v for k, v in value.items()})
        elif isinstance(value, list):
            out.update({f"{name}/{i + 1}": v for i, v in enumerate(value)})
        else:
            out[name] = value
    return out


def scrub_secrets(obj: Any) -> Any:
    """Drop values whose key looks like a credential (credentials.is_secret_name) before a config is logged or
    saved."""
    if isinstance(obj, dict):
        return {k: ("<redacted>" if is_secret_name(k) else scrub_secrets(v))
                for k, v in obj.items()}
    return obj


def _fmt_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


class Monitor:
    """Rank 0's sink for metric records: file, W&B, console."""

    def __init__(self, output_dir: str | Path, total_steps: int, *, config: dict[str, Any], use_wandb: bool,
                 wandb_project: str, wandb_run_name: str, resume_step: int = 0) -> None:
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(resume_step)
        self.file = self.path.open("a")
        self.total = total_steps
        self.wandb = None
        self.tty = sys.stdout.isatty()
        if use_wandb:
            self.wandb = self._init_wandb(output_dir, wandb_project, wandb_run_name, scrub_secrets(config))

    def _truncate_after(self, step: int) -> None:
        """On resume, drop records past the checkpoint so the file reads as one uninterrupted run."""
        if not self.path.exists():
            return
        keep = []
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a torn last line from a crash
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, self.path)

    @staticmethod
    def _init_wandb(output_dir, project: str, run_name: str, config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            warnings.warn("wandb is not installed: metrics go to metrics.jsonl only", stacklevel=2)
            return None
        try:
            return wandb.init(project=project, name=run_name or Path(output_dir).name, dir=str(output_dir),
                              config=config, reinit=True)
        except Exception as exc:  # noqa: BLE001 - W&B must never stop training
            print(f"warning: wandb.init failed ({type(exc).__name__}: {exc}); metrics go to metrics.jsonl only",
                  file=sys.stderr, flush=True)
            return None

    def log(self, record: dict[str, Any]) -> None:
        """Append one record, mirror it to W&B, print the status line."""
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb is not None:
            try:
                self.wandb.log(wandb_flatten(record), step=int(record["step"]))
            except Exception as exc:  # noqa: BLE001
                print(f"warning: wandb.log failed ({exc}); disabling W&B", file=sys.stderr, flush=True)
                self.wandb = None
        self.status(record)

    def status(self, r: dict[str, Any]) -> None:
        """One status line: step/total, loss, accuracy, tau (est_tau, val_est_tau when measured), tokens/s, queue
        depth, ETA."""
        taus = "".join(f" | {name} {r[key]:.2f}" for key, name in (("est_tau", "est"), ("val_est_tau", "val est"))
                       if key in r)
        line = (f"step {r['step']}/{self.total} | loss {r['loss']:.4f} | acc {r['accuracy']:.3f} | "
                f"tau {r['tau']:.2f}{taus} | {r['tok_per_sec']:,.0f} tok/s | queue {r['hs_queue_depth']:.1f} | "
                f"eta {_fmt_eta(r['eta_s'])}")
        end = "\r" if self.tty and r["step"] < self.total else "\n"
        print(line.ljust(100) if self.tty else line, end=end, flush=True)

    def close(self) -> None:
        """Flush the file and finish the W&B run."""
        self.file.close()
        if self.wandb is not None:
            try:
                self.wandb.finish()
            except Exception:  # noqa: BLE001
                pass
