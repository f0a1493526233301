"""Routing traces: record which experts every ubatch routed, and replay them against a cache offline.

    rec = TraceRecorder(cfg, expert_bytes)
    llm.engine.model.on_route = rec          # called with (layer, ids (T, k)) for every MoE layer of every forward
    ...; rec.save("run.trace.npz")
    replay(load_trace("run.trace.npz"), n_slots=1700, policy="lfru")   # {"total": {...}, "per_layer": {...}}

So policies and cache sizes are compared on real routing without a GPU. The replay runs the live cache's own
planner (clock, residency, waves, counters), so it predicts the live counts exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import UserError
from .cache import CachePlanner


@dataclass
class Trace:
    layers: np.ndarray          # (R,) layer of each record, in forward order
    ids: list[np.ndarray]       # R arrays (T, k) of expert ids
    n_layers: int
    n_experts: int
    expert_bytes: int


class TraceRecorder:
    def __init__(self, n_layers: int, n_experts: int, expert_bytes: int):
        self.n_layers, self.n_experts, self.expert_bytes = n_layers, n_experts, expert_bytes
        self.layers: list[int] = []
        self.ids: list[np.ndarray] = []

    def __call__(self, layer: int, ids) -> None:
        self.layers.append(layer)
        self.ids.append(ids.detach().cpu().numpy().astype(np.int16))

    def trace(self) -> Trace:
        return Trace(np.array(self.layers, dtype=np.int32), self.ids, self.n_layers, self.n_experts,
                     self.expert_bytes)

    def save(self, path: str) -> None:
        rows = np.array([len(a) for a in self.ids], dtype=np.int64)
        k = self.ids[0].shape[1] if self.ids else 0
        flat = np.concatenate(self.ids) if self.ids else np.zeros((0, k), dtype=np.int16)
        np.savez_compressed(path, layers=np.array(self.layers, dtype=np.int32), rows=rows, ids=flat,
                            meta=np.array([self.n_layers, self.n_experts, self.expert_bytes], dtype=np.int64))


def load_trace(path: str) -> Trace:
    try:
        z = np.load(path)
        layers, rows, flat, meta = z["layers"], z["rows"], z["ids"], z["meta"]
    except (OSError, KeyError, ValueError) as e:
        raise UserError(f"cannot read routing trace {path!r} ({e}); record one with generate --trace FILE") from None
    ids = np.split(flat, np.cumsum(rows)[:-1]) if len(rows) else []
    return Trace(layers, ids, int(meta[0]), int(meta[1]), int(meta[2]))


def replay(trace: Trace, n_slots: int, policy: str = "lfru") -> dict:
    """Counts the live cache would have had on this routing: totals and per layer."""
    planner = CachePlanner(n_slots, trace.n_layers, trace.n_experts, policy, trace.expert_bytes)
    for layer, ids in zip(trace.layers.tolist(), trace.ids):
        for group in planner.groups(layer, np.unique(ids).astype(np.int64)):
            planner.plan(layer, group)
    return {"total": planner.stats.summary(planner.stats.total),
            "per_layer": {l: c.as_dict() for l, c in sorted(planner.stats.total.items())}}
