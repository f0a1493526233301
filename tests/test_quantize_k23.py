"""Q2_K and Q3_K: the quantizers against gguf.quants' decoding and ggml's reference quantizers, the file types that
use them (Q2_K, Q3_K_S, Q3_K_M, Q3_K_L) as llama-quantize mixes them, and `moestream quantize` to them end to end."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from ggml_k23 import q2_k_block, q3_k_block
from test_quantize import assert_file_matches

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


# --- the mixes -------------------------------------------------------------------------------------------------
def _check(types: dict[str, Q], n_layers: int, v, down, attn_output, default):
    """Every tensor's type: v[i] and down[i] for layer i's attn_v and ffn_down, the given attn_output, Q6_K for
    output.weight, F32 for norms and routers, `default` for the rest (token_embd, q, k, gate, up)."""
    for name, t in types.items():
        layer = int(name.split(".")[1]) if name.startswith("blk.") else -1
        if name.endswith("norm.weight") or "ffn_gate_inp" in name:
            want = Q.F32
        elif name == "output.weight":
            want = Q.Q6_K
        elif "attn_v.weight" in name:
            want = v[layer]
        elif "ffn_down" in name:
            want = down[layer]
        elif "attn_output.weight" in name:
            want = attn_output
        else:
            want = default
        assert t == want, (name, t.name, want.name)
    assert sum("attn_v.weight" in n for n in types) == n_layers


def test_mixes_on_tiny():
    """synth:tiny (4 layers, 8 query heads on 2 kv heads, 16 experts, expert FFN 128): ffn_down's rows of 128 are
    not whole 256-blocks and fall back, Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1."""
    from moestream.loading.synth import SynthSource
    from moestream.quant.mix import file_types
    cfg = SynthSource.from_spec("tiny").config
    _check(file_types(cfg, "Q2_K"), 4, [Q.Q4_K] * 4, [Q.Q4_0] * 4, Q.Q3_K, Q.Q2_K)
    _check(file_types(cfg, "Q3_K_S"), 4, [Q.Q3_K] * 4, [Q.Q4_0] * 4, Q.Q3_K, Q.Q3_K)
    _check(file_types(cfg, "Q3_K_M"), 4, [Q.Q5_K] * 2 + [Q.Q4_K] * 2, [Q.Q5_0] * 4, Q.Q4_K, Q.Q3_K)
    _check(file_types(cfg, "Q3_K_L"), 4, [Q.Q5_K] * 4, [Q.Q5_1] * 4, Q.Q5_K, Q.Q3_K)
    gqa1 = cfg.replace(n_kv_heads=8)                       # fewer than 4 query heads a kv head: Q2_K's attn_v Q3_K
    assert file_types(gqa1, "Q2_K")["blk.0.attn_v.weight"] == Q.Q3_K


def test_mixes_on_qwen3_30b_a3b():
    """Qwen3-30B-A3B's shapes (48 layers, 32 query heads on 4 kv heads, 128 experts, expert FFN 768): whole blocks
    everywhere. Q3_K_M's ffn_down is Q5_K in the first sixteenth of the layers (0-2), its attn_v in the first 2."""
    from moestream.loading.synth import SynthSource
    from moestream.quant.mix import estimate_bytes, file_types
    cfg = SynthSource.from_spec("qwen3-30b-a3b").config
    _check(file_types(cfg, "Q2_K"), 48, [Q.Q4_K] * 48, [Q.Q3_K] * 48, Q.Q3_K, Q.Q2_K)
    _check(file_types(cfg, "Q3_K_S"), 48, [Q.Q3_K] * 48, [Q.Q3_K] * 48, Q.Q3_K, Q.Q3_K)
    _check(file_types(cfg, "Q3_K_M"), 48, [Q.Q5_K] * 2 + [Q.Q4_K] * 46, [Q.Q5_K] * 3 + [Q.Q4_K] * 45, Q.Q4_K, Q.Q3_K)
    _check(file_types(cfg, "Q3_K_L"), 48, [Q.Q5_K] * 48, [Q.Q5_K] * 48, Q.Q5_K, Q.Q3_K)
    # the tensor bytes these mixes give, from the config: 11.25, 13.29, 14.71, 15.89 GB (Q4_K_M: 18.55)
    sizes = [estimate_bytes(cfg, f) / 1e9 for f in ("Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_M")]
    assert sizes == sorted(sizes)
    assert np.allclose(sizes[:4], [11.25, 13.29, 14.71, 15.89], rtol=2e-3), sizes


