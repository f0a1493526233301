"""The quantized-expert kernels on the reference expert shape (I=768, H=2048), one GPU:

    python bench/quant_kernels.py [--experts 50] [--reps 50]

dequant: kernels/dequant.py's dequantize_rows of 50 experts (a prompt ubatch's routed experts of one layer) to
bf16, per type; GB/s counts the bytes read (the blocks) and written (bf16 values). decode: one
experts_by_address_quant call, T = 1 and 8 tokens, k = 8, rows in device memory, against kernels/decode.py's bf16
experts_by_address on the same shape, and T = 1 and 8 with every row read from pinned host memory; each quantized
layout in both variants of kernels/decode_quant.py ("subblocks", the default, and "values", the first kernel), side
by side. Median of `reps` timed calls (CUDA events) after warm-up. Prints markdown.
"""
import argparse
import statistics

import torch
from gguf import GGMLQuantizationType as Q

from moestream.kernels.decode import experts_by_address
from moestream.kernels.decode_quant import experts_by_address_quant
from moestream.kernels.dequant import dequantize_rows
from moestream.quant.layout import ExpertLayout
from moestream.quant.types import type_size

ap = argparse.ArgumentParser()
ap.add_argument("--experts", type=int, default=50)
ap.add_argument("--reps", type=int, default=50)
ns = ap.parse_args()
I, H, K = 768, 2048, 8
SCALES = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q5_0: (0,), Q.IQ4_NL: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2),
          Q.Q6_K: (208,), Q.IQ4_XS: (0,)}


def rows_of(lay: ExpertLayout, n: int) -> torch.Tensor:
    """(n, nbytes) uint8 on the GPU: random blocks, every float16 scale 0.01 (finite values)."""
    rows = torch.randint(0, 256, (n, lay.nbytes), dtype=torch.uint8, device="cuda")
    for t, off, size in zip(lay.types, lay.offsets, lay.sizes):
        blocks = rows[:, off:off + size].view(n, -1, type_size(t))
        for s in SCALES[t]:
            blocks[..., s:s + 2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8).cuda()
    return rows


def timed(fn) -> float:
    """Median milliseconds of one call."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(ns.reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


print(f"dequantize_rows: {ns.experts} experts of I={I}, H={H} to bf16\n")
print("| types | MB read | MB written | ms | GB/s |\n|---|---|---|---|---|")
for types in ((Q.Q8_0,) * 3, (Q.Q4_0,) * 3, (Q.Q5_0,) * 3, (Q.Q4_K,) * 3, (Q.Q5_K,) * 3, (Q.Q6_K,) * 3,
              (Q.IQ4_NL,) * 3, (Q.IQ4_XS,) * 3, (Q.Q4_K, Q.Q4_K, Q.Q6_K)):
    lay = ExpertLayout(I, H, types)
    rows = rows_of(lay, 64)
    index = torch.randperm(64, device="cuda")[:ns.experts]
    ms = timed(lambda: dequantize_rows(rows, index, lay, torch.bfloat16))
    read, written = ns.experts * lay.nbytes, ns.experts * lay.numel * 2
    name = ",".join(t.name for t in types) if len(set(types)) > 1 else types[0].name
    print(f"| {name} | {read / 1e6:.0f} | {written / 1e6:.0f} | {ms:.3f} | {(read + written) / ms / 1e6:.0f} |")

print(f"\nexperts_by_address: one decode call, k={K}, I={I}, H={H}, rows on the GPU (host: pinned host rows)\n")
print("| types | variant | MB an expert | T=1 us | T=8 us | T=1 host us | T=8 host us |\n|---|---|---|---|---|---|---|")
E = 64
g = torch.Generator(device="cuda").manual_seed(0)
for types in (None, (Q.Q8_0,) * 3, (Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q4_K,) * 3, (Q.Q6_K,) * 3, (Q.Q5_K,) * 3):
    if types is None:
        lay = ExpertLayout(I, H)
        rows = (torch.randn(E, lay.numel, device="cuda", generator=g) * H ** -0.5).to(torch.bfloat16)
        kernels, mb, name = [("-", lambda x, a, w: experts_by_address(x, a, w, I))], lay.numel * 2e-6, "bf16"
    else:
        lay = ExpertLayout(I, H, types)
        rows = rows_of(lay, E)
        kernels = [(v, lambda x, a, w, lay=lay, v=v: experts_by_address_quant(x, a, w, lay, variant=v))
                   for v in ("subblocks", "values")]
        mb = lay.nbytes / 1e6
        name = ",".join(t.name for t in types) if len(set(types)) > 1 else types[0].name
    step = rows.stride(0) * rows.element_size()
    host = rows.cpu().pin_memory()
    for variant, kernel in kernels:
        us = []
        for T, where in ((1, rows), (8, rows), (1, host), (8, host)):
            gi = torch.Generator(device="cuda").manual_seed(T)
            ids = torch.stack([torch.randperm(E, device="cuda", generator=gi)[:K] for _ in range(T)])
            x = torch.randn(T, H, device="cuda", generator=gi).to(torch.bfloat16)
            w = torch.softmax(torch.randn(T, K, device="cuda", generator=gi), -1).to(torch.bfloat16)
            addrs = where.data_ptr() + ids * step
            us.append(1e3 * timed(lambda: kernel(x, addrs, w)))
        print(f"| {name} | {variant} | {mb:.2f} | " + " | ".join(f"{u:.1f}" for u in us) + " |")
