"""Expert providers: what the MoE block asks for the weights of a ubatch's routed experts.

    w = provider.fetch(layer, ids)      # ids (T, k) routed expert ids on the compute device
    y = kernel(x, w.slots, w.w13, w.w2)

`fetch` returns stacked weights and, per routed choice, the slot that holds it. The model never knows whether
the weights were on the GPU all along or were just uploaded: the cache slots in here without touching it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .stats import CacheStats
from .store import ExpertStore, expert_views


@dataclass
class ExpertWeights:
    w13: torch.Tensor          # (S, 2I, H)
    w2: torch.Tensor           # (S, H, I)
    slots: torch.Tensor        # (T, k) int64: the slot of each routed choice


class ResidentExperts:
    """Every expert of some layers on the compute device: slot = expert id, nothing moves."""

    def __init__(self, rows: dict[int, torch.Tensor], inter: int, hidden: int):
        self.rows = rows                       # layer -> (E, numel) on the device
        self.views = {l: expert_views(r, inter, hidden) for l, r in rows.items()}

    def fetch(self, layer: int, ids: torch.Tensor, lookahead=None) -> ExpertWeights:
        w13, w2 = self.views[layer]
        return ExpertWeights(w13, w2, ids)


class UploadPerUbatch:
    """Host-resident layers without a cache: each ubatch uploads its routed experts, each once, synchronously.

    The staging buffer has one slot per expert id, so an expert lands in the slot of its own id and the kernel
    launch is the same as for a GPU-resident layer (hence bit-identical results). One buffer serves every layer:
    the copies and the compute that reads them are ordered on the compute stream, so layer L+1's uploads
    cannot overwrite what layer L's queued compute still reads.
    """

    def __init__(self, store: ExpertStore, n_experts: int, device: torch.device):
        any_rows = next(iter(store.rows.values()))
        self.store = store
        self.buf = torch.empty(n_experts, any_rows.shape[1], dtype=any_rows.dtype, device=device)   # (E, numel)
        self.w13, self.w2 = expert_views(self.buf, store.inter, store.hidden)
        self.stats = CacheStats()

    def fetch(self, layer: int, ids: torch.Tensor, lookahead=None) -> ExpertWeights:
        src = self.store.rows[layer]
        wanted = torch.unique(ids).tolist()    # host sync: the copies are chosen on the host
        for e in wanted:
            self.buf[e].copy_(src[e], non_blocking=True)
        nb = len(wanted) * self.store.expert_bytes
        self.stats.record(layer, misses=len(wanted), uploaded_bytes=nb, copies=len(wanted))
        return ExpertWeights(self.w13, self.w2, ids)


class LayerRouter:
    """Sends each layer to the provider that owns it."""

    def __init__(self, by_layer: dict[int, object]):
        self.by_layer = by_layer

    def fetch(self, layer: int, ids: torch.Tensor, lookahead=None) -> ExpertWeights:
        return self.by_layer[layer].fetch(layer, ids, lookahead)

    def wants_lookahead(self, layer: int, n_tokens: int) -> bool:
        p = self.by_layer[layer]
        return hasattr(p, "wants_lookahead") and p.wants_lookahead(layer, n_tokens)

    def experts_launched(self, layer: int) -> None:
        p = self.by_layer[layer]
        if hasattr(p, "experts_launched"):
            p.experts_launched(layer)
