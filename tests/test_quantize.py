"""The quantize tool: torch quantizers in ggml's layout, llama-quantize's type mixes, and `moestream quantize`."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import gguf
from gguf import GGMLQuantizationType as Q

from moestream.quant.quantize import ENCODERS, quantize

# Relative RMS error (||deq - x|| / ||x||) on N(0, 1) rows, measured ~0.0054, 0.086, 0.079, 0.043, 0.038,
# 0.072, 0.036, 0.018, 0.076, 0.077 (the numbers ggml's reference quantizers give on such data), with margin.
MAX_REL_RMS = {Q.Q8_0: 0.01, Q.Q4_0: 0.1, Q.Q4_1: 0.09, Q.Q5_0: 0.05, Q.Q5_1: 0.045,
               Q.Q4_K: 0.08, Q.Q5_K: 0.042, Q.Q6_K: 0.021, Q.IQ4_NL: 0.085, Q.IQ4_XS: 0.085}
BIT_EXACT = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)       # gguf.quants.quantize implements these


def _rows(n_rows=48, n=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n_rows, n), generator=g)
    x[0] = 0                                   # an all-zero row: every type must encode it as zeros
    x[1, :256] = 0.5                           # a flat block
    x[2] *= 1e-3                               # a small-scale row
    x[3, 7] = 40.0                             # an outlier
    return x


@pytest.mark.parametrize("qtype", list(ENCODERS), ids=lambda t: t.name)
def test_layout_and_error(qtype):
    """gguf.quants.dequantize (ggml's layout) of the bytes gives the values the quantizer meant, close to x."""
    x = _rows()
    q, v = quantize(x, qtype, values=True)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    assert q.dtype == torch.uint8 and q.shape == (48, 1024 // block * size)
    deq = gguf.quants.dequantize(q.numpy(), qtype)
    np.testing.assert_array_equal(deq, v.numpy())
    assert not deq[0].any()
    body = slice(4, None)
    err = np.sqrt(((deq[body] - x[body].numpy()) ** 2).sum() / (x[body].numpy() ** 2).sum())
    assert err < MAX_REL_RMS[qtype], err
    small = np.sqrt(((deq[2] - x[2].numpy()) ** 2).sum() / (x[2].numpy() ** 2).sum())
    assert small < 2 * MAX_REL_RMS[qtype]
    assert torch.equal(quantize(x, qtype), q)                 # values= changes nothing in the bytes


@pytest.mark.parametrize("qtype", BIT_EXACT, ids=lambda t: t.name)
def test_legacy_types_equal_gguf(qtype):
    x = _rows(seed=1)
    assert np.array_equal(quantize(x, qtype).numpy(), gguf.quants.quantize(x.numpy(), qtype))


def test_shapes_chunks_and_dtypes(monkeypatch):
    """Leading dims are kept, rows are encoded a chunk at a time, bf16 input is read as float32."""
    import moestream.quant.quantize as qz
    x = torch.randn(3, 5, 512).to(torch.bfloat16)
    whole = quantize(x, Q.Q4_K)
    monkeypatch.setattr(qz, "CHUNK", 512 * 2)               # two rows a chunk
    assert whole.shape == (3, 5, 2 * 144) and torch.equal(quantize(x, Q.Q4_K), whole)
    assert torch.equal(whole, quantize(x.float(), Q.Q4_K))


def test_bad_rows():
    from moestream.errors import UserError
    with pytest.raises(UserError, match="not whole Q4_K blocks"):
        quantize(torch.randn(2, 96), Q.Q4_K)
    with pytest.raises(UserError, match="cannot quantize to Q2_K"):
        quantize(torch.randn(2, 256), Q.Q2_K)


@pytest.mark.cuda
@pytest.mark.parametrize("qtype", list(ENCODERS), ids=lambda t: t.name)
def test_cuda_matches_layout(qtype):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    x = _rows()
    q, v = quantize(x.cuda(), qtype, values=True)
    deq = gguf.quants.dequantize(q.cpu().numpy(), qtype)
    np.testing.assert_allclose(deq, v.cpu().numpy(), rtol=1e-5, atol=1e-6)     # a fused multiply-add at most
    err = np.sqrt(((deq[4:] - x[4:].numpy()) ** 2).sum() / (x[4:].numpy() ** 2).sum())
    assert err < MAX_REL_RMS[qtype]
