"""MXFP4 (OCP microscaling FP4): blocks of 32 e2m1 values sharing one e8m0 scale, in ggml's layout and OpenAI's.

    w = dequantize_mxfp4(b)                       # (n, 17) uint8 blocks -> (n, 32) float32, gguf.quants' bits
    q, v = encode_mxfp4(x)                        # x (n, 32) float32 -> (n, 17) uint8, and the values they hold
    rows = from_openai(blocks, scales, "...")     # OpenAI's *_blocks (..., G, 16), *_scales (..., G) -> (..., G * 17)
    rows = random_mxfp4(R, C, generator)          # random weights of a (R, C) matrix, E[w**2] = 1 / C (synth models)

ggml's block (GGML type MXFP4, 17 bytes, ggml-common.h's block_mxfp4): byte 0 is the e8m0 scale e, bytes 1..16 the
nibbles, value j < 16 in the low nibble of byte 1 + j and value 16 + j in its high nibble (Q4_0's order). A value is
KVALUES[nibble] * 2**(e - 128): ggml's codebook is e2m1 doubled (0, 1, 2, 3, 4, 6, 8, 12; bit 3 the sign), so the
scale is halved (ggml_e8m0_to_fp32_half: e = 0 and 1 are the subnormals 2**-128 and 2**-127). Each value is a small
integer times a power of two, exact in float32 (up to the overflow of e = 255 to inf), so every order of operations
gives the same bits: the Triton kernels and the runs decode need no care to match this oracle.

OpenAI's checkpoints (gpt-oss) keep a matrix (R, C) as `*_blocks` (R, C / 32, 16) uint8 and `*_scales` (R, C / 32)
uint8: the same e8m0 byte and e2m1 nibbles (transformers' convert_moe_packed_tensors: FP4_VALUES[nibble] *
2**(scale - 127)), but value 2 j in the low nibble of byte j and 2 j + 1 in its high nibble. `from_openai` repacks
them to ggml's blocks once, at load, so that one layout goes downstream; `to_openai` is its inverse (tests, writers).
The values are the same but for zero's sign: OpenAI's nibble 8 is -0.0, ggml's +0.0.
"""
from __future__ import annotations

import math

import torch

from ..errors import UserError

KVALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)     # ggml's kvalues_mxfp4: e2m1, doubled
BLOCK, BYTES = 32, 17
_MIDPOINTS = (0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 10.0)     # between KVALUES[0..7]: bucketize counts those below


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """e8m0 bytes (any integer dtype) -> 2**(e - 128) float32, exactly as ggml_e8m0_to_fp32_half builds its bits."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e.clamp(max=1), (e - 1) << 23)
    return bits.view(torch.float32)


def _codebook(device) -> torch.Tensor:
    return torch.tensor(KVALUES, dtype=torch.float32, device=device)


def dequantize_mxfp4(b: torch.Tensor) -> torch.Tensor:
    """(n, 17) uint8 ggml blocks -> (n, 32) float32: KVALUES[nibble] * 2**(e - 128), gguf.quants' bits."""
    d = e8m0_half(b[:, :1])                                                     # (n, 1)
    qs = b[:, 1:].long()                                                        # (n, 16)
    q = torch.cat([qs & 15, qs >> 4], dim=1)                                    # (n, 32): low nibbles, then high
    return d * _codebook(b.device)[q]


