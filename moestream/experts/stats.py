"""Cache counters: hits, misses, evictions, bytes uploaded and copies, per layer, cumulative and per prompt."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KEYS = ("hits", "misses", "evictions", "uploaded_bytes", "copies", "prefetched", "prefetched_bytes",
        "prefetch_used", "prefetch_wasted", "waits", "wait_s", "lookahead_tp", "lookahead_fp", "lookahead_fn",
        "sync_s", "host_s", "host_reads", "host_read_bytes", "landed", "filled")


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


INDEX = {k: i for i, k in enumerate(KEYS)}
SECONDS = {"wait_s", "sync_s", "host_s"}       # the float counters (the others count and stay ints)


class CacheStats:
    """Counts per layer since load (cumulative: `total`) and since the current prompt began (`prompt`), each a dict
    layer -> Counts. A decode step adds its layers' counts as arrays (record_layers, count): they wait in one
    (layers, KEYS) array and join both dicts when either is read, so a step costs a few array ops, not a Python
    loop over its layers."""

    def __init__(self):
        self._total: dict[int, Counts] = {}
        self._prompt: dict[int, Counts] = {}
        self._adds = np.zeros((0, len(KEYS)))          # the adds not yet in both dicts, per layer

    @property
    def total(self) -> dict[int, Counts]:
        self._join()
        return self._total

    @property
    def prompt(self) -> dict[int, Counts]:
        self._join()
        return self._prompt

    def record(self, layer: int, **counts) -> None:
        """Add counts to a layer's totals, e.g. record(3, hits=5, misses=2): named fields only, no Counts built."""
        for d in (self._total, self._prompt):
            c = d.get(layer)
            if c is None:
                c = d[layer] = Counts()
            for k, v in counts.items():
                setattr(c, k, getattr(c, k) + v)

    def record_layers(self, layers: np.ndarray, **counts) -> None:
        """record() for several distinct layers at once: each count an array aligned with `layers` (or a number
        for all of them)."""
        adds = self._rows(layers)
        for k, v in counts.items():
            adds[layers, INDEX[k]] += v

    def count(self, layers, key: str) -> None:
        """Add one to `key` of each layer in `layers` (an array, a layer as often as it counts)."""
        if len(layers):
            layers = np.asarray(layers)
            np.add.at(self._rows(layers)[:, INDEX[key]], layers, 1)

    def _rows(self, layers: np.ndarray) -> np.ndarray:
        n = int(layers.max()) + 1 if len(layers) else 0
        if n > len(self._adds):
            self._adds = np.concatenate([self._adds, np.zeros((n - len(self._adds), len(KEYS)))])
        return self._adds

    def _join(self) -> None:
        for l in np.flatnonzero(self._adds.any(axis=1)).tolist():
            self.record(l, **{k: (float(v) if k in SECONDS else int(round(v)))
                              for k, v in zip(KEYS, self._adds[l].tolist()) if v})
        self._adds[:] = 0

    def begin_prompt(self) -> None:
        self._join()
        self._prompt = {}

    @staticmethod
    def joined(parts: list["CacheStats"]) -> "CacheStats":
        """The counters of several providers of disjoint layers as one (the devices of a split)."""
        out = CacheStats()
        for st in parts:
            out._total.update(st.total)
            out._prompt.update(st.prompt)
        return out

    @staticmethod
    def summary(per_layer: dict[int, Counts]) -> dict:
        s = Counts()
        for c in per_layer.values():
            s.add(c)
        return s.as_dict()
