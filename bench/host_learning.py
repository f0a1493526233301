"""Host time of zero-copy decode's learning a step, on the CPU, at a model's routing shapes (no model, no GPU).

    python bench/host_learning.py --layers 12 --experts 512 --top-k 10 --slots 2100 --steps 400
    python bench/host_learning.py --layers 24 --experts 128 --top-k 8 --slots 1300 --tokens 8 --profile

A decode step's host work (begin_step, then end_step: the last step's routing learned, the next table prepared)
runs while the GPU runs the step; where it takes longer than the step, it is the step's bound. This drives the
cache's decode path (experts/zero_copy.py, the same code as live) with stand-in rows of one byte and a routing
drawn from a skewed popularity per layer (a Zipf law, exponent --skew), and prints the host ms a step, and with
--profile the functions that take it.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np
import torch

from moestream.device import Device
from moestream.experts.cache import ExpertCache
from moestream.experts.store import ExpertStore
from moestream.quant.layout import ExpertLayout


def routing(rng, n_layers: int, n_experts: int, top_k: int, n_tokens: int, skew: float):
    """A function giving one step's ids (L, T, k): each token draws k distinct experts by a Zipf popularity of its
    own per layer (a random permutation of ranks per layer)."""
    p = 1.0 / np.arange(1, n_experts + 1) ** skew
    p /= p.sum()
    perms = [rng.permutation(n_experts) for _ in range(n_layers)]

    def step():
        return np.stack([np.stack([perms[l][rng.choice(n_experts, top_k, replace=False, p=p)]
                                   for _ in range(n_tokens)]) for l in range(n_layers)])
    return step


def run(args) -> dict:
    rng = np.random.default_rng(0)
    layers = list(range(args.layers))
    store = ExpertStore({l: torch.zeros(args.experts, 16, dtype=torch.uint8) for l in layers}, ExpertLayout(1, 1))
    cache = ExpertCache(store, args.slots, args.layers, args.experts, Device("cpu"), host_layers=layers,
                        top_k=args.top_k)
    cache.enable_zero_copy(16, read_through=not args.no_read_through, staged=args.staged)
    zc, draw = cache.zero_copy, routing(rng, args.layers, args.experts, args.top_k, args.tokens, args.skew)
    steps = [draw() for _ in range(args.warmup + args.steps)]
    times = []
    prof = cProfile.Profile() if args.profile else None
    for i, ids in enumerate(steps):
        for l in layers:
            zc.replay_route(l, ids[l])
        if i == args.warmup and prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        zc.begin_step()
        zc.end_step(args.tokens)
        times.append(time.perf_counter() - t0)
    if prof is not None:
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    cache.collect_waits()
    total = cache.stats.summary(cache.stats.total)
    ms = np.array(times[args.warmup:]) * 1e3
    n = args.warmup + args.steps
    return {"ms_median": float(np.median(ms)), "ms_mean": float(ms.mean()), "hit_rate": total["hit_rate"],
            **{k: total[k] / n for k in ("misses", "landed", "copies", "host_reads")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--experts", type=int, default=512)
    ap.add_argument("--top-k", type=int, default=10)
    ap.add_argument("--slots", type=int, default=2100, help="the pool's slots (4000 MiB of 1.9 MB experts: 2100)")
    ap.add_argument("--tokens", type=int, default=1, help="tokens a step (streams decoded together)")
    ap.add_argument("--skew", type=float, default=1.0, help="the Zipf exponent of each layer's popularity")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--staged", action="store_true")
    ap.add_argument("--no-read-through", action="store_true")
    ap.add_argument("--profile", action="store_true", help="cProfile the timed steps")
    args = ap.parse_args()
    r = run(args)
    print(f"host ms a step: median {r['ms_median']:.3f}, mean {r['ms_mean']:.3f} "
          f"({r['ms_median'] / args.layers:.3f} a layer); hit rate {r['hit_rate']:.3f}; a step: "
          + ", ".join(f"{k} {r[k]:.2f}" for k in ("misses", "landed", "copies", "host_reads")))


if __name__ == "__main__":
    main()
