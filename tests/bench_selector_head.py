"""DFlash2's training loss at the real vocabulary (V 151,936, a Qwen3-8B's): the DFlash loss + the selector term with the
LM head run twice (the selector's own top-K pass, before issue #36) or once (its candidates from the DFlash loss's
chunks, `chunked_dflash_loss(top_k=K)`). Forward + backward of 64 blocks of 15 positions, H 512, one thread,
interleaved repetitions; docs/QUALITY.md has the figures.

usage: python tests/bench_selector_head.py
"""
import time, torch
from dflash_ds.components.loss import chunked_dflash_loss
from dflash_ds.models.dflash2_loss import selector_loss
from dflash_ds.models.dflash2_selector import CandidateSelector
torch.manual_seed(0)
torch.set_num_threads(1)
N, K, H, V, k = 64, 15, 512, 151936, 8
head_w = torch.randn(V, H) * 0.02
head = lambda x: x @ head_w.T
sel = CandidateSelector(H, V, 64)
torch.nn.init.normal_(sel.predecessor_codebook, std=0.02); torch.nn.init.normal_(sel.successor_codebook, std=0.02)
labels = torch.randint(0, V, (N, K)); valid = torch.ones(N, K, dtype=torch.bool); anchor = torch.randint(0, V, (N,))
def step(once):
    h = (torch.randn(N, K, H) * 0.5).requires_grad_()
    t0 = time.perf_counter()
    terms = chunked_dflash_loss(h, head, labels, valid, gamma=4.0, chunk_blocks=16, top_k=k if once else 0)
    s, _ = selector_loss(h, head, sel, labels, valid, anchor, top_k=k, gamma=4.0, chunk_blocks=16,
                         candidates=terms.candidates if once else None)
    (terms.loss + s).backward()
    return time.perf_counter() - t0
step(True); step(False)
times = {True: [], False: []}
for _ in range(4):
    for once in (False, True):
        times[once].append(step(once))
for once in (False, True):
    t = sorted(times[once])
    print(f"{'once' if once else 'twice'}: median {t[len(t)//2]:.2f} s, min {t[0]:.2f} s over {len(t)}")
