"""Routing statistics per server slot: expert counts (layers x experts) of each slot's current request and of its
previous one, to seed the prefetch of the slot's next prompt (a slot is a context, as DESIGN.md says).

    routing = SlotRouting(engine, n_slots=4)           # observes the engine's routing (engine.observe)
    logits = routing.counted(2, engine.prefill, 2, tokens, start)      # a prompt ubatch: every row is slot 2's
    logits = routing.counted([0, 2], engine.decode, steps)             # a batched decode: row i is slot [0, 2][i]'s
    routing.begin(2)                                    # slot 2 takes a new request: current -> previous, zeroed
    current, previous = routing.current(2), routing.previous[2]        # (n_layers, n_experts) int64 numpy arrays

Counts stay on the device and are added with one index_add_ per engine call, so that counting never synchronizes
and costs a few kernel launches per forward, not per layer. Call everything on the thread that owns the engine.
"""
from __future__ import annotations

import numpy as np
import torch

from ..experts.routing import RouteObserver


class SlotRouting(RouteObserver):
    def __init__(self, engine, n_slots: int):
        cfg = engine.cfg
        self.layers = cfg.moe_layers
        # (n_layers, n_slots, n_experts): a layer's block is contiguous; rows of dense layers stay zero.
        self.counts = torch.zeros((cfg.n_layers, n_slots, cfg.n_experts), dtype=torch.int64, device=engine.device.torch)
        self.previous = [np.zeros((cfg.n_layers, cfg.n_experts), dtype=np.int64) for _ in range(n_slots)]
        self._owner = None                    # int, (B,) tensor, or None while no counted call runs
        self._owners: dict[tuple[int, ...], torch.Tensor] = {}    # device tensors, made once per key
        self._bases: dict[tuple[int, ...], torch.Tensor] = {}
        self._routed: list[tuple[int, torch.Tensor]] = []       # (layer, ids (T, k)) of the running call
        engine.observe(self)

    def counted(self, owner: int | list[int] | None, fn, *args):
        """fn(*args), one engine call, with its routing added to the owner's counts (None: not counted)."""
        if isinstance(owner, list):
            key = tuple(owner)
            if key not in self._owners:
                self._owners[key] = torch.tensor(key, dtype=torch.int64, device=self.counts.device)
            owner = self._owners[key]
        self._owner, self._routed = owner, []
        try:
            out = fn(*args)
        finally:
            self._owner = None
        if owner is not None and self._routed:
            _, S, E = self.counts.shape
            by_layer: dict[int, list[torch.Tensor]] = {}
            for layer, ids in self._routed:   # a call of several ubatches sees a layer several times
                by_layer.setdefault(layer, []).append(ids)
            layers = tuple(sorted(by_layer))
            ids = torch.stack([torch.cat(by_layer[l]) for l in layers])                    # (nL, T, k)
            if layers not in self._bases:    # made once: a copy from pageable memory may synchronize the stream
                first = torch.tensor(layers, dtype=torch.int64, device=ids.device) * (S * E)     # (nL,)
                self._bases[layers] = first[:, None, None]
            base = self._bases[layers]                                                     # (nL, 1, 1)
            rows = owner * E if isinstance(owner, int) else (owner * E)[None, :, None]      # each row's slot
            idx = (base + rows + ids).reshape(-1)                                          # into counts.view(-1)
            self.counts.view(-1).index_add_(0, idx, torch.ones_like(idx))
        self._routed = []
        return out

    def on_route(self, layer: int, ids: torch.Tensor, guess: torch.Tensor | None = None) -> None:
        if self._owner is not None:          # (host decode graphs report host tensors)
            self._routed.append((layer, ids.to(self.counts.device, non_blocking=True)))

    def begin(self, slot: int) -> None:
        """A new request in `slot`: its counts so far become the previous request's; the current ones restart."""
        self.previous[slot] = self.current(slot)
        self.counts[:, slot].zero_()

    def current(self, slot: int) -> np.ndarray:
        return self.counts[:, slot].to("cpu", copy=True).numpy()                            # (L, E)

    def summary(self, top: int = 4) -> list[dict]:
        """Per slot: the top experts of each MoE layer, current and previous, and the routed (token, expert) count."""
        counts = self.counts.cpu().numpy()                                                  # (L, S, E)
        return [{"current": self._top(counts[:, s], top), "previous": self._top(self.previous[s], top),
                 "routed": int(counts[:, s].sum())} for s in range(counts.shape[1])]

    def _top(self, counts: np.ndarray, k: int) -> dict:
        """{layer: [[expert, count], ...]}: the k most routed experts of each MoE layer (ties to the lower id)."""
        out = {}
        for l in self.layers:
            row = counts[l]
            order = np.argsort(-row, kind="stable")[:k]
            out[str(l)] = [[int(e), int(row[e])] for e in order if row[e] > 0]
        return out
