"""Importance matrices: llama.cpp's files, `moestream imatrix`'s collection, and IQ1/IQ2 files from `moestream
quantize --imatrix` (llama-quantize's type rules, the ffn_down fallback that mixes an expert's types)."""
from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from moestream.errors import UserError
from moestream.quant.imatrix import Imatrix, read_imatrix, write_imatrix
from cli_run import one_error, run

TINY1 = "synth:tiny:layers=1"        # one layer: an IQ1_M file of it takes ~2 s to write on one core


def _imatrix() -> Imatrix:
    return Imatrix({"blk.0.ffn_down_exps.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
                    "blk.0.attn_q.weight": np.full((1, 4), 6.0, dtype=np.float32)},
                   {"blk.0.ffn_down_exps.weight": np.array([2.0, 0.0, 4.0]), "blk.0.attn_q.weight": np.array([3.0])},
                   ["calib.txt"], 5, 512)


def test_gguf_round_trip_and_importance(tmp_path):
    """llama-imatrix's layout (in_sum2 (n, n_mat), counts (1, n_mat) in ggml order) and llama-quantize's
    normalisation: sums / count, 1 for an expert no token reached."""
    import gguf
    path = write_imatrix(tmp_path / "i.gguf", _imatrix())
    r = gguf.GGUFReader(path)
    assert {t.name: t.shape.tolist() for t in r.tensors} == {
        "blk.0.attn_q.weight.in_sum2": [4, 1], "blk.0.attn_q.weight.counts": [1, 1],
        "blk.0.ffn_down_exps.weight.in_sum2": [4, 3], "blk.0.ffn_down_exps.weight.counts": [1, 3]}
    assert "general.architecture" not in r.fields
    im = read_imatrix(path)
    assert (im.datasets, im.chunk_count, im.chunk_size) == (["calib.txt"], 5, 512)
    np.testing.assert_array_equal(im.importance("blk.0.ffn_down_exps.weight").numpy(),
                                  [[0, 0.5, 1, 1.5], [1, 1, 1, 1], [2, 2.25, 2.5, 2.75]])
    np.testing.assert_array_equal(im.importance("blk.0.attn_q.weight").numpy(), [[2, 2, 2, 2]])
    assert im.importance("blk.0.attn_k.weight") is None


def test_legacy_dat(tmp_path):
    """llama.cpp's .dat: sums stored as (sum / count) * ncall, divided by ncall on reading."""
    body = struct.pack("<i", 1) + struct.pack("<i", 19) + b"blk.0.attn_q.weight" + struct.pack("<ii", 4, 3)
    body += struct.pack("<3f", 4.0, 8.0, 2.0) + struct.pack("<i", 4) + struct.pack("<i", 3) + b"a.t"
    (tmp_path / "i.dat").write_bytes(body)
    im = read_imatrix(tmp_path / "i.dat")
    assert im.legacy and im.chunk_count == 4 and im.datasets == ["a.t"]
    np.testing.assert_array_equal(im.importance("blk.0.attn_q.weight").numpy(), [[1, 2, 0.5]])


@pytest.mark.parametrize("content,why", [(b"GGUF\x03\x00\x00\x00garbage", "damaged or not one"),
                                         (b"\x07\x00", "damaged or not one"), (b"", "damaged or not one")])
def test_damaged_file(tmp_path, content, why):
    (tmp_path / "bad").write_bytes(content)
    with pytest.raises(UserError, match=f"{why}.*moestream imatrix"):
        read_imatrix(tmp_path / "bad")


def test_a_model_is_not_an_imatrix(tmp_path):
    from moestream.loading.gguf_write import write_gguf
    from moestream.loading.synth import SynthSource
    path = write_gguf(SynthSource.from_spec(TINY1[len("synth:"):]), tmp_path / "m.gguf", dtype="float32")
    with pytest.raises(UserError, match="no imatrix.datasets key: a model, not an imatrix"):
        read_imatrix(path)


