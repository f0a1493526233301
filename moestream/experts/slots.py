"""The slot pool: the GPU tier of expert slots, the copies that fill them and the compute that reads them.

    slots = SlotPool(store, planner.residency, device)
    seq = slots.submit([(slot, store.rows[layer][e])], speculative=False)   # one copy batch
    seq = slots.copy_experts(layer, [(e, slot), ...], speculative=True)     # the same from the layer's rows, in runs
    slots.hand_out(layer, plan.slots)    # compute waits for their copies; they stay pinned until it has read them
    lut = slots.upload_table(layer, slots.table(layer))      # (E,) each expert's slot
    y = kernel(x, lut[ids], *slots.layer_weights(layer))
    slots.mark_reads()                   # after the reading compute is queued: an event frees its slots later

Which expert sits in which slot is the residency map's (residency.py); the pool holds the bytes and the timing:
which copy batch last filled each slot (`ready`), which compute reads each slot (`use`, pins), and the compute
stream's waits for copies. The prompt path (prompt.py) and zero-copy decode (zero_copy.py) both work through it.

Invariants (tests/test_slots.py checks them without a model):
- A pinned slot is never a victim. A slot handed out to compute is pinned from `hand_out` until the compute event
  recorded by the next `mark_reads` has completed; `refresh_pins` writes the pins into `residency.pinned`, whose
  slots `Residency.ensure` never evicts. (On the CPU compute has run by then: `mark_reads` frees at once.)
- A table points only at slots whose copy has landed: `hand_out` makes the compute stream wait for the last copy
  batch into every slot it hands out before the compute that reads through the table, and a zero-copy decode
  table points at a slot only where `landed` says its copy is done (elsewhere it reads the host row).
- `ready[s]` is the copy batch that last filled slot s (0: none in flight since the start). Batches run in order
  on one copy stream, so a slot has landed once the queue has completed its batch.
- `prefetched[s]`: slot s was filled by a speculative copy and nobody has claimed it since (the prompt path
  counts a claim of a hit as a prefetch used, of a victim as a prefetch wasted).
"""
from __future__ import annotations

import numpy as np
import torch

from ..kernels.batch_copy import batch_copy, batch_copy_available
from ..kernels.copy_rows import copy_rows, copy_rows_available
from ..kernels.host_arrays import upload
from .copy_queue import CopyQueue
from .provider import ExpertWeights
from .residency import Residency
from .store import ExpertStore


NOT_YET = np.iinfo(np.int64).max          # a slot handed out whose reading compute has no event yet
RUN_BYTES = 32 << 20                      # copy_experts: at most this much in one copy (the copy stream's
                                          # progress is seen a copy at a time)
# How copy_experts moves a layer's misses on CUDA (a copy call costs the host ~30 µs, what 1.6 MB take on the link,
# so the host fell behind on Q4_K_M rows of 2-3 MB, bench/RESULTS.md stop 25):
#   batch   one driver call per RUN_BYTES hands the copy engines every (from, to) pair (kernels/batch_copy.py);
#   kernel  one launch of the row-copy kernel per RUN_BYTES (kernels/copy_rows.py), where the driver has no batch
#           call; its programs take SMs from the GEMMs beside it;
#   calls   a copy call per run of consecutive experts (run_copies): the CPU path, rows not pinned, and rows of
#           more than MANY_ROWS_MAX bytes (bf16 experts, 6-9 MB: the host keeps up with their copy calls, and the
#           batch call read 15% slower on the 30B's in one lease, +4% on Qwen3-Next's: RESULTS.md stop 26).
# Each falls back to the next where it cannot run. (MOESTREAM_COPY, which forced a later one for an A/B, was removed
# at stop 47: bench/RESULTS.md, stops 25 and 26.)
COPY_MODES = ("batch", "kernel", "calls")
MANY_ROWS_MAX = 4 << 20


