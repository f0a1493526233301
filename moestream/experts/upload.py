"""No cache: each ubatch uploads its routed experts into rows of one layer's experts, an expert in the row of its
id; with a second set of rows, the next host layers' experts are copied ahead while this one computes.

    up = UploadPerUbatch(store, n_experts=512, device=dev, top_k=10, second=True)
    up.begin_ubatch(seq, 2048, is_prompt=True)   # the first two host layers' guessed experts start copying
    w = up.fetch(layer, ids)        # compute waits for this layer's copy-ahead; the rest is uploaded now, in order
    y = w.run(kernel, x); up.experts_launched(layer)     # its rows may refill for the layer after the next

With no cache, uploads are a ubatch's cost. With one set of rows they run on the compute stream, in series with
compute: a layer's copies cannot start before the layer before it has read the rows. With two, the host layers of
a forward take turns (the i-th reads set i mod 2) and a copy stream fills one set while compute reads the other:
the copy-ahead of host layer i+2 waits only for layer i's compute. What it copies: the experts the layer routed in
its last ubatch of at least PrefetchConfig.min_batch tokens, or, before there is one, every expert where the
ubatch makes at least ALL_CHOICES choices an expert (a uniform routing then leaves e^-3, 5%, unrouted: Qwen3-Next's
512 experts at ubatch 2048 make 40). Routed experts not copied ahead are uploaded on the compute stream once the
layer's routing is on the host. A forward copies ahead only where the layers' last big ubatches routed at least
WIDE_SHARE of their experts on average, and then only the layers that did: on the 30B reference's skewed routing
(37-62 of 128 at ubatch 512-4096) the last ubatch's set missed a sixth of the next one's and copied a sixth for
nothing, and the copy-ahead queued before the next layer's demand uploads on the link: ubatch 512 went from 5795 to
5196 tok/s with every layer copied ahead, and to 4731 with the wide layers alone (bench/RESULTS.md, stop 22).

An expert sits in the row of its id in either set and its GEMM does not read the row's address, so results are the
same bits with one set or two, with copy-ahead or without.
"""
from __future__ import annotations

import numpy as np
import torch

from ..quant.layout import ExpertLayout
from .copy_queue import CopyQueue
from .prefetch import PrefetchConfig
from .provider import ExpertWeights, HostProvider, row_addresses
from .routing import report_route
from .slots import run_copies
from .store import ExpertStore

ALL_CHOICES = 3            # with no routing seen yet, copy every expert ahead from this many choices an expert
WIDE_SHARE = 0.5           # copy ahead only a layer whose last big ubatch routed at least this share of its experts


