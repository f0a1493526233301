"""GGML blocks decoded in Triton registers: the one place the kernels learn a block format.

    vals = block_values(p, j, l, mask, kv_ptr, QT)     # float32, the shape of p + j * SUB + l broadcast

`p` points at blocks (uint8 pointers, any rank), `j` indexes a block's sub-blocks and `l` a sub-block's values
(each an arange broadcast along its own trailing axis), so a caller lays a tile out as it likes:
(blocks, NSUB, SUB) to dequantize, (rows, blocks, NSUB, SUB) for a GEMV. Value `j * SUB + l` of a block is the
block's value of that index in ggml's order, computed with gguf.quants' float32 operations in their order
(`d * sc` then `* q` then `- dm`, never fused: launch with enable_fp_fusion=False), so each value is the
reference's bits. Bytes are loaded one by one: blocks of 34, 18, 22 or 210 bytes align to 2 bytes only (MXFP4's 17 to
1).

F32, F16 and BF16 matrices (raw values inside a quantized layout) are read as virtual blocks of 32 values.
The IQ types' codebooks, sign table and grids are one float32 table on the device (`kvalues`, TABLE's layout),
read by index: the grid types' blocks are decoded in kernels/qblocks_iq.py.
"""
from __future__ import annotations

import functools

from gguf import GGMLQuantizationType as Q

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# type -> (values per block, bytes per block, NSUB, SUB): the tile of one block is (NSUB, SUB).
SHAPES = {
    Q.F32: (32, 128, 1, 32), Q.F16: (32, 64, 1, 32), Q.BF16: (32, 64, 1, 32),
    Q.Q8_0: (32, 34, 1, 32), Q.Q4_0: (32, 18, 2, 16), Q.Q5_0: (32, 22, 2, 16), Q.IQ4_NL: (32, 18, 2, 16),
    Q.Q4_1: (32, 20, 2, 16), Q.Q5_1: (32, 24, 2, 16), Q.MXFP4: (32, 17, 2, 16),
    Q.Q4_K: (256, 144, 8, 32), Q.Q5_K: (256, 176, 8, 32), Q.Q6_K: (256, 210, 16, 16), Q.IQ4_XS: (256, 136, 8, 32),
    Q.Q2_K: (256, 84, 16, 16), Q.Q3_K: (256, 110, 16, 16),
    Q.IQ2_XXS: (256, 66, 8, 32), Q.IQ2_XS: (256, 74, 8, 32), Q.IQ2_S: (256, 82, 8, 32), Q.IQ3_XXS: (256, 98, 8, 32),
    Q.IQ3_S: (256, 110, 8, 32), Q.IQ1_S: (256, 50, 8, 32), Q.IQ1_M: (256, 56, 8, 32),
}
KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)     # IQ4_NL's and IQ4_XS's
# The device table's parts, in order: (what, float32 values). Their offsets are written into qblocks_iq.py's
# kernels as numbers (TABLE_OFFSETS says them; a test checks the two agree). IQ1_S and IQ1_M share a grid.
TABLE = (("kvalues", 16), ("ksigns", 128), (Q.IQ2_XXS, 256 * 8), (Q.IQ2_XS, 512 * 8), (Q.IQ2_S, 1024 * 8),
         (Q.IQ3_XXS, 256 * 4), (Q.IQ3_S, 512 * 4), (Q.IQ1_S, 2048 * 8))
TABLE_OFFSETS = {what: sum(n for _, n in TABLE[:i]) for i, (what, _) in enumerate(TABLE)}


def has_path(qtype: Q, n: int) -> bool:
    """Whether rows of n values of qtype have a Triton path (raw floats: whole virtual blocks of 32)."""
    return triton is not None and qtype in SHAPES and n % SHAPES[qtype][0] == 0


def kvalues(device):
    """The IQ types' table on `device` (TABLE: the IQ4 codebook first, then the sign table and the grids), made
    once per device (a copy inside a CUDA graph capture is not allowed)."""
    import torch
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _kvalues(device)


