"""A link-budget model of sweeping prompts over the real prompt path (experts/prompt.py), on the CPU: how long the
compute waits for copies under each fill (MOESTREAM_FILL_AHEAD=lookahead|ring), and how many experts cross.

    python bench/fill_model.py [--slots 2203] [--compute-ms 9.5] [--gbps 55] [--gap-ms 5] [--prompts 6]

The defaults are Qwen3-Next's Q4_K_M at 4000 MiB, ubatch 4096 (12 layers of 512 experts of ~1.86 MB, every expert
routed; 2203 slots; 9.5 ms a layer's compute: the all-GPU prompt). The model: at a layer's routing its demand misses
cross the link while compute waits; under a layer's compute the link moves compute-ms worth of copies, which the
prompt path spends as it would (the next layer's copy-ahead within the in-flight bound, then its fill calls);
between prompts (--gap-ms: the logits, the next prompt's start) the same. One-byte experts stand in for the bytes,
so the cache's decisions are the live code's and only the timing is modelled (no host time, no attention, the link
at its full rate): it ranks fills, it does not predict tok/s (bench/RESULTS.md, stop 37).
"""
import argparse

import numpy as np
import torch

from moestream.device import Device
from moestream.experts import prompt as pm
from moestream.experts.cache import ExpertCache
from moestream.experts.prefetch import PrefetchConfig
from moestream.experts.store import ExpertStore
from moestream.quant.layout import ExpertLayout

ap = argparse.ArgumentParser()
ap.add_argument("--layers", type=int, default=12)
ap.add_argument("--experts", type=int, default=512)
ap.add_argument("--slots", type=int, default=2203)
ap.add_argument("--expert-mb", type=float, default=1.86)
ap.add_argument("--compute-ms", type=float, default=9.5, help="a layer's compute")
ap.add_argument("--gbps", type=float, default=55.0, help="the link")
ap.add_argument("--gap-ms", type=float, default=5.0, help="between prompts")
ap.add_argument("--inflight", type=int, default=512, help="--prefetch-max-inflight-mib")
ap.add_argument("--prompts", type=int, default=6)
ns = ap.parse_args()
L, E = ns.layers, ns.experts
T = ns.expert_mb * 1e6 / (ns.gbps * 1e9) * 1e3            # ms an expert on the link
EVERY = np.full(E, 5, dtype=np.int64)                       # a sweep: every expert routed


def model(mode: str) -> None:
    pm.FILL_AHEAD = mode
    store = ExpertStore({l: torch.zeros(E, 3, dtype=torch.uint8) for l in range(L)}, ExpertLayout(1, 1))
    c = ExpertCache(store, ns.slots, L, E, Device("cpu"), "cycle", PrefetchConfig(min_batch=8), list(range(L)),
                    top_k=10)
    p, eb = c.prompt, store.expert_bytes
    bound = int(ns.inflight * 2 ** 20 / (ns.expert_mb * 1e6))          # the in-flight bound, in experts
    left = [0]                                                         # copies the link has time for now
    prefetch = p._prefetch

    def budgeted(layer, experts, room=None):
        n = prefetch(layer, experts[:max(0, left[0])])
        left[0] -= n
        return n

    p._prefetch = budgeted
    p._in_flight_room = lambda: max(0, min(left[0], bound)) * eb
    pm.FILL_LOW_BYTES = max(1, round(24 * 2 ** 20 / (ns.expert_mb * 1e6))) * eb

    def spare(ms: float) -> None:                                      # the link's time: fill calls until spent
        left[0] = int(ms / T)
        while left[0] > 0 and p._fill(left[0] * eb):
            pass

    copies = lambda: c.stats.summary(c.stats.total)["copies"]          # noqa: E731
    for rep in range(ns.prompts):
        first, wait = copies(), 0.0
        c.begin_prompt(0)
        left[0] = int(ns.gap_ms / T)
        c.begin_ubatch(0, 4096, True)
        spare(left[0] * T)
        for layer in range(L):
            c.slots.mark_reads()
            before, left[0] = copies(), 10 ** 9                        # demand misses: compute waits for them
            c.prepare(layer, EVERY, [EVERY] * min(2, L - 1 - layer) or None)
            wait += (copies() - before) * T
            left[0] = int(ns.compute_ms / T)
            c.experts_launched(layer)
            spare(left[0] * T)
        ms = wait + L * ns.compute_ms + ns.gap_ms
        n = copies() - first
        print(f"{mode:9s} prompt {rep}: {n} experts ({n * ns.expert_mb / 1e3:.2f} GB), compute waits {wait:.1f} ms, "
              f"~{ms:.0f} ms a prompt")


for mode in ("lookahead", "ring"):
    model(mode)
