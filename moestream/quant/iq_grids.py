"""The lattice tables ggml's IQ2_XXS, IQ2_XS, IQ1_S and IQ1_M quantizers search (iq2xs_init_impl), made from the grids
gguf.quants decodes with.

    g = lattice(Q.IQ2_XS, torch.device("cpu"))
    g.levels        # (512, 8) int64: each grid point's 8 levels in {0, 1, 2}
    g.index[u]      # the grid point whose levels pack (2 bits each, lowest first) to u; -1 when u is off the grid
    g.flat[g.start[u]:g.start[u] + g.count[u]]     # for an off-grid u: the grid points nearest it, ggml's order

A group of 8 values is rounded to levels; when that point is not on the grid, ggml picks among its neighbours: the
grid points at the nearest `nwant` distinct distances (2 for IQ2_XXS and IQ2_XS, 3 for IQ1_S and IQ1_M), ordered by
(distance, index). The lists are one flat table (18 to 73 entries on average, up to 292), so a whole chunk's
off-grid groups are scored in one pass over their candidates.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import gguf.quants
import torch
from gguf import GGMLQuantizationType as Q

MAP_SIZE = 43692        # ggml's kmap_size: every packing of 8 levels in {0, 1, 2} is below it
NWANT = {Q.IQ2_XXS: 2, Q.IQ2_XS: 2, Q.IQ1_S: 3, Q.IQ1_M: 3}


@dataclass(frozen=True)
class Lattice:
    levels: torch.Tensor        # (N, 8) int64 in {0, 1, 2}
    index: torch.Tensor         # (MAP_SIZE,) int64: packed levels -> grid point, -1 off the grid
    start: torch.Tensor         # (MAP_SIZE,) int64: where an off-grid point's candidates begin in flat
    count: torch.Tensor         # (MAP_SIZE,) int64: how many (0 on the grid)
    flat: torch.Tensor          # (K,) int64: the candidates of every off-grid point, one after the other
    onehot: torch.Tensor        # (24, N) float32: row 3 i + l is 1 where a grid point's value i is at level l


def pack(levels: torch.Tensor) -> torch.Tensor:
    """(..., 8) levels in {0, 1, 2} -> (...,) their 2-bit packing, lowest first (ggml's `u`)."""
    return (levels.long() << torch.arange(0, 16, 2, device=levels.device)).sum(-1)


@functools.cache
def lattice(qtype: Q, device: torch.device) -> Lattice:
    cls = getattr(gguf.quants, qtype.name)
    cls.init_grid()
    values = torch.tensor(cls.grid.reshape(cls.grid_shape), dtype=torch.float32)            # (N, 8)
    grid_map = torch.tensor(cls.grid_map, dtype=torch.float32)
    levels = (values.unsqueeze(-1) == grid_map).float().argmax(-1)                          # (N, 8) in {0, 1, 2}
    n = levels.shape[0]
    index = torch.full((MAP_SIZE,), -1, dtype=torch.long)
    index[pack(levels)] = torch.arange(n)
    # every point of {0, 1, 2}^8 off the grid, and its squared distance to each grid point (in ggml's 2l + 1 units)
    points = torch.cartesian_prod(*[torch.arange(3)] * 8).flip(-1)                          # (6561, 8)
    points = points[index[pack(points)] < 0]
    d2 = (4 * (points.unsqueeze(1) - levels.unsqueeze(0)) ** 2).sum(-1)                    # (P, N)
    order = (d2 * n + torch.arange(n)).argsort(-1)                                          # by (distance, index)
    d2_sorted = d2.gather(1, order)
    # rank of each distance among the row's distinct distances; keep the first NWANT of them
    rank = torch.cat([torch.zeros_like(d2_sorted[:, :1]), (d2_sorted.diff(dim=1) > 0).long()], 1).cumsum(1)
    keep = rank < NWANT[qtype]
    counts = keep.sum(1)
    start, count = torch.zeros(MAP_SIZE, dtype=torch.long), torch.zeros(MAP_SIZE, dtype=torch.long)
    count[pack(points)] = counts
    start[pack(points)] = counts.cumsum(0) - counts
    flat = order[keep]                                                  # row-major: each point's list in order
    onehot = torch.nn.functional.one_hot(levels, 3).permute(1, 2, 0).reshape(24, n).float()
    return Lattice(levels.to(device), index.to(device), start.to(device), count.to(device), flat.to(device),
                   onehot.to(device))


def nearest_neighbour(lat: Lattice, u: torch.Tensor, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                      values: torch.Tensor) -> torch.Tensor:
    """ggml's iq2_find_best_neighbour / iq1_find_best_neighbour2 for groups off the grid: u (G,) packed levels,
    x, w (G, 8), scale (G, 1), values (G, 3) the float each level stands for. The neighbour of u minimising
    sum w (scale * value - x)^2, the first such in ggml's order. Returns grid points (G,)."""
    G = u.shape[0]
    count = lat.count[u]
    group = torch.repeat_interleave(torch.arange(G, device=u.device), count)            # (K,): each candidate's group
    first = count.cumsum(0) - count
    pos = torch.arange(group.shape[0], device=u.device) - first[group]                 # its rank in the group's list
    cand = lat.flat[lat.start[u][group] + pos]                                          # (K,)
    # each value's term for each level, (G, 8, 3); a grid point's distance is the sum of its 8 levels' terms: one
    # product with the grid's one-hot levels (24, N) gives every grid point's, summed in ggml's order (value 0 first)
    diff = scale.unsqueeze(-1) * values.unsqueeze(1) - x.unsqueeze(-1)
    e = w.unsqueeze(-1) * diff * diff
    every = e.reshape(G, 24) @ lat.onehot                                               # (G, N)
    d2 = every.reshape(-1)[group * every.shape[1] + cand]
    best = torch.full((G,), float("inf"), device=u.device).scatter_reduce(0, group, d2, "amin")
    # the first candidate reaching the minimum, as ggml's strict `<` keeps it
    rank = torch.where(d2 == best[group], pos, torch.full_like(pos, 1 << 30))
    pick = torch.full((G,), 1 << 30, dtype=torch.long, device=u.device).scatter_reduce(0, group, rank, "amin")
    return lat.flat[lat.start[u] + pick]
