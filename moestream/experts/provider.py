"""Expert providers: what the MoE block asks for the weights of a ubatch's routed experts.

    w = provider.fetch(layer, ids)      # ids (T, k) routed expert ids on the compute device
    y = kernel(x, w.slots, w.w13, w.w2)

`fetch` returns stacked weights and, per routed choice, the slot that holds it. The model never knows whether
the weights were on the GPU all along or were just uploaded: the cache slots in here without touching it.

Zero-copy decode asks instead where each routed expert's row lies (device or pinned host memory), and the decode
kernel reads it there (kernels/decode.py):

    addrs = provider.addresses(layer, ids)     # (T, k) int64 addresses, without touching the host
    table, routed = provider.address_table(layer)  # what `addresses` reads and writes (a fused router's launch)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..quant.layout import ExpertLayout
from .routing import report_route
from .stats import CacheStats
from .store import ExpertStore


@dataclass
class ExpertWeights:
    """A layer's experts as the kernel reads them: stacked float weights indexed by slot, or (a quantized layout)
    the raw rows, which `run` dequantizes (only the slots the ubatch reads) before the same kernel."""
    w13: torch.Tensor | None   # (S, 2I, H), None for quantized rows
    w2: torch.Tensor | None    # (S, H, I)
    slots: torch.Tensor        # (T, k) int64: the slot of each routed choice
    rows: torch.Tensor | None = None            # (S, >= nbytes) uint8: a quantized layout's rows
    layout: ExpertLayout | None = None

    @staticmethod
    def over(rows: torch.Tensor, layout: ExpertLayout, slots: torch.Tensor) -> "ExpertWeights":
        """The weights of rows (S, row) laid out as `layout`, each routed choice at its slot."""
        if layout.quantized:
            return ExpertWeights(None, None, slots, rows, layout)
        return ExpertWeights(*layout.views(rows), slots)

    def run(self, kernel, x: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """kernel(x, slots, w13, w2) -> (T, k, H). Quantized rows: the slots read are dequantized into a scratch
        stack, in slot order, and the kernel reads it by compact index; each expert's rows meet the same values in
        the same order as from float weights, so its result does not depend on its slot."""
        slots = self.slots if slots is None else slots
        if self.layout is None:
            return kernel(x, slots, self.w13, self.w2)
        from ..kernels.dequant import dequantize_rows     # Triton on CUDA, plain torch elsewhere: the same values
        used, compact = torch.unique(slots, sorted=True, return_inverse=True)
        w13, w2 = dequantize_rows(self.rows, used, self.layout, x.dtype)
        return kernel(x, compact, w13, w2)


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

    def address_table(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A zero-copy decode step's view of the layer: (E,) int64 device addresses of each expert's row (where
        the step reads it), and a flat int64 device row the step writes its (T, k) ids into for the host (None:
        the provider keeps none). Device tensors the provider rewrites in place, so a captured step reads them."""
        raise NotImplementedError

    def addresses(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """ids (T, k) -> (T, k) int64 addresses of each routed expert's row, for a zero-copy decode step; the ids
        kept where address_table says (a fused step does both in its router's launch: kernels/gemv.py)."""
        table, routed = self.address_table(layer)
        if routed is not None:
            routed[:ids.numel()].copy_(ids.reshape(-1))
        return table[ids]

    def layout(self, layer: int) -> ExpertLayout:
        """How the layer's expert rows read (quant/layout.py): what a by-address kernel needs to read one."""
        raise NotImplementedError

    def landing(self, layer: int, ids: torch.Tensor):
        """Read-through and staging: the layer's kernels.stage.Landing for the decode kernel, or None."""
        return None

    def device_rows(self) -> list[torch.Tensor]:
        """The device tensors of rows a decode kernel may read by address (slots, staging rows)."""
        return []

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

    def __init__(self, rows: dict[int, torch.Tensor], layouts: dict[int, ExpertLayout]):
        super().__init__()
        self.rows, self.layouts = rows, layouts          # layer -> (E, row) on the device, and its layout
        self.addr = {l: row_addresses(r, r.device) for l, r in rows.items()}

    def address_table(self, layer: int):
        return self.addr[layer], None

    def layout(self, layer: int) -> ExpertLayout:
        return self.layouts[layer]

    def fetch(self, layer: int, ids: torch.Tensor, lookahead=None) -> ExpertWeights:
        return ExpertWeights.over(self.rows[layer], self.layouts[layer], ids)


class UploadPerUbatch(ExpertProvider):
    """Host-resident layers without a cache: each ubatch uploads its routed experts, each once, synchronously.

    The staging buffer has one slot per expert id, so an expert lands in the slot of its own id and the kernel
    launch is the same as for a GPU-resident layer (hence bit-identical results). One buffer serves every layer:
    the copies and the compute that reads them are ordered on the compute stream, so layer L+1's uploads
    cannot overwrite what layer L's queued compute still reads.
    """

    def __init__(self, store: ExpertStore, n_experts: int, device: torch.device, top_k: int = 8,
                 staged: bool = False, buf: torch.Tensor | None = None):
        super().__init__()
        any_rows = next(iter(store.rows.values()))
        self.store, self.top_k = store, top_k
        width = max(r.shape[1] for r in store.rows.values())                       # the widest layer's row
        if buf is None:                          # (or rows it shares: the smallest cache's pool, buffered.py)
            buf = torch.empty(n_experts, width, dtype=any_rows.dtype, device=device)
        self.buf = buf                                                             # (E, row)
        self.addr = {l: row_addresses(r, device) for l, r in store.rows.items()}
        # Staged (kernels/stage.py): a zero-copy step copies its host reads into buf first, each distinct expert
        # once, and reads them there; else the kernel reads in place (the grouped bf16 kernel each expert once).
        self.staged = staged
        self.reads_once = staged or not any(lay.quantized for lay in store.layouts.values())
        self.no_slots = torch.zeros(0, dtype=torch.int64, device=device)
        self.aligned = store.aligned16(self.buf)
        self.rows_of = {l: i for i, l in enumerate(sorted(store.rows))}
        self.routed = None                           # (host layers, MAX_TOKENS k): a zero-copy step's ids, on device

    def address_table(self, layer: int):
        """Zero-copy decode with no cache: every routed expert is read from host memory, in place. The ids are
        kept for end_decode_step (in a fixed buffer: a captured step rewrites it each replay)."""
        if self.routed is None:
            from ..kernels.decode import MAX_TOKENS
            self.routed = torch.zeros(len(self.rows_of), MAX_TOKENS * self.top_k, dtype=torch.int64,
                                      device=self.buf.device)
        return self.addr[layer], self.routed[self.rows_of[layer]]

    def layout(self, layer: int) -> ExpertLayout:
        return self.store.layouts[layer]

    def device_rows(self) -> list[torch.Tensor]:
        return [self.buf]

    def landing(self, layer: int, ids: torch.Tensor):
        """Staged: every routed expert is a host read, copied into the upload buffer's rows (no slot to land in)."""
        if not self.staged:
            return None
        from ..kernels.stage import Landing
        return Landing(ids, self.addr[layer], self.no_slots, self.buf, self.aligned)

    def end_decode_step(self, n_tokens: int, observer=None) -> None:
        """The step is queued: its routing to `observer`, then what crossed the link per host layer: each distinct
        expert once (a step of several tokens reads an expert once for all of them, kernels/decode_grouped.py;
        the quantized kernel reads once per choice). Counting reads the routing back, after the step."""
        if self.routed is None:
            return
        n = n_tokens * self.top_k
        for l, i in self.rows_of.items():
            report_route(observer, l, self.routed[i, :n].view(n_tokens, self.top_k))
        host = self.routed[:, :n].cpu()                      # waits for the step (its logits are read next anyway)
        for l, i in self.rows_of.items():
            reads = int(host[i].unique().numel()) if self.reads_once and n_tokens > 1 else n
            self.stats.record(l, host_reads=reads, host_read_bytes=reads * self.store.layer_bytes(l))

    def fetch(self, layer: int, ids: torch.Tensor, lookahead=None) -> ExpertWeights:
        src = self.store.rows[layer]
        width = src.shape[1]
        wanted = torch.unique(ids).tolist()    # host sync: the copies are chosen on the host
        for e in wanted:
            self.buf[e, :width].copy_(src[e], non_blocking=True)
        nb = len(wanted) * self.store.layer_bytes(layer)
        self.stats.record(layer, misses=len(wanted), uploaded_bytes=nb, copies=len(wanted))
        return ExpertWeights.over(self.buf[:, :width], self.store.layouts[layer], ids)


class LayerRouter(ExpertProvider):
    """Sends each layer to the provider that owns it."""

    def __init__(self, by_layer: dict[int, ExpertProvider]):
        super().__init__()
        self.by_layer = by_layer

    def fetch(self, layer: int, ids: torch.Tensor, lookahead=None) -> ExpertWeights:
        return self.by_layer[layer].fetch(layer, ids, lookahead)

    def lookahead_layers(self, layer: int, n_tokens: int) -> int:
        return self.by_layer[layer].lookahead_layers(layer, n_tokens)

    def address_table(self, layer: int):
        return self.by_layer[layer].address_table(layer)

    def landing(self, layer: int, ids: torch.Tensor):
        return self.by_layer[layer].landing(layer, ids)

    def layout(self, layer: int) -> ExpertLayout:
        return self.by_layer[layer].layout(layer)

    def experts_launched(self, layer: int) -> None:
        self.by_layer[layer].experts_launched(layer)


def row_addresses(rows: torch.Tensor, device) -> torch.Tensor:
    """(E,) int64 on `device`: the address of each expert's row of rows (E, numel), device or pinned host memory."""
    step = rows.stride(0) * rows.element_size()
    return torch.from_numpy(rows.data_ptr() + np.arange(rows.shape[0], dtype=np.int64) * step).to(device)
