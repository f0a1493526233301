"""MXFP4 experts (quant/mxfp4.py) from file to kernel on the CPU, on Qwen3-MoE (synth:tiny): the dequantizer on
every scale byte against gguf.quants, OpenAI's packed layout against transformers' convert_moe_packed_tensors,
`moestream quantize ... MXFP4_MOE` as llama-quantize mixes it, and a model whose experts are MXFP4 (a GGUF, and an HF
checkpoint in OpenAI's packed form) computing exactly what its experts dequantized to float32 compute, with the
numerics contract and MXFP4's 17 bytes a 32 values counted. (The quantizer against gguf.quants, the random blocks and
the chunks are tests/test_quantize.py's and tests/test_quant_dequant.py's, which take every type; the kernels
tests/test_mxfp4_kernels.py's.)"""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file

from moestream import LLM
from moestream.errors import UserError
from moestream.quant.dequant import dequantize, random_blocks
from moestream.quant.mxfp4 import check_openai, from_openai, to_openai


def _prompt(n, seed):
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_every_scale_byte_and_nibble_dequantizes_as_gguf():
    """All 256 e8m0 bytes (the subnormal 0 and 1, and 255 whose 12s overflow to inf as in ggml) with random
    nibbles: gguf.quants' bits, +0 and -0 and inf included."""
    g = torch.Generator().manual_seed(0)
    b = torch.randint(0, 256, (512, 17), dtype=torch.uint8, generator=g)
    b[:256, 0] = torch.arange(256)
    b[256:, 1:] = torch.arange(16, dtype=torch.uint8) * 17         # every code, in both nibbles
    with np.errstate(over="ignore"):
        ref = torch.from_numpy(gguf.quants.dequantize(b.reshape(-1).numpy(), Q.MXFP4).astype(np.float32))
    out = dequantize(b.reshape(-1), Q.MXFP4)
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))


def test_the_quantizer_breaks_ties_as_ggml():
    """Values exactly between two codes (x / d a half-integer) and both signs: gguf.quants' bytes (the first code
    of least error, so the smaller magnitude; a negative half step goes to +0)."""
    from moestream.quant.quantize import quantize
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-24, 25, (8, 256), generator=g).float() / 4
    x = torch.cat([x, -x, x * 2.0 ** -120])
    assert np.array_equal(quantize(x, Q.MXFP4).numpy(), gguf.quants.quantize(x.numpy(), Q.MXFP4))


def test_openai_packing_repacks_to_ggml_blocks_with_transformers_values():
    """OpenAI's blocks and scales -> ggml's rows and back, bytes unchanged; the rows dequantize to what transformers'
    convert_moe_packed_tensors makes of OpenAI's (its (E, cols, rows) transposed; -0.0 there is +0.0 in ggml)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    g = torch.Generator().manual_seed(2)
    rows = random_blocks(Q.MXFP4, 3 * 10 * 4, g).reshape(3, 10, 4 * 17)           # E = 3, 10 rows of 128 values
    blocks, scales = to_openai(rows)
    assert blocks.shape == (3, 10, 4, 16) and scales.shape == (3, 10, 4)
    assert torch.equal(from_openai(blocks, scales, "t"), rows)
    hf = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)          # (3, 128, 10)
    ours = dequantize(rows, Q.MXFP4)                                               # (3, 10, 128)
    assert torch.equal(hf.transpose(1, 2), ours)
    # one block by hand: OpenAI's byte 0 holds values 0 (low nibble) and 1 (high)
    one = torch.zeros(1, 16, dtype=torch.uint8)
    one[0, 0] = 0x2 | (0x7 << 4)                                  # 1.0 and 6.0 (e2m1), scale 2**0
    v = dequantize(from_openai(one, torch.tensor([127], dtype=torch.uint8), "t"), Q.MXFP4)
    assert v[:2].tolist() == [1.0, 6.0] and not v[2:].any()


def test_blocks_and_scales_that_disagree_name_the_tensor():
    with pytest.raises(UserError, match=r"MXFP4 tensor x\.gate_up_proj_blocks: blocks \[2, 8, 4, 16\] and scales "
                                        r"\[2, 8, 3\] disagree"):
        check_openai((2, 8, 4, 16), (2, 8, 3), "x.gate_up_proj_blocks")
    with pytest.raises(UserError, match="blocks must be"):
        from_openai(torch.zeros(2, 4, 17, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8), "y")


# --- a GGUF: moestream quantize's MXFP4_MOE --------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """synth:tiny as llama-quantize's MXFP4_MOE (through the command line), and the same weights as float32."""
    from moestream.cli import main
    from moestream.loading.gguf import GGUFSource
    from moestream.loading.gguf_write import write_gguf
    d = tmp_path_factory.mktemp("mxfp4")
    assert main(["quantize", "synth:tiny", str(d / "mxfp4.gguf"), "mxfp4_moe", "--device", "cpu"]) == 0
    write_gguf(GGUFSource(d / "mxfp4.gguf"), d / "deq.gguf", dtype="float32")
    return str(d / "mxfp4.gguf"), str(d / "deq.gguf")


