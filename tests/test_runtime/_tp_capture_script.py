"""Under torchrun: load each TARGET sharded over the world (tensor parallel) and compare its capture with the whole.

argv: pairs of target folder and output JSON (one launch for several families: a launch costs seconds of imports).
For each, rank 0 writes the largest differences (the selected layers' outputs and the
final hidden state against an unsharded load on the same batch), and every rank its local parameter count.
"""

import json
import sys
import threading
from pathlib import Path

import safetensors
import torch
import torch.distributed as dist

from dflash_ds.models.target import capture_hidden, load_target


def local_numel(model) -> int:
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())


class MapWatch:
    """Whether this process maps a file of the target folder while loading, outside safetensors' own open.

    transformers' own loader memory-maps the safetensors from open to close of the load (a mapped file's
    read-around pages count in the rank's RSS); the sharded load must read its slices with pread. safetensors
    (0.8.0) still maps a file for an instant inside `safe_open` itself, to parse the header (it left up to 512 kB
    resident, then unmapped): /proc/self/maps is polled every ms and a mapping counts only when no `safe_open`
    call of ours was in progress at any moment of the poll (the wrapper below counts them; transformers imports
    its own reference, so its mmap loader's mappings always count)."""

    def __init__(self, folder: str) -> None:
        self.folder, self.line, self._stop = folder, "", threading.Event()
        self.opening, self.opens = 0, 0  # safe_open calls in progress, started so far
        real = safetensors.safe_open

        def counted_open(*args, **kwargs):
            self.opening += 1
            self.opens += 1
            try:
                return real(*args, **kwargs)
            finally:
                self.opening -= 1

        safetensors.safe_open = counted_open
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set() and not self.line:
            before = (self.opening, self.opens)
            with open("/proc/self/maps") as f:
                hits = [line.strip() for line in f if self.folder in line]
            if hits and before[0] == 0 and (self.opening, self.opens) == before:
                self.line = hits[0]
            self._stop.wait(0.001)

    def stop(self) -> str | bool:
        """False, or the first mapping line seen."""
        self._stop.set()
        self._thread.join()
        return self.line or False


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for path, out in zip(sys.argv[1::2], sys.argv[2::2]):
        compare(path, out)
    dist.destroy_process_group()


def compare(path: str, out: str) -> None:
    world = dist.get_world_size()
    watch = MapWatch(str(Path(path).resolve()))
    sharded = load_target(path, tp_size=world)
    mapped = watch.stop()
    ids = torch.randint(5, 500, (2, 40), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0  # a padded row, as batches have
    layers = [0, 1, 3]
    ctx, last = capture_hidden(sharded, ids, mask, layers)
    counts = [None] * world
    dist.all_gather_object(counts, local_numel(sharded))
    maps = [None] * world
    dist.all_gather_object(maps, mapped)
    if dist.get_rank() == 0:
        whole = load_target(path)
        ref_ctx, ref_last = capture_hidden(whole, ids, mask, layers)
        keep = mask.bool()
        json.dump({"context": (ctx - ref_ctx)[keep].abs().max().item(),
                   "last_hidden": (last - ref_last)[keep].abs().max().item(),
                   "scale": ref_ctx[keep].abs().max().item(),
                   "plain_tensors": type(ctx) is torch.Tensor and type(last) is torch.Tensor,
                   "local_params": counts, "mapped_target_file": maps, "whole_params": local_numel(whole),
                   "expert_shapes": {n: [list(p.shape), list((p.to_local() if hasattr(p, "to_local") else p).shape)]
                                     for n, p in sharded.named_parameters() if "layers.0.mlp.experts" in n}},
                  open(out, "w"))
    dist.barrier()


if __name__ == "__main__":
    main()
