"""The quantize tool: torch quantizers in ggml's layout, llama-quantize's type mixes, and `moestream quantize`."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import gguf
from gguf import GGMLQuantizationType as Q

from moestream.quant.quantize import ENCODERS, quantize

# Relative RMS error (||deq - x|| / ||x||) on N(0, 1) rows, measured ~0.0054, 0.086, 0.079, 0.043, 0.038,
# 0.297, 0.151, 0.072, 0.036, 0.018, 0.076, 0.077, 0.115 (the numbers ggml's reference quantizers give on such
# data), with margin.
MAX_REL_RMS = {Q.Q8_0: 0.01, Q.Q4_0: 0.1, Q.Q4_1: 0.09, Q.Q5_0: 0.05, Q.Q5_1: 0.045, Q.Q2_K: 0.31, Q.Q3_K: 0.16,
               Q.Q4_K: 0.08, Q.Q5_K: 0.042, Q.Q6_K: 0.021, Q.IQ4_NL: 0.085, Q.IQ4_XS: 0.085,
               Q.MXFP4: 0.125}
BIT_EXACT = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.MXFP4)       # gguf.quants.quantize implements these


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
    with pytest.raises(UserError, match="cannot quantize to IQ3_XXS"):
        quantize(torch.randn(2, 256), Q.IQ3_XXS)


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


def test_the_hybrids_deltanet_input_takes_attn_vs_rules():
    """b11549's llama-quant.cpp: attn_qkv (the DeltaNet's fused input projection of qwen3next, qwen35moe and
    Qwen3.8-Flash-Next) is attn_v-like (category_is_attn_v, line 157), and llama_tensor_get_type_impl's attn_v
    branch (line 567) comes before its ATTENTION_QKV one (line 689), which is never reached: attn_qkv takes attn_v's
    rules, counted with the attention layers' attn_v in file order (n_attention_wv, line 933). Its gate and the
    attention layers' q as the file type."""
    from moestream.loading.synth import SynthSource
    from moestream.quant.mix import Mix, file_types, use_more_bits
    cfg = _reference_config()
    for ftype, want in (("Q4_K_M", Q.Q6_K), ("Q5_K_M", Q.Q6_K), ("Q4_K_S", Q.Q5_K), ("Q6_K", Q.Q6_K)):
        mix = Mix.for_config(cfg, ftype)                # (24 attn_v; attn_qkv not in this file: its layer counts)
        assert mix.type("blk.3.attn_qkv.weight", (8192, 2048)) == mix.type("blk.3.attn_v.weight", (512, 2048))
        assert mix.type("blk.2.attn_qkv.weight", (8192, 2048)) == want, ftype
    mix = Mix.for_config(cfg, "Q4_K_M")
    assert mix.type("blk.4.attn_gate.weight", (4096, 2048)) == mix.type("blk.3.attn_q.weight", (8192, 2048)) == Q.Q4_K
    # qwen3-next-80b-a3b: 48 layers, attention every 4th (attn_v), DeltaNet between (attn_qkv): one a layer
    nxt = SynthSource.from_spec("qwen3-next-80b-a3b").config
    types = file_types(nxt, "Q4_K_M")
    v = [types.get(f"blk.{i}.attn_qkv.weight") or types[f"blk.{i}.attn_v.weight"] for i in range(48)]
    assert v == [Q.Q6_K if use_more_bits(i, 48) else Q.Q4_K for i in range(48)]
    assert types["blk.0.attn_qkv.weight"] == Q.Q6_K and types["blk.7.attn_v.weight"] == Q.Q4_K
    types = file_types(nxt, "Q3_K_M")                   # i_attention_wv < 2: Q5_K
    assert [types["blk.0.attn_qkv.weight"], types["blk.1.attn_qkv.weight"], types["blk.2.attn_qkv.weight"]] == \
        [Q.Q5_K, Q.Q5_K, Q.Q4_K]
    assert file_types(nxt, "Q2_K")["blk.5.attn_qkv.weight"] == Q.Q4_K                  # 8 query heads per kv head
    assert file_types(nxt, "IQ4_XS")["blk.5.attn_qkv.weight"] == Q.Q5_K


def test_an_mtp_heads_block_counts_as_a_layer():
    """llama.cpp counts the ffn_down layers of a file as its block count (llama-quant.cpp line 940: n_layer_all,
    llama-model.cpp line 1355: block_count, the MTP heads' blocks too) and its attn_v tensors as they come (line
    933): with DeepSeek-V3's MTP block (61 + 1), use_more_bits(53, 62) is false, where (53, 61) was true."""
    from moestream.loading.synth import SynthSource
    from moestream.quant.mix import file_types, use_more_bits
    assert use_more_bits(53, 61) and not use_more_bits(53, 62)
    types = file_types(SynthSource.from_spec("deepseek-v3:mtp=1").config, "Q4_K_M")
    assert types["blk.53.ffn_down_exps.weight"] == types["blk.53.ffn_down_shexp.weight"] == Q.Q4_K
    assert types["blk.61.ffn_down_exps.weight"] == types["blk.54.ffn_down_exps.weight"] == Q.Q6_K
    glm = file_types(SynthSource.from_spec("tiny-glm:mtp=1").config, "Q4_K_M")     # 4 + 1 blocks: 2 and 4, not 3
    assert [glm[f"blk.{i}.attn_v.weight"] for i in range(5)] == [Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q4_K, Q.Q6_K]


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


