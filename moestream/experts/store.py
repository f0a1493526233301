"""Expert weights as flat rows: one contiguous range per expert, gate (I, H) | up (I, H) | down (H, I).

One row is one expert, so one copy moves one expert, and a (n, numel) tensor of rows reads as stacked weights:

    w13, w2 = expert_views(rows, inter, hidden)    # (n, 2I, H) and (n, H, I), views, no copy
"""
from __future__ import annotations

import torch


def expert_views(rows: torch.Tensor, inter: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked gate|up and down weights over rows (n, 3*I*H): views into the same memory."""
    n = rows.shape[0]
    split = 2 * inter * hidden
    return rows[:, :split].view(n, 2 * inter, hidden), rows[:, split:].view(n, hidden, inter)


def fill_layer(rows: torch.Tensor, source, layer: int, inter: int, hidden: int) -> None:
    """Copy every expert of `layer` from a WeightSource into rows (E, numel), casting to rows' dtype."""
    w13, w2 = expert_views(rows, inter, hidden)
    for e in range(rows.shape[0]):
        gate, up, down = source.expert(layer, e)
        w13[e, :inter].copy_(gate)
        w13[e, inter:].copy_(up)
        w2[e].copy_(down)


class ExpertStore:
    """The host tier: per host-resident layer, an (E, numel) tensor in pinned memory, filled once at load."""

    def __init__(self, rows: dict[int, torch.Tensor], inter: int, hidden: int):
        self.rows = rows                       # layer -> (E, numel) pinned
        self.inter, self.hidden = inter, hidden

    @property
    def expert_bytes(self) -> int:
        any_rows = next(iter(self.rows.values()))
        return any_rows.shape[1] * any_rows.element_size()

    @property
    def nbytes(self) -> int:
        return sum(r.numel() * r.element_size() for r in self.rows.values())
