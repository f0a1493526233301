"""The byte readers of kernels/qblocks.py, and its decoders of Q2_K, Q3_K and the grid IQ types (Triton).

    vals = iq_values(p, v, m, table_ptr, QT)      # value v of the blocks at p, float32, gguf.quants' bits

The grid types store indices: a grid of 4 or 8 values an index (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S,
IQ1_M), signs as bits or as indices into the sign table (ksigns: 7 bits -> 8 of even parity), and scales per
sub-block. The grids and ksigns are read from the device table qblocks.kvalues makes (qblocks.TABLE); their
offsets are the numbers in this file (tests/test_quant_kernels.py checks them against qblocks.TABLE_OFFSETS).
Each value is computed with quant/dequant_iq.py's float32 operations in their order (d * (0.5 + s) * 0.25, then
* grid, then * sign; dl * (grid + delta)), which are gguf.quants', so the bits are the reference's.
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:
    @triton.jit
    def _u8(p, m):
        return tl.load(p, mask=m, other=0).to(tl.int32)

    @triton.jit
    def _half(bits):
        """16 bits of an f16, as float32 (exact)."""
        return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _u16(p, m):
        return _u8(p, m) | (_u8(p + 1, m) << 8)

    @triton.jit
    def _f16(p, m):
        """The little-endian float16 at p, as float32 (exact)."""
        return _half(_u16(p, m))

    @triton.jit
    def _sign(bits, e):
        """+1.0 where bit e of bits is clear, -1.0 where it is set."""
        return 1.0 - 2.0 * ((bits >> e) & 1).to(tl.float32)

    @triton.jit
    def _ksign(tab, aux, c, e):
        """The sign of value e of chunk c: bit e of ksigns[(aux >> 7 c) & 127] (aux: the low 28 bits of a u32)."""
        return _sign(tl.load(tab + 16 + ((aux >> (7 * c)) & 127)).to(tl.int32), e)

    @triton.jit
    def _u32_low28(p, m):
        """Bits 0..27 of the little-endian u32 at p (the sign indices; the top nibble is a scale)."""
        return _u8(p, m) | (_u8(p + 1, m) << 8) | (_u8(p + 2, m) << 16) | ((_u8(p + 3, m) & 15) << 24)

    @triton.jit
    def _nibble(p, i, m):
        """4-bit field i of the bytes at p, low nibble first."""
        return (_u8(p + i // 2, m) >> (4 * (i % 2))) & 15

    @triton.jit
    def k23_values(p, v, m, QT: tl.constexpr):
        """Q2_K (QT 10) and Q3_K (11): value v of 256; 16 sub-blocks of 16 values, 2-bit quants in 4 planes of
        each half's 32 bytes."""
        sb = v // 16
        h = v // 128
        s = (v % 128) // 32
        i = v % 32
        if QT == 10:           # scales (16: scale | min << 4), qs (64), d, dmin
            q = (_u8(p + 16 + 32 * h + i, m) >> (2 * s)) & 3
            sc = _u8(p + sb, m)
            dl = _f16(p + 80, m) * (sc & 15).to(tl.float32)
            ml = _f16(p + 82, m) * (sc >> 4).to(tl.float32)
            out = dl * q.to(tl.float32) - ml
        else:                  # hmask (32), qs (64), 12 bytes of 6-bit scales, d; a clear hmask bit subtracts 4
            low = (_u8(p + 96 + sb % 8, m) >> (4 * (sb // 8))) & 15
            high = (_u8(p + 104 + sb % 4, m) >> (2 * (sb // 4))) & 3
            dl = _f16(p + 108, m) * ((low | (high << 4)).to(tl.float32) - 32.0)
            ql = (_u8(p + 32 + 32 * h + i, m) >> (2 * s)) & 3
            hm = ((_u8(p + v % 32, m) >> (v // 32)) & 1) ^ 1
            out = dl * (ql - (hm << 2)).to(tl.float32)
        return out

    @triton.jit
    def iq_values(p, v, m, tab, QT: tl.constexpr):
        """Value v of 256 of the grid-type blocks at p (tab: the device table, qblocks.TABLE)."""
        kk = v // 8            # the 8-value grid index of an IQ2 or IQ1 block
        e = v % 8
        if QT == 16:           # IQ2_XXS: d, 8 groups of (4 grid indices, u32: 4 x 7 sign bits | scale << 28)
            gp = p + 2 + 8 * (v // 32)
            db = _f16(p, m) * (0.5 + (_u8(gp + 7, m) >> 4).to(tl.float32)) * 0.25
            grid = tl.load(tab + 144 + _u8(gp + (v % 32) // 8, m) * 8 + e)
            out = db * grid * _ksign(tab, _u32_low28(gp + 4, m), (v % 32) // 8, e)
        elif QT == 17:         # IQ2_XS: d, 32 u16 (9-bit grid index | 7-bit sign index << 9), 16 4-bit scales
            q = _u16(p + 2 + 2 * kk, m)
            db = _f16(p, m) * (0.5 + _nibble(p + 66, v // 16, m).to(tl.float32)) * 0.25
            grid = tl.load(tab + 2192 + (q & 511) * 8 + e)
            out = db * grid * _sign(tl.load(tab + 16 + (q >> 9)).to(tl.int32), e)
        elif QT == 22:         # IQ2_S: d, qs (32), sign bits (32), qh (8: 2 high index bits each), scales (8)
            index = _u8(p + 2 + kk, m) | (((_u8(p + 66 + kk // 4, m) >> (2 * (kk % 4))) & 3) << 8)
            db = _f16(p, m) * (0.5 + _nibble(p + 74, v // 16, m).to(tl.float32)) * 0.25
            grid = tl.load(tab + 6288 + index * 8 + e)
            out = db * grid * _sign(_u8(p + 34 + kk, m), e)
        elif QT == 18:         # IQ3_XXS: d, 64 4-value grid indices, 8 u32 (4 x 7 sign bits | scale << 28)
            ap = p + 66 + 4 * (v // 32)
            db = _f16(p, m) * (0.5 + (_u8(ap + 3, m) >> 4).to(tl.float32)) * 0.5
            grid = tl.load(tab + 14480 + _u8(p + 2 + v // 4, m) * 4 + v % 4)
            out = db * grid * _ksign(tab, _u32_low28(ap, m), (v % 32) // 8, e)
        elif QT == 21:         # IQ3_S: d, qs (64), qh (8: the 9th index bits), sign bits (32), scales (4)
            k4 = v // 4
            index = _u8(p + 2 + k4, m) | (((_u8(p + 66 + k4 // 8, m) >> (k4 % 8)) & 1) << 8)
            db = _f16(p, m) * (1 + 2 * _nibble(p + 106, v // 32, m)).to(tl.float32)
            grid = tl.load(tab + 15504 + index * 4 + v % 4)
            out = db * grid * _sign(_u8(p + 74 + kk, m), e)
        elif QT == 19:         # IQ1_S: d, qs (32), 8 u16 (4 x 3 high index bits | scale << 12 | delta sign << 15)
            qh = _u16(p + 34 + 2 * (v // 32), m)
            dl = _f16(p, m) * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
            delta = 0.125 - 0.25 * (qh >> 15).to(tl.float32)
            index = _u8(p + 2 + kk, m) | (((qh >> (3 * (kk % 4))) & 7) << 8)
            out = dl * (tl.load(tab + 17552 + index * 8 + e) + delta)
        else:                  # IQ1_M (29): qs (32), qh (16 bytes: a nibble an index), 4 u16 scales (the f16 d in
            sb = v // 16       # their top nibbles)
            bits = ((_u8(p + 49, m) >> 4) | ((_u8(p + 51, m) >> 4) << 4) | ((_u8(p + 53, m) >> 4) << 8)
                    | ((_u8(p + 55, m) >> 4) << 12))
            s = (_u16(p + 48 + 2 * (sb // 4), m) >> (3 * (sb % 4))) & 7
            dl = _half(bits) * (2 * s + 1).to(tl.float32)
            nib = _nibble(p + 32, kk, m)
            index = _u8(p + kk, m) | ((nib & 7) << 8)
            delta = 0.125 - 0.25 * (nib >> 3).to(tl.float32)
            out = dl * (tl.load(tab + 17552 + index * 8 + e) + delta)
        return out
