"""The "runs" decode kernel's per-type unit routines (Triton): a unit's runs loaded as words, then its dot products
with x. The units, runs and parts of each type are kernels/qruns.py's (its docstring's table, UNITS).

    ws, ws2 = unit_words(blk, blk2, c, m, m2, al, QT, A16, TWO)     # the units' words, loaded once
    acc, acc2 = unit_dots(ws, ws2, c, m | m2, xp, one, QT, TWO)     # (L,) float32: each unit's share of a dot

A lane loads its runs as words (a 16-byte vector where the compiler knows the run is 16-aligned, ALIGNED; else
aligned words and a funnel shift, any address), turns each field into the float 1 + q / 2**BITS with two integer
operations (q at the top of the mantissa: exact, no int-to-float conversion), and multiplies it by x:

    S_p = sum f x = sum x + sum q x / 2**BITS,     so   sum (a q + b) x = a 2**BITS S_p + (b - a 2**BITS) X_p

with X_p = sum x, made from the same x in the same lane. The scales apply once a part (`alpha_p S_p + beta_p
X_p`), in the lane: no value leaves its lane before the row's sum. The bits depend on the bytes alone: the
alignment changes the loads, never the arithmetic (unit_words loads, unit_dots computes). The values differ from
gguf.quants' (the scales are factored out and the products are fused), so this path is checked against the
float32 oracle, not bit for bit.

IQ4_NL's and IQ4_XS's values are d kvalues[q] (IQ4_XS: d (ls - 32) kvalues[q], ls a sub-block's 6-bit scale), a
codebook that is not affine in q: `_kv4` makes each kvalues[q] from its nibble alone, exactly, in the lane, with
the two integer operations of 1 + q / 16 and five float ones: a quartic in f = 1 + q / 16 whose error on the 16
codes is under 0.434, rounded to the integer by adding 1.5 * 2**23 (where a float32's ulp is 1), less 1.5 * 2**23.
Then S_p = sum kvalues[q] x, beta_p = 0 and no X_p. The alternatives cost more: a load of the table a value
(a memory instruction each), tl.gather (shuffles), or llama.cpp's byte permutes (PRMT: inline assembly, which
Triton's interpreter does not run, and in the compiled SASS libdevice's __nv_byte_perm took more instructions
than the quartic).

MXFP4's codes are e2m1 values, doubled (quant/mxfp4.py): `_fp4` writes each as a float32's bits with integer
operations alone (c = 2 e + m: c < 2 is c, else exponent e and mantissa m), exact; alpha_p is the block's power of
two, so S_p = sum kvalues[q] x, no X_p, as for IQ4.
"""
from __future__ import annotations

