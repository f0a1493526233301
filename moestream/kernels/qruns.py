"""GGML blocks read as 16-byte runs of int32 words, one run a lane: the "runs" decode kernel's formats, and their
layout on the host (which types have runs, how many units a block, where x goes in the lanes' order).

    pos = lane_order(qtype, n, bb)          # (n,) int64: value v of a row goes to place pos[v]
    x_lanes = x[:, np.argsort(pos)]         # (T, n): x in the lanes' order, gathered once a step

A row of a matrix is blocks; a block is NU units (`UNITS`); a unit is the 16-byte runs of quants one lane owns,
NP parts of one sub-block each, a part's values 4 w + b (word w, byte b) from its first x (qruns_units' `_xoff`,
`_xoff_host` here):

    Q4_K, Q5_K   4 units a block: unit c is qs bytes 32c..32c+31 (2 runs), parts: sub-blocks 2c and 2c + 1
                 (the low and high nibbles), 32 values each; Q5_K's unit also reads qh (2 runs), shared
    Q6_K         4 units: unit c = 2h + s is ql's runs 64h + 16s and 64h + 32 + 16s and qh's 128 + 32h + 16s;
                 parts k = 0..3: sub-blocks 8h + 2k + s, 16 values each
    Q8_0         1 unit: the 32 int8 (2 runs), one part
    Q4_0         1 unit: the 16 bytes of nibbles (1 run), parts: the low nibbles (values 0..15), the high (16..31)
    Q5_0         1 unit: Q4_0's run and the word qh (bit i: value i's fifth bit), the same parts
    Q4_1, Q5_1   as Q4_0 and Q5_0, each block's m added (d q + m)
    IQ4_NL       1 unit: Q4_0's run and parts, each nibble a codebook index (`_kv4`)
    MXFP4        1 unit: the 16 bytes after the e8m0 scale byte, Q4_0's parts, each nibble an e2m1 code (`_fp4`)
    IQ4_XS       4 units: unit c is qs bytes 32c..32c+31 (2 runs: sub-blocks 2c and 2c + 1), parts k = 0..3: the
                 low and high nibbles of run k // 2, 16 values each, codebook indices

The Triton routines that load a unit's runs and make its dot products with x (unit_words, unit_dots, and the
codebooks `_kv4`, `_fp4`) are in kernels/qruns_units.py; this module is host-side only (numpy, no kernel code).
Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS and MXFP4 have runs (`RUN_TYPES`); a layout with any
other type keeps the "values" kernel.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q

from .qblocks import SHAPES, triton

# type -> (units a block, whether every run is 16-aligned where the block is)
UNITS = {Q.Q4_K: (4, True), Q.Q5_K: (4, True), Q.Q6_K: (4, False), Q.Q8_0: (1, False), Q.Q4_0: (1, False),
         Q.Q4_1: (1, False), Q.Q5_0: (1, False), Q.Q5_1: (1, False), Q.IQ4_NL: (1, False), Q.IQ4_XS: (4, False),
         Q.MXFP4: (1, False)}
RUN_TYPES = tuple(UNITS)


def parts_words(qtype) -> tuple[int, int]:
    """(parts a unit, words a part): unit_dots' NP and NW."""
    parts = 1 if qtype == Q.Q8_0 else 4 if qtype in (Q.Q6_K, Q.IQ4_XS) else 2
    return parts, 8 if qtype in (Q.Q8_0, Q.Q4_K, Q.Q5_K) else 4


def _xoff_host(qtype, c, p):
    """_xoff on the host (numpy, broadcasting); as parts_words mirrors unit_dots' NP and NW. A mismatch puts x
    where the kernel does not read it: tests/test_quant_kernels.py's order checks compare both orders' bits."""
    if qtype in (Q.Q4_K, Q.Q5_K):
        return 64 * c + 32 * p
    if qtype == Q.Q6_K:
        return 128 * (c // 2) + 16 * (c % 2) + 32 * p
    if qtype == Q.IQ4_XS:
        return 64 * c + 16 * p
    return 0 * c + (0 if qtype == Q.Q8_0 else 16 * p)


def lane_order(qtype, n: int, bb: int, copies: int = 1) -> np.ndarray:
    """(n,) int64: where each value of a row of n goes when x is laid out in the lanes' order (unit_dots with
    XS = 4 copies G, G = bb NU the units of a step): a step of bb blocks at a time, in it part p's word w of
    every copy's every unit (g = block in the step x NU + unit) side by side, 4 values each,

        position = step copies bb BS + ((p NW + w) copies G + j G + g) 4 + b       (copy j; returned: j = 0)

    so that the lanes of a warp, which hold neighbouring units (and, in the down launch, the k choices' units),
    read neighbouring x: one 128-byte line serves 8 to 32 lanes, where x in the block's order gave every lane
    a line of its own (L1 wavefronts, not bytes, bound the launch)."""
    bs, nu = SHAPES[qtype][0], UNITS[qtype][0]
    parts, words = parts_words(qtype)
    G = bb * nu
    s, bi, c, p, w, b = np.meshgrid(np.arange(n // (bb * bs)), np.arange(bb), np.arange(nu), np.arange(parts),
                                    np.arange(words), np.arange(4), indexing="ij")
    v = (s * bb + bi) * bs + _xoff_host(qtype, c, p) + 4 * w + b
    q = s * copies * bb * bs + ((p * words + w) * copies * G + bi * nu + c) * 4 + b
    pos = np.empty(n, dtype=np.int64)
    pos[v.ravel()] = q.ravel()
    return pos


def runs_available(qtype, n: int) -> bool:
    return triton is not None and qtype in UNITS and n % SHAPES[qtype][0] == 0


def aligned16(qtype, offset: int, row_bytes: int) -> bool:
    """Whether every run of a matrix at `offset` in a 16-aligned expert row is 16-aligned (the vector loads)."""
    return UNITS[qtype][1] and offset % 16 == 0 and row_bytes % 16 == 0 and SHAPES[qtype][1] % 16 == 0

