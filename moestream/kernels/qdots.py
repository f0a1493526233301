"""Dot products of GGML rows with a float vector, by sub-block (Triton): the decode kernel's inner loop.

    acc = row_dots(mat, ro, rmask, vec_ptr, kv_ptr, QT, NB, BS, TS, NSUB, SUB, BB)   # ro (R,) -> (R,) float32

Rows `mat + ro` (a uint8 pointer and the rows' int32 byte offsets from it) against `vec` (NB blocks of BS values).
kernels/qblocks.py makes each value (`d * sc * q - dmin * m`) and multiplies it by x; here, as llama.cpp's MMVQ
does, the scales leave the inner product: per sub-block

    d * sc * sum(q x) - dmin * m * sum(x)

with q the sub-block's integers (exact in float32), so a value costs a byte extract, a conversion and a
multiply-add; the scales cost a few loads per sub-block of 16 or 32 values, and sum(x) is made once per tile for
all R rows. The quants are read as contiguous runs of bytes (16 or 32 a run), which the compiler loads as words
where the pointers' alignment allows: call with a `mat` whose alignment the compiler can see (kernels/
decode_quant.py passes a 16-aligned base when the address is). The bits depend on the bytes only: alignment
changes the load instructions, never the arithmetic.

Q4_K, Q5_K, Q6_K and Q8_0 have this path (`SUBBLOCK_TYPES`); the other types go through `value_dots`, the
value-by-value product of kernels/qblocks.py's `block_values`.
"""
from __future__ import annotations

from gguf import GGMLQuantizationType as Q

from .qblocks import SHAPES, triton

SUBBLOCK_TYPES = (Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)


def step_blocks(qtype, n_blocks: int, step_values: int) -> int:
    """Blocks of a row per step: the largest power of two dividing n_blocks, at most step_values values (so no
    block of a step is masked: a down row of I=768 is 3 Q4_K blocks, read one block a step)."""
    bs = SHAPES[qtype][0]
    bb = 1
    while n_blocks % (2 * bb) == 0 and 2 * bb * bs <= step_values:
        bb *= 2
    return bb


