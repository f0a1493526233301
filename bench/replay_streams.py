"""What the last batch of several streams in a routing trace reads over the link, replayed through the live
cache's code (experts/trace.py) on the CPU: experts a layer a decode step read from host memory in place, and
uploaded, for pool sizes. No GPU, no model.

    moestream bench -m ref.gguf --parallel 8 -npp 512 -ntg 64 -r 1 -ub 512 --trace p8.npz     # record (any device)
    python bench/replay_streams.py p8.npz [--slots-per-layer 37,74] [--policy cycle] [--belady] [--quantized]
    python bench/replay_streams.py p8.npz --slots-per-layer 74 --set hot_set.FREQ_DECAY=0.95 --set prompt.TAIL=32

The trace holds a warm-up batch and then the timed one (bench --parallel's order); the counts are the timed
batch's decode steps: the replay of the whole trace less the replay up to its first step. (The hot set's single
decaying sum, MOESTREAM_HOT_SET=sum, was compared here until stop 47: bench/RESULTS.md, stop 28.) `--belady`: the
fewest misses any pool of that size could have had on those steps, knowing the future, starting empty, a miss
landing for free (bench/RESULTS.md, stop 28). `--set MODULE.NAME=VALUE` changes a constant of moestream.experts
(hot_set, read_through, prompt, zero_copy) for the replay: how stop 29 swept the hot set's.
"""
import argparse
import importlib
import sys

import numpy as np

from moestream.experts import trace as T

ap = argparse.ArgumentParser()
ap.add_argument("trace")
ap.add_argument("--slots-per-layer", default="37,74", help="comma list (74: 16000 MiB of the BF16 reference)")
ap.add_argument("--policy", default="cycle")
ap.add_argument("--belady", action="store_true")
ap.add_argument("--quantized", action="store_true",
                help="replay as a quantized file's pool: staged host reads (a float trace's routing)")
ap.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                help="a constant of moestream.experts.MODULE for the replay (repeatable), e.g. hot_set.FREQ_DECAY=0.95")
ns = ap.parse_args()
for item in ns.set:
    name, _, value = item.partition("=")
    mod_name, _, const = name.partition(".")
    try:
        mod = importlib.import_module(f"moestream.experts.{mod_name}")
        old = getattr(mod, const)
        if isinstance(old, bool):            # (bool("False") is True; the switches have their own flags)
            raise ValueError(f"{name} is a switch, not a number")
        setattr(mod, const, type(old)(value))
    except (ImportError, AttributeError, ValueError) as e:
        sys.exit(f"error: --set {item}: want MODULE.NAME=VALUE, a constant of moestream.experts.MODULE ({e})")
tr = T.load_trace(ns.trace)
tr.quantized = tr.quantized or ns.quantized
ub = tr.ubatches
decode = np.flatnonzero(ub[:, 2] == 0)
gaps = np.flatnonzero(np.diff(decode) > 1)
first = int(decode[gaps[-1] + 1] if len(gaps) else decode[0])         # the timed batch's first step
cut = int(np.flatnonzero(tr.ubatch_of == first)[0])
head = T.Trace(tr.layers[:cut], tr.ids[:cut], tr.n_layers, tr.n_experts, tr.expert_bytes, tr.ubatch_of[:cut], ub,
               tr.guesses[:cut] if tr.guesses else None, tr.quantized, tr.step_seqs, tr.begun)
steps, L = len(ub) - first, tr.n_layers
KEYS = ("hits", "misses", "host_reads", "copies")


def link(slots: int) -> tuple[float, float, float]:
    """(hit rate, host reads, uploads) a layer a step of the timed batch's decode."""
    run = lambda t: T.replay(t, slots * L, ns.policy, zero_copy=True, read_through=True, staged=tr.quantized)["total"]
    a, b = run(head), run(tr)
    d = {k: (b.get(k) or 0) - (a.get(k) or 0) for k in KEYS}
    return d["hits"] / max(d["hits"] + d["misses"], 1), d["host_reads"] / steps / L, d["copies"] / steps / L


def belady(slots: int) -> float:
    """Misses a layer a step with the farthest-next-use victims, each step's distinct experts, a miss landing (a
    step may route more than the slots: it reads them all, and keeps the `slots` used soonest)."""
    by_layer = {l: [] for l in range(L)}
    for ids, l, u in zip(tr.ids, tr.layers.tolist(), tr.ubatch_of.tolist()):
        if u >= first:
            by_layer[l].append(set(np.unique(ids).tolist()))
    misses = 0
    for seq in by_layer.values():
        held: set = set()
        for i, want in enumerate(seq):
            misses += len(want - held)
            held |= want
            if len(held) > slots:
                def next_use(e):
                    return next((j for j in range(i + 1, len(seq)) if e in seq[j]), 1 << 30)
                for e in sorted(held, key=next_use, reverse=True)[:len(held) - slots]:
                    held.discard(e)
    return misses / steps / L


print(f"{ns.trace}: {L} layers x {tr.n_experts} experts; the timed batch: {steps} steps of "
      f"{int(ub[first, 1])} tokens; per layer and step{' (' + ', '.join(ns.set) + ')' if ns.set else ''}:")
bound = (" Belady |", " ---: |") if ns.belady else ("", "")
print("| slots a layer | hit rate | host reads | uploads | over the link |" + bound[0])
print("| ---: | ---: | ---: | ---: | ---: |" + bound[1])
for slots in (int(s) for s in ns.slots_per_layer.split(",")):
    h, r, u = link(slots)
    extra = f" {belady(slots):.2f} |" if ns.belady else ""
    print(f"| {slots} | {h:.3f} | {r:.2f} | {u:.2f} | {r + u:.2f} |{extra}")