# --- moestream quantize ----------------------------------------------------------------------------------------
def _run(capsys, *argv):
    from moestream.cli import main
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _source_tensors(src):
    """name -> the source's float32 tensor in the file's shape (expert stacks stacked)."""
    from moestream.arch.names import EXPERT_STACKS, gguf_tensors
    out = {}
    for name, shape in gguf_tensors(src.config):
        parts = name.split(".")
        if len(parts) > 2 and parts[2] in EXPERT_STACKS:
            layer, k = int(parts[1]), EXPERT_STACKS.index(parts[2])
            out[name] = torch.stack([src.expert(layer, e)[k] for e in range(src.config.n_experts)]).float()
        else:
            out[name] = src.tensor(name).float().reshape(shape)
    return out


def assert_file_matches(path, src, ftype, slack=1.0):
    """The file has the mix's type for every tensor and its general.file_type, and every tensor dequantizes (by
    gguf.quants) to close to the source's."""
    from moestream.quant.mix import FTYPES, file_types
    reader = gguf.GGUFReader(path)
    assert int(reader.fields["general.file_type"].contents()) == FTYPES[ftype][0]
    expected, ref = file_types(src.config, ftype), _source_tensors(src)
    assert {t.name for t in reader.tensors} == set(expected)
    for t in reader.tensors:
        assert t.tensor_type == expected[t.name], t.name
        x = ref[t.name].numpy()
        deq = gguf.quants.dequantize(t.data, t.tensor_type).reshape(x.shape)
        if t.tensor_type == Q.F32:
            assert np.array_equal(deq, x), t.name
            continue
        err = np.sqrt(((deq - x) ** 2).sum() / (x ** 2).sum())
        assert err < slack * MAX_REL_RMS.get(t.tensor_type, 0.01), (t.name, t.tensor_type.name, err)
    return reader


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    """synth:tiny as Q8_0 and Q4_K_M, through the command line (its rows of 128 exercise the fallbacks)."""
    from moestream.cli import main
    d = tmp_path_factory.mktemp("quantized")
    for ftype in ("Q8_0", "Q4_K_M"):
        assert main(["quantize", "synth:tiny", str(d / f"{ftype}.gguf"), ftype, "--device", "cpu"]) == 0
    return d


@pytest.mark.parametrize("ftype", ["Q8_0", "Q4_K_M"])
def test_cli_tiny(tiny_files, ftype):
    from moestream.loading.synth import SynthSource
    assert_file_matches(tiny_files / f"{ftype}.gguf", SynthSource.from_spec("tiny"), ftype)
    assert not list(tiny_files.glob("*.partial"))


def test_q8_0_file_loads_and_equals_make_models(tiny_files, tmp_path):
    """The Q8_0 file loads in moestream, with the tokenizer and config, and holds the blocks make-model's q8_0
    writes (which quantizes the routers too, where llama-quantize keeps them F32)."""
    from moestream.loading.gguf import GGUFSource
    from moestream.loading.gguf_write import write_gguf
    from moestream.loading.synth import SynthSource
    src = SynthSource.from_spec("tiny")
    out = GGUFSource(tiny_files / "Q8_0.gguf")
    assert out.config == src.config and out.tokenizer.encode("Hello") == src.tokenizer.encode("Hello")
    write_gguf(src, tmp_path / "mm.gguf", dtype="q8_0")
    a, b = gguf.GGUFReader(tmp_path / "mm.gguf"), gguf.GGUFReader(tiny_files / "Q8_0.gguf")
    for x, y in zip(a.tensors, b.tensors):
        assert x.name == y.name
        if x.name.endswith("ffn_gate_inp.weight"):
            assert (x.tensor_type, y.tensor_type) == (Q.Q8_0, Q.F32)
        else:
            assert x.tensor_type == y.tensor_type and np.array_equal(x.data, y.data), x.name


