"""Loaders and writers: synth presets, Hugging Face directories and GGUF files, round trips and bad input."""
from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from conftest import write_checkpoint
from moestream.errors import UserError
from moestream.loading.gguf import GGUFSource
from moestream.loading.gguf_write import write_gguf
from moestream.loading.hf import HFSource, hf_names, write_hf
from moestream.loading.source import open_source
from moestream.loading.synth import SynthSource
from moestream.arch.names import dense_names
from moestream.tools.make_model import make_model


def assert_same_model(a, b, exact_dtype=True):
    """Every tensor and expert of `a` equals `b`'s; 1-D tensors may come back as float32 (GGUF keeps them F32)."""
    assert a.config == b.config
    for n in dense_names(a.config):
        x, y = a.tensor(n), b.tensor(n)
        assert x.shape == y.shape, n
        if exact_dtype and x.dim() > 1:
            assert x.dtype == y.dtype, n
        assert torch.equal(x.float(), y.float()), n
    for layer in a.config.moe_layers:
        for e in range(a.config.n_experts):
            for x, y in zip(a.expert(layer, e), b.expert(layer, e)):
                assert x.dtype == y.dtype and torch.equal(x, y), (layer, e)


# --- synth -----------------------------------------------------------------------------------------------------
def test_synth_is_deterministic_and_lazy():
    a, b = SynthSource.from_spec("tiny"), SynthSource.from_spec("tiny")
    # Tensors do not depend on the order they are made in.
    names = dense_names(a.config)
    for n in names[::-1]:
        assert torch.equal(a.tensor(n), b.tensor(n)), n
    assert all(torch.equal(x, y) for x, y in zip(a.expert(3, 15), b.expert(3, 15)))
    c = SynthSource.from_spec("tiny:seed=1")
    assert not torch.equal(a.tensor("blk.0.attn_q.weight"), c.tensor("blk.0.attn_q.weight"))
    assert not torch.equal(a.expert(0, 0)[0], a.expert(0, 1)[0])
    assert not torch.equal(a.tensor("blk.0.attn_norm.weight"), torch.ones(256))


def test_synth_presets():
    tiny = SynthSource.from_spec("tiny")
    c = tiny.config
    assert (c.family, c.hidden_size, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim) == ("qwen3_moe", 256, 4, 8, 2, 32)
    assert (c.n_experts, c.n_experts_used, c.moe_intermediate_size, c.norm_topk_prob) == (16, 4, 128, True)
    assert c.vocab_size == 1024 and tiny.tensor("token_embd.weight").dtype == torch.float32
    if tiny.tokenizer is not None:
        assert tiny.tokenizer.vocab_size == c.vocab_size
    big = SynthSource.from_spec("qwen3-30b-a3b:layers=2:seed=3")
    c = big.config
    assert (c.hidden_size, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim) == (2048, 2, 32, 4, 128)
    assert c.vocab_size == 151936
    assert (c.n_experts, c.n_experts_used, c.moe_intermediate_size, c.max_position_embeddings) == (128, 8, 768, 40960)
    assert (c.rope_theta, c.rms_norm_eps, c.norm_topk_prob) == (1e6, 1e-6, True)
    assert big.tokenizer is None
    gate, up, down = big.expert(1, 127)
    assert gate.dtype == torch.bfloat16 and gate.shape == (768, 2048) and down.shape == (2048, 768)
    assert SynthSource.from_spec("qwen3-30b-a3b:dtype=float32").expert(0, 0)[0].dtype == torch.float32


@pytest.mark.parametrize("spec", ["nope", "tiny:layers=0", "tiny:layers=x", "tiny:color=red", "tiny:dtype=int8"])
def test_synth_bad_spec(spec):
    with pytest.raises(UserError, match="presets: tiny, qwen3-30b-a3b"):
        open_source("synth:" + spec)


def test_tiny_routing_is_decisive():
    """The router's softmax over a normed hidden state is far from uniform (top-4 of 16 take most of the mass)."""
    src = SynthSource.from_spec("tiny")
    x = src.tensor("token_embd.weight")[:200]
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * src.tensor("blk.0.ffn_norm.weight")
    p = (x @ src.tensor("blk.0.ffn_gate_inp.weight").T).softmax(-1)
    assert p.topk(4).values.sum(-1).mean() > 0.6        # uniform would be 0.25