def test_eight_experts_and_the_hybrids():
    """Mixtral's rule (8 experts): attn_v and attn_k Q8_0; attn_output Q5_K for Q2_K, Q3_K_S and Q3_K_M, while
    Q3_K_L's keeps Q3_K (llama.cpp leaves it out of that list). The hybrids' attn_qkv takes attn_v's rules
    (b11549's llama-quant.cpp: category_is_attn_v, line 157; its attn_v branch, line 567, before the ATTENTION_QKV
    one, line 689, never reached): Q4_K for Q2_K (8 query heads per kv head), Q5_K in the first 2 for Q3_K_M."""
    from test_quantize import _reference_config

    from moestream.quant.mix import Mix
    cfg = _reference_config().replace(n_experts=8, n_layers=8)
    for ftype, out in (("Q2_K", Q.Q5_K), ("Q3_K_S", Q.Q5_K), ("Q3_K_M", Q.Q5_K), ("Q3_K_L", Q.Q3_K)):
        mix = Mix.for_config(cfg, ftype)
        assert mix.type("blk.3.attn_v.weight", (512, 2048)) == mix.type("blk.3.attn_k.weight", (512, 2048)) == Q.Q8_0
        assert mix.type("blk.3.attn_output.weight", (2048, 4096)) == out, ftype
    cfg = _reference_config()
    for ftype, want in (("Q2_K", Q.Q4_K), ("Q3_K_S", Q.Q3_K), ("Q3_K_M", Q.Q4_K), ("Q3_K_L", Q.Q5_K)):
        assert Mix.for_config(cfg, ftype).type("blk.4.attn_qkv.weight", (8192, 2048)) == want, ftype
    assert Mix.for_config(cfg, "Q3_K_M").type("blk.1.attn_qkv.weight", (8192, 2048)) == Q.Q5_K


def test_q2_k_s_needs_an_imatrix():
    from moestream.errors import UserError
    from moestream.quant.mix import parse_ftype
    with pytest.raises(UserError, match="Q2_K_S needs an importance matrix.*use Q2_K"):
        parse_ftype("q2_k_s")


# --- moestream quantize, and the files in moestream ---------------------------------------------------------------
def test_cli_q3_k_m_tiny_loads_and_generates(tmp_path):
    """`moestream quantize synth:tiny OUT Q3_K_M`: every tensor of the mix's type and close to the source; moestream
    loads it with the experts in their blocks (gate and up Q3_K, down Q5_0) and generates."""
    from moestream import LLM
    from moestream.cli import main
    from moestream.loading.synth import SynthSource
    out = tmp_path / "q3_k_m.gguf"
    assert main(["quantize", "synth:tiny", str(out), "Q3_K_M", "--device", "cpu"]) == 0
    assert_file_matches(out, SynthSource.from_spec("tiny"), "Q3_K_M")
    llm = LLM(str(out), ctx_size=64, device="cpu", cpu_moe=True)
    assert {lay.types for lay in llm.engine.host.store.layouts.values()} == {(Q.Q3_K, Q.Q3_K, Q.Q5_0)}
    done = llm.generate("Once upon a time", max_tokens=8, ignore_eos=True)
    assert len(done.token_ids) == 8 and done.text


@pytest.mark.parametrize("ftype,experts", [("Q2_K", (Q.Q2_K, Q.Q2_K, Q.Q3_K)), ("Q3_K_S", (Q.Q3_K,) * 3)])
def test_whole_blocks_model(tmp_path, ftype, experts):
    """tiny with an expert FFN of 256: every expert stack in Q2_K / Q3_K itself, no fallback; the file loads, its
    experts stay in their blocks, and it generates the same tokens with the experts on the host and cached."""
    from moestream import LLM
    from moestream.config import ModelConfig
    from moestream.loading.gguf_write import write_gguf
    from moestream.loading.synth import PRESETS, TINY_ROUTER_SCALE, SynthSource
    from moestream.quant.mix import Mix
    cfg = ModelConfig(**dict(PRESETS["tiny"], n_layers=2, moe_intermediate_size=256))
    src = SynthSource(cfg, tokenizer=SynthSource.from_spec("tiny").tokenizer, router_scale=TINY_ROUTER_SCALE)
    mix = Mix.for_config(cfg, ftype)
    path = tmp_path / f"{ftype}.gguf"
    write_gguf(src, path, types=mix.type, file_type=mix.file_type, device="cpu")
    assert_file_matches(path, src, ftype)
    host = LLM(str(path), ctx_size=64, device="cpu", cpu_moe=True)
    assert {lay.types for lay in host.engine.host.store.layouts.values()} == {experts}
    prompt = host.encode("Once upon a time")
    want = host.generate(prompt, max_tokens=6, ignore_eos=True).token_ids
    assert want == LLM(str(path), ctx_size=64, device="cpu").generate(prompt, max_tokens=6, ignore_eos=True).token_ids
