"""gpt-oss with MXFP4 experts (issue 53), on the CPU: a tiny checkpoint in OpenAI's published layout (experts as
packed *_blocks / *_scales with gate and up in alternate rows, float biases beside them, quantization_config mxfp4),
written from tests/test_gptoss.py's float checkpoint with quant/mxfp4 and to_openai; a GGUF of it with MXFP4
experts; `moestream quantize ... MXFP4_MOE`; the synth presets' MXFP4 experts.

Bounds: float32 logits of the packed checkpoint bit-identical to those of its experts dequantized to float32 (an
MXFP4 value is exact in float32, and the fetched experts are dequantized into a float scratch before the same
kernel with the same biases), whatever the placement and cache size; within 1e-4 of transformers' own reading of
the packed checkpoint (Mxfp4Config(dequantize=True)), as tests/test_gptoss.py's bound.
"""
from __future__ import annotations

import json
import shutil

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file
from test_gptoss import ATOL, decode_steps, gptoss, prompt  # noqa: F401  (gptoss: the float checkpoint fixture)

from moestream import LLM
from moestream.errors import UserError
from moestream.loading.gguf import GGUFSource
from moestream.loading.gguf_write import write_gguf
from moestream.loading.hf import HFSource, write_hf
from moestream.loading.synth import SynthSource
from moestream.quant.layout import ExpertLayout
from moestream.quant.mxfp4 import to_openai
from moestream.quant.quantize import quantize

# what OpenAI's config.json says of its checkpoints
QUANTIZATION_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
KW = dict(ubatch_size=16, ctx_size=64, device="cpu")
PLACEMENTS = (dict(), dict(cpu_moe=True), dict(cpu_moe=True, moe_cache_mib=0), dict(cpu_moe=True, moe_cache_mib=1),
              dict(n_cpu_moe=2, moe_cache_mib=1, cache_policy="lru"))


def _float_experts(model, layer: int, e: int):
    """transformers' expert e of `layer`: gate (I, H), up (I, H), down (H, I), as moestream holds them."""
    ex = model.model.layers[layer].mlp.experts
    gate_up = ex.gate_up_proj[e].detach().t()                    # (2I, H): gate and up in alternate rows
    return gate_up[0::2], gate_up[1::2], ex.down_proj[e].detach().t()


@pytest.fixture(scope="module")
def dirs(gptoss, tmp_path_factory):
    """packed: the float checkpoint with its experts MXFP4 in OpenAI's layout; deq: that one's experts dequantized,
    written back as a float32 checkpoint."""
    path, _ = gptoss
    d = tmp_path_factory.mktemp("gptoss_mxfp4")
    (d / "packed").mkdir()
    shutil.copy(f"{path}/generation_config.json", d / "packed")
    c = json.loads(open(f"{path}/config.json").read()) | {"quantization_config": QUANTIZATION_CONFIG}
    (d / "packed" / "config.json").write_text(json.dumps(c))
    sd = load_file(f"{path}/model.safetensors")
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts."
        for proj in ("gate_up_proj", "down_proj"):          # (E, H, 2I) and (E, I, H): rows of out-features
            rows = quantize(sd.pop(p + proj).transpose(1, 2).contiguous(), Q.MXFP4)
            sd[p + proj + "_blocks"], sd[p + proj + "_scales"] = to_openai(rows)
    save_file(sd, str(d / "packed" / "model.safetensors"))
    write_hf(HFSource(d / "packed"), d / "deq", dtype="float32")
    return d