def test_mxfp4_moe_is_llama_quantizes_mix(gguf_files):
    """Expert stacks MXFP4, output and every other quantized tensor Q8_0, routers and norms F32; each tensor close
    to the source's."""
    from moestream.loading.synth import SynthSource
    from moestream.quant.mix import file_types
    from test_quantize import assert_file_matches
    src = SynthSource.from_spec("tiny")
    reader = assert_file_matches(gguf_files[0], src, "MXFP4_MOE")
    types = file_types(src.config, "MXFP4_MOE")
    assert {n for n, t in types.items() if t == Q.MXFP4} == {t.name for t in reader.tensors if "_exps" in t.name}
    assert types["output.weight"] == types["token_embd.weight"] == types["blk.0.attn_q.weight"] == Q.Q8_0
    assert types["blk.0.ffn_gate_inp.weight"] == types["blk.0.attn_norm.weight"] == Q.F32


def test_experts_stay_mxfp4_and_count_17_bytes_a_32_values(gguf_files):
    """The store holds the file's MXFP4 blocks; a slot and an upload are 3 I H / 32 * 17 bytes; --moe-cache-mib
    counts slots of that size."""
    from moestream.loading.gguf import GGUFSource
    from moestream.quant.layout import ExpertLayout
    llm = LLM(gguf_files[0], ubatch_size=16, ctx_size=128, device="cpu", cpu_moe=True, moe_cache_mib=1)
    store, cfg = llm.engine.host.store, llm.model_config
    I, H = cfg.moe_intermediate_size, cfg.hidden_size
    per_expert = 3 * I * H // 32 * 17
    for l in cfg.moe_layers:
        assert store.layouts[l] == ExpertLayout(I, H, (Q.MXFP4,) * 3) and store.layouts[l].nbytes == per_expert
        assert store.rows[l].dtype == torch.uint8 and store.rows[l].shape == (cfg.n_experts, per_expert)
        assert torch.equal(store.rows[l][5], GGUFSource(gguf_files[0]).expert_bytes(l, 5))
    assert store.expert_bytes == per_expert
    assert llm.engine.host.n_slots == (1 << 20) // per_expert
    llm.logits(_prompt(40, 0))
    per = llm.stats()["per_layer"]
    assert all(per[l]["uploaded_bytes"] == per[l]["misses"] * per_expert > 0 for l in cfg.moe_layers)


def test_logits_equal_the_dequantized_weights_and_keep_the_contract(gguf_files):
    """CPU, float32: bit-identical to the same weights as float32 experts, all on the device or over a cache;
    bit-identical whatever the placement and cache size, the same greedy tokens."""
    qpath, fpath = gguf_files
    want = None
    for kw in (dict(), dict(cpu_moe=True), dict(cpu_moe=True, moe_cache_mib=1),
               dict(n_cpu_moe=2, moe_cache_mib=2, cache_policy="lru")):
        q = LLM(qpath, ubatch_size=16, ctx_size=128, device="cpu", **kw)
        got = q.logits(_prompt(40, 1))
        if want is None:
            f = LLM(fpath, ubatch_size=16, ctx_size=128, device="cpu", **kw)
            assert q.engine.quantized and not f.engine.quantized
            want, greedy = f.logits(_prompt(40, 1)), f.generate(_prompt(8, 2), max_tokens=8, ignore_eos=True).sha256
        assert torch.equal(got, want), kw
        assert q.generate(_prompt(8, 2), max_tokens=8, ignore_eos=True).sha256 == greedy, kw


