"""Eviction policies: which resident expert makes room for a miss. Plain numpy over slots, no device.

    p = make_policy("lfru", n_slots=1700)
    p.tick()                      # a new ubatch began
    p.at_layer(layer, sweeping)   # the ubatch's experts of this layer are planned now (sweeping: nearly all)
    p.touch(slots)                # these slots were used (hits and fresh inserts)
    victims = p.order(candidates) # candidates sorted best victim first
    victims = p.lowest(candidates, n, layers)   # the n best, knowing each candidate's layer (cycle uses it)

A policy only ranks slots: the residency table says which slots are free, pinned or in use.
"""
from __future__ import annotations

import numpy as np

from ..errors import UserError


class LRU:
    """Least recently used: the victim is the slot touched longest ago."""
    name = "lru"

    def __init__(self, n_slots: int):
        self.clock = 0
        self.last = np.full(n_slots, -1, dtype=np.int64)

    def tick(self) -> None:
        self.clock += 1

    def at_layer(self, layer: int, sweeping: bool) -> None:
        """The ubatch's routed experts of `layer` are planned now; `sweeping`: nearly all of the layer's."""

    def touch(self, slots: np.ndarray) -> None:
        self.last[slots] = self.clock

    def forget(self, slots: np.ndarray) -> None:
        self.last[slots] = -1

    def score(self, slots: np.ndarray) -> np.ndarray:
        return self.last[slots].astype(np.float64)

    def order(self, candidates: np.ndarray, layers: np.ndarray | None = None) -> np.ndarray:
        """candidates (ascending slots) sorted by eviction preference (lowest score first; ties by slot index)."""
        return candidates[np.argsort(self.rank(candidates, layers), kind="stable")]

    def rank(self, candidates: np.ndarray, layers: np.ndarray | None) -> np.ndarray:
        """The candidates' eviction scores (lowest first), given their layers where known."""
        return self.score(candidates)

    def lowest(self, candidates: np.ndarray, n: int, layers: np.ndarray | None = None) -> np.ndarray:
        """order(candidates)[:n] without sorting them all (a miss picks a few victims among ~all slots). layers:
        each candidate's layer, for a policy that ranks by it."""
        if n >= len(candidates):
            return self.order(candidates, layers)
        s = self.rank(candidates, layers)
        cut = np.partition(s, n - 1)[n - 1]
        below = np.flatnonzero(s < cut)
        at = np.flatnonzero(s == cut)[:n - len(below)]          # ties at the cut: lowest slots, as order() has
        return candidates[np.concatenate([below[np.argsort(s[below], kind="stable")], at])]


class LFRU(LRU):
    """Decayed frequency: each use adds 1, and the sum halves every `half_life` ubatches.

    An expert the decode loop uses every token builds up a count of ~half_life/ln 2; a long prompt streamed through
    the cache touches each of its experts once per ubatch, so its experts start at 1 and go first. That is the
    scan resistance plain LRU lacks (a scan is the most recent thing LRU has seen). Ties go to the older slot.

    Half-life 16: on the reference model's recorded routing (prompts, then a decode) the prompts hit alike at any
    half-life from 8 to 64, and the decode that follows hits 0.975 at 16 against 0.922 at 64 (its new experts
    must outgrow the prompts' counts); the scan test (tests/test_cache.py) still keeps the whole decode set.
    """
    name = "lfru"

    def __init__(self, n_slots: int, half_life: float = 16.0):
        super().__init__(n_slots)
        self.freq = np.zeros(n_slots, dtype=np.float64)
        self.decay = np.log(2.0) / half_life

    def _now(self, slots: np.ndarray) -> np.ndarray:
        return self.freq[slots] * np.exp(-self.decay * (self.clock - self.last[slots]))

    def touch(self, slots: np.ndarray) -> None:
        self.freq[slots] = self._now(slots) + 1.0
        self.last[slots] = self.clock

    def forget(self, slots: np.ndarray) -> None:
        self.freq[slots] = 0.0
        self.last[slots] = -1

    def score(self, slots: np.ndarray) -> np.ndarray:
        # Frequency first; recency breaks ties (a tiny term, smaller than any frequency step).
        return self._now(slots) + 1e-9 * self.last[slots]


class Cycle(LFRU):
    """lfru, but while a prompt ubatch sweeps (routes nearly every expert of each layer, as Qwen3-Next's 2048-token
    ubatches do), the victims are the experts of the layers it has just passed, the latest first: the ones whose
    next use is farthest, the next sweep's pass over the layers (Belady's order for this cycle). lfru ranks a sweep's
    experts alike and evicts the oldest, which are the next layers' kept experts: at 4000 MiB a Qwen3-Next prompt
    moved 92-100% of its experts. `bench/sweep_residency.py` simulates 85.5% with this order (two layers copied
    ahead), and 75.6% for BF16 at 16000 MiB against 87-88% live (bench/RESULTS.md, stop 26). Decode and prompts
    that route part of a layer keep lfru's order, scan resistance included. The default: on the GPU (RESULTS.md,
    stop 27) it took Qwen3-Next's Q4_K_M prompts at 4000 MiB from 14.5-15.9k to 19.4-20.0k tok/s (12.2 -> 8.3 GB a
    prompt) and its BF16 ones at 16000 MiB from 6.1k to 7.1-7.3k (33.9 -> 29.2 GB), and left the 30B's alike."""
    name = "cycle"
    WEIGHT = 1e6                    # a layer step outweighs any decayed frequency

    def __init__(self, n_slots: int, layers: list[int] | None = None):
        super().__init__(n_slots)
        order = sorted(layers) if layers else [0]
        self.pos = np.zeros(max(order) + 1, dtype=np.int64)        # layer id -> its place in a pass
        self.pos[order] = np.arange(len(order))
        self.n_layers = len(order)
        self.cursor: int | None = None                              # the sweeping layer's place, else None

    def at_layer(self, layer: int, sweeping: bool) -> None:
        self.cursor = int(self.pos[layer]) if sweeping and layer < len(self.pos) else None

    def rank(self, candidates: np.ndarray, layers: np.ndarray | None) -> np.ndarray:
        s = self.score(candidates)
        if self.cursor is None or layers is None:
            return s
        ahead = (self.pos[layers] - self.cursor) % self.n_layers    # layers until their next use: the largest go
        return s - self.WEIGHT * ahead


POLICIES = {"lfru": LFRU, "lru": LRU, "cycle": Cycle}


def make_policy(name: str, n_slots: int, layers: list[int] | None = None):
    """layers: the cache's host layers, in the order a forward passes them (cycle ranks by it)."""
    if name not in POLICIES:
        raise UserError(f"unknown cache policy {name!r}; choose one of: {', '.join(POLICIES)}")
    return Cycle(n_slots, layers) if name == "cycle" else POLICIES[name](n_slots)