# --- Hugging Face ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shard_bytes", [1 << 30, 3 << 20])
def test_hf_round_trip(tmp_path, shard_bytes):
    src = SynthSource.from_spec("tiny")
    write_hf(src, tmp_path, max_shard_bytes=shard_bytes)
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard_bytes < 1 << 30)
    out = HFSource(tmp_path)
    assert_same_model(src, out)
    if src.tokenizer is not None:
        assert out.tokenizer.vocab_size == src.tokenizer.vocab_size
        assert out.tokenizer.encode("Hello world") == src.tokenizer.encode("Hello world")


def test_transformers_loads_written_tiny(tmp_path):
    from transformers import AutoModelForCausalLM
    src = SynthSource.from_spec("tiny")
    write_hf(src, tmp_path)
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    sd = model.state_dict()
    assert torch.equal(sd["model.layers.2.self_attn.k_norm.weight"], src.tensor("blk.2.attn_k_norm.weight"))
    gate, up, down = src.expert(2, 5)
    assert torch.equal(sd["model.layers.2.mlp.experts.gate_up_proj"][5], torch.cat([gate, up]))
    assert torch.equal(sd["model.layers.2.mlp.experts.down_proj"][5], down)
    assert model.config.rope_parameters["rope_theta"] == 1e6


def _module_expert(sd: dict, layer: int, e: int):
    """(gate, up, down) of one expert from a transformers 5 model's fused parameters."""
    gate_up = sd[f"model.layers.{layer}.mlp.experts.gate_up_proj"][e]
    inter = gate_up.shape[0] // 2
    return gate_up[:inter], gate_up[inter:], sd[f"model.layers.{layer}.mlp.experts.down_proj"][e]


def test_transformers_checkpoint_of_each_family(checkpoint, tmp_path):
    """A checkpoint transformers wrote loads with every tensor and equals the transformers module's weights;
    written back by write_hf it loads into transformers again, and as GGUF it reads back identical."""
    family, path, model = checkpoint
    src = HFSource(path)
    sd = model.state_dict()
    for n in dense_names(src.config):
        assert src.has(n), n
        hf = next(h for h in hf_names(n, src.config.family) if h in sd)
        assert torch.equal(src.tensor(n), sd[hf].reshape(src.tensor(n).shape)), n
    for layer in src.config.moe_layers:
        for e in range(src.config.n_experts):
            for x, y in zip(src.expert(layer, e), _module_expert(sd, layer, e)):
                assert torch.equal(x, y), (layer, e)

    from transformers import AutoModelForCausalLM
    write_hf(src, tmp_path / "hf")
    again, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in sd.items())
    ids = torch.arange(20)[None] * 7 % model.config.vocab_size
    with torch.no_grad():      # the rebuilt config.json means the same model (rope, top-k norm, clip_qkv, ...)
        assert torch.equal(model(ids).logits, again(ids).logits)
    assert_same_model(src, HFSource(tmp_path / "hf"))

    if family == "mixtral":
        with pytest.raises(UserError, match="GGUF export of mixtral is not supported yet"):
            write_gguf(src, tmp_path / "m.gguf")
    else:
        write_gguf(src, tmp_path / "m.gguf")
        assert_same_model(src, GGUFSource(tmp_path / "m.gguf"))


def test_fused_expert_checkpoint(tmp_path):
    """Experts stored as transformers 5 holds them in memory: gate_up_proj (E, 2I, H) and down_proj (E, H, I)."""
    model = write_checkpoint("qwen3_moe", str(tmp_path))
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    (tmp_path / "model.safetensors").unlink()
    save_file(sd, str(tmp_path / "model.safetensors"))
    src = HFSource(tmp_path)
    for layer in src.config.moe_layers:
        for e in range(src.config.n_experts):
            assert all(torch.equal(x, y) for x, y in zip(src.expert(layer, e), _module_expert(sd, layer, e)))


# --- GGUF ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["tiny", "tiny:dtype=bfloat16"])
def test_gguf_round_trip(tmp_path, spec):
    src = SynthSource.from_spec(spec)
    write_gguf(src, tmp_path / "m.gguf")
    out = GGUFSource(tmp_path / "m.gguf")
    assert_same_model(src, out)
    assert out.tensor("blk.0.attn_norm.weight").dtype == torch.float32     # 1-D tensors are F32, as llama.cpp's
    if src.tokenizer is not None:
        assert out.tokenizer.encode("Hello world") == src.tokenizer.encode("Hello world")


