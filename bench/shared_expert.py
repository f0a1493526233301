"""The shared expert of a decode step (kernels/shared_expert.py) against its torch form (models/moe.py's _shared),
one GPU:

    python bench/shared_expert.py [--hidden 2048] [--inter 512] [--tokens 1,2,4,8,16] [--reps 50]
                                  [--configs 4x2048x8/16x512x4,2x2048x4/8x512x4]

Each call is one layer's shared expert: x, out (T, H) bf16, gate and up (I, H), down (H, I), the gate (1, H). The
calls cycle through LAYERS copies of the weights (16 x 6 MiB at Qwen3-Next's H = 2048, I = 512: more than the 60 MB
L2), so each reads its weights from HBM, as a decode step's layers do; LAYERS calls are captured in one CUDA graph,
as the engine's decode steps are, and each replay is timed (CUDA events) and divided by LAYERS. Each cell:
microseconds a call (median of `reps` replays, after warm-up) and, in brackets, GB/s of the weight bytes a call
reads (3 I H + H elements). --configs: block shapes of the kernel, BLOCK_IxBLOCK_HxWARPS/BLOCK_OxBLOCK_IxWARPS
(the module's GATE_UP and DOWN first). `vs torch`: |kernel - torch| / |torch| at the largest T. Prints markdown.
"""
import argparse
import types

import torch

from graph_timing import graph_ms

from moestream.kernels.shared_expert import DOWN, GATE_UP, shared_expert
from moestream.models.moe import _shared

ap = argparse.ArgumentParser()
ap.add_argument("--hidden", type=int, default=2048)
ap.add_argument("--inter", type=int, default=512)
ap.add_argument("--tokens", default="1,2,4,8,16")
ap.add_argument("--reps", type=int, default=50)
ap.add_argument("--configs", default="", help="more block shapes, BIxBHxW/BOxBIxW, comma list")
ns = ap.parse_args()
H, I, LAYERS = ns.hidden, ns.inter, 16
NAMES = ("ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight", "ffn_gate_inp_shexp.weight")


def parse(spec: str) -> tuple:
    a, b = spec.split("/")
    return tuple(int(v) for v in a.split("x")), tuple(int(v) for v in b.split("x"))


def timed(fn) -> float:
    """Median milliseconds of one call; call i takes layer i's weights; the LAYERS calls replayed as one graph."""
    return graph_ms(fn, LAYERS, ns.reps)


g = torch.Generator(device="cuda").manual_seed(0)
shapes = ((I, H), (I, H), (H, I), (1, H))
layers = [{n: (torch.randn(*s, device="cuda", generator=g) * s[1] ** -0.5).to(torch.bfloat16)
           for n, s in zip(NAMES, shapes)} for _ in range(LAYERS)]
cfg = types.SimpleNamespace(shared_expert_intermediate_size=I)
nbytes = (3 * I * H + H) * 2
configs = [(GATE_UP, DOWN)] + [parse(c) for c in ns.configs.split(",") if c]
tokens = [int(t) for t in ns.tokens.split(",")]
print(f"shared expert, H={H}, I={I}, bf16: us a call (GB/s of its {nbytes / 2 ** 20:.2f} MiB of weights)\n")
print("| form | " + " | ".join(f"T={T}" for T in tokens) + " | vs torch |\n|---|" + "---|" * (len(tokens) + 1))
inputs = {T: (torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16),
              (0.1 * torch.randn(T, H, device="cuda", generator=g)).to(torch.bfloat16)) for T in tokens}
forms = [("torch", lambda x, lw, out: _shared(x, lw, cfg, out))]
forms += [(f"kernel {'x'.join(map(str, a))}/{'x'.join(map(str, b))}",
           lambda x, lw, out, c=(a, b): shared_expert(x, *(lw[n] for n in NAMES), out, c)) for a, b in configs]
x8, out8 = inputs[tokens[-1]]
want = _shared(x8, layers[0], cfg, out8).float()
for name, form in forms:
    cells = []
    for T in tokens:
        x, out = inputs[T]
        ms = timed(lambda i: form(x, layers[i], out))
        cells.append(f"{1e3 * ms:.1f} ({nbytes / ms / 1e6:.0f})")
    got = form(x8, layers[0], out8).float()
    print(f"| {name} | " + " | ".join(cells) + f" | {((got - want).norm() / want.norm()).item():.1e} |", flush=True)
