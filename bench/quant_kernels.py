"""The quantized-expert kernels on the reference expert shape (I=768, H=2048; --shape I,H,k for another), one GPU:

    python bench/quant_kernels.py [--experts 50] [--reps 50] [--variants values,runs] [--no-dequant]
                                  [--runs-shapes 128x4,64x2,256x8,128x4r,128x4o,128x4-2] [--no-graphs]
                                  [--types bf16,Q4_K_M]

dequant: kernels/dequant.py's dequantize_rows of 50 experts (a prompt ubatch's routed experts of one layer) to
bf16, per type; GB/s counts the bytes read (the blocks) and written (bf16 values).

decode: one experts_by_address_quant call, k = 8, T = 1 and 8 tokens, every row in device memory and every row in
pinned host memory (read in place over the link), in each variant of kernels/decode_quant.py, beside
kernels/decode.py's bf16 experts_by_address on the same shape; "runs AxW" rows are the runs variant with A units a
program and W warps (decode_runs.UNITS_A_STEP, WARPS; --runs-shapes, the default first), "AxWr" with a row's
block steps in a loop instead of unrolled (decode_runs.UNROLL = 0), "o" with x in the rows' order instead of the
lanes' (decode_runs.LANE_ORDER = False), "-1" / "-2" with one / two rows a down lane (DOWN_ROWS_A_LANE; by
default one at T=1, two at T=8), in that order ("128x4o-2"). Calls cycle
through disjoint sets of experts (of EXPERTS in all, 384-660 MB), so no call finds the previous calls' rows in the
60 MB L2: each call reads its rows from HBM or over the link, as a decode step's layer does. The calls run from a
CUDA graph, as the engine's decode steps do (--no-graphs: one by one, each paying its launches on the host: the
older tables' way). Each cell: microseconds a call (median of `reps` timed graph replays, CUDA events, after
warm-up) and, in brackets, GB/s: the T k expert rows the call reads (a token's 8 rows of 2.65-5.0 MB each) over
its time. `vs first`: |out - out_first| / |out_first| at T=8 against the first variant
listed (bf16 outputs: the variants round differently, and must agree to about bf16's precision). Q2_K, Q3_K and
the grid IQ types (IQ2_XXS ... IQ1_M) have no runs variant: their rows are "values" only. (The "subblocks" variant's rows:
bench/RESULTS.md, 2026-12-01; removed at stop 47.) Rows are random valid blocks (quant/dequant.py's random_blocks). Prints markdown.
"""
import argparse
import re
import statistics

import torch
from gguf import GGMLQuantizationType as Q
from graph_timing import graph_ms

from moestream.kernels.decode import experts_by_address
from moestream.kernels.decode_quant import experts_by_address_quant
from moestream.kernels import decode_runs
from moestream.kernels.decode_runs import runs_layout
from moestream.kernels.dequant import dequantize_rows
from moestream.quant.dequant import random_blocks
from moestream.quant.layout import ExpertLayout
from moestream.quant.types import type_size

ap = argparse.ArgumentParser()
ap.add_argument("--experts", type=int, default=50)
ap.add_argument("--reps", type=int, default=50)
ap.add_argument("--variants", default="values,runs")
ap.add_argument("--dequant", action=argparse.BooleanOptionalAction, default=True)
ap.add_argument("--runs-shapes", default="128x4", help="runs variant shapes, UNITSxWARPS[r][o][-1|-2], comma list")
ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=True)
ap.add_argument("--types", default=None, help="only these rows of the decode table, comma list of their names "
                "(bf16, Q4_K_M, Q8_0, ...)")
ap.add_argument("--shape", default="768,2048,8", help="I,H,k: the expert's shape and the choices a token "
                "(Qwen3-Next: 512,2048,10)")
