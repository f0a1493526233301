"""The CUDA expert kernel: every expert of a layer in two grouped GEMMs (no Python loop over experts).

`torch._grouped_mm` multiplies row group g of the sorted input by slot g's weights. Groups are all S slots, in
slot order; empty groups cost nothing. Reads weights straight from their slots: no gather, no staging copy.
One launch takes at most MAX_GROUPS groups, so a larger cache pool runs in segments of slots (one launch per
segment that has rows; finding the row ranges costs one host sync, which host-resident layers pay anyway).
"""
from __future__ import annotations

import torch

from .reference import OaiSwiglu, down_bias, glu, sort_by_slot


def grouped_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cuda" and dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(device)[0] >= 9)


MAX_GROUPS = 1023          # torch._grouped_mm takes fewer than 1024 groups per launch


def _expert_mlp(xs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor,
                act: OaiSwiglu | None = None, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Rows xs (n, H) grouped by slot (offs: end row of each slot's group) -> (n, H); `act`: gpt-oss's activation
    and the biases of each row's expert `ids` (n,), added in torch between and after the GEMMs."""
    inter = w2.shape[-1]
    gu = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)            # (n, 2I): gate then up
    h = glu(gu, inter, act, ids)
    return down_bias(torch._grouped_mm(h, w2.transpose(1, 2), offs=offs), act, ids)     # (n, H)


def experts_grouped(x: torch.Tensor, slots: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    act: OaiSwiglu | None = None) -> torch.Tensor:
    """Same signature and result layout as experts_reference: x (T, H), slots (T, k) -> (T, k, H)."""
    T, k = slots.shape
    S = w13.shape[0]
    order, counts = sort_by_slot(slots, S)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)                     # (S,) end row of each group
    xs = x[order // k]                                                    # (T*k, H)
    ids = act.ids.reshape(-1)[order] if act is not None else None        # (T*k,) each sorted row's expert
    if S <= MAX_GROUPS:
        y = _expert_mlp(xs, w13, w2, offs, act, ids)
    elif xs.is_cuda and torch.cuda.is_current_stream_capturing():
        y = _segments_without_sync(xs, w13, w2, offs, act, ids)
    else:
        starts = range(0, S, MAX_GROUPS)
        ends = offs[MAX_GROUPS - 1::MAX_GROUPS].tolist()[:len(starts) - 1] + [T * k]     # one host sync
        y = torch.empty_like(xs)
        r0 = 0
        for a, r1 in zip(starts, ends):
            if r1 > r0:
                b = min(a + MAX_GROUPS, S)
                y[r0:r1] = _expert_mlp(xs[r0:r1], w13[a:b], w2[a:b], offs[a:b] - r0, act,
                                       ids[r0:r1] if ids is not None else None)
            r0 = r1
    out = torch.empty_like(y)
    out[order] = y
    return out.view(T, k, -1)


def _segments_without_sync(xs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offs: torch.Tensor,
                           act: OaiSwiglu | None = None, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Segments of slots with no host sync (inside a CUDA graph capture): every launch takes all rows; a segment
    [a, b) runs as groups a-1 .. b-1 where group a-1 absorbs every row before the segment (computed, discarded),
    and rows after it are left out. Each slot's rows still meet only their own weights: the same bits."""
    n, S = xs.shape[0], w13.shape[0]
    rows = torch.arange(n, device=xs.device)
    y = torch.zeros_like(xs)
    a = 0
    while a < S:
        if a == 0:
            b = min(MAX_GROUPS, S)
            seg_offs, g13, g2, start = offs[:b], w13[:b], w2[:b], None
        else:
            b = min(a + MAX_GROUPS - 1, S)
            start = offs[a - 1]
            seg_offs, g13, g2 = offs[a - 1:b], w13[a - 1:b], w2[a - 1:b]
        part = _expert_mlp(xs, g13, g2, seg_offs, act, ids)
        inside = rows < offs[b - 1]
        if start is not None:
            inside &= rows >= start
        y = torch.where(inside[:, None], part, y)
        a = b
    return y
