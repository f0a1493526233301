"""Reading expert rows from pinned host memory, one GPU: what the link gives a decode step's host reads.

    python bench/host_reads.py [--reps 20] [--blocks 16384,65536,262144] [--warps 4,8] [--misses 1,2,4] [--only-misses]

1. The copy engine (torch's pinned -> device copy): one token's 8 experts as one copy and as 8, and 256 MB.
2. kernels/stage.py's copy launch alone (the step's host-read experts into device scratch rows), by the bytes
   a program moves (BLOCK_BYTES) and warps: T=1 (8 experts) and T=8 (64 choices).
3. A decode layer's experts, k=8 (I=768, H=2048), every choice a host read: the expert kernel reading in place
   against staging then reading the copies, for Q4_K_M rows (the "runs" kernel) and bf16 rows; the outputs must
   be the same bits.
4. A decode step's usual layer: one token, M of its 8 choices on host and the rest in device slots (a cache's
   misses), Q4_K_M: the copy launch by BLOCK_BYTES and warps, and the layer (copy, then the kernel) against the
   kernel with every choice on the device: what M misses add to a layer.

Calls run from CUDA graphs (bench/graph_timing.py) and cycle through disjoint experts (128 in all), so no call
finds the previous calls' rows in L2. Each cell: µs a call and, in brackets, GB/s of the host rows read.
"""
import argparse

import torch
from gguf import GGMLQuantizationType as Q
from graph_timing import graph_ms

from moestream.kernels import stage
from moestream.kernels.decode import experts_by_address
from moestream.kernels.decode_quant import experts_by_address_quant
from moestream.kernels.stage import Landing, stage_host_rows
from moestream.quant.layout import ExpertLayout
from moestream.quant.types import type_size

ap = argparse.ArgumentParser()
ap.add_argument("--reps", type=int, default=20)
ap.add_argument("--blocks", default="16384,65536,262144")
ap.add_argument("--warps", default="4,8")
ap.add_argument("--misses", default="1,2,4")
ap.add_argument("--only-misses", action="store_true", help="only section 4")
ns = ap.parse_args()
I, H, K, E = 768, 2048, 8, 128


def q4km_rows(lay: ExpertLayout, n: int) -> torch.Tensor:
    rows = torch.randint(0, 256, (n, lay.nbytes), dtype=torch.uint8, device="cuda")
    for t, off, size in zip(lay.types, lay.offsets, lay.sizes):
        blocks = rows[:, off:off + size].view(n, -1, type_size(t))
        for s in {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}[t]:
            blocks[..., s:s + 2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8).cuda()
    return rows


