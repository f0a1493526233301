"""The plain-torch expert kernel: the CPU path, and the oracle every fast kernel is tested against."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def sort_by_slot(slots: torch.Tensor, n_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Order of the T*k (token, choice) rows grouped by slot, token order kept inside a group; rows per slot.

    The stable sort keeps each expert's rows in the same order whatever slot it sits in, so its GEMM sees the
    same input wherever the cache put it.
    """
    flat = slots.reshape(-1)                                              # (T*k,)
    order = torch.sort(flat, stable=True).indices                         # (T*k,)
    counts = torch.zeros(n_slots, dtype=torch.int32, device=slots.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # (S,): no host sync, graph-safe
    return order, counts


def experts_reference(x: torch.Tensor, slots: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """x (T, H), slots (T, k) -> (T, k, H): for each used slot, silu(x W_gate^T) * (x W_up^T) W_down^T."""
    T, k = slots.shape
    inter = w2.shape[-1]
    order, counts = sort_by_slot(slots, w13.shape[0])
    xs = x[order // k]                                                    # (T*k, H), grouped by slot
    out = torch.empty(T * k, x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for s, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        rows = order[start:start + n]
        gu = F.linear(xs[start:start + n], w13[s])                         # (n, 2I): gate then up
        h = F.silu(gu[:, :inter]) * gu[:, inter:]
        out[rows] = F.linear(h, w2[s])                                    # (n, H)
        start += n
    return out.view(T, k, -1)
