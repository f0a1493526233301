"""Expert providers: what the MoE block asks for the weights of a ubatch's routed experts.

    w = provider.fetch(layer, ids)      # ids (T, k) routed expert ids on the compute device
    y = kernel(x, w.slots, w.w13, w.w2)

`fetch` returns stacked weights and, per routed choice, the slot that holds it. The model never knows whether
the weights were on the GPU all along or were just uploaded: the cache slots in here without touching it.

Zero-copy decode asks instead where each routed expert's row lies (device or pinned host memory), and the decode
kernel reads it there (kernels/decode.py):

    addrs = provider.addresses(layer, ids)     # (T, k) int64 addresses, without touching the host
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .stats import CacheStats
from .store import ExpertStore, expert_views


@dataclass
class ExpertWeights:
    w13: torch.Tensor          # (S, 2I, H)
    w2: torch.Tensor           # (S, H, I)
    slots: torch.Tensor        # (T, k) int64: the slot of each routed choice


class ExpertProvider:
    """What the MoE block and the engine ask of whoever holds some layers' experts. Every hook but `fetch` and
    `addresses` is a no-op by default, so a provider says only what it does.

    The engine calls begin_prompt / begin_ubatch around forwards and begin_decode_step / end_decode_step around a
    zero-copy decode step; the MoE block calls lookahead_layers, fetch (or addresses and landing in a zero-copy
    step) and experts_launched for each of the provider's layers."""

    def __init__(self):
        self.stats = CacheStats()

    def fetch(self, layer: int, ids: torch.Tensor, lookahead=None) -> "ExpertWeights":
        """ids (T, k) routed expert ids -> the weights and each choice's slot (or the cache's Waves)."""
        raise NotImplementedError

    def addresses(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """ids (T, k) -> (T, k) int64 addresses of each routed expert's row, for a zero-copy decode step."""
        raise NotImplementedError

    def landing(self, layer: int, ids: torch.Tensor):
        """Read-through: (ids, host-row addresses, landing slots' addresses) for the decode kernel, or None."""
        return None

    def lookahead_layers(self, layer: int, n_tokens: int) -> int:
        """How many MoE layers ahead the forward should guess this layer's successors' experts (0: none)."""
        return 0

    def experts_launched(self, layer: int) -> None:
        """The layer's expert kernels are queued (the cache copies ahead from here)."""

    def begin_prompt(self, seq: int) -> None:
        self.stats.begin_prompt()

    def begin_ubatch(self, seq: int, n_tokens: int, is_prompt: bool) -> None:
        pass

    def begin_decode_step(self) -> None:
        pass

    def end_decode_step(self, n_tokens: int, observer=None) -> None:
        pass

    def flush_decode(self) -> None:
        pass


class ResidentExperts(ExpertProvider):
    """Every expert of some layers on the compute device: slot = expert id, nothing moves."""

    def __init__(self, rows: dict[int, torch.Tensor], inter: int, hidden: int):
        super().__init__()
        self.rows = rows                       # layer -> (E, numel) on the device
        self.views = {l: expert_views(r, inter, hidden) for l, r in rows.items()}
        self.addr = {l: row_addresses(r, r.device) for l, r in rows.items()}

    def addresses(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        return self.addr[layer][ids]

    def fetch(self, layer: int, ids: torch.Tensor, lookahead=None) -> ExpertWeights:
        w13, w2 = self.views[layer]
        return ExpertWeights(w13, w2, ids)


class UploadPerUbatch(ExpertProvider):
    """Host-resident layers without a cache: each ubatch uploads its routed experts, each once, synchronously.

    The staging buffer has one slot per expert id, so an expert lands in the slot of its own id and the kernel
    launch is the same as for a GPU-resident layer (hence bit-identical results). One buffer serves every layer:
    the copies and the compute that reads them are ordered on the compute stream, so layer L+1's uploads
    cannot overwrite what layer L's queued compute still reads.
    """

    def __init__(self, store: ExpertStore, n_experts: int, device: torch.device, top_k: int = 8):
        super().__init__()
        any_rows = next(iter(store.rows.values()))
        self.store, self.top_k = store, top_k
        self.buf = torch.empty(n_experts, any_rows.shape[1], dtype=any_rows.dtype, device=device)   # (E, numel)
        self.w13, self.w2 = expert_views(self.buf, store.inter, store.hidden)
        self.addr = {l: row_addresses(r, device) for l, r in store.rows.items()}

    def addresses(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """Zero-copy decode with no cache: every routed expert is read from host memory, in place."""
        return self.addr[layer][ids]

    def end_decode_step(self, n_tokens: int, observer=None) -> None:
        """Every routed choice of every host layer crossed the link (counted without reading the routing back)."""
        reads = n_tokens * self.top_k
        for l in self.store.rows:
            self.stats.record(l, host_reads=reads, host_read_bytes=reads * self.store.expert_bytes)

    def fetch(self, layer: int, ids: torch.Tensor, lookahead=None) -> ExpertWeights:
        src = self.store.rows[layer]
        wanted = torch.unique(ids).tolist()    # host sync: the copies are chosen on the host
        for e in wanted:
            self.buf[e].copy_(src[e], non_blocking=True)
        nb = len(wanted) * self.store.expert_bytes
        self.stats.record(layer, misses=len(wanted), uploaded_bytes=nb, copies=len(wanted))
        return ExpertWeights(self.w13, self.w2, ids)


class LayerRouter(ExpertProvider):
    """Sends each layer to the provider that owns it."""

    def __init__(self, by_layer: dict[int, ExpertProvider]):
        super().__init__()
        self.by_layer = by_layer

    def fetch(self, layer: int, ids: torch.Tensor, lookahead=None) -> ExpertWeights:
        return self.by_layer[layer].fetch(layer, ids, lookahead)

    def lookahead_layers(self, layer: int, n_tokens: int) -> int:
        return self.by_layer[layer].lookahead_layers(layer, n_tokens)

    def addresses(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        return self.by_layer[layer].addresses(layer, ids)

    def landing(self, layer: int, ids: torch.Tensor):
        return self.by_layer[layer].landing(layer, ids)

    def experts_launched(self, layer: int) -> None:
        self.by_layer[layer].experts_launched(layer)


def row_addresses(rows: torch.Tensor, device) -> torch.Tensor:
    """(E,) int64 on `device`: the address of each expert's row of rows (E, numel), device or pinned host memory."""
    step = rows.stride(0) * rows.element_size()
    return torch.from_numpy(rows.data_ptr() + np.arange(rows.shape[0], dtype=np.int64) * step).to(device)