def test_collection_counts_and_sums():
    """Over two chunks of 32 tokens: every dense matrix of a layer counted 64 tokens; attention's q, k and v share
    their input; each expert stack's counts add up to 64 k and, as every token's input reaches k experts and the
    router, the gate stack's sums add up to k times the router's; gate and up see the same input."""
    from moestream import LLM
    from moestream.tools.imatrix import compute_imatrix
    llm = LLM("synth:tiny:layers=2", ctx_size=64, device="cpu", cpu_moe=True)
    k = llm.model_config.n_experts_used
    chunks = [list(range(5, 37)), list(range(40, 72))]
    im = compute_imatrix(llm, chunks, "ids", None)
    assert (im.chunk_count, im.chunk_size) == (2, 32)
    for layer in range(2):
        p = f"blk.{layer}."
        assert all(im.counts[p + n + ".weight"].tolist() == [64] for n in ("attn_q", "attn_output", "ffn_gate_inp"))
        np.testing.assert_array_equal(im.sums[p + "attn_q.weight"], im.sums[p + "attn_v.weight"])
        assert im.counts[p + "ffn_down_exps.weight"].sum() == 64 * k
        np.testing.assert_array_equal(im.sums[p + "ffn_gate_exps.weight"], im.sums[p + "ffn_up_exps.weight"])
        np.testing.assert_allclose(im.sums[p + "ffn_gate_exps.weight"].sum(0),
                                   k * im.sums[p + "ffn_gate_inp.weight"][0], rtol=1e-5)
        assert im.sums[p + "ffn_down_exps.weight"].shape == (16, llm.model_config.moe_intermediate_size)
    assert llm.generate([1, 2, 3], max_tokens=2).token_ids       # the engine is as it was


def test_collection_covers_a_hybrid():
    """tiny-next (DeltaNet layers: ssm_in held as attn_qkv + attn_gate in the file, a shared expert): an entry for
    every tensor an IQ2_XS file quantizes with an imatrix."""
    from moestream import LLM
    from moestream.arch.names import gguf_name, gguf_tensors
    from moestream.quant.mix import REQUIRES_IMATRIX, Mix
    from moestream.tools.imatrix import compute_imatrix
    llm = LLM("synth:tiny-next:layers=2", ctx_size=64, device="cpu", cpu_moe=True)
    im = compute_imatrix(llm, [list(range(5, 37))], "ids")
    cfg = llm.model_config
    mix = Mix.for_config(cfg, "IQ2_XS", has_imatrix=True)
    need = [gguf_name(cfg, n) for n, s in gguf_tensors(cfg) if mix.type(n, s) in REQUIRES_IMATRIX]
    assert "blk.0.attn_gate.weight" in need and [n for n in need if n not in im.sums] == []


@pytest.mark.parametrize("spec", ["synth:tiny-gptoss:layers=2", "synth:tiny-flash-next:layers=2"])
def test_collection_covers_other_families(spec):
    """gpt-oss (the expert kernel takes its clamped SwiGLU's biases too) and Qwen3.8-Flash-Next (the split DeltaNet
    projections, fused at load as ssm_proj; its output mixer output_hc_*, outside blk.*): an entry for every tensor
    an IQ2_XS file quantizes with an imatrix, and every routed choice counted by the down stack."""
    from moestream import LLM
    from moestream.arch.names import gguf_name, gguf_tensors
    from moestream.quant.mix import REQUIRES_IMATRIX, Mix
    from moestream.tools.imatrix import compute_imatrix
    llm = LLM(spec, ctx_size=64, device="cpu", cpu_moe=True)
    im = compute_imatrix(llm, [list(range(5, 37))], "ids")
    cfg = llm.model_config
    mix = Mix.for_config(cfg, "IQ2_XS", has_imatrix=True)
    need = [gguf_name(cfg, n) for n, s in gguf_tensors(cfg) if mix.type(n, s) in REQUIRES_IMATRIX]
    assert need and [n for n in need if n not in im.sums] == []
    assert im.counts["blk.1.ffn_down_exps.weight"].sum() == 32 * cfg.n_experts_used


