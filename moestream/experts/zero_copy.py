"""Zero-copy decode: a decode step reads each routed expert where it lies, a cache slot or pinned host memory.

    zc = ZeroCopyDecode(cache, max_tokens=16)
    zc.begin_step()                      # the address table (layer, expert) -> slot or host row, onto the device
    addrs = zc.addresses(layer, ids)     # inside the (captured) step: (T, k) addresses; the ids are kept
    zc.end_step(n_tokens)                # after the step is queued: learn from the previous step's routing

A decode step then needs no host decision: the whole step is one CUDA graph, and a miss costs its bytes over the
link once, read in place by the kernel (kernels/decode.py), as an upload would. The cache still learns: after each
step is queued, the host reads the previous step's routing back and runs the policy on it, uploading its misses on
the copy stream behind the step in flight; an expert's address moves to its slot once its copy has landed.

Why this is safe without pins: a table is written on the compute stream before its step, and copies for a step's
misses wait for the step queued after it, so no step reads a slot while a copy overwrites it, and no table points
at a slot before its copy has completed.
"""
from __future__ import annotations

import numpy as np
import torch

from ..models.moe import report_route


class ZeroCopyDecode:
    def __init__(self, cache, max_tokens: int, top_k: int):
        dev, L, E = cache.device, cache.residency.slot_of.shape[0], cache.n_experts
        self.cache, self.top_k = cache, top_k
        self.row_bytes = cache.store.expert_bytes
        self.host_addr = np.zeros((L, E), dtype=np.int64)
        for l, rows in cache.store.rows.items():
            self.host_addr[l] = rows.data_ptr() + np.arange(E, dtype=np.int64) * self.row_bytes
        self.pool_addr = cache.pool.data_ptr()
        self.table = torch.zeros(L, E, dtype=torch.int64, device=dev.torch)      # read by the captured steps
        self.staging = dev.pinned_empty((L, E), torch.int64)
        self.routed = torch.zeros(L, max_tokens * top_k, dtype=torch.int64, device=dev.torch)   # written by a step
        self.routed_host = dev.pinned_empty((L, max_tokens * top_k), torch.int64)
        self.from_host = np.zeros((L, E), dtype=bool)       # the queued step's experts read from host memory
        self.pending = None                                 # (n_tokens, event, from_host) of a step not learned yet

    def addresses(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """ids (T, k) -> (T, k) addresses; keeps the ids for the host (graph-safe: device copies only)."""
        self.routed[layer, :ids.numel()].copy_(ids.reshape(-1))
        return self.table[layer][ids]

    def begin_step(self) -> None:
        """Write the address table: an expert resident in a slot whose copy has landed reads from the slot,
        every other one from its host row."""
        if self.pending is not None and self.pending[1] is not None:
            self.pending[1].synchronize()        # its table copy is done before the staging is rewritten
        c = self.cache
        slot = c.residency.slot_of
        landed = slot >= 0
        landed[landed] = c.ready[slot[landed]] <= c.queue.poll()
        np.logical_not(landed, out=self.from_host)
        table = np.where(landed, self.pool_addr + slot * self.row_bytes, self.host_addr)
        self.staging.numpy()[:] = table
        self.table.copy_(self.staging, non_blocking=True)

    def end_step(self, n_tokens: int, on_route=None) -> None:
        """The step is queued: report its routing (device views, in stream order), then learn from the previous
        step's while this one runs."""
        c, n = self.cache, n_tokens * self.top_k
        for l in c.layers:
            report_route(on_route, l, self.routed[l, :n].view(n_tokens, self.top_k))
        previous = self._take_pending()
        event = None
        if c.device.is_cuda:
            self.routed_host[:, :n].copy_(self.routed[:, :n], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            self.routed_host[:, :n].copy_(self.routed[:, :n])
        self.pending = (n_tokens, event, self.from_host.copy())
        if previous is not None:
            self._learn(*previous, after=event)

    def flush(self) -> None:
        """Learn from the last step now (before a prompt changes the cache, or counters are read)."""
        previous = self._take_pending()
        if previous is not None:
            self._learn(*previous, after=None)

    def _take_pending(self):
        if self.pending is None:
            return None
        n_tokens, event, from_host = self.pending
        self.pending = None
        if event is not None:
            event.synchronize()                  # normally long done: the caller read that step's logits
        return self.routed_host[:, :n_tokens * self.top_k].numpy().copy(), from_host

    def _learn(self, routed: np.ndarray, from_host: np.ndarray, after) -> None:
        """The policy and counters see one step's routing (L, T k); its misses are uploaded behind `after` (the
        step now queued, which may read their victims), or at once when nothing is queued."""
        c = self.cache
        c._mark_reads()                          # slots a prompt handed out are free once its compute has run
        for l in c.layers:
            counts = np.bincount(routed[l], minlength=c.n_experts)
            reads = int(counts[from_host[l]].sum())
            if reads:
                c.stats.record(l, host_reads=reads, host_read_bytes=reads * self.row_bytes)
            wanted = np.flatnonzero(counts).astype(np.int64)
            if len(c.planner.groups(l, wanted)) > 1:      # more than the layer's region holds: the most routed
                wanted = np.sort(wanted[np.argsort(-counts[wanted], kind="stable")[:c.residency.region_size(l)]])
            c._load_slots(l, wanted, compute_waits=False, after=after)