def test_gguf_q8_0(tmp_path):
    src = SynthSource.from_spec("tiny")
    write_gguf(src, tmp_path / "q.gguf", dtype="q8_0")
    out = GGUFSource(tmp_path / "q.gguf")
    assert out.config == src.config
    assert next(t for t in out._reader.tensors if t.name == "blk.1.ffn_down_exps.weight").tensor_type == Q.Q8_0
    w = src.tensor("blk.1.attn_q.weight")
    ref = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), Q.Q8_0), Q.Q8_0))
    assert torch.equal(out.tensor("blk.1.attn_q.weight"), ref)
    # Q8_0's error is at most half a step: max|block| / 127 / 2, here about 1% of the largest weight.
    for x, y in zip(out.expert(1, 7), src.expert(1, 7)):
        assert x.dtype == torch.float32 and x.shape == y.shape
        assert (x - y).abs().max() <= y.abs().max() / 127 * 0.51


def test_gguf_like_the_reference_script(tmp_path):
    """A file written the way bench/make_reference_gguf.py writes one (its keys, BF16 as raw uint8, no vocab)."""
    H, inter, E, K, V, NH, NKV, HD, L = 64, 32, 4, 2, 100, 4, 2, 16, 2
    w = gguf.GGUFWriter(tmp_path / "ref.gguf", "qwen3moe")
    w.add_block_count(L); w.add_context_length(40960); w.add_embedding_length(H)
    w.add_feed_forward_length(6144); w.add_head_count(NH); w.add_head_count_kv(NKV)
    w.add_key_length(HD); w.add_value_length(HD); w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6); w.add_expert_count(E); w.add_expert_used_count(K)
    w.add_expert_feed_forward_length(inter); w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    w.add_tokenizer_model("none"); w.add_vocab_size(V)
    specs = [("token_embd.weight", (V, H)), ("output_norm.weight", (H,)), ("output.weight", (V, H))]
    for i in range(L):
        p = f"blk.{i}."
        specs += [(p + "attn_norm.weight", (H,)), (p + "attn_q.weight", (NH * HD, H)),
                  (p + "attn_k.weight", (NKV * HD, H)), (p + "attn_v.weight", (NKV * HD, H)),
                  (p + "attn_output.weight", (H, NH * HD)),
                  (p + "attn_q_norm.weight", (HD,)), (p + "attn_k_norm.weight", (HD,)), (p + "ffn_norm.weight", (H,)),
                  (p + "ffn_gate_inp.weight", (E, H)), (p + "ffn_gate_exps.weight", (E, inter, H)),
                  (p + "ffn_up_exps.weight", (E, inter, H)), (p + "ffn_down_exps.weight", (E, H, inter))]
    g = torch.Generator().manual_seed(0)
    data = {n: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g)).to(
        torch.float32 if len(s) == 1 else torch.bfloat16) for n, s in specs}
    for n, s in specs:
        if len(s) == 1:
            w.add_tensor_info(n, s, np.dtype(np.float32), int(np.prod(s)) * 4)
        else:
            w.add_tensor_info(n, (*s[:-1], s[-1] * 2), np.dtype(np.uint8), int(np.prod(s)) * 2, raw_dtype=Q.BF16)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_ti_data_to_file()
    for n, s in specs:
        t = data[n]
        w.write_tensor_data(t.numpy() if len(s) == 1 else t.view(torch.int16).numpy().view(np.uint8))
    w.close()

    src = open_source(str(tmp_path / "ref.gguf"))
    c = src.config
    assert (c.family, c.vocab_size, c.n_layers, c.head_dim, c.n_experts, c.moe_intermediate_size) == (
        "qwen3_moe", V, L, HD, E, inter)
    assert (c.norm_topk_prob, c.intermediate_size, c.dense_layers, c.rope_theta, c.rms_norm_eps) == (
        True, 0, (), 1e6, 1e-6)
    assert src.tokenizer is None and not c.tie_word_embeddings
    assert torch.equal(src.tensor("blk.1.attn_q.weight"), data["blk.1.attn_q.weight"])
    for x, y in zip(src.expert(1, 3), (data[f"blk.1.ffn_{p}_exps.weight"][3] for p in ("gate", "up", "down"))):
        assert torch.equal(x, y)