# --- an HF checkpoint with OpenAI's packed MXFP4 experts ------------------------------------------------------
def _pack_experts(float_dir, out_dir):
    """float_dir's checkpoint (experts one tensor each) with each layer's experts fused and MXFP4 in OpenAI's form
    (`mlp.experts.gate_up_proj_blocks` / `_scales`: gate rows then up rows; `down_proj_blocks` / `_scales`)."""
    from moestream.quant.quantize import quantize
    out_dir.mkdir()
    for f in ("config.json", "generation_config.json"):
        (out_dir / f).write_text((float_dir / f).read_text())
    tensors = load_file(float_dir / "model.safetensors")
    n_layers = json.loads((float_dir / "config.json").read_text())["num_hidden_layers"]
    for layer in range(n_layers):
        p = f"model.layers.{layer}.mlp.experts."
        stack = {proj: torch.stack([tensors.pop(f"{p}{e}.{proj}.weight")
                                    for e in range(len([k for k in tensors if k.startswith(p) and proj in k]))])
                 for proj in ("gate_proj", "up_proj", "down_proj")}
        for name, w in (("gate_up_proj", torch.cat([stack["gate_proj"], stack["up_proj"]], 1)),
                        ("down_proj", stack["down_proj"])):
            tensors[f"{p}{name}_blocks"], tensors[f"{p}{name}_scales"] = to_openai(quantize(w, Q.MXFP4))
    save_file(tensors, out_dir / "model.safetensors")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """synth:tiny as an HF directory with packed MXFP4 experts, and its experts dequantized (float32, one each)."""
    from moestream.loading.hf import HFSource, write_hf
    from moestream.loading.synth import SynthSource
    d = tmp_path_factory.mktemp("hf_mxfp4")
    write_hf(SynthSource.from_spec("tiny"), d / "float")
    _pack_experts(d / "float", d / "packed")
    write_hf(HFSource(d / "packed"), d / "deq", dtype="float32")
    return d


def test_packed_experts_load_as_ggml_mxfp4_and_compute_their_dequantized_weights(hf_dirs):
    """The HF loader repacks OpenAI's blocks to ggml's (the bytes moestream quantize writes for the same weights),
    keeps them MXFP4 in the store, and the logits are bit-identical to the dequantized float checkpoint's, over a
    cache too."""
    from moestream.loading.hf import HFSource
    from moestream.quant.quantize import quantize
    src, flt = HFSource(hf_dirs / "packed"), HFSource(hf_dirs / "float")
    assert src.expert_types(0) == (Q.MXFP4,) * 3 and flt.expert_types(0) is None
    want = torch.cat([quantize(w, Q.MXFP4).reshape(-1) for w in flt.expert(2, 7)])
    assert torch.equal(src.expert_bytes(2, 7), want)
    for kw in (dict(), dict(cpu_moe=True, moe_cache_mib=1)):
        q = LLM(str(hf_dirs / "packed"), ubatch_size=16, ctx_size=128, device="cpu", **kw)
        f = LLM(str(hf_dirs / "deq"), ubatch_size=16, ctx_size=128, device="cpu", **kw)
        assert q.engine.quantized and (not kw or q.engine.host.store.rows[0].dtype == torch.uint8)
        assert torch.equal(q.logits(_prompt(40, 3)), f.logits(_prompt(40, 3))), kw


def test_packed_blocks_and_scales_that_disagree_are_one_line(hf_dirs, tmp_path):
    from moestream.loading.hf import HFSource
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ("config.json", "generation_config.json"):
        (bad / f).write_text((hf_dirs / "packed" / f).read_text())
    tensors = load_file(hf_dirs / "packed" / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj_scales"
    tensors[name] = tensors[name][:, :, :-1].contiguous()
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(UserError, match=r"MXFP4 tensor model\.layers\.1\.mlp\.experts\.down_proj_blocks: blocks") as e:
        HFSource(bad)
    assert "\n" not in str(e.value)


def test_a_gguf_of_the_packed_checkpoint_keeps_its_values_and_logits(hf_dirs, tmp_path):
    """Re-encoding MXFP4 values is lossless (a block's scale comes back, or a smaller one whose codes are the old
    ones doubled): the GGUF written from the packed checkpoint, experts MXFP4 and the rest F32, holds the same
    expert values and gives bit-identical logits."""
    import gguf as gg
    from moestream.loading.gguf import GGUFSource
    from moestream.loading.gguf_write import write_gguf
    from moestream.loading.hf import HFSource
    src = HFSource(hf_dirs / "packed")
    path = write_gguf(src, tmp_path / "m.gguf", types=lambda name, shape: Q.MXFP4 if len(shape) == 3 else Q.F32,
                      file_type=gg.LlamaFileType.MOSTLY_MXFP4_MOE)
    out = GGUFSource(path)
    for w, v in zip(src.expert(1, 4), out.expert(1, 4)):
        assert torch.equal(w, v)
    kw = dict(ubatch_size=16, ctx_size=128, device="cpu", cpu_moe=True, moe_cache_mib=1)
    assert torch.equal(LLM(str(path), **kw).logits(_prompt(40, 4)),
                       LLM(str(hf_dirs / "packed"), **kw).logits(_prompt(40, 4)))