def encode_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (n, 32) float32 -> ((n, 17) uint8 ggml blocks, (n, 32) float32 values), as quantize_row_mxfp4_ref (and
    gguf.quants' MXFP4) encode: e = floor(log2(max |x|)) - 2 + 127 (0 for a zero block), each value the code of
    least |KVALUES[i] d - x|, the first such i (best_index_mxfp4). That is the nearest magnitude of |x| / d (exact:
    d is a power of two), a tie to the smaller, negative where x is and the magnitude is not 0. An e below 0 (max |x|
    under 2**-125, which ggml's cast to uint8 leaves undefined) is 0 here."""
    amax = x.abs().amax(-1, keepdim=True)                                       # (n, 1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2 + 127, torch.zeros_like(amax)).clamp(0, 255)
    e = e.to(torch.uint8)
    d = e8m0_half(e)                                                            # (n, 1)
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=x.device)
    mag = torch.bucketize(x.abs() / d, mids)                                    # (n, 32): midpoints below, 0..7
    q = mag | ((x < 0) & (mag > 0)).to(mag.dtype) << 3
    blocks = torch.cat([e, (q[:, :16] | (q[:, 16:] << 4)).to(torch.uint8)], dim=1)
    return blocks, d * _codebook(x.device)[q]


def random_mxfp4(rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """(rows, cols / 32 * 17) uint8 ggml rows of random weights with E[w**2] = 1 / cols, as the benchmark reference
    draws gpt-oss's experts (bench/make_reference_gptoss_gguf.py): uniform codes, and each block's exponent k or
    k + 1, k + 1 with the probability that makes the mean square exact (a uniform code has E[KVALUES**2] = 34.25)."""
    codes = torch.randint(0, 16, (rows * cols // BLOCK, BLOCK), generator=generator, dtype=torch.uint8)
    t = 1.0 / (cols * sum(k * k for k in KVALUES) / 16)        # the wanted E[4 ** (e - 128)]
    lo = math.floor(math.log(t, 4))
    hi = torch.rand(rows * cols // BLOCK, 1, generator=generator) < (t - 4.0 ** lo) / (3 * 4.0 ** lo)
    e = hi.to(torch.uint8) + (lo + 128)
    return torch.cat([e, codes[:, :16] | (codes[:, 16:] << 4)], dim=1).reshape(rows, -1)


def check_openai(blocks: torch.Tensor | tuple, scales: torch.Tensor | tuple, name: str) -> None:
    """A one-line UserError naming `name` where *_blocks (..., G, 16) and *_scales (..., G) (tensors or shapes)
    do not describe the same blocks."""
    bs = tuple(blocks.shape if isinstance(blocks, torch.Tensor) else blocks)
    ss = tuple(scales.shape if isinstance(scales, torch.Tensor) else scales)
    if len(bs) < 2 or bs[-1] != 16 or bs[:-1] != ss:
        raise UserError(f"MXFP4 tensor {name}: blocks {list(bs)} and scales {list(ss)} disagree (blocks must be "
                        "scales' shape + [16]); the checkpoint is damaged or not OpenAI's packed MXFP4")


def from_openai(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> torch.Tensor:
    """OpenAI's packed MXFP4, blocks (..., G, 16) and scales (..., G) uint8 -> ggml's MXFP4 rows (..., G * 17):
    each block's 32 nibbles moved from the order (0 1)(2 3).. to (0 16)(1 17).., its scale byte put first."""
    check_openai(blocks, scales, name)
    b = blocks.to(torch.uint8)
    q = torch.stack([b & 15, b >> 4], dim=-1).flatten(-2)                      # (..., G, 32): values in order
    packed = q[..., :16] | (q[..., 16:] << 4)                                   # (..., G, 16): ggml's nibbles
    out = torch.cat([scales.to(torch.uint8).unsqueeze(-1), packed], dim=-1)    # (..., G, 17)
    return out.flatten(-2)


def to_openai(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's MXFP4 rows (..., G * 17) uint8 -> OpenAI's blocks (..., G, 16) and scales (..., G): from_openai's
    inverse."""
    b = rows.reshape(*rows.shape[:-1], -1, BYTES)                               # (..., G, 17)
    qs = b[..., 1:]
    q = torch.cat([qs & 15, qs >> 4], dim=-1)                                   # (..., G, 32): values in order
    return q[..., 0::2] | (q[..., 1::2] << 4), b[..., 0].contiguous()