def test_iq_types_without_imatrix_refused():
    from moestream.tools.quantize import quantize_model
    with pytest.raises(UserError, match="IQ1_M needs an importance matrix.*moestream imatrix -m IN -f TEXT.*--imatrix"):
        quantize_model(TINY1, "/nonexistent/out.gguf", "iq1_m")
    with pytest.raises(UserError, match="Q2_K_S needs an importance matrix.*IQ1_S, IQ1_M.*use Q2_K"):
        quantize_model(TINY1, "/nonexistent/out.gguf", "Q2_K_S")


def test_imatrix_missing_a_tensor_or_of_another_shape(tmp_path):
    from moestream.tools.quantize import quantize_model
    other = Imatrix({"blk.9.ffn_up_exps.weight": np.ones((2, 4), np.float32)}, {"blk.9.ffn_up_exps.weight": np.ones(2)},
                    [], 1, 512)
    write_imatrix(tmp_path / "other.gguf", other)
    with pytest.raises(UserError, match="has no entry for blk.0.attn_q.weight, which IQ2_XS quantizes to IQ2_XS: "
                                        "it was made for another model"):
        quantize_model(TINY1, tmp_path / "o.gguf", "IQ2_XS", imatrix=str(tmp_path / "other.gguf"))
    write_imatrix(tmp_path / "i.gguf", _imatrix())
    with pytest.raises(UserError, match=r"has 4 values for blk.0.attn_q.weight, which takes 256 \(1 x 256\)"):
        quantize_model(TINY1, tmp_path / "o.gguf", "IQ2_XS", imatrix=str(tmp_path / "i.gguf"))


def test_iq_mix_rules():
    """llama-quant.cpp b11549's IQ branch and fallbacks on Qwen3-30B-A3B's shapes (48 layers, 128 experts): the first
    48 / 8 ffn_down tensors Q2_K; a down projection of rows of 640 (Qwen3.8-Flash-Next's) not whole 256-blocks:
    IQ4_NL, or Q4_0 where the rule said Q2_K."""
    from moestream.loading.synth import SynthSource
    from moestream.quant.mix import Mix
    cfg = SynthSource.from_spec("qwen3-30b-a3b").config
    mix = Mix.for_config(cfg, "IQ1_M", has_imatrix=True)
    E, I, H = cfg.n_experts, cfg.moe_intermediate_size, cfg.hidden_size
    assert mix.type("output.weight", (cfg.vocab_size, H)) == Q.Q5_K
    assert mix.type("token_embd.weight", (cfg.vocab_size, H)) == Q.Q2_K
    assert mix.type("blk.7.attn_v.weight", (512, H)) == Q.Q4_K                 # 128 experts (and gqa 8)
    assert mix.type("blk.7.attn_output.weight", (H, 4096)) == Q.IQ2_XXS
    assert mix.type("blk.7.attn_q.weight", (4096, H)) == Q.IQ1_M
    assert mix.type("blk.7.ffn_gate_exps.weight", (E, I, H)) == Q.IQ1_M
    downs = [mix.type(f"blk.{i}.ffn_down_exps.weight", (E, H, I)) for i in (0, 5, 6, 47)]
    assert downs == [Q.Q2_K, Q.Q2_K, Q.IQ1_M, Q.IQ1_M]
    downs = [mix.type(f"blk.{i}.ffn_down_exps.weight", (E, H, 640)) for i in (0, 5, 6, 47)]
    assert downs == [Q.Q4_0, Q.Q4_0, Q.IQ4_NL, Q.IQ4_NL]
    assert Mix.for_config(cfg, "IQ2_XS").type("blk.9.attn_output.weight", (H, 4096)) == Q.IQ2_XS
    assert Mix.for_config(cfg, "Q4_K_M").type("blk.9.ffn_down_exps.weight", (E, H, 640)) == Q.Q5_0


