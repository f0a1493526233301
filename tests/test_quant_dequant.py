"""The plain-torch dequantizers against gguf.quants, bit for bit, for every type moestream loads."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from moestream.errors import UserError
from moestream.quant import dequant
from moestream.quant.dequant import dequantize, random_blocks
from moestream.quant.types import LOADABLE

LEGACY = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)      # the types gguf.quants can also quantize


def _name(qtype):
    return qtype.name


def _blocks(qtype, shape=(3, 5, 16), seed=0) -> torch.Tensor:
    """random_blocks shaped (*shape[:-1], shape[-1] blocks of bytes)."""
    g = torch.Generator().manual_seed(seed * 1000 + int(qtype))
    *lead, n = shape
    return random_blocks(qtype, int(np.prod(shape)), g).reshape(*lead, n * GGML_QUANT_SIZES[qtype][1])


def _reference(data: torch.Tensor, qtype) -> torch.Tensor:
    out = gguf.quants.dequantize(np.ascontiguousarray(data.cpu().numpy()), qtype)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))


def assert_same_bits(out: torch.Tensor, ref: torch.Tensor):
    """Equal as float32 bit patterns: +0 and -0 differ, and a NaN cannot hide a difference."""
    assert out.dtype == torch.float32 and out.shape == ref.shape, (out.dtype, out.shape, ref.shape)
    same = out.cpu().view(torch.int32) == ref.view(torch.int32)
    assert bool(same.all()), f"{int((~same).sum())} of {same.numel()} values differ"


@pytest.mark.parametrize("qtype", LOADABLE, ids=_name)
def test_random_blocks_match_gguf_bit_for_bit(qtype):
    data = _blocks(qtype)                                                       # (3, 5, 16 blocks of bytes)
    out = dequantize(data, qtype)
    assert out.shape == (3, 5, 16 * GGML_QUANT_SIZES[qtype][0])
    assert_same_bits(out, _reference(data, qtype))
    assert bool(torch.isfinite(out).all()), "random_blocks must give finite values"


@pytest.mark.parametrize("qtype", LOADABLE, ids=_name)
def test_a_strided_slice_of_rows_dequantizes_as_its_copy(qtype):
    """ExpertLayout hands over column slices of expert rows: not contiguous."""
    size = GGML_QUANT_SIZES[qtype][1]
    rows = _blocks(qtype, (4, 9), seed=1)
    part = rows[:, 2 * size:7 * size]                                           # (4, 5 blocks), strided
    assert not part.is_contiguous()
    assert_same_bits(dequantize(part, qtype), _reference(part.contiguous(), qtype))


@pytest.mark.parametrize("qtype", LEGACY, ids=_name)
def test_blocks_that_gguf_quantized_match_gguf(qtype):
    x = np.random.default_rng(int(qtype)).standard_normal((4, 7, 256)).astype(np.float32)
    x[0, 0] = 0                                                                 # a block of zeros: d = 0
    x[1, 1] *= 1e-6
    data = torch.from_numpy(gguf.quants.quantize(x, qtype))                     # (4, 7, nbytes)
    out = dequantize(data, qtype)
    assert_same_bits(out, _reference(data, qtype))
    assert (out - torch.from_numpy(x)).abs().max() < 0.5                        # and it is x, roughly


@pytest.mark.parametrize("blocks_per_chunk", [1, 4])       # 4: chunks that end mid-row, and a short last one
@pytest.mark.parametrize("qtype", LOADABLE, ids=_name)
def test_chunks_give_the_same_bits_as_one(qtype, blocks_per_chunk, monkeypatch):
    data = _blocks(qtype, (2, 3, 7), seed=2)                                    # 42 blocks in rows of 7
    whole = dequantize(data, qtype)
    assert dequant.CHUNK_VALUES >= whole.numel()                                # one chunk
    monkeypatch.setattr(dequant, "CHUNK_VALUES", blocks_per_chunk * GGML_QUANT_SIZES[qtype][0])
    assert_same_bits(dequantize(data, qtype), whole)


def test_random_blocks_are_whole_blocks_with_sane_scales():
    g = torch.Generator().manual_seed(0)
    data = random_blocks(Q.Q4_K, 64, g)
    assert data.dtype == torch.uint8 and data.shape == (64 * 144,)
    d = data.reshape(64, 144)[:, :4].contiguous().view(torch.float16).float()   # d and dmin
    assert bool(((d.abs() >= 1e-3 * 0.999) & (d.abs() <= 1)).all())
    assert bool((d < 0).any() and (d > 0).any())
    again = random_blocks(Q.Q4_K, 64, torch.Generator().manual_seed(0))
    assert torch.equal(data, again)


def test_an_unsupported_type_names_itself_and_the_types_that_work():
    with pytest.raises(UserError, match="TQ1_0") as err:
        dequantize(torch.zeros(2, GGML_QUANT_SIZES[Q.TQ1_0][1], dtype=torch.uint8), Q.TQ1_0)
    assert "Q4_K" in str(err.value) and "IQ1_M" in str(err.value)
    with pytest.raises(UserError, match="NVFP4"):
        random_blocks(Q.NVFP4, 1)


def test_partial_blocks_are_refused():
    with pytest.raises(ValueError, match="Q4_K"):
        dequantize(torch.zeros(143, dtype=torch.uint8), Q.Q4_K)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("qtype", LOADABLE, ids=_name)
def test_on_cuda_the_same_bits_as_gguf(qtype, monkeypatch):
    data = _blocks(qtype, (3, 5, 64), seed=3)
    cuda = data.cuda()
    out = dequantize(cuda, qtype)
    assert out.device == cuda.device
    ref = _reference(data, qtype)
    assert_same_bits(out, ref)
    monkeypatch.setattr(dequant, "CHUNK_VALUES", 1000)
    assert_same_bits(dequantize(cuda, qtype), ref)