from .qblocks import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _scalar(p, m):
        """(L,) uint32 at the word pointers p (L,), through an (L, 4) load of which only element 0 is live: its
        layout is the runs' (L, 4) layout, so nothing moves between lanes."""
        w = tl.arange(0, 4)[None, :]
        v = tl.load(p[:, None] + w * 0, mask=m[:, None] & (w == 0), other=0)
        return tl.sum(v, axis=1)

    @triton.jit
    def _funnel(lo, hi, sh):
        """The word sh bits into lo:hi (uint32, sh in 0, 8, 16, 24; hi is 0 where sh is 0): one 64-bit funnel
        shift on the GPU (SHF.R.U64)."""
        return ((hi.to(tl.uint64) << 32 | lo.to(tl.uint64)) >> sh.to(tl.uint64)).to(tl.uint32)

    @triton.jit
    def _word(A, m, N: tl.constexpr):
        """(L,) uint32: the little-endian word at byte addresses A (L,) int64, any alignment, of which the low N
        bytes are wanted (the rest are 0 where no wanted byte is in the second aligned word). The second word is
        read only where it holds a wanted byte: a block's last field (Q6_K's d) may end a buffer, and the word past
        it may not be mapped (an illegal address on the GPU: Qwen3-Next's 512 Q4_K_M experts fill whole 2 MiB
        segments). A word that holds a wanted byte lies inside the buffer's mapped pages."""
        p = ((A >> 2) << 2).to(tl.pointer_type(tl.uint32))
        sh = ((A & 3) * 8).to(tl.uint32)
        lo = _scalar(p, m)
        hi = _scalar(p + 1, m & (sh + 8 * N > 32))
        return _funnel(lo, hi, sh)

    @triton.jit
    def _run(A, m, ALIGNED: tl.constexpr):
        """(L, 4) uint32: the 4 words at byte addresses A (L,) int64 (16-aligned if ALIGNED, else any)."""
        w = tl.arange(0, 4)[None, :]
        if ALIGNED:
            p = tl.multiple_of(A.to(tl.pointer_type(tl.uint32)), 16)
            v = tl.load(p[:, None] + w, mask=m[:, None], other=0)
        else:
            p = ((A >> 2) << 2).to(tl.pointer_type(tl.uint32))
            sh = ((A & 3) * 8).to(tl.uint32)[:, None]
            lo = tl.load(p[:, None] + w, mask=m[:, None], other=0)
            hi = tl.load(p[:, None] + w + 1, mask=m[:, None] & (sh != 0), other=0)
            v = _funnel(lo, hi, sh)
        return v

    @triton.jit
    def _pick(v, i: tl.constexpr):
        """Element i of each lane's 4 (v (L, 4) -> (L,)): a register, no data moves."""
        return tl.sum(tl.where(tl.arange(0, 4)[None, :] == i, v, 0), axis=1)

    @triton.jit
    def _f(v, s, one, BITS: tl.constexpr):
        """The BITS-bit fields at bit s of v (uint32, broadcasting) as 1 + q / 2**BITS, float32, exact. `one` is
        1.0's bits (0x3F800000) as a runtime value: held in a register, the mask-and-set is one LOP3."""
        P: tl.constexpr = 23 - BITS
        M: tl.constexpr = ((1 << BITS) - 1) << P
        return ((((v >> s) << P) & M) | one).to(tl.float32, bitcast=True)

    @triton.jit
    def _small(u):
        """Small non-negative ints (uint32) as float32, exact: 2**23 + u, less 2**23."""
        return (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0

    @triton.jit
    def _half(u):
        """The float16 in the low 16 bits of u (uint32), as float32."""
        return (u & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _int8(u):
        """The int8 in the low byte of u (uint32), as float32 (exact)."""
        return _small((u ^ 0x80) & 0xFF) - 128.0

    @triton.jit
    def _kv4(v, s, one):
        """IQ4's codebook (kernels/qblocks.py's KVALUES) at the nibbles at bit s of v (uint32, broadcasting), as
        float32, exact: the quartic in f = 1 + q / 16 (Horner), its float32 coefficients fitted to the 16 codes
        within 0.434 (a margin that holds with the multiply-adds fused or not), plus 1.5 * 2**23 in its last
        coefficient: the sum rounds to the integer there (a float32's ulp is 1), and the subtraction is exact."""
        f = _f(v, s, one, 4)
        y = tl.fma(f, 103.93415832519531, -288.38604736328125)
        y = tl.fma(y, f, -109.67660522460938)
        y = tl.fma(y, f, 1055.56103515625)
        y = tl.fma(y, f, 12582024.0)                  # 1.5 * 2**23 - 888
        return y - 12582912.0

    @triton.jit
    def _fp4(v, s):
        """MXFP4's codes (ggml's kvalues_mxfp4: e2m1 doubled) at the nibbles at bit s of v (uint32, broadcasting),
        as float32, exact: magnitude c = q & 7 is c where c < 2, else 2**(c >> 1) (1 + (c & 1) / 2); bit 3 the sign
        (code 8 is -0.0, which sums as +0.0 does)."""
        q = (v >> s) & 15
        c = q & 7
        bits = tl.where(c < 2, c * 0x3F800000, (((c >> 1) + 127) << 23) | ((c & 1) << 22))
        return (bits | ((q & 8) << 28)).to(tl.float32, bitcast=True)

    @triton.jit
    def _spread(u):
        """The low 4 bits of u (uint32) to bits 0, 8, 16 and 24 (bit b to 8 b): one multiply, one mask."""
        return ((u & 0xF) * 0x204081) & 0x01010101

    @triton.jit
    def _words(blk, c, m, QT: tl.constexpr, ALIGNED: tl.constexpr):
        """A unit's runs: blk (L,) int64 block addresses, c (L,) the unit in its block. Returns the quants' runs
        (four (L, 4), repeated where a type has fewer) and its scale words (four (L,))."""
        if QT == 12 or QT == 13:       # Q4_K, Q5_K: d, dmin | 12 bytes of scales | (qh 32 |) qs 128; unit c is
            hd = _run(blk, m, ALIGNED)  # the 32 bytes of qs holding sub-blocks 2c (low nibbles) and 2c + 1
            QS: tl.constexpr = 16 if QT == 12 else 48
            q0 = _run(blk + QS + 32 * c, m, ALIGNED)
            q1 = _run(blk + QS + 16 + 32 * c, m, ALIGNED)
            h0 = q0
            h1 = q1
            if QT == 13:               # the fifth bits of all 32 bytes of qh, bit j for sub-block j
                h0 = _run(blk + 16, m, ALIGNED)
                h1 = _run(blk + 32, m, ALIGNED)
            return q0, q1, h0, h1, _pick(hd, 0), _pick(hd, 1), _pick(hd, 2), _pick(hd, 3)
        elif QT == 14:                 # Q6_K: ql 128 | qh 64 | 16 int8 scales | d; unit c = 2 h + s
            h = c // 2
            s = c % 2
            qa = _run(blk + 64 * h + 16 * s, m, ALIGNED)
            qb = _run(blk + 64 * h + 32 + 16 * s, m, ALIGNED)
            qh = _run(blk + 128 + 32 * h + 16 * s, m, ALIGNED)
            sc0 = _word(blk + 192 + 8 * h, m, 4)
            sc1 = _word(blk + 196 + 8 * h, m, 4)
            d = _word(blk + 208, m, 2)
            return qa, qb, qh, qh, sc0, sc1, d, d
        elif QT == 2 or QT == 20:      # Q4_0, IQ4_NL: d | 16 bytes, value l's nibble in byte l % 16; a block a unit
            q0 = _run(blk + 2, m, ALIGNED)
            d = _word(blk, m, 2)
            return q0, q0, q0, q0, d, d, d, d
        elif QT == 3:                  # Q4_1: d, m | 16 bytes as Q4_0's
            q0 = _run(blk + 4, m, ALIGNED)
            dm = _word(blk, m, 4)
            return q0, q0, q0, q0, dm, dm, dm, dm
        elif QT == 6 or QT == 7:       # Q5_0: d | qh (4 bytes) | 16 bytes as Q4_0's; Q5_1: d, m | qh | 16 bytes
            QS: tl.constexpr = 6 if QT == 6 else 8
            q0 = _run(blk + QS, m, ALIGNED)
            dm = _word(blk, m, 4)
            return q0, q0, q0, q0, dm, _word(blk + QS - 4, m, 4), dm, dm   # qh: scale word s1
        elif QT == 39:                 # MXFP4: e8m0 | 16 bytes as Q4_0's; a block a unit
            q0 = _run(blk + 1, m, ALIGNED)
            e = _word(blk, m, 1)
            return q0, q0, q0, q0, e, e, e, e
        elif QT == 23:                 # IQ4_XS: d, scales_h (u16) | scales_l (4 bytes) | qs 128; unit c is the
            q0 = _run(blk + 8 + 32 * c, m, ALIGNED)      # 32 bytes of qs holding sub-blocks 2c and 2c + 1
            q1 = _run(blk + 24 + 32 * c, m, ALIGNED)
            hd = _word(blk, m, 4)
            sl = _word(blk + 4, m, 4)
            return q0, q1, q0, q1, hd, sl, hd, hd
        else:                          # Q8_0: d | 32 int8, the whole block a unit
            q0 = _run(blk + 2, m, ALIGNED)
            q1 = _run(blk + 18, m, ALIGNED)
            d = _word(blk, m, 2)
            return q0, q1, q0, q1, d, d, d, d

    @triton.jit
    def _fields(r0, r1, r2, r3, s1, c, one, p: tl.constexpr, w: tl.constexpr, QT: tl.constexpr):
        """(L, 4) float32: part p, word w of a unit (its 4 bytes' values, as 1 + q / 2**BITS; IQ4: kvalues[q]),
        from its runs r0..r3 and (Q5_0, Q5_1: qh) its scale word s1."""
        b8 = 8 * tl.arange(0, 4)[None, :]
        if QT == 12:                   # Q4_K: word w of the 32 qs bytes; part p: the nibble p of each byte
            v = _f(_pick(r0 if w < 4 else r1, w % 4)[:, None], b8 + 4 * p, one, 4)
        elif QT == 2 or QT == 3:       # Q4_0, Q4_1: word w of the 16 bytes, the nibble p
            v = _f(_pick(r0, w)[:, None], b8 + 4 * p, one, 4)
        elif QT == 20:                 # IQ4_NL: Q4_0's nibbles through the codebook
            v = _kv4(_pick(r0, w)[:, None], b8 + 4 * p, one)
        elif QT == 39:                 # MXFP4: Q4_0's nibbles as e2m1 codes
            v = _fp4(_pick(r0, w)[:, None], b8 + 4 * p)
        elif QT == 23:                 # IQ4_XS: part k: nibble k % 2 of run k // 2, word w
            v = _kv4(_pick(r0 if p < 2 else r1, w)[:, None], b8 + 4 * (p % 2), one)
        elif QT == 6 or QT == 7:       # Q5_0, Q5_1: and qh's bits 16 p + 4 w .. + 3, one a byte
            q = (_pick(r0, w) >> (4 * p)) & 0x0F0F0F0F
            v = _f((q | (_spread(s1 >> (16 * p + 4 * w)) << 4))[:, None], b8, one, 5)
        elif QT == 13:                 # Q5_K: and bit 2c + p of qh's byte
            q = (_pick(r0 if w < 4 else r1, w % 4) >> (4 * p)) & 0x0F0F0F0F
            hb = (_pick(r2 if w < 4 else r3, w % 4) >> (2 * c + p)) & 0x01010101
            v = _f((q | (hb << 4))[:, None], b8, one, 5)
        elif QT == 14:                 # Q6_K: part k: nibble k // 2 of ql run k % 2, bits 2k of qh
            lo = (_pick(r0 if p % 2 == 0 else r1, w) >> (4 * (p // 2))) & 0x0F0F0F0F
            hi = (_pick(r2, w) >> (2 * p)) & 0x03030303
            v = _f((lo | (hi << 4))[:, None], b8, one, 6)
        else:                          # Q8_0: the byte, offset to unsigned
            v = _f((_pick(r0 if w < 4 else r1, w % 4) ^ 0x80808080)[:, None], b8, one, 8)
        return v

    @triton.jit
    def _coefs(s0, s1, s2, s3, c, p: tl.constexpr, QT: tl.constexpr):
        """(alpha, beta) (L,) of part p: the part's sum is alpha S_p + beta X_p."""
        if QT == 12 or QT == 13:       # sub-block 2c + p: scale and min bytes 2c + p of the 8 of each
            scw = tl.where(c < 2, s1 & 0x3F3F3F3F, (s3 & 0x0F0F0F0F) | ((s1 >> 2) & 0x30303030))
            mnw = tl.where(c < 2, s2 & 0x3F3F3F3F, ((s3 >> 4) & 0x0F0F0F0F) | ((s2 >> 2) & 0x30303030))
            sh = 16 * (c % 2) + 8 * p
            sc = _small((scw >> sh) & 0xFF)
            mn = _small((mnw >> sh) & 0xFF)
            SCALE: tl.constexpr = 16.0 if QT == 12 else 32.0
            a = SCALE * _half(s0) * sc                     # d sc q - dmin m, q = SCALE (f - 1)
            b = -(a + _half(s0 >> 16) * mn)
        elif QT == 14:                 # d sc (q - 32), q = 64 (f - 1); scale byte 8 h + 2 p + s
            sw = s0 if p < 2 else s1
            sc = _int8(sw >> (8 * (2 * (p % 2) + c % 2)))
            a = 64.0 * _half(s2) * sc
            b = -1.5 * a
        elif QT == 2:                  # d (q - 8), q = 16 (f - 1)
            a = 16.0 * _half(s0)
            b = -1.5 * a
        elif QT == 6:                  # d (q - 16), q = 32 (f - 1)
            a = 32.0 * _half(s0)
            b = -1.5 * a
        elif QT == 3 or QT == 7:       # d q + m, q = 2**BITS (f - 1)
            SCALE: tl.constexpr = 16.0 if QT == 3 else 32.0
            a = SCALE * _half(s0)
            b = _half(s0 >> 16) - a
        elif QT == 20:                 # d kvalues[q]: S_p is sum kvalues[q] x, and no X_p (b unused: SX)
            a = _half(s0)
            b = a
        elif QT == 39:                 # 2**(e - 128) kvalues[q] (ggml_e8m0_to_fp32_half; e < 2: subnormal)
            e = s0 & 0xFF
            a = tl.where(e < 2, 0x00200000 << tl.minimum(e, 1), (e - 1) << 23).to(tl.float32, bitcast=True)
            b = a
        elif QT == 23:                 # sub-block j = 2c + k // 2: d (ls - 32), ls = 4 bits of scales_l byte c
            sh = 4 * (p // 2)          # (nibble j % 2), 2 of scales_h (bits 2 j)
            ls = ((s1 >> (8 * c + sh)) & 0xF) | (((s0 >> (16 + 4 * c + p // 2 * 2)) & 0x3) << 4)
            a = _half(s0) * (_small(ls) - 32.0)
            b = a
        else:                          # d (u - 128), u = 256 (f - 1)
            a = 256.0 * _half(s0)
            b = -1.5 * a
        return a, b

    @triton.jit
    def _xoff(c, p: tl.constexpr, QT: tl.constexpr):
        """(L,) position in its block of part p's first value of unit c (the part's values follow: 4 w + b)."""
        if QT == 12 or QT == 13:
            o = 64 * c + 32 * p
        elif QT == 14:
            o = 128 * (c // 2) + 16 * (c % 2) + 32 * p
        elif QT == 23:
            o = 64 * c + 16 * p
        elif QT == 2 or QT == 3 or QT == 6 or QT == 7 or QT == 20 or QT == 39:
            o = c * 0 + 16 * p
        else:
            o = c * 0
        return o

    @triton.jit
    def unit_words(blk, blk2, c, m, m2, al, QT: tl.constexpr, A16: tl.constexpr, TWO: tl.constexpr):
        """The runs and scale words of units (blk, c) (L,), and (TWO) of the same units at blk2: 128-bit loads
        where al and A16 say every run is 16-aligned, else aligned words shifted into place. Only the loads
        differ between the two: the arithmetic that follows (unit_dots) is one piece of code."""
        if A16:
            if al:
                ws = _words(blk, c, m, QT, True)
                ws2 = ws
                if TWO:
                    ws2 = _words(blk2, c, m2, QT, True)
            else:
                ws = _words(blk, c, m, QT, False)
                ws2 = ws
                if TWO:
                    ws2 = _words(blk2, c, m2, QT, False)
        else:
            ws = _words(blk, c, m, QT, False)
            ws2 = ws
            if TWO:
                ws2 = _words(blk2, c, m2, QT, False)
        return ws, ws2

    @triton.jit
    def unit_dots(ws, ws2, c, xm, xp, one, QT: tl.constexpr, TWO: tl.constexpr, XS: tl.constexpr):
        """(L,) float32 twice: the units of words ws (unit_words) against x at xp (L,) (any float type; xm: where
        to load it), and (TWO) the units of ws2 against the same x, which each lane then loads once for both.
        Words once loaded serve any number of calls (tokens). x is in the block's order (XS = 0: xp points at
        each unit's block's first x) or in the lanes' (XS > 0, `lane_order`: xp points at the lane's first 4
        values, and part p's word w is XS (p NW + w) further on, so the lanes of a warp read neighbouring x)."""
        NP: tl.constexpr = 1 if QT == 8 else (4 if (QT == 14 or QT == 23) else 2)   # parts of a unit
        NW: tl.constexpr = 8 if (QT == 8 or QT == 12 or QT == 13) else 4           # words of a part
        SX: tl.constexpr = QT != 20 and QT != 23 and QT != 39     # whether alpha S + beta X needs X (beta != 0)
        r0, r1, r2, r3, s0, s1, s2, s3 = ws
        t0, t1, t2, t3, u0, u1, u2, u3 = ws2
        b4 = tl.arange(0, 4)[None, :]
        acc = tl.zeros(c.shape, dtype=tl.float32)
        acc2 = tl.zeros(c.shape, dtype=tl.float32)
        for p in tl.static_range(NP):
            if XS == 0:
                xq = xp + _xoff(c, p, QT)
            else:
                xq = xp + p * NW * XS
            sp = tl.zeros([c.shape[0], 4], dtype=tl.float32)
            sq = tl.zeros([c.shape[0], 4], dtype=tl.float32)
            xs = tl.zeros([c.shape[0], 4], dtype=tl.float32)
            for w in tl.static_range(NW):
                xv = tl.load(xq[:, None] + (4 * w if XS == 0 else XS * w) + b4, mask=xm[:, None],
                             other=0.0).to(tl.float32)
                if SX:
                    xs += xv
                sp += _fields(r0, r1, r2, r3, s1, c, one, p, w, QT) * xv
                if TWO:
                    sq += _fields(t0, t1, t2, t3, u1, c, one, p, w, QT) * xv
            X = tl.sum(xs, axis=1)
            a, b = _coefs(s0, s1, s2, s3, c, p, QT)
            if SX:
                acc += a * tl.sum(sp, axis=1) + b * X
            else:
                acc += a * tl.sum(sp, axis=1)
            if TWO:
                a, b = _coefs(u0, u1, u2, u3, c, p, QT)
                if SX:
                    acc2 += a * tl.sum(sq, axis=1) + b * X
                else:
                    acc2 += a * tl.sum(sq, axis=1)
        return acc, acc2
