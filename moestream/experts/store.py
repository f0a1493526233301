"""Expert weights as flat rows: one contiguous range per expert, gate (I, H) | up (I, H) | down (H, I).

One row is one expert, so one copy moves one expert. A layer's ExpertLayout (quant/layout.py) says how a row reads:
typed rows of the model's dtype read as stacked weights (views, no copy); a quantized file's rows are its GGUF
blocks (an FP8 checkpoint's: its e4m3 bytes and block scales), uint8, which the kernels dequantize as they read them:

    w13, w2 = layout.views(rows)      # float rows (n, numel): (n, 2I, H) and (n, H, I)
    store.layer_bytes(layer)          # one expert's bytes in that layer: what an upload moves
"""
from __future__ import annotations

import torch

from ..quant.layout import ExpertLayout


def fill_layer(rows: torch.Tensor, source, layer: int, layout: ExpertLayout) -> None:
    """Copy every expert of `layer` from a WeightSource into rows (E, row): float rows cast to rows' dtype, or a
    quantized layout's raw blocks."""
    if layout.quantized:
        for e in range(rows.shape[0]):
            rows[e].copy_(source.expert_bytes(layer, e))
        return
    w13, w2 = layout.views(rows)
    inter = layout.inter
    for e in range(rows.shape[0]):
        gate, up, down = source.expert(layer, e)
        w13[e, :inter].copy_(gate)
        w13[e, inter:].copy_(up)
        w2[e].copy_(down)


class ExpertStore:
    """The host tier: per host-resident layer, an (E, row) tensor in pinned memory, filled once at load, and the
    layer's layout (one for every layer, or a dict per layer: a quantized file's layers may differ in types)."""

    def __init__(self, rows: dict[int, torch.Tensor], layouts: ExpertLayout | dict[int, ExpertLayout]):
        self.rows = rows                       # layer -> (E, row) pinned
        self.layouts = layouts if isinstance(layouts, dict) else dict.fromkeys(rows, layouts)

    @property
    def expert_bytes(self) -> int:
        """The bytes of the largest expert row: what a slot of the GPU cache holds."""
        return max(r.shape[1] * r.element_size() for r in self.rows.values())

    def layer_bytes(self, layer: int) -> int:
        r = self.rows[layer]
        return r.shape[1] * r.element_size()

    @property
    def quantized(self) -> bool:
        return any(lay.quantized for lay in self.layouts.values())

    @property
    def nbytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self.rows.values())

    def aligned16(self, *tensors) -> bool:
        """Whether every host row, every row of `tensors` (device rows: slots, scratch; None skipped) and every
        layer's row bytes are 16-byte aligned (a staged copy then moves 128-bit words: kernels/stage.py)."""
        rows = [*self.rows.values(), *(t for t in tensors if t is not None)]
        return all(r.data_ptr() % 16 == 0 and (r.stride(0) * r.element_size()) % 16 == 0 for r in rows) and \
            all(self.layer_bytes(l) % 16 == 0 for l in self.rows)
