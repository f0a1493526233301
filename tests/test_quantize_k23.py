"""Q2_K and Q3_K: the quantizers against gguf.quants' decoding and ggml's reference quantizers."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from ggml_k23 import q2_k_block, q3_k_block

from moestream.quant.quantize import quantize

ORACLE = {Q.Q2_K: q2_k_block, Q.Q3_K: q3_k_block}


def _cases(seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows of whole super-blocks, by what they test."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    mixed = randn(4, 512)
    mixed[0, :16] = 0                            # one zero sub-block in a live super-block
    mixed[1, 7] = 40.0                           # an outlier
    mixed[2, :256] = 0.5                         # a flat super-block
    return {
        "gaussian": randn(16, 1024), "zeros": torch.zeros(4, 512), "mixed": mixed,
        "tiny": randn(4, 512) * 1e-6,            # steps below float16's smallest: they round to 0
        "below_eps": randn(2, 256) * 1e-20,      # under ggml's GROUP_MAX_EPS: Q3_K's sub-blocks are all zero
        "large": randn(4, 512) * 1e4,
        "one_sign": torch.cat([randn(2, 256).abs() + 2, -randn(2, 256).abs()]),
        "heavy_tails": randn(4, 512) ** 3,
    }


@pytest.mark.parametrize("case", list(_cases()))
@pytest.mark.parametrize("qtype", list(ORACLE), ids=lambda t: t.name)
def test_round_trip_bit_for_bit(qtype, case):
    """gguf.quants.dequantize (ggml's dequantize_row_q2_K / q3_K) of the bytes gives the quantizer's values, bit for
    bit; values= changes nothing in the bytes."""
    x = _cases()[case]
    q, v = quantize(x, qtype, values=True)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    assert q.shape == (x.shape[0], x.shape[1] // block * size)
    deq = gguf.quants.dequantize(q.numpy(), qtype)
    np.testing.assert_array_equal(deq, v.numpy())
    assert torch.equal(quantize(x, qtype), q)
    if case in ("zeros", "below_eps"):
        assert not deq.any()
    if case == "zeros":
        assert not q.any()


@pytest.mark.parametrize("qtype", list(ORACLE), ids=lambda t: t.name)
def test_blocks_are_ggmls(qtype):
    """Every block is the one ggml's reference quantizer writes (tests/ggml_k23.py: its loops in float32, in C's
    order). Measured: 0 of 384 N(0, 1) blocks differ for either type. The vectorised sums may still differ from C's
    in the last bit, which decides only where two candidate fits tie (seen on a Q2_K sub-block of one sign whose
    codes take two values): none in these rows."""
    cases = _cases(1)
    x = torch.cat([cases["gaussian"].reshape(-1, 256)[:24], cases["mixed"].reshape(-1, 256)[:4],
                   cases["large"].reshape(-1, 256)[:2], cases["zeros"][:1, :256], cases["below_eps"][:1]])
    q = quantize(x, qtype).numpy()
    for i in range(x.shape[0]):
        assert bytes(q[i]) == ORACLE[qtype](x[i].numpy()), i


def test_error_q2_k_above_q3_k_above_q4_k():
    """Relative RMS error on N(0, 1) rows, measured 0.297 (Q2_K), 0.151 (Q3_K), 0.071 (Q4_K); ggml's reference
    quantizers give these on such data."""
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(3))
    err = {}
    for t in (Q.Q2_K, Q.Q3_K, Q.Q4_K):
        _, v = quantize(x, t, values=True)
        err[t] = ((v - x).norm() / x.norm()).item()
    assert err[Q.Q4_K] < err[Q.Q3_K] < err[Q.Q2_K]
    assert 0.28 < err[Q.Q2_K] < 0.31 and 0.14 < err[Q.Q3_K] < 0.16, err
