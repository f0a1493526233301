"""Cache counters: hits, misses, evictions, bytes uploaded and copies, per layer, cumulative and per prompt."""
from __future__ import annotations

from dataclasses import dataclass, field

KEYS = ("hits", "misses", "evictions", "uploaded_bytes", "copies")


@dataclass
class Counts:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    uploaded_bytes: int = 0
    copies: int = 0

    def add(self, other: "Counts") -> None:
        for k in KEYS:
            setattr(self, k, getattr(self, k) + getattr(other, k))

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in KEYS}
        d["hit_rate"] = self.hits / (self.hits + self.misses) if self.hits + self.misses else 0.0
        return d


@dataclass
class CacheStats:
    """Counts per layer since load (cumulative) and since the current prompt began."""
    total: dict[int, Counts] = field(default_factory=dict)
    prompt: dict[int, Counts] = field(default_factory=dict)

    def record(self, layer: int, c: Counts) -> None:
        for d in (self.total, self.prompt):
            d.setdefault(layer, Counts()).add(c)

    def begin_prompt(self) -> None:
        self.prompt = {}

    @staticmethod
    def summary(per_layer: dict[int, Counts]) -> dict:
        s = Counts()
        for c in per_layer.values():
            s.add(c)
        return s.as_dict()
