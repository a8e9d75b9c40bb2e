"""The target's features kept in the run folder, for a colocated run that sees its rows more than once.

A colocated rank runs the frozen target forward on every batch it trains: on SmolLM2-135M on 2 CPU cores that
forward was 61-70% of the step, and from the second epoch on it recomputes what the first already computed.
With the cache a rank writes each row's features (the selected layers' outputs, and the final hidden state when
the loss reads it) as the first epoch computes them, and a batch whose rows are all cached is read back instead
of running the target (docs/THROUGHPUT_CPU.md). The drafter step is unchanged.

Layout of `<output_dir>/feature_cache/`:
- `meta.json`: what the features are of (`cache_key`): the target's fingerprint, the data's, the layers read,
  whether the final hidden state is kept, the row width and the target's dtype. A run whose key differs is
  refused, naming what changed; remove the folder to rebuild it.
- `features.bin`: in the target's dtype, row r at a fixed offset (the tokens of the rows before it x the bytes a
  token takes): its [length, K*H] context, then its [length, H] final hidden state when kept. A sparse file: only rows that
  were cached take disk. Rows past `train.feature_cache_gb` (in row order) are never cached.
- `rows.<rank>.log`: the rows each rank wrote, int64, appended after their bytes reached the disk (fdatasync):
  a row is cached when a log lists it, so a rank killed mid-write leaves no row half-cached (a torn last record
  is ignored) and a resumed run goes on filling the same cache. Every rank reads every log (D colocated ranks
  train each other's rows in the next epoch).

Values: the cache holds what the target produced, in its dtype (bf16 where the CPU computes it natively, fp32 on
an AVX2-only CPU: 2x the disk, and exact). So null (auto) turns it on for every colocated CPU run that revisits its
rows; on a GPU, where the target's forward is cheap beside reading its features back, only true asks for it.
Before 2026-12-07 an fp32 run cached bf16-rounded features and null left it off: on an AVX2-only CPU the one-command
recipe then ran the fp32 target on every step (docs/THROUGHPUT_CPU.md).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from dflash_ds.errors import DFlashError
from dflash_ds.runtime.digest import hash_file

FOLDER = "feature_cache"
VERSION = 2  # 2: small weight files hashed whole (runtime/digest.py)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def target_fingerprint(path: str | Path) -> str:
    """The target folder's config.json, and of each weight file its size, header and 256 evenly spread 64 KiB
    samples (16 MiB a file, not the whole file: a Qwen3-8B hashed in full took minutes on every rank). A change
    confined to the bytes between samples is not seen."""
    folder = Path(path)
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for f in sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES or p.name.endswith(".index.json")):
        hash_file(h, f, sampled=f.suffix in WEIGHT_SUFFIXES)
    return h.hexdigest()[:16]


def data_fingerprint(paths: list[str]) -> str:
    """Every Arrow file of the prepared folders, hashed whole, in the order the run appends them (data.path,
    then data.val_path): the rows, their tokens and loss masks."""
    h = hashlib.sha256()
    for path in paths:
        folder = Path(path)
        files = [folder / f["filename"] for f in json.loads((folder / "state.json").read_text())["_data_files"]]
        for f in files:
            hash_file(h, f, sampled=False)
    return h.hexdigest()[:16]


def cache_key(cfg, arch, target_dtype: torch.dtype) -> dict:
    """What a cache's features are of; a run with another key cannot read them."""
    paths = [cfg.data.path] + ([cfg.data.val_path] if cfg.data.val_path else [])
    return {"version": VERSION, "target": target_fingerprint(cfg.target), "data": data_fingerprint(paths),
            "target_layer_ids": list(arch.target_layer_ids), "last_hidden": bool(cfg.loss.needs_last_hidden),
            "hidden_size": int(arch.hidden_size), "target_dtype": str(target_dtype).replace("torch.", ""),
            "stored_dtype": str(target_dtype).replace("torch.", "")}


