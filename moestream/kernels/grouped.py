"""The CUDA expert kernel: every expert of a layer in two grouped GEMMs (no Python loop over experts).

`torch._grouped_mm` multiplies row group g of the sorted input by slot g's weights. Groups are all S slots, in
slot order; empty groups cost nothing. Reads weights straight from their slots: no gather, no staging copy.
One launch takes at most MAX_GROUPS groups, so a larger cache pool runs in segments of slots (one launch per
segment that has rows; finding the row ranges costs one host sync, which host-resident layers pay anyway).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import sort_by_slot


def grouped_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(device)[0] >= 9)


MAX_GROUPS = 1023          # torch._grouped_mm takes fewer than 1024 groups per launch


def _expert_mlp(xs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows xs (n, H) grouped by slot (offs: end row of each slot's group) -> (n, H)."""
    inter = w2.shape[-1]
    gu = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)            # (n, 2I): gate then up
    h = F.silu(gu[:, :inter]) * gu[:, inter:]
    return torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)            # (n, H)


def experts_grouped(x: torch.Tensor, slots: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Same signature and result layout as experts_reference: x (T, H), slots (T, k) -> (T, k, H)."""
    T, k = slots.shape
    S = w13.shape[0]
    order, counts = sort_by_slot(slots, S)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)                     # (S,) end row of each group
    xs = x[order // k]                                                    # (T*k, H)
    if S <= MAX_GROUPS:
        y = _expert_mlp(xs, w13, w2, offs)
    else:
        y = torch.empty_like(xs)
        ends = offs[MAX_GROUPS - 1::MAX_GROUPS].tolist() + [T * k]      # end row of each segment of slots
        r0 = 0
        for i, r1 in enumerate(ends):
            if r1 > r0:
                a = i * MAX_GROUPS
                b = min(a + MAX_GROUPS, S)
                y[r0:r1] = _expert_mlp(xs[r0:r1], w13[a:b], w2[a:b], offs[a:b] - r0)
            r0 = r1
    out = torch.empty_like(y)
    out[order] = y
    return out.view(T, k, -1)
