"""Eviction policies: which resident expert makes room for a miss. Plain numpy over slots, no device.

    p = make_policy("lfru", n_slots=1700)
    p.tick()                      # a new ubatch began
    p.touch(slots)                # these slots were used (hits and fresh inserts)
    victims = p.order(candidates) # candidates sorted best victim first

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

    def touch(self, slots: np.ndarray) -> None:
        self.last[slots] = self.clock

    def forget(self, slots: np.ndarray) -> None:
        self.last[slots] = -1

    def score(self, slots: np.ndarray) -> np.ndarray:
        return self.last[slots].astype(np.float64)

    def order(self, candidates: np.ndarray) -> np.ndarray:
        """candidates (ascending slots) sorted by eviction preference (lowest score first; ties by slot index)."""
        return candidates[np.argsort(self.score(candidates), kind="stable")]

    def lowest(self, candidates: np.ndarray, n: int) -> np.ndarray:
        """order(candidates)[:n] without sorting them all (a miss picks a few victims among ~all slots)."""
        if n >= len(candidates):
            return self.order(candidates)
        s = self.score(candidates)
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


POLICIES = {"lru": LRU, "lfru": LFRU}


def make_policy(name: str, n_slots: int):
    if name not in POLICIES:
        raise UserError(f"unknown cache policy {name!r}; choose one of: {', '.join(POLICIES)}")
    return POLICIES[name](n_slots)
