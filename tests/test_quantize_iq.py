"""IQ2_XXS, IQ2_XS, IQ1_S and IQ1_M with an importance matrix: ggml's bytes, ggml's layout, ggml's error."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import gguf
from gguf import GGMLQuantizationType as Q

from moestream.errors import UserError
from moestream.quant.dequant import dequantize
from moestream.quant.quantize import quantize

IQ = (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ1_S, Q.IQ1_M)
# tests/data/iq_llamacpp.json: what llama.cpp b11549's quantize_iq2_xxs, _iq2_xs, _iq1_s, _iq1_m, _iq4_nl and _iq4_xs
# (ggml-quants.c compiled alone, called through ctypes) wrote for _rows() with _importance(); IQ1_M also with none.
REFERENCE = json.loads((Path(__file__).parent / "data" / "iq_llamacpp.json").read_text())


def _rows() -> torch.Tensor:
    """8 rows of 256 from a formula (no RNG): smooth, noisy-looking, a zero row, a tiny one and an outlier. (A flat
    block is an exact tie of several IQ1 splits, which ggml breaks by its last rounding bits: not here.)"""
    i = torch.arange(256, dtype=torch.float64)
    rows = [torch.sin(i * (0.37 + 0.11 * r) + r) * (1 + r) + 0.3 * torch.cos(i * i * 0.013 * (r + 1)) for r in range(8)]
    x = torch.stack(rows).float()
    x[1] = 0
    x[3] *= 1e-4
    x[4, 17] = 25.0
    return x


def _importance() -> torch.Tensor:
    i = torch.arange(256, dtype=torch.float64)
    return (1.5 + torch.sin(i * 0.05)).pow(3).float()


@pytest.mark.parametrize("qtype", (*IQ, Q.IQ4_NL, Q.IQ4_XS), ids=lambda t: t.name)
def test_bytes_equal_llamacpp(qtype):
    q = quantize(_rows(), qtype, importance=_importance())
    assert [row.numpy().tobytes().hex() for row in q] == REFERENCE[qtype.name]


def test_iq1_m_without_imatrix_equals_llamacpp():
    q = quantize(_rows(), Q.IQ1_M)
    assert [row.numpy().tobytes().hex() for row in q] == REFERENCE["IQ1_M_no_imatrix"]


def _weighted_rms(x, v, imp):
    return float(((imp * (v - x) ** 2).mean() / imp.mean()).sqrt())


def test_layout_error_and_order():
    """gguf.quants decodes our bytes as dequant_iq does; the weighted error falls with the bits (IQ1_S > IQ1_M >
    IQ2_XXS > IQ2_XS) and an imatrix lowers the error it weights. Here the relative weighted RMS measured 0.431,
    0.366, 0.344, 0.232, llama.cpp's quantizers 0.431, 0.366, 0.344, 0.231 on the same rows: bounds 10% above."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 512, generator=g)
    x[0, :256], x[1, :40] = 0, 0.5                   # a zero block, a flat stretch: valid blocks all the same
    imp = torch.rand(512, generator=g) ** 4 * 10
    errs = {}
    for qtype in IQ:
        q, v = quantize(x, qtype, values=True, importance=imp)
        np.testing.assert_array_equal(gguf.quants.dequantize(q.numpy(), qtype), v.numpy())
        np.testing.assert_array_equal(dequantize(q, qtype).numpy(), v.numpy())
        errs[qtype] = _weighted_rms(x, v, imp) / _weighted_rms(x, torch.zeros_like(x), imp)
    bound = {Q.IQ1_S: 0.48, Q.IQ1_M: 0.41, Q.IQ2_XXS: 0.38, Q.IQ2_XS: 0.26}
    assert all(errs[t] < bound[t] for t in IQ), errs
    assert errs[Q.IQ1_S] > errs[Q.IQ1_M] > errs[Q.IQ2_XXS] > errs[Q.IQ2_XS], errs
    flat = quantize(x, Q.IQ1_M, values=True, importance=torch.ones(512))[1]
    assert _weighted_rms(x, quantize(x, Q.IQ1_M, values=True, importance=imp)[1], imp) < _weighted_rms(x, flat, imp)


def test_expert_importance_and_chunks(monkeypatch):
    """A stack (E, rows, n) takes one importance row per expert; chunking changes nothing."""
    import moestream.quant.quantize as qz
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, 256, generator=g)
    imp = torch.rand(3, 256, generator=g)
    whole = quantize(x, Q.IQ2_XS, importance=imp)
    for e in range(3):
        assert torch.equal(whole[e], quantize(x[e], Q.IQ2_XS, importance=imp[e]))
    monkeypatch.setattr(qz, "IQ_CHUNK", 512)
    assert torch.equal(quantize(x, Q.IQ2_XS, importance=imp), whole)


def test_needs_importance():
    with pytest.raises(UserError, match="IQ2_XXS needs an importance matrix.*--imatrix"):
        quantize(torch.randn(2, 256), Q.IQ2_XXS)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu():
    """On a GPU the same searches run (its sums may round otherwise): nearly every block the CPU's, the same error."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 512, generator=g)
    imp = torch.rand(512, generator=g) + 0.1
    for qtype in (*IQ, Q.IQ4_NL):
        cpu = quantize(x, qtype, importance=imp, values=True)
        gpu = quantize(x.cuda(), qtype, importance=imp.cuda(), values=True)
        size = gguf.GGML_QUANT_SIZES[qtype][1]
        same = (gpu[0].cpu().reshape(-1, size) == cpu[0].reshape(-1, size)).all(-1).float().mean()
        assert same > 0.95, (qtype, same)
        assert abs(_weighted_rms(x, gpu[1].cpu(), imp) / _weighted_rms(x, cpu[1], imp) - 1) < 0.01
