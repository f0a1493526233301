"""/slots' view of the engine's routing store (experts/routing.py): per server slot (a context), the most routed
experts of each MoE layer in its current and previous request.

    with engine.routing.counting(2):                        # the serving loop names each engine call's rows
        engine.prefill(2, tokens, start)
    slot_routing(engine.routing, cfg.moe_layers, n_slots=4)  # [{"current": {layer: [[expert, count], ...]}, ...}]
"""
from __future__ import annotations

import numpy as np

from ..experts.routing import RoutingStore


def slot_routing(store: RoutingStore, moe_layers: list[int], n_slots: int, top: int = 4) -> list[dict]:
    """Per slot: the top experts of each MoE layer, current and previous, and the routed (token, expert) count."""
    out = []
    for s in range(n_slots):
        current = store.current(s)                                                          # (L, E)
        out.append({"current": _top(current, moe_layers, top), "previous": _top(store.previous[s], moe_layers, top),
                    "routed": int(current.sum())})
    return out


def _top(counts: np.ndarray, moe_layers: list[int], k: int) -> dict:
    """{layer: [[expert, count], ...]}: the k most routed experts of each MoE layer (ties to the lower id)."""
    out = {}
    for l in moe_layers:
        row = counts[l]
        order = np.argsort(-row, kind="stable")[:k]
        out[str(l)] = [[int(e), int(row[e])] for e in order if row[e] > 0]
    return out