class UploadPerUbatch(HostProvider):
    """Host-resident layers without a cache: each ubatch uploads its routed experts, each once.

    A set of rows has one row per expert id, so an expert lands in the row of its own id and the kernel launch is
    the same as for a GPU-resident layer (hence bit-identical results). Zero-copy decode reads host rows in place,
    and stages them (kernels/stage.py) in the first set.
    """
    pauses = False      # a decode step between a prompt's layers would stage into the rows the prompt reads

    def __init__(self, store: ExpertStore, n_experts: int, device, top_k: int = 8, staged: bool = False,
                 buf: torch.Tensor | None = None, second: bool = False,
                 prefetch: PrefetchConfig = PrefetchConfig()):
        super().__init__()
        any_rows = next(iter(store.rows.values()))
        self.store, self.top_k, self.device, self.prefetch = store, top_k, device, prefetch
        self.n_experts = n_experts
        width = max(r.shape[1] for r in store.rows.values())                       # the widest layer's row
        if buf is None:                          # (or rows it shares: the smallest cache's pool, buffered.py)
            buf = torch.empty(n_experts, width, dtype=any_rows.dtype, device=device.torch)
        self.buf = buf                                                             # (E, row)
        self.sets = [buf] + ([torch.empty_like(buf)] if second else [])          # host layer i reads i mod 2
        self.queue = CopyQueue(device) if second else None                         # the copy-ahead's stream
        self.addr = {l: row_addresses(r, device.torch) for l, r in store.rows.items()}
        # Staged (kernels/stage.py): a zero-copy step copies its host reads into buf first, each distinct expert
        # once, and reads them there; else the kernel reads in place (the grouped bf16 kernel each expert once).
        self.staged = staged
        self.reads_once = staged or not any(lay.quantized for lay in store.layouts.values())
        self.no_slots = torch.zeros(0, dtype=torch.int64, device=device.torch)
        self.aligned = store.aligned16(self.buf)
        self.layers = sorted(store.rows)                                           # a forward's order
        self.rows_of = {l: i for i, l in enumerate(self.layers)}
        self.routed = None                           # (host layers, MAX_TOKENS k): a zero-copy step's ids, on device
        self.seen: dict[int, np.ndarray] = {}        # layer -> the experts it routed in its last copy-ahead ubatch
        self.ahead: dict[int, tuple[np.ndarray, int]] = {}    # layer -> (E,) copied ahead into its set, and batch
        self.copying = self.learning = False
        self.n_tokens = 0
        self.freed: list = [None] * len(self.sets)    # per set, an event after its last reader's compute (CUDA),
                                                      # None where a reader may have gone unseen (a decode step)

    @property
    def pipelined(self) -> bool:
        return len(self.sets) > 1

    def copies_ahead(self, n_tokens: int) -> bool:
        """Whether a ubatch of n_tokens would copy ahead (the layers' last routing wide enough, on average)."""
        pf, E = self.prefetch, self.n_experts
        if not (self.pipelined and pf.enabled and n_tokens >= pf.min_batch):
            return False
        if not self.seen:
            return n_tokens * self.top_k >= ALL_CHOICES * E
        return np.mean([len(s) for s in self.seen.values()]) >= WIDE_SHARE * E

    # --- prompts: uploads per ubatch ---------------------------------------------------------------------------
    def begin_ubatch(self, seq: int, n_tokens: int, is_prompt: bool, seqs: list[int] | None = None) -> None:
        if self.ahead:                           # copies nobody waited for (a forward cut short): before any reuse
            self._wait(self.queue.seq)
            self.ahead = {}
        pf = self.prefetch
        self.n_tokens = n_tokens
        self.learning = self.pipelined and pf.enabled and n_tokens >= pf.min_batch      # its routing is `seen`
        self.copying = self.copies_ahead(n_tokens)
        if self.copying:                         # each set after its last reader (the previous forward's), or
            start = None                         # after all that is queued so far
            for i, l in enumerate(self.layers[:len(self.sets)]):
                after = self.freed[i]
                if after is None:
                    start = start or self._compute_event()
                    after = start
                self._copy_ahead(l, after)

    def begin_decode_step(self, seqs: list[int] | None = None) -> None:
        self.forget_readers()

    def forget_readers(self) -> None:
        """Something besides fetch reads the rows now (zero-copy decode steps, the cache over the first set): the
        next copy-ahead waits for all queued compute."""
        self.freed = [None] * len(self.sets)

    def fetch(self, layer: int, ids: torch.Tensor, lookahead=None) -> ExpertWeights:
        src = self.store.rows[layer]
        width = src.shape[1]
        rows = self.sets[self.rows_of[layer] % len(self.sets)]
        wanted = torch.unique(ids).cpu().numpy()     # host sync: the copies are chosen on the host
        missing = wanted
        if (ahead := self.ahead.pop(layer, None)) is not None:
            copied, seq = ahead
            self._wait(seq)
            missing = wanted[~copied[wanted]]
            used = len(wanted) - len(missing)
            self.stats.record(layer, hits=used, prefetch_used=used, prefetch_wasted=int(copied.sum()) - used)
        copies = run_copies(rows, src, missing, missing)
        for dst, s in copies:
            dst.copy_(s, non_blocking=True)
        nb = len(missing) * self.store.layer_bytes(layer)
        self.stats.record(layer, misses=len(missing), uploaded_bytes=nb, copies=len(missing))
        if self.learning:
            self.seen[layer] = wanted
        return ExpertWeights.over(rows[:, :width], self.store.layouts[layer], ids, used=wanted)

    def experts_launched(self, layer: int) -> None:
        """The layer's expert kernels are queued: its set of rows may take the layer after the next, once they
        have run."""
        if not self.pipelined:
            return
        b = self.rows_of[layer] % len(self.sets)
        self.freed[b] = self._compute_event()
        if self.copying and (i := self.rows_of[layer] + len(self.sets)) < len(self.layers):
            self._copy_ahead(self.layers[i], self.freed[b])

    def _copy_ahead(self, layer: int, after) -> None:
        E = self.n_experts
        experts = self.seen.get(layer)
        if experts is None:
            experts = np.arange(E) if self.n_tokens * self.top_k >= ALL_CHOICES * E else np.zeros(0, np.int64)
        if len(experts) < WIDE_SHARE * E:       # a part of the layer: the guess misses and wastes a sixth each
            return
        copies = run_copies(self.sets[self.rows_of[layer] % len(self.sets)], self.store.rows[layer], experts, experts)
        nb = len(experts) * self.store.layer_bytes(layer)
        seq = self.queue.submit(copies, speculative=False, after=after)
        copied = np.zeros(E, dtype=bool)
        copied[experts] = True
        self.ahead[layer] = (copied, seq)
        self.stats.record(layer, prefetched=len(experts), prefetched_bytes=nb, uploaded_bytes=nb,
                          copies=len(experts))

    def _compute_event(self):
        if not self.device.is_cuda:
            return None                          # (on the CPU compute has run by now)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device.torch))
        return ev

    def _wait(self, seq: int) -> None:
        if self.device.is_cuda:
            self.queue.wait(seq, torch.cuda.current_stream(self.device.torch))

    # --- zero-copy decode: host rows read in place ------------------------------------------------------------
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
