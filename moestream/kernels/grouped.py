"""The CUDA expert kernel: every expert of a layer in two grouped GEMMs (no Python loop over experts).

`torch._grouped_mm` multiplies row group g of the sorted input by slot g's weights. Groups are all S slots, in
slot order; empty groups cost nothing. Reads weights straight from their slots: no gather, no staging copy.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import sort_by_slot


def grouped_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(device)[0] >= 9)


def experts_grouped(x: torch.Tensor, slots: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Same signature and result layout as experts_reference: x (T, H), slots (T, k) -> (T, k, H)."""
    T, k = slots.shape
    inter = w2.shape[-1]
    order, counts = sort_by_slot(slots, w13.shape[0])
    offs = torch.cumsum(counts, 0, dtype=torch.int32)                     # (S,) end row of each group
    xs = x[order // k]                                                    # (T*k, H)
    gu = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)            # (T*k, 2I)
    h = F.silu(gu[:, :inter]) * gu[:, inter:]
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)               # (T*k, H)
    out = torch.empty_like(y)
    out[order] = y
    return out.view(T, k, -1)