class SlotPool:
    def __init__(self, store: ExpertStore, residency: Residency, device):
        any_rows = next(iter(store.rows.values()))
        n_slots, n_experts = residency.n_slots, residency.slot_of.shape[1]
        self.residency, self.device, self.n_experts = residency, device, n_experts
        width = max(r.shape[1] for r in store.rows.values())            # a slot holds the widest layer's row
        self.pool = torch.empty(n_slots, width, dtype=any_rows.dtype, device=device.torch)   # (S, row)
        self.layouts = store.layouts
        self.store_rows = store.rows
        self.copier = {l: self._copier(r) for l, r in store.rows.items()}      # layer -> one of COPY_MODES
        self.aligned = store.aligned16(self.pool)
        # Each host layer's view of the pool, as its rows (quantized layouts read only their own row's bytes).
        self.views = {l: self.pool[:, :r.shape[1]] for l, r in store.rows.items()}
        self.queue = CopyQueue(device)
        self.ready = np.zeros(n_slots, dtype=np.int64)          # copy batch that filled each slot
        self.prefetched = np.zeros(n_slots, dtype=bool)         # filled by a speculative copy, not claimed yet
        self.use = np.full(n_slots, -1, dtype=np.int64)         # compute event after each slot's last read
        self.use_events: dict[int, object] = {}
        self.use_seq, self.use_done = 0, 0
        self.handed: np.ndarray = np.zeros(0, dtype=np.int64)   # slots the last hand_out gave to compute
        self.waits: list[tuple[int, object, object]] = []      # (layer, before, after) compute-stream events

    @property
    def n_slots(self) -> int:
        return self.residency.n_slots

    def _copier(self, rows: torch.Tensor) -> str:
        """How copy_experts moves this layer's rows (COPY_MODES): the first that can."""
        row = rows.shape[1] * rows.element_size()
        many, dev = rows.is_pinned() and row <= MANY_ROWS_MAX, self.pool.device
        if many and batch_copy_available(dev):
            return "batch"
        if many and copy_rows_available(dev) and row % 4 == 0:
            return "kernel"
        return "calls"

    # --- copies -----------------------------------------------------------------------------------------------
    def submit(self, copies: list[tuple[int, torch.Tensor]], speculative: bool, after=None) -> int:
        """Copy each (slot, host row) into its slot on the copy stream, as one batch behind the compute event
        `after` (the slots' last readers), if given. A speculative batch (a prefetch) counts against the queue's
        in-flight bound and marks its slots `prefetched`. Returns the batch's sequence number."""
        slots = np.array([s for s, _ in copies], dtype=np.int64)
        return self._queue([(self.pool[s, :src.shape[0]], src) for s, src in copies], slots, speculative, after)

    def copy_experts(self, layer: int, misses: list[tuple[int, int]], speculative: bool) -> int:
        """Copy the (expert, slot) pairs of one layer from its host rows, as one batch as submit does, by the layer's
        copier (COPY_MODES): a batch call or a kernel launch per RUN_BYTES, or a copy call for each run of
        consecutive experts into consecutive slots (up to RUN_BYTES). Returns the batch's sequence number."""
        rows = self.store_rows[layer]                                        # (E, row) pinned
        pairs = np.asarray(misses, dtype=np.int64).reshape(-1, 2)
        pairs = pairs[np.argsort(pairs[:, 1], kind="stable")]               # by slot
        e, s = pairs[:, 0], pairs[:, 1]
        row_bytes = rows.shape[1] * rows.element_size()
        how = self.copier[layer]
        if how == "batch":
            copies = self._batch_copies(rows, e, s, row_bytes)
        elif how == "kernel":
            copies = self._kernel_copies(rows, e, s, row_bytes)
        else:
            copies = run_copies(self.pool, rows, e, s)
        return self._queue(copies, s, speculative)

    def _addresses(self, rows: torch.Tensor, experts: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """(2, n) int64: each pair's host row address and slot address."""
        pool_row = self.pool.stride(0) * self.pool.element_size()
        return np.stack([rows.data_ptr() + experts * (rows.stride(0) * rows.element_size()),
                         self.pool.data_ptr() + slots * pool_row])

    def _batch_copies(self, rows: torch.Tensor, experts: np.ndarray, slots: np.ndarray, row_bytes: int) -> list:
        """copy_experts' pieces as batch calls to the copy engines (kernels/batch_copy.py), RUN_BYTES each (the
        queue marks its progress a piece at a time)."""
        src, dst = self._addresses(rows, experts, slots)
        stream = self.queue.stream

        def piece(a: int, b: int) -> int:
            batch_copy(dst[a:b], src[a:b], row_bytes, stream)
            return (b - a) * row_bytes

        return _pieces(piece, len(slots), row_bytes)

    def _kernel_copies(self, rows: torch.Tensor, experts: np.ndarray, slots: np.ndarray, row_bytes: int) -> list:
        """copy_experts' pieces as launches of the row-copy kernel (kernels/copy_rows.py), RUN_BYTES each (the
        queue marks its progress a piece at a time), after one upload of every pair's addresses."""
        addrs = self._addresses(rows, experts, slots)                               # (2, n): from, to
        dev = []

        def upload() -> int:
            dev.append(torch.from_numpy(addrs).pin_memory().to(self.device.torch, non_blocking=True))
            return 0

        def launch(a: int, b: int) -> int:
            copy_rows(dev[0][0], dev[0][1], row_bytes, self.aligned, first=a, count=b - a)
            return (b - a) * row_bytes

        return [upload] + _pieces(launch, len(slots), row_bytes)

    def _queue(self, copies: list, slots: np.ndarray, speculative: bool, after=None) -> int:
        """Queue the copies ((pool rows, host rows) pairs or kernel launches, CopyQueue.submit's pieces) as one
        batch, the slots they fill marked as filled by it."""
        seq = self.queue.submit(copies, speculative=speculative, after=after)
        self.ready[slots] = seq
        if speculative:
            self.prefetched[slots] = True
        return seq

    def landed(self, slots: np.ndarray | None = None) -> np.ndarray:
        """(n,) bool: whether the last copy into each slot (every slot, by default) has completed (one poll of the
        queue)."""
        return (self.ready if slots is None else self.ready[slots]) <= self.queue.poll()

    def written(self, slots: np.ndarray) -> None:
        """Completed compute wrote these slots' bytes (read-through): no copy to wait for."""
        self.ready[slots] = 0

    def claim(self, slots: np.ndarray) -> int:
        """The slots are read or refilled now: how many held a prefetch nobody had claimed (now none does)."""
        n = int(self.prefetched[slots].sum())
        self.prefetched[slots] = False
        return n

    # --- readers and pins -------------------------------------------------------------------------------------
    def hand_out(self, layer: int, slots: np.ndarray) -> None:
        """Compute of `layer` is about to read these slots: the compute stream waits for their copies, and they
        are pinned until the event of the next `mark_reads` completes (call it once that compute is queued, before
        the next hand_out)."""
        self.wait_for(layer, int(self.ready[slots].max()))
        self.use[slots] = NOT_YET
        self.handed = slots

    def mark_reads(self) -> None:
        """An event after everything queued so far, which includes the compute that read the last hand_out's
        slots. On the CPU that compute has already run: the slots are free at once."""
        if not self.device.is_cuda:
            self.use[self.handed] = 0
            return
        self.use_seq += 1
        ev = torch.cuda.Event()
        ev.record()
        self.use_events[self.use_seq] = ev
        self.use[self.handed] = self.use_seq
        self.handed = np.zeros(0, dtype=np.int64)

    def refresh_pins(self) -> None:
        """Pin (in the residency map) exactly the slots whose reading compute has not completed."""
        while self.use_done < self.use_seq and self.use_events[self.use_done + 1].query():
            del self.use_events[self.use_done + 1]
            self.use_done += 1
        self.residency.pinned = self.use > self.use_done

    def pin(self, slots: np.ndarray) -> None:
        """Pin these slots too until the next refresh_pins (a decode step in flight writes them)."""
        self.residency.pinned[slots] = True

    # --- the compute stream's waits ---------------------------------------------------------------------------
    def wait_for(self, layer: int, seq: int) -> None:
        """The compute stream waits for copy batch `seq` (if still running), timed with a pair of events."""
        if not self.device.is_cuda or seq <= self.queue.poll():
            return
        compute = torch.cuda.current_stream(self.device.torch)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(compute)
        self.queue.wait(seq, compute)
        after.record(compute)
        self.waits.append((layer, before, after))

    def collect_waits(self, stats) -> None:
        """Turn recorded event pairs into per-layer wait counts in `stats` (synchronises)."""
        if self.waits:
            self.device.synchronize()
            for layer, before, after in self.waits:
                stats.record(layer, waits=1, wait_s=before.elapsed_time(after) / 1e3)
            self.waits = []

    # --- slot tables ------------------------------------------------------------------------------------------
    def table(self, layer: int) -> np.ndarray:
        """The layer's slot table (E,): each expert's slot, -1 if absent."""
        return self.residency.slot_of[layer].copy()

    def upload_table(self, layer: int, table: np.ndarray) -> torch.Tensor:
        """The layer's slot table (E,) on the device, in order on the compute stream: not by a copy call, which
        would wait behind the copies queued on the copy stream since (kernels/host_arrays.py)."""
        return upload(table, self.device.torch)

    def weights(self, layer: int, slots: torch.Tensor, used: np.ndarray | None = None) -> ExpertWeights:
        """The pool as the layer's kernel reads it, each routed choice at `slots` (its table's entries; `used`:
        the distinct ones, ascending, if known)."""
        return ExpertWeights.over(self.views[layer], self.layouts[layer], slots, used)

    def layer_weights(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Float layouts: the (S, 2I, H) and (S, H, I) views of the pool as the layer's rows."""
        return self.layouts[layer].views(self.views[layer])


def _pieces(copy, n: int, row_bytes: int) -> list:
    """The queue's pieces that copy n rows of row_bytes by `copy(a, b)` (rows a to b), RUN_BYTES or so each."""
    cap = max(1, RUN_BYTES // row_bytes)
    return [lambda a=a: copy(a, min(a + cap, n)) for a in range(0, n, cap)]


def run_copies(dst: torch.Tensor, src: torch.Tensor, experts: np.ndarray, slots: np.ndarray) -> list:
    """The (dst rows, src rows) copies that move src's rows `experts` into dst's rows `slots` (both ascending,
    paired): one copy for each run of consecutive experts into consecutive slots, of at most RUN_BYTES, not one an
    expert (each copy costs the host some microseconds). dst's rows may be wider than src's: each copy writes the
    first src.shape[1] of them (torch stages such a copy)."""
    row_bytes = src.shape[1] * src.element_size()
    cap = max(1, RUN_BYTES // row_bytes)
    starts = np.flatnonzero(np.r_[True, (np.diff(slots) != 1) | (np.diff(experts) != 1)])
    ends = np.r_[starts[1:], len(slots)]
    copies = []
    for a, b in zip(starts.tolist(), ends.tolist()):
        for c in range(a, b, cap):
            n = min(cap, b - c)
            copies.append((dst[slots[c]:slots[c] + n, :src.shape[1]], src[experts[c]:experts[c] + n]))
    return copies
