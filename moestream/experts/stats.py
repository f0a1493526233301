"""Cache counters: hits, misses, evictions, bytes uploaded and copies, per layer, cumulative and per prompt."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

KEYS = ("hits", "misses", "evictions", "uploaded_bytes", "copies", "prefetched", "prefetched_bytes",
        "prefetch_used", "prefetch_wasted", "waits", "wait_s", "lookahead_tp", "lookahead_fp", "lookahead_fn",
        "sync_s", "host_s", "host_reads", "host_read_bytes", "landed", "filled", "host_computed")


@dataclass
class Counts:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    uploaded_bytes: int = 0         # demand and speculative
    copies: int = 0
    prefetched: int = 0             # experts copied ahead of their layer (speculative)
    prefetched_bytes: int = 0
    prefetch_used: int = 0          # ... and then used by their layer
    prefetch_wasted: int = 0        # ... and evicted unused
    waits: int = 0                  # times the compute stream waited for a copy
    wait_s: float = 0.0             # total time it waited (CUDA events)
    lookahead_tp: int = 0           # decode lookahead: predicted and routed
    lookahead_fp: int = 0           # predicted, not routed
    lookahead_fn: int = 0           # routed, not predicted
    sync_s: float = 0.0             # host time blocked reading a layer's routing back from the device
    host_s: float = 0.0             # host time deciding (residency, copies, prefetch) once the routing is read
    host_reads: int = 0             # zero-copy decode: experts the kernel read from host memory (a several-token
                                    # step's grouped kernel reads each once; the quantized kernel once per choice)
    host_read_bytes: int = 0        # ... and their bytes over the link
    landed: int = 0                 # read-through: experts a decode kernel wrote into a free slot as it read them
    filled: int = 0                 # prefetched from guesses beyond the next layer, the copy stream short of work
    host_computed: int = 0          # --host-compute: experts a decode step computed on the host's cores instead

    def add(self, other: "Counts") -> None:
        for k in KEYS:
            setattr(self, k, getattr(self, k) + getattr(other, k))

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in KEYS}
        d["hit_rate"] = self.hits / (self.hits + self.misses) if self.hits + self.misses else 0.0
        tp, fp, fn = self.lookahead_tp, self.lookahead_fp, self.lookahead_fn
        d["lookahead_precision"] = tp / (tp + fp) if tp + fp else 0.0
        d["lookahead_recall"] = tp / (tp + fn) if tp + fn else 0.0
        return d


@dataclass
class CacheStats:
    """Counts per layer since load (cumulative) and since the current prompt began."""
    total: dict[int, Counts] = field(default_factory=dict)
    prompt: dict[int, Counts] = field(default_factory=dict)

    def record(self, layer: int, **counts) -> None:
        """Add counts to a layer's totals, e.g. record(3, hits=5, misses=2): named fields only, no Counts built
        (this runs several times per layer on the decode path)."""
        for d in (self.total, self.prompt):
            c = d.get(layer)
            if c is None:
                c = d[layer] = Counts()
            for k, v in counts.items():
                setattr(c, k, getattr(c, k) + v)

    def count(self, layers, key: str) -> None:
        """Add one to `key` of each layer in `layers` (an array, a layer as often as it counts)."""
        if len(layers):
            ls, ns = np.unique(layers, return_counts=True)
            for l, n in zip(ls.tolist(), ns.tolist()):
                self.record(l, **{key: n})

    def begin_prompt(self) -> None:
        self.prompt = {}

    @staticmethod
    def summary(per_layer: dict[int, Counts]) -> dict:
        s = Counts()
        for c in per_layer.values():
            s.add(c)
        return s.as_dict()