def test_packed_experts_stay_mxfp4(gptoss, dirs):
    """The packed experts repacked to ggml's blocks: the bytes quantize writes for transformers' (de-interleaved)
    weights; the store keeps them, 3 I H / 32 * 17 bytes an expert."""
    _, model = gptoss
    src = HFSource(dirs / "packed")
    assert src.expert_types(1) == (Q.MXFP4,) * 3 and HFSource(dirs / "deq").expert_types(1) is None
    want = torch.cat([quantize(w.contiguous(), Q.MXFP4).reshape(-1) for w in _float_experts(model, 1, 5)])
    assert torch.equal(src.expert_bytes(1, 5), want)
    llm = LLM(str(dirs / "packed"), cpu_moe=True, moe_cache_mib=1, **KW)
    cfg, store = llm.model_config, llm.engine.host.store
    I, H = cfg.moe_intermediate_size, cfg.hidden_size
    for layer in cfg.moe_layers:
        assert store.layouts[layer] == ExpertLayout(I, H, (Q.MXFP4,) * 3)
        assert store.rows[layer].dtype == torch.uint8 and store.rows[layer].shape == (8, 3 * I * H // 32 * 17)


def test_logits_equal_the_dequantized_twin_and_transformers(dirs):
    """Bit-identical to the float twin at every placement and cache size (so to each other), the same greedy
    tokens; transformers' dequantized reading of the packed checkpoint within 1e-4."""
    from transformers import AutoModelForCausalLM, Mxfp4Config
    ids = prompt(40, seed=7)
    ref = AutoModelForCausalLM.from_pretrained(str(dirs / "packed"), dtype=torch.float32,
                                               quantization_config=Mxfp4Config(dequantize=True))
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    base = None
    for kw in PLACEMENTS:
        q, f = LLM(str(dirs / "packed"), **KW, **kw), LLM(str(dirs / "deq"), **KW, **kw)
        assert q.engine.quantized and not f.engine.quantized
        got = q.logits(ids)
        assert torch.equal(got, f.logits(ids)), kw
        base = got if base is None else base
        assert torch.equal(got, base), kw
        assert (q.generate(ids[:6], max_tokens=8, ignore_eos=True).token_ids
                == f.generate(ids[:6], max_tokens=8, ignore_eos=True).token_ids), kw
    assert (base - want).abs().max().item() < ATOL


def test_zero_copy_decode_reads_mxfp4_rows_by_address(dirs):
    """Zero-copy decode steps of the packed checkpoint (on the CPU the by-address kernels' oracle dequantizes each
    MXFP4 row where it lies, with the OaiSwiglu): within 1e-5 of the fetched steps (float32 sums in another order),
    and the same bits at every placement and cache size, its host reads staged (the default for quantized rows) or
    read in place."""
    eng, fetched = decode_steps(str(dirs / "packed"))
    assert eng.quantized and not eng.plan.zero_copy
    eng, want = decode_steps(str(dirs / "packed"), zero_copy_decode=True)
    assert eng.plan.zero_copy and eng.decode_kernel is not None
    assert (want - fetched).abs().max() < 1e-5
    for kw in PLACEMENTS[1:] + (dict(cpu_moe=True, moe_cache_mib=1, stage_host_reads=False),):
        eng, got = decode_steps(str(dirs / "packed"), zero_copy_decode=True, **kw)
        assert eng.plan.staged == kw.get("stage_host_reads", True) and torch.equal(got, want), kw


def test_a_gguf_with_mxfp4_experts_gives_the_same_logits(dirs, tmp_path):
    """The packed checkpoint as llama.cpp's converter writes it (experts MXFP4 in ggml's blocks, file type
    MOSTLY_MXFP4_MOE; here the rest F32): the same expert values, its experts kept MXFP4, and logits bit-identical
    to the float twin's GGUF at every placement, and to the packed checkpoint's once its config.json says
    truncate: true (a GGUF's YaRN is rounded, as llama.cpp computes it: tests/test_gptoss.py)."""
    src = HFSource(dirs / "packed")
    path = write_gguf(src, tmp_path / "mxfp4.gguf", file_type=gguf.LlamaFileType.MOSTLY_MXFP4_MOE,
                      types=lambda name, shape: Q.MXFP4 if name.endswith("_exps.weight") else Q.F32)
    twin = write_gguf(HFSource(dirs / "deq"), tmp_path / "deq.gguf", dtype="float32")
    out = GGUFSource(path)
    types = {t.name: t.tensor_type for t in out._reader.tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == types["blk.2.ffn_down_exps.weight"] == Q.MXFP4
    assert types["blk.0.ffn_gate_exps.bias"] == types["blk.0.attn_sinks.weight"] == Q.F32
    assert out.expert_types(0) == (Q.MXFP4,) * 3
    for w, v in zip(src.expert(2, 3), out.expert(2, 3)):
        assert torch.equal(w, v)
    ids = prompt(40, seed=8)
    want = LLM(str(twin), **KW).logits(ids)
    for kw in PLACEMENTS[:4]:
        q = LLM(str(path), **KW, **kw)
        assert q.engine.quantized and torch.equal(q.logits(ids), want), kw
    rounded = tmp_path / "rounded"
    shutil.copytree(dirs / "packed", rounded)
    c = json.loads((rounded / "config.json").read_text())
    c["rope_parameters"]["truncate"] = True
    (rounded / "config.json").write_text(json.dumps(c))
    assert torch.equal(LLM(str(rounded), **KW).logits(ids), want)


def test_quantize_mxfp4_moe_of_a_tiny_gpt_oss(gptoss, tmp_path):
    """moestream quantize ... MXFP4_MOE as llama-quantize mixes it for gpt-oss: expert stacks MXFP4, the other
    matrices Q8_0, biases, sinks, router and norms F32; it runs, and computes what its dequantized weights do."""
    from moestream.cli import main
    path, _ = gptoss
    out = tmp_path / "q.gguf"
    assert main(["quantize", path, str(out), "mxfp4_moe", "--device", "cpu"]) == 0
    src = GGUFSource(out)
    types = {t.name: t.tensor_type for t in src._reader.tensors}
    assert {n for n, t in types.items() if t == Q.MXFP4} == {n for n in types if n.endswith("_exps.weight")}
    assert types["blk.1.attn_q.weight"] == types["output.weight"] == Q.Q8_0
    assert all(types[f"blk.1.{n}"] == Q.F32 for n in ("ffn_gate_exps.bias", "ffn_down_exps.bias", "attn_sinks.weight",
                                                      "ffn_gate_inp.weight", "ffn_gate_inp.bias", "attn_q.bias"))
    twin = write_gguf(src, tmp_path / "deq.gguf", dtype="float32")
    ids = prompt(30, seed=9)
    kw = dict(KW, cpu_moe=True, moe_cache_mib=1)
    assert torch.equal(LLM(str(out), **kw).logits(ids), LLM(str(twin), **kw).logits(ids))


def test_synth_presets_make_mxfp4_experts():
    """gpt-oss-20b and -120b draw MXFP4 experts (E[w**2] = 1 / fan_in, as the benchmark reference); experts=float
    and experts=mxfp4 choose; a CPU-sized MXFP4 model keeps its experts MXFP4 and the placement contract."""
    src = SynthSource.from_spec("gpt-oss-20b:layers=1")
    assert src.expert_types(0) == (Q.MXFP4,) * 3
    assert src.expert_bytes(0, 3).shape == (3 * 2880 * 2880 // 32 * 17,)
    gate, _, down = src.expert(0, 3)
    assert abs(gate.pow(2).mean().item() * 2880 - 1) < 0.02 and down.shape == (2880, 2880)
    assert SynthSource.from_spec("gpt-oss-120b:layers=1:experts=float").expert_types(0) is None
    assert SynthSource.from_spec("tiny-gptoss").expert_types(0) is None
    ids = list(range(1, 30))
    base = LLM("synth:tiny-gptoss:experts=mxfp4", **KW)
    assert base.engine.quantized
    want = base.logits(ids)
    for kw in PLACEMENTS[1:4]:
        assert torch.equal(LLM("synth:tiny-gptoss:experts=mxfp4", **KW, **kw).logits(ids), want), kw
    with pytest.raises(UserError, match="experts=int4"):
        SynthSource.from_spec("tiny-gptoss:experts=int4")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_numerics_contract_of_mxfp4_gpt_oss_on_cuda(dirs):
    """bf16 on the GPU: the prompt's kernels dequantize MXFP4 by Triton into scratch, then the grouped GEMM with the
    biases; the decode steps read the MXFP4 rows by address (kernels/decode_quant.py's "runs", the OaiSwiglu's
    biases by expert id), in CUDA graphs and eagerly: bit-identical logits and greedy tokens all on the GPU and over
    the cache at every size; near the dequantized twin's (the same bf16 weights, summed in another order where the
    kernels differ)."""
    kw = dict(ubatch_size=16, ctx_size=64, device="cuda", dtype="bfloat16")
    ids = prompt(40, seed=10)
    base = LLM(str(dirs / "packed"), **kw)
    assert base.engine.quantized
    want, greedy = base.logits(ids), base.generate(ids[:6], max_tokens=12, ignore_eos=True).token_ids
    ref = LLM(str(dirs / "deq"), **kw).logits(ids).float()
    assert ((want.float() - ref).norm() / ref.norm()).item() < 2e-2
    assert base.engine.plan.zero_copy and base.engine.plan.graphs
    for extra in PLACEMENTS[1:] + (dict(cpu_moe=True, moe_cache_mib=1, cuda_graphs=False),
                                   dict(cpu_moe=True, stage_host_reads=False)):
        llm = LLM(str(dirs / "packed"), **kw, **extra)
        assert llm.engine.plan.zero_copy and llm.engine.decode_kernel is not None, extra
        assert torch.equal(llm.logits(ids), want), extra
        assert llm.generate(ids[:6], max_tokens=12, ignore_eos=True).token_ids == greedy, extra
