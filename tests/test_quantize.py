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


# --- the type mix --------------------------------------------------------------------------------------------
def _reference_config():
    from moestream.loading.synth import SynthSource
    return SynthSource.from_spec("qwen3-30b-a3b:layers=24").config


def test_reference_q4_k_m_is_llama_quantizes():
    """llama-quantize's Q4_K_M of the reference: 8.83 GiB of tensors; gate/up Q4_K, down Q6_K in use_more_bits
    layers, attn_v likewise, output Q6_K; routers and norms F32. From the config alone, in well under a second."""
    import time

    from moestream.quant.mix import estimate_bytes, file_types, use_more_bits
    t0 = time.perf_counter()
    cfg = _reference_config()
    q4, q8 = estimate_bytes(cfg, "Q4_K_M"), estimate_bytes(cfg, "Q8_0")
    assert time.perf_counter() - t0 < 1.0
    assert abs(q4 / 2**30 / 8.83 - 1) < 0.03 and abs(q8 / 2**30 / 15.4 - 1) < 0.03, (q4, q8)
    types = file_types(cfg, "Q4_K_M")
    more = [i for i in range(24) if use_more_bits(i, 24)]
    assert more == [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]
    for i in range(24):
        big = Q.Q6_K if i in more else Q.Q4_K
        assert types[f"blk.{i}.ffn_down_exps.weight"] == big and types[f"blk.{i}.attn_v.weight"] == big
        assert types[f"blk.{i}.ffn_gate_exps.weight"] == types[f"blk.{i}.ffn_up_exps.weight"] == Q.Q4_K
        assert types[f"blk.{i}.attn_q.weight"] == types[f"blk.{i}.attn_k.weight"] == Q.Q4_K
        assert types[f"blk.{i}.attn_output.weight"] == Q.Q4_K
        assert types[f"blk.{i}.ffn_gate_inp.weight"] == types[f"blk.{i}.attn_q_norm.weight"] == Q.F32
    assert types["output.weight"] == Q.Q6_K and types["token_embd.weight"] == Q.Q4_K
    assert types["output_norm.weight"] == Q.F32
    m5, iq = file_types(cfg, "Q5_K_M"), file_types(cfg, "IQ4_XS")
    assert m5["blk.3.ffn_down_exps.weight"] == Q.Q5_K and m5["blk.5.ffn_down_exps.weight"] == Q.Q6_K
    assert iq["blk.0.ffn_down_exps.weight"] == Q.Q5_K and iq["blk.3.ffn_down_exps.weight"] == Q.IQ4_XS
    assert iq["blk.7.attn_v.weight"] == Q.Q5_K                 # 8 query heads per kv head
    assert file_types(cfg, "Q4_K_S")["blk.2.ffn_down_exps.weight"] == Q.Q5_K
    assert file_types(cfg, "Q4_K_S")["blk.3.attn_v.weight"] == Q.Q5_K
    assert file_types(cfg, "Q4_K_S")["blk.4.attn_v.weight"] == Q.Q4_K
    assert set(file_types(cfg, "Q4_K_M", pure=True).values()) == {Q.Q4_K, Q.F32}


def test_eight_experts_and_shared_expert():
    """Mixtral's rule (n_expert == 8: attn_v / attn_k Q8_0, attn_output Q5_K), and a Qwen2-MoE shared expert: its
    ffn_down counted by the layer in its name like the experts', its (H,) gate F32."""
    from moestream.quant.mix import Mix
    cfg = _reference_config().replace(n_experts=8, n_layers=8)
    mix = Mix.for_config(cfg, "Q4_K_M")
    assert mix.type("blk.3.attn_v.weight", (512, 2048)) == mix.type("blk.3.attn_k.weight", (512, 2048)) == Q.Q8_0
    assert mix.type("blk.3.attn_output.weight", (2048, 4096)) == Q.Q5_K
    assert mix.type("blk.3.attn_q.weight", (4096, 2048)) == Q.Q4_K
    assert Mix.for_config(cfg, "Q5_K_M").type("blk.3.attn_output.weight", (2048, 4096)) == Q.Q5_K  # the default
    assert Mix.for_config(cfg, "Q6_K").type("blk.3.attn_output.weight", (2048, 4096)) == Q.Q6_K
    assert Mix.for_config(cfg, "Q6_K").type("blk.3.attn_v.weight", (512, 2048)) == Q.Q8_0
    # use_more_bits(i, 8): layers 0, 3, 6, 7
    for i, t in [(0, Q.Q6_K), (1, Q.Q4_K), (2, Q.Q4_K), (3, Q.Q6_K), (5, Q.Q4_K), (6, Q.Q6_K), (7, Q.Q6_K)]:
        assert mix.type(f"blk.{i}.ffn_down_shexp.weight", (2048, 5632)) == t
        assert mix.type(f"blk.{i}.ffn_down_exps.weight", (8, 2048, 1024)) == t
    assert mix.type("blk.1.ffn_gate_inp_shexp.weight", (2048,)) == Q.F32
    assert mix.type("blk.1.attn_q.bias", (4096,)) == Q.F32


def test_fallbacks_and_overrides():
    """Rows that are not whole 256-blocks: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL, F16 when
    not whole 32-blocks; output.weight Q8_0 then. The overrides win."""
    from moestream.quant.mix import Mix, file_types
    from moestream.loading.synth import SynthSource
    tiny = SynthSource.from_spec("tiny").config       # hidden 256, expert FFN 128, 4 layers: use_more_bits 2, 3
    types = file_types(tiny, "Q4_K_M")
    assert [types[f"blk.{i}.ffn_down_exps.weight"] for i in range(4)] == [Q.Q5_0, Q.Q5_0, Q.Q8_0, Q.Q8_0]
    assert types["blk.0.ffn_gate_exps.weight"] == Q.Q4_K and types["blk.2.attn_v.weight"] == Q.Q6_K
    assert file_types(tiny, "Q5_K_S")["blk.0.ffn_down_exps.weight"] == Q.Q5_1
    assert file_types(tiny, "IQ4_XS")["blk.3.ffn_down_exps.weight"] == Q.IQ4_NL
    mix = Mix.for_config(tiny, "Q4_K_M")
    assert mix.type("blk.0.ffn_down_exps.weight", (16, 256, 48)) == Q.F16
    assert mix.type("output.weight", (1000, 96)) == Q.Q8_0
    mix = Mix.for_config(tiny, "Q4_K_M", output_type=Q.Q8_0, token_embd_type=Q.Q6_K)
    assert mix.type("output.weight", (1024, 256)) == Q.Q8_0 and mix.type("token_embd.weight", (1024, 256)) == Q.Q6_K
    tied = tiny.replace(tie_word_embeddings=True)
    assert file_types(tied, "Q4_K_M")["token_embd.weight"] == Q.Q6_K
    assert file_types(tiny, "Q8_0")["output.weight"] == Q.Q8_0
    assert file_types(tiny, "Q4_0")["output.weight"] == Q.Q6_K
    assert set(file_types(tiny, "BF16").values()) == {Q.BF16, Q.F32}
