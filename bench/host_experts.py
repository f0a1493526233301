"""Routed experts on the host's cores (kernels/host_experts.py) on the reference expert shape (I=768, H=2048):

    python bench/host_experts.py [--threads 1,4,8,16] [--types Q4_K_M,Q4_K,Q8_0,bf16] [--reps 16]

One layer's 128 experts of each type (random valid blocks; bf16: random values) in host memory, pinned where
CUDA is there (as the expert store holds them), plain otherwise. Each call: T=1 with k=8, 4, 2, 1 distinct
experts, and T=8 with k=8 each (picked from a window of 64, so some experts serve several tokens, as in a
decode step of 8 sequences). Calls cycle through disjoint windows of experts, so no call finds the previous
call's rows in the caches. Each cell: µs a call (median of `reps` calls, after a warm-up call that loads or
compiles the kernels) and, in brackets, GB/s: the distinct experts' bytes a call reads over its time. `err`:
||out - ref|| / ||ref|| of one T=8 call against host_experts_reference. Prints markdown.
"""
import argparse
import statistics
import time

import torch
from gguf import GGMLQuantizationType as Q

from moestream.kernels.host_experts import fast_path, host_experts, host_experts_reference, set_threads
from moestream.quant.dequant import random_blocks
from moestream.quant.layout import ExpertLayout
from moestream.quant.types import type_size

ap = argparse.ArgumentParser()
ap.add_argument("--threads", default="1,4,8,16", help="numba thread counts, comma list (capped at the cores)")
ap.add_argument("--types", default="Q4_K_M,Q4_K,Q8_0,bf16")
ap.add_argument("--reps", type=int, default=16)
ns = ap.parse_args()
I, H, E = 768, 2048, 128
LAYOUTS = {"Q4_K_M": (Q.Q4_K, Q.Q4_K, Q.Q6_K), "Q4_K": (Q.Q4_K,) * 3, "Q5_K": (Q.Q5_K,) * 3,
           "Q6_K": (Q.Q6_K,) * 3, "Q8_0": (Q.Q8_0,) * 3, "bf16": None}
CASES = ((1, 8), (1, 4), (1, 2), (1, 1), (8, 8))                  # (T, k)
DISTINCT = 8                                                      # experts generated; the 128 rows repeat them


def host_rows(lay: ExpertLayout, g: torch.Generator) -> torch.Tensor:
    """(E, row) host rows: DISTINCT random experts, copied round the E rows (random bytes cost more to make than
    the bench takes; the calls still read E distinct rows of memory)."""
    if lay.quantized:
        few = torch.cat([random_blocks(t, DISTINCT * s // type_size(t), g).view(DISTINCT, s)
                         for t, s in zip(lay.types, lay.sizes)], dim=1)       # (DISTINCT, nbytes) uint8
    else:
        few = (torch.randn(DISTINCT, lay.numel, generator=g) * H ** -0.5).to(torch.bfloat16)
    rows = torch.empty(E, few.shape[1], dtype=few.dtype, pin_memory=torch.cuda.is_available())
    for e in range(E):
        rows[e] = few[e % DISTINCT]
    return rows


def id_sets(T: int, k: int, g: torch.Generator) -> list[torch.Tensor]:
    """(T, k) ids per call; calls on disjoint windows of the E experts (each call reads cold rows)."""
    W = min(E // 2, T * k)
    order = torch.randperm(E, generator=g)
    return [torch.stack([order[r * W:(r + 1) * W][torch.randperm(W, generator=g)[:k]] for _ in range(T)])
            for r in range(E // W)]


g = torch.Generator().manual_seed(0)
import numba                                                        # noqa: E402  (after the flags: --help is quick)
threads = [n for n in map(int, ns.threads.split(",")) if n <= numba.config.NUMBA_NUM_THREADS]
print(f"host experts, I={I} H={H}, {E} experts a layer, {'pinned' if torch.cuda.is_available() else 'plain'} "
      f"host memory; threads {threads} of {numba.config.NUMBA_NUM_THREADS} cores\n")
head = " | ".join(f"T={T} k={k}" for T, k in CASES)
print(f"| type | MB an expert | threads | {head} | err |\n|---|---:|---:|" + "---:|" * len(CASES) + "---:|")
for name in ns.types.split(","):
    lay = ExpertLayout(I, H, LAYOUTS[name])
    assert fast_path(lay), f"{name}: no numba fast path"
    rows = host_rows(lay, g)
    nbytes = rows.stride(0) * rows.element_size()
    sets = {c: id_sets(*c, g) for c in CASES}
    xs = {c: torch.randn(c[0], H, generator=g) for c in CASES}
    ws = {c: torch.softmax(torch.randn(*c, generator=g), -1) for c in CASES}
    c8 = CASES[-1]
    out = host_experts(xs[c8], rows, sets[c8][0], ws[c8], lay)              # warm-up: loads or compiles
    ref = host_experts_reference(xs[c8], rows, sets[c8][0], ws[c8], lay)
    err = ((out - ref).norm() / ref.norm()).item()
    for n in threads:
        set_threads(n)
        cells = []
        for c in CASES:
            calls = sets[c]
            host_experts(xs[c], rows, calls[-1], ws[c], lay)
            times = []
            for r in range(ns.reps):
                ids = calls[r % len(calls)]
                t0 = time.perf_counter()
                host_experts(xs[c], rows, ids, ws[c], lay)
                times.append(time.perf_counter() - t0)
            t = statistics.median(times) * 1e6
            distinct = statistics.mean(int(ids.unique().numel()) for ids in calls)
            cells.append(f"{t:.0f} ({distinct * nbytes / t / 1e3:.1f})")
        print(f"| {name} | {nbytes / 1e6:.2f} | {n} | {' | '.join(cells)} | {err:.1e} |", flush=True)
    del rows
print(f"\nnumba {numba.__version__}, threading layer {numba.threading_layer()}")
