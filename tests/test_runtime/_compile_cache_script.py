"""One process of tests/test_runtime/test_compile_cache.py: load the run's compile cache (train.compile_cache), run
one fused function compiled (an RMSNorm over [rows x 96], forward only), save the cache; print what happened as JSON.

argv: OUT (the run folder), ROWS. The inductor cache folder and thread count are the caller's (TORCHINDUCTOR_CACHE_DIR,
OMP_NUM_THREADS)."""

import json
import sys
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from dflash_ds.components import fusion
from dflash_ds.models import layer_ops
from dflash_ds.runtime import compile_cache

out, rows = Path(sys.argv[1]), int(sys.argv[2])
loaded = compile_cache.load(out)
fusion.set_fuse_mode("on")
with torch.no_grad():
    y = layer_ops.rms_norm(torch.ones(rows, 96), torch.full((96,), 2.0), 1e-6)
print(json.dumps({"loaded": loaded, "saved": compile_cache.save(out), "value": float(y.mean()),
                  "hits": counters["inductor"]["fxgraph_cache_hit"], "misses": counters["inductor"]["fxgraph_cache_miss"]}))