# --- make-model ------------------------------------------------------------------------------------------------
def test_make_model(tmp_path):
    import argparse

    from moestream.tools import make_model as mm
    parser = argparse.ArgumentParser()
    mm.add_arguments(parser)
    args = parser.parse_args(["tiny", str(tmp_path / "t.gguf")])
    assert args.func(args) == 0
    assert GGUFSource(tmp_path / "t.gguf").config == SynthSource.from_spec("tiny").config
    make_model("synth:tiny:layers=2", tmp_path / "hf", progress=False)
    assert HFSource(tmp_path / "hf").config.n_layers == 2
    umask = os.umask(0)
    os.umask(umask)                    # as open() and mkdir() make them: others may read the model (umask 022)
    assert (tmp_path / "hf").stat().st_mode & 0o777 == 0o777 & ~umask
    assert {p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()} == {0o666 & ~umask}
    assert (tmp_path / "t.gguf").stat().st_mode & 0o777 == 0o666 & ~umask
    with pytest.raises(UserError, match="already exists"):
        make_model("tiny", tmp_path / "hf", "hf", progress=False)


# --- bad input -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_hf")
    write_hf(SynthSource.from_spec("tiny"), path, max_shard_bytes=3 << 20)
    return path


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_hf_bad_input(tmp_path, tiny_hf):
    with pytest.raises(UserError, match="model not found"):
        open_source(str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match="is not a directory"):
        HFSource(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="has no config.json"):
        open_source(str(tmp_path / "empty"))

    d = _copy(tiny_hf, tmp_path / "truncated")
    shard = d / "model-00002-of-00010.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(UserError, match="cannot read model-00002-of-00010.safetensors.*truncated"):
        HFSource(d)

    d = _copy(tiny_hf, tmp_path / "missing_shard")
    (d / "model-00003-of-00010.safetensors").unlink()
    with pytest.raises(UserError, match="names shard 'model-00003-of-00010.safetensors'.*download complete"):
        HFSource(d)

    d = _copy(tiny_hf, tmp_path / "missing_tensor")
    shard = d / "model-00001-of-00010.safetensors"
    tensors = load_file(shard)
    del tensors["model.layers.0.self_attn.q_proj.weight"]
    save_file(tensors, shard)
    src = HFSource(d)
    assert not src.has("blk.0.attn_q.weight")
    with pytest.raises(UserError, match="checkpoint lacks tensor model.layers.0.self_attn.q_proj.weight.*complete"):
        src.tensor("blk.0.attn_q.weight")

    d = _copy(tiny_hf, tmp_path / "llama")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="unsupported architecture 'LlamaForCausalLM'"):
        HFSource(d)


def test_gguf_bad_input(tmp_path):
    write_gguf(SynthSource.from_spec("tiny"), tmp_path / "ok.gguf")
    data = (tmp_path / "ok.gguf").read_bytes()
    for cut in (len(data) // 2, len(data) - 64, 100, 10):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(UserError, match="truncated|not a GGUF"):
            GGUFSource(tmp_path / "cut.gguf")
    (tmp_path / "x.gguf").write_text('{"not": "gguf"}')
    with pytest.raises(UserError, match="is not a GGUF file"):
        open_source(str(tmp_path / "x.gguf"))

    w = gguf.GGUFWriter(tmp_path / "llama.gguf", "llama")
    w.add_block_count(1)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_ti_data_to_file(); w.close()
    with pytest.raises(UserError, match="unsupported GGUF architecture 'llama'; supported: qwen3moe"):
        GGUFSource(tmp_path / "llama.gguf")

    # TQ1_0 (ternary) is a type moestream does not load: the error names it and lists the types that work.
    w = gguf.GGUFWriter(tmp_path / "tq1.gguf", "qwen3moe")
    block, size = gguf.GGML_QUANT_SIZES[Q.TQ1_0]
    w.add_tensor_info("token_embd.weight", (2, size), np.dtype(np.uint8), 2 * size, raw_dtype=Q.TQ1_0)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_ti_data_to_file()
    w.write_tensor_data(np.zeros((2, size), dtype=np.uint8))
    w.close()
    with pytest.raises(UserError, match="token_embd.weight has type TQ1_0.*the types that work: F32, F16, BF16, "
                                        "Q8_0.*Q4_K.*IQ4_XS.*IQ1_M"):
        GGUFSource(tmp_path / "tq1.gguf")