ns = ap.parse_args()
I, H, K = (int(v) for v in ns.shape.split(","))
EXPERTS = 128
# Q2_K, Q3_K and the grid IQ types (kernels/qblocks_iq.py: "values" only)
GRID = ((Q.Q2_K,) * 3, (Q.Q3_K,) * 3, (Q.IQ2_XXS,) * 3, (Q.IQ2_XS,) * 3, (Q.IQ2_S,) * 3, (Q.IQ3_XXS,) * 3,
        (Q.IQ3_S,) * 3, (Q.IQ1_S,) * 3, (Q.IQ1_M,) * 3)


def rows_of(lay: ExpertLayout, n: int) -> torch.Tensor:
    """(n, nbytes) uint8 on the GPU: random valid blocks (quant/dequant.py's random_blocks: finite scales)."""
    g = torch.Generator().manual_seed(n)
    parts = [random_blocks(t, n * size // type_size(t), g).view(n, size) for t, size in zip(lay.types, lay.sizes)]
    return torch.cat(parts, 1).cuda()


def timed(fn, n_inputs: int = 1, graphs: bool = False) -> float:
    """Median milliseconds of one call; call i gets input i % n_inputs. graphs: the n_inputs calls captured in one
    CUDA graph, each replay timed and divided by n_inputs."""
    for i in range(max(5, n_inputs)):
        fn(i % n_inputs)
    if graphs:
        return graph_ms(fn, n_inputs, ns.reps)
    times = []
    for i in range(ns.reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(i % n_inputs)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def runs_shaped(x, addrs, w, lay, shape: str):
    """The runs variant of shape UNITSxWARPS[r][o][1|2] (the module's settings put back after)."""
    spec = re.fullmatch(r"(\d+)x(\d+)(r?)(o?)(?:-([12]))?", shape)
    units, warps, loop, rows, down_rows = spec.groups()
    names = ("UNITS_A_STEP", "WARPS", "UNROLL", "LANE_ORDER", "DOWN_ROWS_A_LANE")
    kept = [getattr(decode_runs, n) for n in names]
    values = (int(units), int(warps), 0 if loop else kept[2], not rows, down_rows and int(down_rows))
    for n, v in zip(names, values):
        setattr(decode_runs, n, v)
    try:
        return experts_by_address_quant(x, addrs, w, lay, variant="runs")
    finally:
        for n, v in zip(names, kept):
            setattr(decode_runs, n, v)


def name_of(types) -> str:
    return ",".join(t.name for t in types) if len(set(types)) > 1 else types[0].name


if ns.dequant:
    print(f"dequantize_rows: {ns.experts} experts of I={I}, H={H} to bf16\n")
    print("| types | MB read | MB written | ms | GB/s |\n|---|---|---|---|---|")
    for types in ((Q.Q8_0,) * 3, (Q.Q4_0,) * 3, (Q.Q5_0,) * 3, (Q.Q4_1,) * 3, (Q.Q5_1,) * 3, (Q.Q4_K,) * 3,
                  (Q.Q5_K,) * 3, (Q.Q6_K,) * 3, (Q.IQ4_NL,) * 3, (Q.IQ4_XS,) * 3, (Q.Q4_K, Q.Q4_K, Q.Q6_K)) + GRID:
        lay = ExpertLayout(I, H, types)
        blocks = rows_of(lay, 64)
        index = torch.randperm(64, device="cuda")[:ns.experts]
        ms = timed(lambda i: dequantize_rows(blocks, index, lay, torch.bfloat16))
        read, written = ns.experts * lay.nbytes, ns.experts * lay.numel * 2
        print(f"| {name_of(types)} | {read / 1e6:.0f} | {written / 1e6:.0f} | {ms:.3f} | "
              f"{(read + written) / ms / 1e6:.0f} |")
    print()


def id_sets(T: int, g: torch.Generator) -> list[torch.Tensor]:
    """(T, K) expert ids per call: call r's tokens choose among a window of W experts, the windows disjoint, so a
    call's rows were last read EXPERTS / W calls before (T=1: 16 calls, 384+ MB; T=8: 2 calls, 192+ MB)."""
    W = min(EXPERTS // 2, T * K)
    order = torch.randperm(EXPERTS, generator=g)
    sets = []
    for r in range(EXPERTS // W):
        window = order[r * W:(r + 1) * W]
        sets.append(torch.stack([window[torch.randperm(W, generator=g)[:K]] for _ in range(T)]).cuda())
    return sets


print(f"experts_by_address: one decode call, k={K}, I={I}, H={H}; us a call (GB/s of the T k rows it reads)\n")
print("| types | variant | MB an expert | T=1 | T=8 | host T=1 | host T=8 | vs first |\n"
      "|---|---|---|---|---|---|---|---|")
variants = ns.variants.split(",")
g = torch.Generator().manual_seed(0)
for types in (None, (Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q4_K,) * 3, (Q.Q6_K,) * 3, (Q.Q8_0,) * 3, (Q.Q5_K,) * 3,
              (Q.Q4_0,) * 3, (Q.Q4_1,) * 3, (Q.Q5_0,) * 3, (Q.Q5_1,) * 3, (Q.IQ4_NL,) * 3, (Q.IQ4_XS,) * 3,
              (Q.IQ4_XS, Q.IQ4_XS, Q.Q6_K)) + GRID:
    label = "bf16" if types is None else ("Q4_K_M" if types == (Q.Q4_K, Q.Q4_K, Q.Q6_K) else name_of(types))
    if ns.types is not None and label not in ns.types.split(","):
        continue
    if types is None:
        lay = ExpertLayout(I, H)
        rows = (torch.randn(EXPERTS, lay.numel, device="cuda") * H ** -0.5).to(torch.bfloat16)
        kernels, name = [("-", lambda x, a, w: experts_by_address(x, a, w, I))], "bf16"
        nbytes = lay.numel * 2
    else:
        lay = ExpertLayout(I, H, types)
        rows = rows_of(lay, EXPERTS)
        kernels = [(v, lambda x, a, w, lay=lay, v=v: experts_by_address_quant(x, a, w, lay, variant=v))
                   for v in variants if v != "runs"]
        if "runs" in variants and runs_layout(lay):
            kernels += [(f"runs {shape}", lambda x, a, w, lay=lay, shape=shape: runs_shaped(x, a, w, lay, shape))
                        for shape in ns.runs_shapes.split(",")]
        name, nbytes = name_of(types), lay.nbytes
    step = rows.stride(0) * rows.element_size()
    host = rows.cpu().pin_memory()
    inputs = {}
    for T in (1, 8):
        gx = torch.Generator(device="cuda").manual_seed(T)
        x = torch.randn(T, H, device="cuda", generator=gx).to(torch.bfloat16)
        w = torch.softmax(torch.randn(T, K, device="cuda", generator=gx), -1).to(torch.bfloat16)
        inputs[T] = x, w, id_sets(T, g)
    first = None
    for variant, kernel in kernels:
        cells = []
        for where, T in ((rows, 1), (rows, 8), (host, 1), (host, 8)):
            x, w, sets = inputs[T]
            addrs = [where.data_ptr() + ids * step for ids in sets]
            ms = timed(lambda i: kernel(x, addrs[i], w), len(addrs), ns.graphs)
            cells.append(f"{1e3 * ms:.1f} ({T * K * nbytes / ms / 1e6:.0f})")
        x, w, sets = inputs[8]
        out = kernel(x, rows.data_ptr() + sets[0] * step, w).float()
        first = out if first is None else first
        vs = "-" if out is first else f"{((out - first).norm() / first.norm()).item():.1e}"
        print(f"| {name} | {variant} | {nbytes / 1e6:.2f} | " + " | ".join(cells) + f" | {vs} |", flush=True)
    del rows, host