@functools.lru_cache(maxsize=None)
def _kvalues(device):
    import torch
    return torch.tensor(table_values(), dtype=torch.float32, device=device)


def table_values() -> list[float]:
    """TABLE's values: gguf.quants' own sign table and grids (as quant/dequant_iq.py reads them), flattened."""
    import gguf.quants
    out = list(KVALUES) + [float(s) for s in gguf.quants.IQ2_XXS.ksigns]
    for qtype, n in TABLE[2:]:
        cls = getattr(gguf.quants, qtype.name)
        cls.init_grid()
        grid = [float(v) for v in cls.grid.reshape(-1)]
        assert len(grid) == n, (qtype, len(grid))
        out += grid
    return out


if triton is not None:
    from .qblocks_iq import _f16, _u8, iq_values, k23_values

    @triton.jit
    def to_bf16(v):
        """float32 -> bfloat16, round to nearest even, in integers: Triton's interpreter truncates in `.to`, and
        the same arithmetic on the GPU keeps the tested path the compiled one. NaN stays NaN."""
        u = v.to(tl.uint32, bitcast=True)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.uint16)
        return tl.where(v != v, 0x7FC0, r).to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _mxfp4_scale(e):
        """e8m0 bytes (int32) -> 2**(e - 128) float32, ggml_e8m0_to_fp32_half's bits (e < 2: subnormal)."""
        bits = tl.where(e < 2, 0x00200000 << tl.minimum(e, 1), (e - 1) << 23)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _e2m1(q):
        """MXFP4 nibbles (int32) -> ggml's kvalues_mxfp4 (0 1 2 3 4 6 8 12, bit 3 the sign; 8 is +0) as float32:
        magnitude c < 4 is c, else (2 + c % 2) << (c / 2 - 1)."""
        c = q & 7
        k = tl.where(c < 4, c, (2 + (c & 1)) << tl.maximum((c >> 1) - 1, 0))
        return tl.where(q >= 8, -k, k).to(tl.float32)

    @triton.jit
    def block_values(p, j, l, m, kv_ptr, QT: tl.constexpr):
        """Values j * SUB + l of the blocks at p (mask m broadcasts like p), float32, gguf.quants' bits."""
        if QT == 0:            # F32: 4 bytes a value
            b = p + 4 * (j * 32 + l)
            bits = (tl.load(b, mask=m, other=0).to(tl.uint32) | (tl.load(b + 1, mask=m, other=0).to(tl.uint32) << 8)
                    | (tl.load(b + 2, mask=m, other=0).to(tl.uint32) << 16)
                    | (tl.load(b + 3, mask=m, other=0).to(tl.uint32) << 24))
            v = bits.to(tl.float32, bitcast=True)
        elif QT == 1:          # F16
            v = _f16(p + 2 * (j * 32 + l), m)
        elif QT == 30:         # BF16: the high half of a float32
            b = p + 2 * (j * 32 + l)
            bits = (_u8(b, m).to(tl.uint32) << 16) | (_u8(b + 1, m).to(tl.uint32) << 24)
            v = bits.to(tl.float32, bitcast=True)
        elif QT == 8:          # Q8_0: d, 32 int8
            q = tl.load(p + 2 + j * 32 + l, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            v = q * _f16(p, m)
        elif QT == 2:          # Q4_0: d, 16 bytes; value 16 j + l is byte l's nibble j
            q = ((_u8(p + 2 + l, m) >> (4 * j)) & 15) - 8
            v = _f16(p, m) * q.to(tl.float32)
        elif QT == 6:          # Q5_0: d, qh (32 high bits), 16 bytes of low nibbles
            i = 16 * j + l
            hi = (_u8(p + 2 + i // 8, m) >> (i % 8)) & 1
            q = (((_u8(p + 6 + l, m) >> (4 * j)) & 15) | (hi << 4)) - 16
            v = _f16(p, m) * q.to(tl.float32)
        elif QT == 3:          # Q4_1: d, m, 16 bytes as Q4_0's; d q + m
            q = (_u8(p + 4 + l, m) >> (4 * j)) & 15
            v = _f16(p, m) * q.to(tl.float32) + _f16(p + 2, m)
        elif QT == 7:          # Q5_1: d, m, qh, 16 bytes as Q5_0's; d q + m
            i = 16 * j + l
            hi = (_u8(p + 4 + i // 8, m) >> (i % 8)) & 1
            q = ((_u8(p + 8 + l, m) >> (4 * j)) & 15) | (hi << 4)
            v = _f16(p, m) * q.to(tl.float32) + _f16(p + 2, m)
        elif QT == 20:         # IQ4_NL: Q4_0's nibbles through the non-linear table
            q = (_u8(p + 2 + l, m) >> (4 * j)) & 15
            v = _f16(p, m) * tl.load(kv_ptr + q)
        elif QT == 39:         # MXFP4: e8m0 e, 16 bytes as Q4_0's; e2m1 doubled (quant/mxfp4.py) times 2**(e - 128)
            q = (_u8(p + 1 + l, m) >> (4 * j)) & 15
            v = _mxfp4_scale(_u8(p, m)) * _e2m1(q)
        elif QT == 12 or QT == 13:    # Q4_K, Q5_K: d, dmin, 12 bytes of 6-bit scales and mins, (qh,) qs
            a = _u8(p + 4 + j, m)
            b = _u8(p + 8 + j, m)
            c = _u8(p + 4 + j % 4, m)
            sc = tl.where(j < 4, a & 63, (b & 15) | ((c >> 6) << 4))
            mn = tl.where(j < 4, b & 63, (b >> 4) | ((a >> 6) << 4))
            dd = _f16(p, m) * sc.to(tl.float32)
            dm = _f16(p + 2, m) * mn.to(tl.float32)
            if QT == 12:
                q = (_u8(p + 16 + 32 * (j // 2) + l, m) >> (4 * (j % 2))) & 15
            else:
                lo = (_u8(p + 48 + 32 * (j // 2) + l, m) >> (4 * (j % 2))) & 15
                q = lo | (((_u8(p + 16 + l, m) >> j) & 1) << 4)
            v = dd * q.to(tl.float32) - dm
        elif QT == 14:         # Q6_K: ql (128), qh (64), 16 int8 scales, d; value 16 j + l
            h = j // 8
            s2 = (j % 8) // 2
            l32 = (j % 2) * 16 + l
            lo = (_u8(p + 64 * h + (s2 % 2) * 32 + l32, m) >> (4 * (s2 // 2))) & 15
            hi = (_u8(p + 128 + 32 * h + l32, m) >> (2 * s2)) & 3
            sc = tl.load(p + 192 + j, mask=m, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            dd = _f16(p + 208, m) * sc
            v = dd * ((lo | (hi << 4)) - 32).to(tl.float32)
        elif QT == 23:         # IQ4_XS: d, scales_h (u16), scales_l (4), qs (128); sub-block j, value l
            sl = (_u8(p + 4 + j // 2, m) >> (4 * (j % 2))) & 15
            sh = (_u8(p + 2 + j // 4, m) >> (2 * (j % 4))) & 3
            dl = _f16(p, m) * ((sl | (sh << 4)) - 32).to(tl.float32)
            q = (_u8(p + 8 + 16 * j + l % 16, m) >> (4 * (l // 16))) & 15
            v = dl * tl.load(kv_ptr + q)
        elif QT == 10 or QT == 11:    # Q2_K, Q3_K: 16 sub-blocks of 16, value 16 j + l
            v = k23_values(p, 16 * j + l, m, QT)
        else:                  # the grid types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M)
            v = iq_values(p, j * 32 + l, m, kv_ptr, QT)
        return v
