"""The activation between a decode kernel's two projections, SwiGLU or gpt-oss's (kernels/reference.py's
OaiSwiglu), in Triton: what the zero-copy decode kernels (decode.py, decode_grouped.py, decode_quant.py,
decode_runs.py, fp8.py) call on their float32 gate and up sums, and on each choice's down sums.

    ids, b13, b2, OAI, LIMIT, ALPHA = act_args(act, x)         # the launch arguments (act None: plain SwiGLU)
    h = glu(g, u, b13 + e * 2 * I + rows, m, I, OAI, LIMIT, ALPHA)     # silu(g) u, or gpt-oss's
    h = glu_at(g, u, ids, pair, b13, rows, m, I, OAI, LIMIT, ALPHA)    # the same for choice `pair`, its id read
    y = down_bias(y, b2 + e * H + rows, m, OAI)                        # + the down bias, or y

gpt-oss: each choice's biases are read from the layer's (E, 2I) and (E, H) device tensors at its expert id
(ids[t, j], never its address or slot), added to the float32 sums, then gate clamped above at LIMIT and up to
[-LIMIT, LIMIT], (up + 1) * (gate * sigmoid(ALPHA gate)) in the reference's order of operations. OAI is a
constexpr: with it off the kernels compile the code they had before the option, the same bits.
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:          # the CPU build of torch has no Triton: kernels/reference.py is the path there
    triton = None


def act_args(act, like) -> tuple:
    """(ids (T, k) int64, b13 (E, 2I), b2 (E, H), OAI, LIMIT, ALPHA) for a launch: an OaiSwiglu's tensors, or
    `like` (any tensor of the launch: never read) where act is None."""
    if act is None:
        return like, like, like, False, 0.0, 0.0
    return (act.ids.contiguous(), act.b13.contiguous(), act.b2.contiguous(), True, float(act.limit),
            float(act.alpha))


if triton is not None:
    @triton.jit
    def glu(g, u, bp, m, I: tl.constexpr, OAI: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr):
        """float32 g, u (any shape) -> silu(g) u; OAI: the gate biases at bp (bp + I: the up biases; mask m, both
        broadcasting like g) added first, then the clamps and (u + 1) (g sigmoid(ALPHA g))."""
        if OAI:
            g = g + tl.load(bp, mask=m, other=0.0).to(tl.float32)
            u = u + tl.load(bp + I, mask=m, other=0.0).to(tl.float32)
            g = tl.minimum(g, LIMIT)
            u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
            h = (u + 1.0) * (g * tl.sigmoid(g * ALPHA))
        else:
            h = g * tl.sigmoid(g) * u
        return h

    @triton.jit
    def glu_at(g, u, eid_ptr, pair, b13_ptr, rows, m, I: tl.constexpr, OAI: tl.constexpr, LIMIT: tl.constexpr,
               ALPHA: tl.constexpr):
        """glu of one choice's gate and up rows `rows` (mask m): the choice `pair` (t k + j) of a launch reads its
        expert's biases (OAI: the id at eid_ptr + pair); what the by-address kernels' gate/up programs end with."""
        e = 0
        if OAI:
            e = tl.load(eid_ptr + pair)
        return glu(g, u, b13_ptr + e * (2 * I) + rows, m, I, OAI, LIMIT, ALPHA)

    @triton.jit
    def down_bias(y, bp, m, OAI: tl.constexpr):
        """float32 y (a choice's down sums) plus the down biases at bp (mask m), where OAI; else y."""
        if OAI:
            y = y + tl.load(bp, mask=m, other=0.0).to(tl.float32)
        return y
