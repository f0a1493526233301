"""The GGML tensor types moestream reads, with their block shapes (from gguf's table).

    row_bytes(Q.Q4_K, 2048)       # 1152: 8 blocks of 256 values, 144 bytes each
    parse_type("q4_k")            # Q.Q4_K; a one-line UserError naming the types that work otherwise

A quantized row is whole blocks: `block_size(t)` values stored in `type_size(t)` bytes, ggml's layout.
"""
from __future__ import annotations

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from ..errors import UserError

FLOAT = (Q.F32, Q.F16, Q.BF16)
# Every quantized type moestream loads (each has a plain-torch dequantizer in dequant.py; MXFP4's in mxfp4.py).
QUANTIZED = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS,
             Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S, Q.IQ1_M, Q.MXFP4)
LOADABLE = FLOAT + QUANTIZED


def block_size(qtype: Q) -> int:
    return GGML_QUANT_SIZES[qtype][0]


def type_size(qtype: Q) -> int:
    return GGML_QUANT_SIZES[qtype][1]


def row_bytes(qtype: Q, n: int) -> int:
    """Bytes of a row of n values of qtype; a UserError when n is not whole blocks."""
    block, size = GGML_QUANT_SIZES[qtype]
    if n % block:
        raise UserError(f"a row of {n} values is not whole {qtype.name} blocks of {block}; "
                        "the file is damaged or was written by a tool that breaks ggml's layout")
    return n // block * size


def names(types=LOADABLE) -> str:
    return ", ".join(t.name for t in types)


def parse_type(name: str, allowed=LOADABLE) -> Q:
    """A type by name, any case (q4_k, Q4_K); a one-line error listing `allowed` otherwise."""
    t = Q.__members__.get(name.upper())
    if t is None or t not in allowed:
        raise UserError(f"unknown or unsupported type {name!r}; the types that work: {names(allowed)}")
    return t
