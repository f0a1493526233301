"""kernels/gemv.py's decode GEMVs against cuBLAS (F.linear) on the reference models' one-token projections, by
tile (weights a program reads, TILE) and warps: µs a call, each call replayed from a CUDA graph of 50 (no launch
cost), and the weights' GB/s, and the tile and warps with the least time over all of them; then norm_route at 128
and 512 experts against the eager router and top-k.

    python bench/gemv.py [--tiles 2048,4096,8192,16384] [--warps 2,4,8]
"""
import argparse

import torch
import torch.nn.functional as F
from graph_timing import graph_ms

from moestream.kernels import gemv
from moestream.models.router import route

ap = argparse.ArgumentParser()
ap.add_argument("--tiles", default="2048,4096,8192,16384")
ap.add_argument("--warps", default="2,4,8")
ns = ap.parse_args()
SHAPES = {"30B qkv": (5120, 2048), "30B o": (2048, 4096), "Next ssm_proj": (12352, 2048),
          "Next attn qkv": (9216, 2048), "Next ssm_out / o": (2048, 4096)}


def timed(fn) -> float:
    """µs a call of fn, 50 calls replayed from one CUDA graph (median of 5 replays)."""
    return 1e3 * graph_ms(lambda i: fn(), 50, 5)


total = {}                      # (tile, warps) -> µs summed over the projections
print("| projection (N x K) | cuBLAS µs | " + " | ".join(f"tile {t} / {w} warps" for t in ns.tiles.split(",")
                                                for w in ns.warps.split(",")) + " |")
for name, (N, K) in SHAPES.items():
    x = torch.randn(1, K, device="cuda").bfloat16()
    d, nw = torch.randn_like(x), torch.rand(K, device="cuda").bfloat16()
    w = torch.randn(N, K, device="cuda").bfloat16()
    gb = N * K * 2 / 1e3
    row = [f"{timed(lambda: F.linear(x, w)):.1f}"]
    for t in ns.tiles.split(","):
        for wp in ns.warps.split(","):
            gemv.TILE, gemv.GEMV_WARPS = int(t), int(wp)
            us = timed(lambda: gemv.norm_linear(x, d, nw, 1e-6, w))
            total[t, wp] = total.get((t, wp), 0.0) + us
            row.append(f"{us:.1f} ({gb / us:.0f})")
    print(f"| {name} ({N} x {K}) | " + " | ".join(row) + " |", flush=True)

best = min(total, key=total.get)
print(f"\nleast in total: tile {best[0]}, {best[1]} warps ({total[best]:.1f} µs over the projections)")
print("\n| router (E x 2048), top-k | eager: F.linear + softmax + top-k µs | norm_route µs |")
for E, k in ((128, 8), (512, 10)):
    x = torch.randn(1, 2048, device="cuda").bfloat16()
    d, nw = torch.randn_like(x), torch.rand(2048, device="cuda").bfloat16()
    r = torch.randn(E, 2048, device="cuda").bfloat16()
    print(f"| {E}, {k} | {timed(lambda: route(x + d, r, k, True)):.1f} | "
          f"{timed(lambda: gemv.norm_route(x, d, nw, 1e-6, r, k, True, torch.bfloat16)):.1f} |", flush=True)
