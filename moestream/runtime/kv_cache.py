"""The KV cache: preallocated per layer, one row per sequence, written in place by (sequence, position).

    kv = KVCache(n_layers=24, n_seq=4, ctx=4096, n_kv=4, hd=128, dtype=torch.bfloat16, device="cuda")
    kv.write(layer, seq_ids, positions, k, v)        # k, v: (T, nkv, hd)
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_layers: int, n_seq: int, ctx: int, n_kv: int, hd: int, dtype, device):
        self.n_seq, self.ctx = n_seq, ctx
        shape = (n_seq, n_kv, ctx, hd)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]

    def span(self, n: int) -> int:
        """Keys a decode step attends when its furthest token is at position n - 1: n rounded up to a power of two
        (at least 256, at most the cache), masked past each token's own position. Every decode path uses the same
        span, so eager and captured steps give the same bits, and a short context does not pay for a long one."""
        return min(self.ctx, max(256, 1 << (n - 1).bit_length()))

    def spans(self) -> list[int]:
        """Every span a decode step can use."""
        out, n = [], 1
        while not out or out[-1] < self.ctx:
            out.append(self.span(n))
            n = out[-1] + 1
        return out

    @staticmethod
    def nbytes_for(n_layers: int, n_seq: int, ctx: int, n_kv: int, hd: int, dtype) -> int:
        return 2 * n_layers * n_seq * n_kv * ctx * hd * torch.empty((), dtype=dtype).element_size()

    def write(self, layer: int, seq_ids: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        # Advanced indices on dims 0 and 2 around a slice: the indexed view is (T, nkv, hd), k's own shape.
        self.k[layer][seq_ids, :, positions] = k
        self.v[layer][seq_ids, :, positions] = v