if triton is not None:
    import triton.language as tl

    from .qblocks import _f16, _u8, block_values

    @triton.jit
    def value_dots(p, rmask, vec_ptr, kv_ptr, QT: tl.constexpr, NB: tl.constexpr, BS: tl.constexpr,
                   TS: tl.constexpr, NSUB: tl.constexpr, SUB: tl.constexpr, BB: tl.constexpr):
        """(R,) float32: rows p (R,) (uint8 pointers to rows of NB blocks) against vec (NB BS), value by value."""
        j = tl.arange(0, NSUB)[None, None, :, None]
        l = tl.arange(0, SUB)[None, None, None, :]
        acc = tl.zeros(p.shape, dtype=tl.float32)
        for b0 in range(0, NB, BB):
            b = b0 + tl.arange(0, BB)[None, :, None, None]                                  # (1, BB, 1, 1)
            bmask = b < NB
            m = rmask[:, None, None, None] & bmask
            v = block_values(p[:, None, None, None] + b * TS, j, l, m, kv_ptr, QT)          # (R, BB, NSUB, SUB)
            xv = tl.load(vec_ptr + b * BS + j * SUB + l, mask=bmask & (j >= 0) & (l >= 0), other=0.0)
            acc += tl.sum(tl.sum(tl.sum(v * xv.to(tl.float32), axis=3), axis=2), axis=1)
        return acc

    @triton.jit
    def _scale_min(p, j, m):
        """Q4_K/Q5_K: sub-block j's 6-bit scale and min (as float32) from the 12 bytes at p + 4."""
        a = _u8(p + 4 + j, m)
        b = _u8(p + 8 + j, m)
        c = _u8(p + 4 + j % 4, m)
        sc = tl.where(j < 4, a & 63, (b & 15) | ((c >> 6) << 4))
        mn = tl.where(j < 4, b & 63, (b >> 4) | ((a >> 6) << 4))
        return sc.to(tl.float32), mn.to(tl.float32)

    @triton.jit
    def _q4k_step(p2, m2, b, vec_ptr, QT: tl.constexpr):
        """(R, BB) partial dots of Q4_K/Q5_K blocks p2 (R, BB): the 32 bytes of qs pair g hold sub-block 2g in
        their low nibbles, 2g + 1 in their high ones (Q5_K: the 5th bit of value l of sub-block j is bit j of
        qh[l])."""
        g3 = tl.arange(0, 4)[None, None, :]                                                  # (1, 1, 4)
        g = g3[:, :, :, None]
        l = tl.arange(0, 32)[None, None, None, :]                                           # (1, 1, 1, 32)
        p3, m3 = p2[:, :, None], m2[:, :, None]
        p4, m4 = p3[:, :, :, None], m3[:, :, :, None]
        QS: tl.constexpr = 16 if QT == 12 else 48
        q = _u8(p4 + QS + 32 * g + l, m4)                                                   # (R, BB, 4, 32)
        lo = q & 15
        hi = q >> 4
        if QT == 13:
            qh = _u8(p4 + 16 + l, m4)                                                       # (R, BB, 1, 32)
            lo = lo | (((qh >> (2 * g)) & 1) << 4)
            hi = hi | (((qh >> (2 * g + 1)) & 1) << 4)
        xo = b[:, :, None, None] * 256 + 64 * g + l                                         # (1, BB, 4, 32)
        xl = tl.load(vec_ptr + xo).to(tl.float32)
        xh = tl.load(vec_ptr + xo + 32).to(tl.float32)
        s_lo = tl.sum(lo.to(tl.float32) * xl, axis=3)                                       # (R, BB, 4)
        s_hi = tl.sum(hi.to(tl.float32) * xh, axis=3)
        x_lo = tl.sum(xl, axis=3)                                                           # (1, BB, 4)
        x_hi = tl.sum(xh, axis=3)
        sc_lo, mn_lo = _scale_min(p3, 2 * g3, m3)                                           # (R, BB, 4)
        sc_hi, mn_hi = _scale_min(p3, 2 * g3 + 1, m3)
        qx = tl.sum(sc_lo * s_lo + sc_hi * s_hi, axis=2)                                    # (R, BB)
        mx = tl.sum(mn_lo * x_lo + mn_hi * x_hi, axis=2)
        return _f16(p2, m2) * qx - _f16(p2 + 2, m2) * mx

    @triton.jit
    def _q6k_step(p2, m2, b, vec_ptr):
        """(R, BB) partial dots of Q6_K blocks p2 (R, BB). Index hs = 2 h + s of the tile: half h of the block
        (128 values), run s of 16 values; part k (0..3) of it is sub-block 8 h + 2 k + s, values
        128 h + 32 k + 16 s + l: the low 4 bits from ql (byte 64 h + 32 (k % 2) + 16 s + l, nibble k // 2), the
        high 2 from qh (byte 128 + 32 h + 16 s + l, bits 2 k); q - 32 by sum(q x) - 32 sum(x)."""
        hs3 = tl.arange(0, 4)[None, None, :]                                                # (1, 1, 4)
        hs = hs3[:, :, :, None]
        l = tl.arange(0, 16)[None, None, None, :]                                           # (1, 1, 1, 16)
        p3, m3 = p2[:, :, None], m2[:, :, None]
        p4, m4 = p3[:, :, :, None], m3[:, :, :, None]
        run = 64 * (hs // 2) + 16 * (hs % 2) + l                                            # (1, 1, 4, 16)
        qa = _u8(p4 + run, m4)                                                              # (R, BB, 4, 16)
        qb = _u8(p4 + 32 + run, m4)
        qh = _u8(p4 + 128 + 32 * (hs // 2) + 16 * (hs % 2) + l, m4)
        xo = b[:, :, None, None] * 256 + 128 * (hs // 2) + 16 * (hs % 2) + l                # (1, BB, 4, 16)
        sc = p3 + 192 + 8 * (hs3 // 2) + hs3 % 2                                            # (R, BB, 4)
        acc = tl.zeros(p2.shape, dtype=tl.float32)
        for k in tl.static_range(4):
            half = qa if k % 2 == 0 else qb
            q = ((half >> (4 * (k // 2))) & 15) | (((qh >> (2 * k)) & 3) << 4)
            xk = tl.load(vec_ptr + xo + 32 * k).to(tl.float32)
            s = tl.sum(q.to(tl.float32) * xk, axis=3) - 32.0 * tl.sum(xk, axis=3)           # (R, BB, 4)
            sk = tl.load(sc + 2 * k, mask=m3, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            acc += tl.sum(sk * s, axis=2)
        return _f16(p2 + 208, m2) * acc

    @triton.jit
    def _q8_step(p2, m2, b, vec_ptr):
        """(R, BB) partial dots of Q8_0 blocks p2 (R, BB): d, 32 int8."""
        l = tl.arange(0, 32)[None, None, :]
        q = tl.load(p2[:, :, None] + 2 + l, mask=m2[:, :, None], other=0).to(tl.int8, bitcast=True)
        xv = tl.load(vec_ptr + b[:, :, None] * 32 + l).to(tl.float32)                       # (1, BB, 32)
        return _f16(p2, m2) * tl.sum(q.to(tl.float32) * xv, axis=2)

    @triton.jit
    def row_dots(mat, ro, rmask, vec_ptr, kv_ptr, QT: tl.constexpr, NB: tl.constexpr, BS: tl.constexpr,
                 TS: tl.constexpr, NSUB: tl.constexpr, SUB: tl.constexpr, BB: tl.constexpr):
        """(R,) float32: rows mat + ro (ro (R,) int32 byte offsets) against vec (NB BS). BB divides NB."""
        if QT == 8 or QT == 12 or QT == 13 or QT == 14:
            acc = tl.zeros(ro.shape, dtype=tl.float32)
            for b0 in range(0, NB, BB):
                b = b0 + tl.arange(0, BB)[None, :]                                          # (1, BB)
                p2 = mat + (ro[:, None] + b * TS)                                           # (R, BB)
                m2 = rmask[:, None] & (b >= 0)
                if QT == 8:
                    part = _q8_step(p2, m2, b, vec_ptr)
                elif QT == 14:
                    part = _q6k_step(p2, m2, b, vec_ptr)
                else:
                    part = _q4k_step(p2, m2, b, vec_ptr, QT)
                acc += tl.sum(part, axis=1)
        else:
            acc = value_dots(mat + ro, rmask, vec_ptr, kv_ptr, QT, NB, BS, TS, NSUB, SUB, BB)
        return acc