def test_cli_imatrix_then_iq1_m(tmp_path, capsys):
    """`moestream imatrix` over a text, then `moestream quantize ... IQ1_M --imatrix`: the file names its imatrix
    as llama-quantize's keys do, its experts mix types (gate, up IQ1_M; down IQ4_NL: rows of 128), moestream loads
    them so and generates."""
    import gguf
    from moestream import LLM
    text = tmp_path / "calib.txt"
    text.write_text("Once upon a time there was a little model that wanted to be small. " * 12)
    code, out, err = run(capsys, "imatrix", "-m", TINY1, "-f", str(text), "-c", "64", "--chunks", "2",
                         "-o", str(tmp_path / "imatrix.gguf"))
    assert code == 0 and "entries over 2 chunks" in out, err
    im = read_imatrix(tmp_path / "imatrix.gguf")
    assert im.sums["blk.0.ffn_down_exps.weight"].shape == (16, 128) and im.datasets == [str(text)]
    dest = tmp_path / "iq1_m.gguf"
    code, out, err = run(capsys, "quantize", TINY1, str(dest), "IQ1_M", "--imatrix", str(tmp_path / "imatrix.gguf"),
                         "--device", "cpu")
    assert code == 0, err
    f = gguf.GGUFReader(dest).fields
    assert bytes(f["quantize.imatrix.file"].parts[-1]).decode() == str(tmp_path / "imatrix.gguf")
    assert int(f["quantize.imatrix.entries_count"].parts[-1][0]) == len(im.sums)
    llm = LLM(str(dest), ctx_size=64, device="cpu", cpu_moe=True)
    assert {lay.types for lay in llm.engine.host.store.layouts.values()} == {(Q.IQ1_M, Q.IQ1_M, Q.IQ4_NL)}
    assert len(llm.generate("Once upon a time", max_tokens=4, ignore_eos=True).token_ids) == 4


def test_cli_imatrix_token_ids_then_iq2_xs_of_flash_next(tmp_path, capsys):
    """Qwen3.8-Flash-Next through `moestream imatrix --token-ids`, then `quantize IQ2_XS --imatrix`: the output
    mixer's output_hc_down (rows of hc x hidden: IQ2_XS, which needs an entry) has one, so the file is written,
    and moestream loads it and generates."""
    import gguf
    spec = "synth:tiny-flash-next:layers=2"
    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(str(5 + i % 200) for i in range(64)))
    code, out, err = run(capsys, "imatrix", "-m", spec, "-f", str(ids), "--token-ids", "-c", "32", "--chunks", "2",
                         "-o", str(tmp_path / "imatrix.gguf"))
    assert code == 0, err
    im = read_imatrix(tmp_path / "imatrix.gguf")
    assert im.sums["output_hc_down.weight"].shape == (1, 1024) and im.counts["output_hc_down.weight"][0] == 64
    dest = tmp_path / "iq2_xs.gguf"
    code, out, err = run(capsys, "quantize", spec, str(dest), "IQ2_XS", "--imatrix", str(tmp_path / "imatrix.gguf"),
                         "--device", "cpu")
    assert code == 0, err
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(dest).tensors}
    assert types["output_hc_down.weight"] == Q.IQ2_XS and types["output_hc_up.weight"] == Q.IQ4_NL
    # b11549's llama-quant.cpp: the QSA indexer's projections kept (tensor_allows_quantization), the n-gram table
    # an embedding (tensor_name_match_token_embd: Q2_K, rows of 32 -> Q4_0)
    assert types["blk.1.indexer.q_proj.weight"] == types["blk.1.indexer.k_proj.weight"] == Q.F32
    assert types["per_layer_token_embd.weight"] == Q.Q4_0 and types["token_embd.weight"] == Q.Q2_K
    from moestream import LLM
    llm = LLM(str(dest), ctx_size=64, device="cpu", cpu_moe=True)
    assert len(llm.generate([5, 6, 7, 8], max_tokens=3, ignore_eos=True).token_ids) == 3


def test_cli_errors(tmp_path, capsys):
    (tmp_path / "bad.gguf").write_bytes(b"GGUF junk")
    code, _, err = run(capsys, "quantize", TINY1, str(tmp_path / "o.gguf"), "IQ2_XXS", "--imatrix",
                       str(tmp_path / "bad.gguf"))
    assert code != 0 and "is damaged or not one" in one_error(err)
    code, _, err = run(capsys, "quantize", TINY1, str(tmp_path / "o.gguf"), "IQ1_S")
    assert code != 0 and "IQ1_S needs an importance matrix" in one_error(err)