def id_sets(T: int, g) -> list[torch.Tensor]:
    """(T, K) ids per call, calls on disjoint windows of the E experts (so each call reads cold rows)."""
    W = min(E // 2, T * K)
    order = torch.randperm(E, generator=g)
    return [torch.stack([order[r * W:(r + 1) * W][torch.randperm(W, generator=g)[:K]] for _ in range(T)]).cuda()
            for r in range(E // W)]


def us(fn, n) -> float:
    return 1e3 * graph_ms(fn, n, ns.reps)


def misses(lay: ExpertLayout) -> None:
    """Section 4: one token's layer with M host reads among device hits."""
    rows = q4km_rows(lay, E)
    nbytes = rows.stride(0) * rows.element_size()
    host = rows.cpu().pin_memory()
    host_tab = host.data_ptr() + torch.arange(E, device="cuda") * nbytes
    dev_tab = rows.data_ptr() + torch.arange(E, device="cuda") * nbytes
    scratch = torch.empty(64, nbytes, dtype=torch.uint8, device="cuda")
    none = torch.zeros(0, dtype=torch.int64, device="cuda")
    sets = id_sets(1, g)
    gx = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, H, device="cuda", generator=gx).to(torch.bfloat16)
    w = torch.softmax(torch.randn(1, K, device="cuda", generator=gx), -1).to(torch.bfloat16)
    kernel = lambda a: experts_by_address_quant(x, a, w, lay)
    hits = [dev_tab[ids] for ids in sets]
    base = us(lambda i: kernel(hits[i]), len(sets))
    print(f"\n## Q4_K_M, one token, M of its {K} choices on host ({nbytes / 1e6:.2f} MB an expert)\n")
    print(f"every choice on the device: {base:.1f} µs\n")
    print("| M | BLOCK_BYTES / warps | copy launch µs (GB/s) | layer µs | added µs (GB/s) | same bits |")
    print("|---:|---|---:|---:|---:|---|")
    for M in map(int, ns.misses.split(",")):
        on_host = torch.arange(K, device="cuda") < M
        addrs = [torch.where(on_host, host_tab[ids], dev_tab[ids]) for ids in sets]
        lans = [Landing(ids, host_tab, none, scratch, aligned=True) for ids in sets]
        for b in ns.blocks.split(","):
            for wp in ns.warps.split(","):
                stage.BLOCK_BYTES, stage.WARPS = int(b), int(wp)
                c = us(lambda i: stage_host_rows(addrs[i], lans[i], nbytes), len(sets))
                t = us(lambda i: kernel(stage_host_rows(addrs[i], lans[i], nbytes)), len(sets))
                same = torch.equal(kernel(hits[0]), kernel(stage_host_rows(addrs[0], lans[0], nbytes)))
                gb = M * nbytes / 1e3
                print(f"| {M} | {b} / {wp} | {c:.1f} ({gb / c:.1f}) | {t:.1f} | {t - base:.1f} ({gb / (t - base):.1f}) "
                      f"| {same} |", flush=True)
    stage.BLOCK_BYTES, stage.WARPS = 65536, 8


g = torch.Generator().manual_seed(0)
if ns.only_misses:
    misses(ExpertLayout(I, H, (Q.Q4_K, Q.Q4_K, Q.Q6_K)))
    raise SystemExit
print("## The copy engine (pinned -> device)\n\n| copy | µs | GB/s |\n|---|---:|---:|")
src = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
dst = torch.empty_like(src, device="cuda")
eb = 3059712                                             # a Q4_K_M expert of the reference
for name, n, parts in (("8 experts, one copy", 8 * eb, 1), ("8 experts, 8 copies", 8 * eb, 8),
                       ("256 MB", 256 << 20, 1)):
    step = n // parts

    def copy(i, n=n, parts=parts, step=step):
        for p in range(parts):
            dst[p * step:(p + 1) * step].copy_(src[p * step:(p + 1) * step], non_blocking=True)
    t = us(copy, 4)
    print(f"| {name} | {t:.1f} | {n / t / 1e3:.1f} |", flush=True)

layouts = {"Q4_K_M": ExpertLayout(I, H, (Q.Q4_K, Q.Q4_K, Q.Q6_K)), "bf16": ExpertLayout(I, H)}
for name, lay in layouts.items():
    if lay.quantized:
        rows = q4km_rows(lay, E)
        kernel = lambda x, a, w, lay=lay: experts_by_address_quant(x, a, w, lay)
    else:
        rows = (torch.randn(E, lay.numel, device="cuda") * H ** -0.5).to(torch.bfloat16)
        kernel = lambda x, a, w: experts_by_address(x, a, w, I)
    nbytes = rows.stride(0) * rows.element_size()
    host = rows.cpu().pin_memory()
    host_tab = host.data_ptr() + torch.arange(E, device="cuda") * nbytes
    scratch = torch.empty(64, nbytes, dtype=torch.uint8, device="cuda")
    none = torch.zeros(0, dtype=torch.int64, device="cuda")
    print(f"\n## {name} rows ({nbytes / 1e6:.2f} MB an expert), every choice read from host\n")
    print("| T | copy launch: BLOCK_BYTES / warps | µs | GB/s |\n|---:|---|---:|---:|")
    cases = {}
    for T in (1, 8):
        sets = id_sets(T, g)
        addrs = [host_tab[ids] for ids in sets]
        lans = [Landing(ids, host_tab, none, scratch, aligned=True) for ids in sets]
        distinct = sum(int(ids.unique().numel()) for ids in sets) / len(sets)
        cases[T] = sets, addrs, lans
        for b in ns.blocks.split(","):
            for w in ns.warps.split(","):
                stage.BLOCK_BYTES, stage.WARPS = int(b), int(w)
                t = us(lambda i: stage_host_rows(addrs[i], lans[i], nbytes), len(sets))
                print(f"| {T} | {b} / {w} | {t:.1f} | {distinct * nbytes / t / 1e3:.1f} |", flush=True)
    stage.BLOCK_BYTES, stage.WARPS = 65536, 8
    print("\n| T | in place µs (GB/s) | staged µs (GB/s) | same bits |\n|---:|---:|---:|---|")
    for T in (1, 8):
        sets, addrs, lans = cases[T]
        gx = torch.Generator(device="cuda").manual_seed(T)
        x = torch.randn(T, H, device="cuda", generator=gx).to(torch.bfloat16)
        w = torch.softmax(torch.randn(T, K, device="cuda", generator=gx), -1).to(torch.bfloat16)
        reads = sum(int(ids.unique().numel()) for ids in sets) / len(sets) * nbytes
        a = us(lambda i: kernel(x, addrs[i], w), len(sets))
        b = us(lambda i: kernel(x, stage_host_rows(addrs[i], lans[i], nbytes), w), len(sets))
        same = torch.equal(kernel(x, addrs[0], w), kernel(x, stage_host_rows(addrs[0], lans[0], nbytes), w))
        print(f"| {T} | {a:.1f} ({reads / a / 1e3:.1f}) | {b:.1f} ({reads / b / 1e3:.1f}) | {same} |", flush=True)
    del rows, host, scratch

misses(layouts["Q4_K_M"])
