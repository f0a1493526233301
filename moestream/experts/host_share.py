"""The host's cores as a second link (--host-compute SHARE): in a zero-copy decode step over the cache, a share of
the experts the step would read from host memory are computed on the host instead, while the GPU reads the rest.

    share = HostShare(store, stats, 0.5, pool, top_k=8, reads_once=True)
    share.active = share.wants(last_step_host_bytes)                  # a step worth an eager step's cost
    part = share.split(layer, x, ids, weights, addrs, from_host)     # None, or (addrs, compute)
    out = decode_kernel(x, addrs, ...)                                 # the GPU's part, queued first
    out = out + compute().to(out)                                      # the host's part, computed meanwhile

Why: a bf16 expert is read at 61-68 GB/s by 16 host cores (kernels/host_experts.py, numba) against the link's
50-55, so a step whose misses split between the two moves them in about half the time (bench/RESULTS.md, stop 19).
The choices the host computes read a zeroed device row in the kernel (their output is exactly 0 there, with no
host bytes read), and the host adds its float32 sum of them to the layer's output. Choice j reads zero row j: a
token's k addresses stay distinct, as the kernels ask (decode_grouped.py's runs hold one choice a token; a token
whose two host-computed choices shared one zero row left a choice unwritten there, on the GPU).

When: only in steps whose experts read from host memory are heavy. A step the host shares costs one host sync a
layer (the routing, to choose), so it runs eagerly, not as a CUDA graph (runtime/decode.py), and lands nothing
(read-through: the kernel does not read what the host computes). On the H200 that cost ~7 ms a step (8 streams of
the BF16 reference at 16000 MiB: 18.9 ms a step as graphs reading 0.53 GB from host, 25.6 ms shared; RESULTS.md,
stop 29), and a share of 0.5 saves about bytes / 110 GB/s: a step shares when the last step learned from read at
least MIN_STEP_BYTES from host (MOESTREAM_HOST_SHARE_MB). Staging stays off (engine_config.DecodeConfig). And the
numerics contract: the host's experts are its float32 sums, in another order than the GPU
kernel's, added to the kernel's rounded output, so a step's bits depend on which experts the host computed.
"""
from __future__ import annotations

import numpy as np
import torch

from .. import knobs
from ..kernels.host_experts import host_experts
from .stats import CacheStats
from .store import ExpertStore

MIN_STEP_BYTES = knobs.positive_int("MOESTREAM_HOST_SHARE_MB", 1000) * 1e6   # host reads of a step worth sharing


class HostShare:
    def __init__(self, store: ExpertStore, stats: CacheStats, share: float, pool: torch.Tensor, top_k: int,
                 reads_once: bool):
        self.store, self.stats, self.share, self.reads_once = store, stats, share, reads_once
        self.zero_rows = pool.new_zeros(top_k, pool.shape[1])   # (k, row): what a host-computed choice j reads
        stride = self.zero_rows.stride(0) * self.zero_rows.element_size()
        self.zero_addrs = self.zero_rows.data_ptr() + stride * torch.arange(top_k, device=pool.device)   # (k,)
        self.active = False             # the step now running shares (set by the cache at begin_decode_step)

    @staticmethod
    def wants(step_bytes: float) -> bool:
        """Whether a step shares, given the bytes the last learned step read from host memory."""
        return step_bytes >= MIN_STEP_BYTES

    def split(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, addrs: torch.Tensor,
              from_host: np.ndarray):
        """x (T, H), ids / weights / addrs (T, k) of the step's layer; from_host (E,): the experts its table reads
        from host memory. The host takes `share` of those the step routes (by count, rounded), the ones fewest
        tokens chose first (its cost grows with the tokens, the link's does not). Returns None when it takes none,
        or when the step does not share (no host sync then: graph-safe)."""
        if not self.active:
            return None
        ids_h = ids.cpu().numpy()                             # the layer's host sync: its routing
        on_host = from_host[ids_h]                            # (T, k)
        if not on_host.any():
            return None
        experts, counts = np.unique(ids_h[on_host], return_counts=True)
        n = int(round(self.share * len(experts)))
        if n == 0:
            return None
        mine = experts[np.argsort(counts, kind="stable")[:n]]
        mask = on_host & np.isin(ids_h, mine)
        addrs = torch.where(torch.from_numpy(mask).to(addrs.device), self.zero_addrs[:addrs.shape[1]], addrs)
        xh, wh = x.cpu().float(), weights.cpu().float()         # (widened on the host: half the bytes moved)
        cpu_ids = torch.from_numpy(np.where(mask, ids_h, -1))
        rows, layout = self.store.rows[layer], self.store.layouts[layer]
        # The kernel does not read these: the step's learning counts them among its host reads, so take them out.
        unread = n if self.reads_once else int(mask.sum())
        self.stats.record(layer, host_computed=n, host_reads=-unread,
                          host_read_bytes=-unread * self.store.layer_bytes(layer))
        return addrs, lambda: host_experts(xh, rows, cpu_ids, wh, layout)
