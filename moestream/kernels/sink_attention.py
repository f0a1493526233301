"""Prompt attention with gpt-oss's options (Triton, CUDA): flash attention whose softmax takes each head's sink logit
and whose sliding layers attend only their last `window` positions.

    o = sink_attention(q, k, v, sinks, window)     # q (1, nh, Tq, hd); k, v (1, nkv, Tk, hd) -> (1, nh, Tq, hd)
    o = sink_attention(q, k, v, sinks, window, start=p0)    # k, v a sliding layer's ring (1, nkv, R, hd)

The signature of models/layers.py's attention_sinks, its plain-torch oracle and the CPU path: q are the last Tq of the
Tk positions of k and v (the earlier ones the KV cache), any strides but a unit last one (views of the cache).

One program takes BLOCK queries of one head and walks the key blocks they may attend, from the first block of the
window of its first query (0 without a window) to the diagonal block of its last: an online softmax in float32,
started from the sink (max = sink, sum = exp(0) = 1, so the sink takes its mass and adds no value), the
probabilities rounded to the values' dtype for their product (as flash attention does). Nothing of the scores is
kept: a 4096-token ubatch of 64 heads reads each key block once per query block.

Key blocks start at multiples of BLOCK from position 0, and a block that masks a query out whole leaves its sums as
they were (times exp(0) = 1, plus 0): a query's output does not depend on how the prompt was split into ubatches,
only on its position and the keys (on the GPU each row of a tensor-core product is its own).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK = 64          # queries per program and keys per step (hd 64: gpt-oss's heads)


if triton is not None:
    @triton.jit
    def _sink_attention(q_ptr, k_ptr, v_ptr, sink_ptr, o_ptr, scale, start, Tq, ring,
                        q_h, q_t, k_h, k_t, v_h, v_t, o_h, o_t,
                        G: tl.constexpr, HD: tl.constexpr, BLOCK: tl.constexpr, WINDOW: tl.constexpr,
                        SINK: tl.constexpr, RING: tl.constexpr):
        """Program (query block, head): queries start + [block * BLOCK, + BLOCK) against the keys each attends
        (RING: key p at row p % ring of k and v)."""
        mb = tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // G
        rows = mb * BLOCK + tl.arange(0, BLOCK)
        live = rows < Tq
        pos = start + rows                                                   # (BLOCK,) the queries' positions
        d = tl.arange(0, HD)
        j = tl.arange(0, BLOCK)
        q = tl.load(q_ptr + h * q_h + rows[:, None] * q_t + d[None, :], mask=live[:, None], other=0.0)
        first = start + mb * BLOCK
        last = tl.minimum(first + BLOCK, start + Tq) - 1                     # the block's last query's position
        lo = 0
        if WINDOW > 0:
            lo = tl.maximum(first - WINDOW + 1, 0) // BLOCK * BLOCK
        if SINK:
            m = tl.zeros([BLOCK], dtype=tl.float32) + tl.load(sink_ptr + h).to(tl.float32)
            l = tl.full([BLOCK], 1.0, dtype=tl.float32)
        else:
            m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
            l = tl.zeros([BLOCK], dtype=tl.float32)
        acc = tl.zeros([BLOCK, HD], dtype=tl.float32)
        for kb in range(lo, last + 1, BLOCK):
            keys = kb + j
            there = keys <= last
            at = keys % ring if RING else keys                               # the keys' rows in k and v
            k = tl.load(k_ptr + kvh * k_h + at[:, None] * k_t + d[None, :], mask=there[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale                               # (BLOCK, BLOCK) float32
            allowed = keys[None, :] <= pos[:, None]
            if WINDOW > 0:
                allowed = allowed & (keys[None, :] > pos[:, None] - WINDOW)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            p = tl.exp(s - m_safe[:, None])
            v = tl.load(v_ptr + kvh * v_h + at[:, None] * v_t + d[None, :], mask=there[:, None], other=0.0)
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        out = acc / l[:, None]
        tl.store(o_ptr + h * o_h + rows[:, None] * o_t + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=live[:, None])


def sink_fits(q: torch.Tensor) -> bool:
    """Whether sink_attention takes q: Triton on CUDA, 16-bit, heads a power of two >= 16 wide (float32 would run
    its products in TF32: it takes attention_sinks)."""
    hd = q.shape[-1]
    return (triton is not None and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and hd >= 16
            and hd & (hd - 1) == 0)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                   window: int = 0, block: int = BLOCK, start: int | None = None) -> torch.Tensor:
    """models/layers.py's attention_sinks as one launch: q (1, nh, Tq, hd), the last Tq of the Tk positions of k, v
    (1, nkv, Tk, hd) -> (1, nh, Tq, hd); sinks (nh,) or None; window > 0: each query attends its last `window`
    positions. block: queries per program and keys per step (a power of two >= 16). start: the queries' first
    position where k, v are a sliding layer's ring (position p at row p % Tk; the key blocks still start at
    multiples of `block` from position 0, so the bits are a linear cache's)."""
    _, nh, Tq, hd = q.shape
    nkv, Tk = k.shape[1], k.shape[2]
    for t in (q, k, v):
        if t.stride(-1) != 1:
            raise ValueError(f"sink_attention: the head dim must be contiguous, strides {t.stride()}")
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    sink = sinks is not None
    _sink_attention[(triton.cdiv(Tq, block), nh)](
        q, k, v, sinks if sink else q, out, hd ** -0.5, Tk - Tq if start is None else start, Tq, Tk,
        q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2), out.stride(1), out.stride(2),
        nh // nkv, hd, block, window, sink, start is not None, num_warps=4)
    return out