WHAT_CHANGED = {
    "target": "the target folder's config or weights changed",
    "data": "the prepared data changed (data.path / data.val_path)",
    "target_layer_ids": "the drafter reads other target layers",
    "last_hidden": "the loss now does (or no longer does) read the target's final hidden state",
    "hidden_size": "the target's width changed",
    "target_dtype": "the target runs in another dtype (train.dtype)",
    "stored_dtype": "the cache now keeps features in the target's dtype (an fp32 run's cache held them in bf16)",
}


def check_key(folder: Path, key: dict) -> None:
    """Refuse a cache made for another target, data or shape, naming what differs; write the key if new."""
    meta = folder / "meta.json"
    if meta.is_file():
        old = json.loads(meta.read_text())
        diff = [k for k in key if old.get(k) != key[k]]
        if diff:
            why = "; ".join(f"{k}: {old.get(k)!r} there, {key[k]!r} now: {WHAT_CHANGED.get(k, 'another format')}"
                            for k in diff)
            raise DFlashError(f"train.feature_cache: {folder} holds the features of another run ({why}); remove "
                              f"that folder to rebuild the cache, or set train.feature_cache off")
        return
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".meta.{os.getpid()}.tmp"  # every rank may write it: the same text, each by an atomic rename
    tmp.write_text(json.dumps(key, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, meta)


class FeatureCache:
    """One rank's view of the run folder's cache: which rows are in it, reading a batch, writing one."""

    def __init__(self, folder: Path, lengths: np.ndarray, layers_width: int, last_width: int, bound_bytes: int,
                 rank: int, write: bool, dtype: torch.dtype = torch.bfloat16) -> None:
        self.folder, self.write, self.dtype = folder, write, dtype
        self.layers_width, self.last_width = layers_width, last_width
        self.token_bytes = dtype.itemsize * (layers_width + last_width)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        ends = np.cumsum(self.lengths * self.token_bytes)
        self.offsets = ends - self.lengths * self.token_bytes
        self.in_bound = int(np.searchsorted(ends, bound_bytes, side="right"))  # rows 0..in_bound-1 fit
        self.bound_bytes = int(ends[self.in_bound - 1]) if self.in_bound else 0
        self.cached = np.zeros(len(self.lengths), dtype=bool)
        self._read_upto: dict[Path, int] = {}
        self._fd = os.open(folder / "features.bin", os.O_RDWR | os.O_CREAT, 0o666)
        self._log = open(folder / f"rows.{rank}.log", "ab")
        self.refresh()

    def refresh(self) -> None:
        """Read what the logs added since the last look (every rank's)."""
        for log in sorted(self.folder.glob("rows.*.log")):
            start = self._read_upto.get(log, 0)
            with open(log, "rb") as fh:
                fh.seek(start)
                data = fh.read()
            whole = len(data) // 8 * 8  # a torn last record (a rank killed mid-append) is not a row
            rows = np.frombuffer(data[:whole], dtype=np.int64)
            self.cached[rows[(rows >= 0) & (rows < len(self.cached))]] = True
            self._read_upto[log] = start + whole

    def has(self, rows: list[int]) -> bool:
        """Whether every row of a batch is cached (looking at the logs again when one is missing)."""
        if self.cached[rows].all():
            return True
        if any(r < self.in_bound for r in rows):
            self.refresh()
        return bool(self.cached[rows].all())

    def read(self, rows: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(context [n, width, K*H], final hidden [n, width, H] or None) of cached rows, zero past each row."""
        n = len(rows)
        context = torch.zeros((n, width, self.layers_width), dtype=self.dtype)
        last = torch.zeros((n, width, self.last_width), dtype=self.dtype) if self.last_width else None
        for k, r in enumerate(rows):
            length = int(self.lengths[r])
            raw = os.pread(self._fd, length * self.token_bytes, int(self.offsets[r]))
            if len(raw) != length * self.token_bytes:
                raise DFlashError(f"train.feature_cache: {self.folder / 'features.bin'} is shorter than its logs "
                                  f"say (row {r}); remove {self.folder} to rebuild it")
            flat = torch.frombuffer(bytearray(raw), dtype=self.dtype)
            split = length * self.layers_width
            context[k, :length] = flat[:split].view(length, self.layers_width)
            if last is not None:
                last[k, :length] = flat[split:].view(length, self.last_width)
        return context, last

    def store(self, rows: list[int], context: torch.Tensor, last: torch.Tensor | None) -> None:
        """Write the rows of a computed batch that are in the bound and not cached yet; then log them."""
        if not self.write:
            return
        todo = [(k, r) for k, r in enumerate(rows) if r < self.in_bound and not self.cached[r]]
        if not todo:
            return
        ctx = context.detach().to("cpu", self.dtype)
        fin = last.detach().to("cpu", self.dtype) if last is not None and self.last_width else None
        for k, r in todo:
            length = int(self.lengths[r])
            parts = [ctx[k, :length].contiguous()] + ([fin[k, :length].contiguous()] if fin is not None else [])
            data = b"".join(p.view(torch.uint8).numpy().tobytes() for p in parts)
            os.pwrite(self._fd, data, int(self.offsets[r]))
        os.fdatasync(self._fd)  # the bytes first, then the log that vouches for them
        self._log.write(np.asarray([r for _, r in todo], dtype=np.int64).tobytes())
        self._log.flush()
        self.cached[[r for _, r in todo]] = True

    def close(self) -> None:
        """Close the files (the cache stays for the next epoch, a resume or the next run)."""
        self._log.close()
        os.close(self._fd)

    def describe(self) -> str:
        """One line: where, the bound and how much of the data fits, how much is cached."""
        n = len(self.lengths)
        dtype = str(self.dtype).replace("torch.", "")
        return (f"{self.folder}, {dtype}, {self.token_bytes:,} bytes a token; {self.in_bound} of {n} rows fit "
                f"train.feature_cache_gb ({self.bound_bytes / 1e9:.3f} GB), {int(self.cached.sum())} cached")


def revisits_rows(cfg, data) -> bool:
    """Whether the run trains a row twice (more steps than an epoch has) or evaluates more than once."""
    steps_per_epoch = data.sampler(0).batches_per_epoch  # optimizer steps: the sampler's consumers are the G batches
    evaluations = cfg.train.max_steps // cfg.train.eval_interval if data.val_micro_steps else 0
    return cfg.train.max_steps > steps_per_epoch or evaluations >= 2


def open_feature_cache(cfg, arch, dtype: torch.dtype, data, rank: int,
                       device: torch.device) -> tuple[FeatureCache | None, str]:
    """This colocated rank's cache (or None) and the line that says whether it is on and why (train.feature_cache)."""
    asked, gb = cfg.train.feature_cache, cfg.train.feature_cache_gb
    if asked is False or gb <= 0:
        return None, f"off (train.feature_cache {asked}, train.feature_cache_gb {gb:g})"
    if asked is None and device.type != "cpu":
        return None, ("off (train.feature_cache null: on a GPU the target's forward is cheap beside reading its "
                      "features back from the run folder; true asks for it)")
    from dflash_ds.data.loader import load_lengths

    folder = Path(cfg.train.output_dir) / FOLDER
    check_key(folder, cache_key(cfg, arch, dtype))
    write = asked is True or revisits_rows(cfg, data)
    last_width = arch.hidden_size if cfg.loss.needs_last_hidden else 0
    cache = FeatureCache(folder, load_lengths(data.dataset), len(arch.target_layer_ids) * arch.hidden_size,
                         last_width, int(gb * 1e9), rank, write, dtype)
    how = "written in the first epoch, read from the second" if write else "read only (the run sees each row once)"
    return cache, f"on ({how}): {cache.describe()}"
