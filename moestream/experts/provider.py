"""Expert providers: what the MoE block asks for the weights of a ubatch's routed experts.

    w = provider.fetch(layer, ids)      # ids (T, k) routed expert ids on the compute device
    y = kernel(x, w.slots, w.w13, w.w2)

`fetch` returns stacked weights and, per routed choice, the slot that holds it. The model never knows whether
the weights were on the GPU all along or were just uploaded: the cache slots in here without touching it.

Zero-copy decode asks instead where each routed expert's row lies (device or pinned host memory), and the decode
kernel reads it there (kernels/decode.py):

    addrs = provider.addresses(layer, ids)     # (T, k) int64 addresses, without touching the host
    table, routed = provider.address_table(layer)  # what `addresses` reads and writes (a fused router's launch)

The engine asks more of the host layers' provider (HostProvider: prompts, ubatches and decode steps begin and end,
the decode plan, counters); the MoE block asks only ExpertProvider's hooks.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..kernels.host_arrays import upload
from ..quant.layout import ExpertLayout
from .stats import CacheStats


@dataclass
class ExpertWeights:
    """A layer's experts as the kernel reads them: stacked float weights indexed by slot, or (a quantized layout)
    the raw rows, which `run` dequantizes (only the slots the ubatch reads) before the same kernel."""
    w13: torch.Tensor | None   # (S, 2I, H), None for quantized rows
    w2: torch.Tensor | None    # (S, H, I)
    slots: torch.Tensor        # (T, k) int64: the slot of each routed choice
    rows: torch.Tensor | None = None            # (S, >= nbytes) uint8: a quantized layout's rows
    layout: ExpertLayout | None = None
    used: np.ndarray | None = None              # the distinct slots of `slots`, ascending, where the host knows them

    @staticmethod
    def over(rows: torch.Tensor, layout: ExpertLayout, slots: torch.Tensor,
             used: np.ndarray | None = None) -> "ExpertWeights":
        """The weights of rows (S, row) laid out as `layout`, each routed choice at its slot. `used`: the distinct
        slots, ascending, if the provider has them on the host already (a quantized run then needs no host sync)."""
        if layout.quantized:
            return ExpertWeights(None, None, slots, rows, layout, used)
        return ExpertWeights(*layout.views(rows), slots, used=used)

    def run(self, kernel, x: torch.Tensor, slots: torch.Tensor | None = None, act=None) -> torch.Tensor:
        """kernel(x, slots, w13, w2) -> (T, k, H), over the weights `dense` gives for `slots` (default: self's);
        act: gpt-oss's activation and biases for these choices (kernels/reference.py's OaiSwiglu), or None."""
        d = self.dense(x.dtype, slots)
        return kernel(x, d.slots, d.w13, d.w2) if act is None else kernel(x, d.slots, d.w13, d.w2, act)

    def dense(self, dtype: torch.dtype, slots: torch.Tensor | None = None) -> "ExpertWeights":
        """The float weights a kernel reads for `slots` (default: self's), and each choice's index into them: self
        for float rows. Quantized rows: the slots read are dequantized into a scratch stack, in slot order, and
        each choice indexes it compactly; each expert's rows meet the same values in the same order as from float
        weights, so its result does not depend on its slot. The slots read come from `used` where the provider
        knew them (the same index as torch.unique's, without its wait for the device: the host queues the layer's
        kernels while its uploads cross the link)."""
        slots = self.slots if slots is None else slots
        if self.layout is None:
            return self._float(slots)
        from ..kernels.dequant import dequantize_rows     # Triton on CUDA, plain torch elsewhere: the same values
        used, compact = self._compact(slots)
        w13, w2 = dequantize_rows(self.rows, used, self.layout, dtype)
        return ExpertWeights(w13, w2, compact)

    def _float(self, slots: torch.Tensor) -> "ExpertWeights":
        """Float rows: the stacks themselves where one grouped GEMM launch takes them (at most MAX_GROUPS slots);
        in a larger pool (one region of float slots) the window of MAX_GROUPS slots that holds every slot read, or
        else those slots gathered into a compact stack in slot order. Each expert meets the same weights in the
        same order wherever they lie: the same bits."""
        from ..kernels.grouped import MAX_GROUPS
        S = self.w13.shape[0]
        if S <= MAX_GROUPS:
            return ExpertWeights(self.w13, self.w2, slots)
        if slots is self.slots and self.used is not None and len(self.used):
            lo = min(int(self.used[0]), S - MAX_GROUPS)
            if int(self.used[-1]) < lo + MAX_GROUPS:                 # one window: views, no copy
                return ExpertWeights(self.w13[lo:lo + MAX_GROUPS], self.w2[lo:lo + MAX_GROUPS], slots - lo)
        used, compact = self._compact(slots)
        return ExpertWeights(self.w13[used], self.w2[used], compact)

    def _compact(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The distinct slots read (ascending, on the device) and each choice's index among them: from `used` where
        the provider knew them on the host, else torch.unique (which waits for the device)."""
        if slots is self.slots and self.used is not None:
            used = upload(self.used, slots.device)      # (by kernel on CUDA: kernels/host_arrays.py)
            return used, torch.searchsorted(used, slots)
        return torch.unique(slots, sorted=True, return_inverse=True)[:2]


class ExpertProvider:
    """What the MoE block and the forward ask of whoever holds some layers' experts (models/moe.py,
    models/transformer.py): lookahead_layers, fetch and experts_launched on the fetching path; address_table (or
    addresses), layout and landing in a zero-copy decode step. `fetch`, `address_table` and `layout` are each
    provider's own; the others are no-ops by default, so a provider says only what it does."""

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

    def lookahead_layers(self, layer: int, n_tokens: int) -> int:
        """How many MoE layers ahead the forward should guess this layer's successors' experts (0: none)."""
        return 0

    def experts_launched(self, layer: int) -> None:
        """The layer's expert kernels are queued (the cache copies ahead from here)."""


class HostProvider(ExpertProvider):
    """The provider of the host layers (uploads per ubatch, the expert cache, the upload buffer as the smallest
    cache: runtime/placement.py), and what the engine asks of it besides: begin_prompt / begin_ubatch around
    forwards, begin_decode_step / end_decode_step and decode_step_ops around a zero-copy decode step, suspend /
    resume around a paused prompt (where `pauses`), the decode plan once at setup (use_plan), the device rows
    decode kernels read (device_rows), and its counters. A "ubatch" here is one forward's tokens: a ubatch, or a
    prompt's batch of several run layer by layer (Engine.forward_parts), whose routing `fetch` gets as one (T, k)."""

    pauses = True       # a prompt ubatch may pause between layers for other forwards (suspend / resume)
    takes_seeds = False  # seed_next copies ahead (a cache that prefetches); else nobody asks for a seed

    def __init__(self):
        self.stats = CacheStats()

    def use_plan(self, plan) -> None:
        """The engine's decode plan (runtime/plan.py), once it is set up: how its decode steps read experts."""

    def device_rows(self) -> list[torch.Tensor]:
        """The device tensors of rows a decode kernel may read by address (slots, staging rows)."""
        return []

    def begin_prompt(self, seq: int) -> None:
        self.stats.begin_prompt()

    def begin_ubatch(self, seq: int, n_tokens: int, is_prompt: bool, seqs: list[int] | None = None) -> None:
        """A forward of n_tokens begins; seq: its first segment's sequence; seqs: each token's sequence, where
        it has several (a decode step; a prompt batch of several sequences' ubatches), else None."""

    def seed_next(self, counts) -> None:
        """The next ubatch's experts as guessed before it (a speculative verify step: its drafts' guesses,
        runtime/speculate.py): counts (layers, E) of guesses per expert, copied ahead from its start where it has no
        seed of its own (experts/prefetch.py's rules). Only where takes_seeds."""

    def suspend(self):
        """The prompt ubatch in progress pauses between two layers while other forwards run (the server's decode
        steps: Engine.prompt_steps): what resume() needs to go on with it. Only where `pauses`."""
        return None

    def resume(self, state) -> None:
        """Go on with the prompt ubatch that suspend() paused, after other forwards."""

    def begin_decode_step(self, seqs: list[int] | None = None) -> None:
        """A zero-copy decode step begins; seqs: each token's sequence."""

    def end_decode_step(self, n_tokens: int, observer=None) -> None:
        """A zero-copy decode step is queued: its routing to `observer` (a RouteObserver), then learn from it."""

    def decode_step_ops(self) -> tuple | None:
        """(first, last, kept): the device ops a zero-copy decode step runs before and after its forward, inside
        its graph (first(), last(n_tokens); experts/zero_copy.py: the landings of one step for the next one's
        table), and a context manager that keeps their state across a capture's warm-up steps; None for none."""
        return None

    def counters(self) -> CacheStats:
        """The counters, up to date (the cache collects the compute stream's waits first)."""
        return self.stats

    def cache_info(self) -> dict | None:
        """The expert cache's size and policy for Engine.stats (None: no cache)."""
        return None

    def pinned_slots(self) -> int | None:
        """The cache's slots the next forward could not evict (None: no cache): Engine.pinned_slots."""
        return None


class ResidentExperts(ExpertProvider):
    """Every expert of some layers on the compute device: slot = expert id, nothing moves."""

    def __init__(self, rows: dict[int, torch.Tensor], layouts: dict[int, ExpertLayout]):
        self.rows, self.layouts = rows, layouts          # layer -> (E, row) on the device, and its layout
        self.addr = {l: row_addresses(r, r.device) for l, r in rows.items()}

    def address_table(self, layer: int):
        return self.addr[layer], None

    def layout(self, layer: int) -> ExpertLayout:
        return self.layouts[layer]

    def fetch(self, layer: int, ids: torch.Tensor, lookahead=None) -> ExpertWeights:
        return ExpertWeights.over(self.rows[layer], self.layouts[layer], ids)


class LayerRouter(ExpertProvider):
    """Sends each layer to the provider that owns it."""

    def __init__(self, by_layer: dict[int, ExpertProvider]):
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