def test_whole_256_rows(tmp_path):
    """A model whose rows are all whole 256-blocks takes the k-quant types themselves, no fallback; 8 experts."""
    from moestream.loading.gguf_write import write_gguf
    from moestream.loading.synth import SynthSource
    from moestream.quant.mix import Mix
    base = SynthSource.from_spec("tiny:layers=2")
    cfg = base.config.replace(moe_intermediate_size=256, n_experts=8, n_experts_used=2)
    src = SynthSource(cfg, tokenizer=base.tokenizer)
    for ftype in ("Q4_K_M", "IQ4_XS"):         # between them every k-quant and IQ4 type
        mix = Mix.for_config(cfg, ftype)
        write_gguf(src, tmp_path / f"{ftype}.gguf", types=mix.type, file_type=mix.file_type)
        reader = assert_file_matches(tmp_path / f"{ftype}.gguf", src, ftype)
        types = {t.name: t.tensor_type for t in reader.tensors}
        assert types["blk.1.attn_v.weight"] == Q.Q8_0                   # 8 experts
        if ftype == "Q4_K_M":
            assert types["blk.0.ffn_down_exps.weight"] == Q.Q4_K and types["blk.1.ffn_down_exps.weight"] == Q.Q6_K
            assert types["blk.0.attn_output.weight"] == Q.Q5_K


def test_requantize(tiny_files, tmp_path, capsys):
    """A quantized GGUF is refused without --allow-requantize, as llama-quantize refuses it; with it, its
    dequantized tensors are quantized again."""
    from moestream.loading.synth import SynthSource
    q8 = str(tiny_files / "Q8_0.gguf")
    code, _, err = _run(capsys, "quantize", q8, str(tmp_path / "r.gguf"), "Q4_K_M")
    assert code == 1 and "already quantized (Q8_0)" in err and "--allow-requantize" in err
    assert not (tmp_path / "r.gguf").exists()
    code, out, _ = _run(capsys, "quantize", q8, str(tmp_path / "r.gguf"), "q4_k_m", "1", "--allow-requantize",
                        "--device", "cpu")
    assert code == 0 and "Q4_K_M" in out
    assert_file_matches(tmp_path / "r.gguf", SynthSource.from_spec("tiny"), "Q4_K_M", slack=1.1)


def _one_line_error(code, err, needle):
    lines = [l for l in err.splitlines() if l.startswith("error:")]
    assert code == 1 and len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in err


BAD = [
    (["synth:tiny", "{out}", "Q9_K"], "Q8_0, Q4_0"),                  # an unknown type: the list of those written
    (["synth:tiny", "{out}", "IQ2_XXS"], "importance matrix"),
    (["synth:tiny", "{out}", "Q2_K_S"], "needs an importance matrix"),
    (["synth:tiny", "{existing}", "Q8_0"], "already exists"),
    (["/no/such/model", "{out}", "Q8_0"], "model not found"),
    (["synth:nope", "{out}", "Q8_0"], "synth preset"),
    (["synth:tiny", "{out}", "Q8_0", "--output-tensor-type", "iq2_xxs"], "iq2_xxs"),
    (["synth:tiny", "{out}", "Q8_0", "--device", "tpu"], "--device"),
    (["synth:tiny", "{out}", "Q8_0", "-3"], "NTHREADS"),
] + ([] if torch.cuda.is_available() else [(["synth:tiny", "{out}", "Q8_0", "--device", "cuda"], "no CUDA")])


@pytest.mark.parametrize("argv,needle", BAD, ids=[b[1] for b in BAD])
def test_bad_input_is_one_line(tmp_path, capsys, argv, needle):
    (tmp_path / "existing.gguf").write_bytes(b"keep me")
    argv = [a.format(out=tmp_path / "o.gguf", existing=tmp_path / "existing.gguf") for a in argv]
    _one_line_error(*_run(capsys, "quantize", *argv)[::2], needle)
    assert not (tmp_path / "o.gguf").exists() and not (tmp_path / "o.gguf.partial").exists()
    assert (tmp_path / "existing.gguf").read_bytes() == b"keep me"


def test_failure_midway_leaves_nothing(tmp_path, capsys, monkeypatch):
    """A source that fails at layer 1's experts (bad input, or any exception) leaves neither OUT nor OUT.partial."""
    from moestream.errors import UserError
    from moestream.loading.synth import SynthSource
    real = SynthSource.expert

    def expert(self, layer, e):
        if layer == 1 and e == 3:
            raise self.failure
        return real(self, layer, e)

    monkeypatch.setattr(SynthSource, "expert", expert)
    out = tmp_path / "o.gguf"
    for failure in (UserError("expert 3 of layer 1 is damaged"), RuntimeError("disk on fire")):
        monkeypatch.setattr(SynthSource, "failure", failure, raising=False)
        if isinstance(failure, UserError):
            _one_line_error(*_run(capsys, "quantize", "synth:tiny:layers=2", str(out), "Q4_K_M")[::2], "damaged")
        else:
            from moestream.tools.quantize import quantize_model
            with pytest.raises(RuntimeError, match="disk on fire"):
                quantize_model("synth:tiny:layers=2", out, "Q4_K_M", device="cpu", progress=False)
        assert not out.exists() and not (tmp_path / "o.gguf.partial").exists()
