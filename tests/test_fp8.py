"""FP8 block-scaled checkpoints (quant/fp8.py) on the CPU: the dequantizer against transformers' own, partial
blocks; a Qwen3-MoE checkpoint the test quantizes keeps its experts FP8 from the file to the store and the slot, and
gives exactly the logits of its dequantized float32 weights (a dequantized value is one float32 product, the same
bits in both, and the rest of the computation is the same); the numerics contract over placements and cache sizes;
the one-line errors. The Triton kernels: tests/test_fp8_kernels.py."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8_checkpoint import fp8_checkpoint, quantize
from moestream import LLM
from moestream.config import ModelConfig
from moestream.errors import UserError
from moestream.loading.hf import HFSource, write_hf
from moestream.loading.synth import SynthSource
from moestream.quant import fp8
from moestream.quant.layout import ExpertLayout

# hidden 192 and moe_intermediate 160: a whole 128 block and a partial one on both sides of every expert matrix;
# the dense layer's 24 and the heads' 64 and 32 rows: blocks of fewer rows than 128.
CFG = ModelConfig(family="qwen3_moe", vocab_size=96, hidden_size=192, n_layers=3, n_heads=4, n_kv_heads=2,
                  head_dim=16, n_experts=8, n_experts_used=2, moe_intermediate_size=160, max_position_embeddings=256,
                  qk_norm="head", norm_topk_prob=True, dense_layers=(1,), intermediate_size=24)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8")
    write_hf(SynthSource(CFG, seed=5), d / "float", dtype="float32")
    fp8_checkpoint(d / "float", d / "fp8", d / "deq")
    return str(d / "fp8"), str(d / "deq")


def _prompt(n, seed):
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_dequantize_is_transformers_with_partial_blocks():
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    g = torch.Generator().manual_seed(0)
    for shape in ((200, 300), (128, 128), (64, 130), (1, 1)):
        q, s = quantize(torch.randn(*shape, generator=g))
        assert s.shape == fp8.scale_shape(*shape)
        want = _dequantize_fp8_weight(q, s, [128, 128], torch.float32)
        assert torch.equal(fp8.dequantize(q, s), want), shape
        assert torch.equal(fp8.dequantize_packed(fp8.pack(q, s)[None], *shape)[0], want), shape
    # and value by value on the partial edge, one float32 product each
    q, s = quantize(torch.randn(130, 129, generator=g))
    w = fp8.dequantize(q, s)
    for r, c in ((0, 0), (127, 128), (128, 127), (129, 128), (129, 0)):
        assert w[r, c].item() == np.float32(q[r, c].float().item()) * np.float32(s[r // 128, c // 128].item())


def test_an_experts_bytes_are_its_weights_and_scales():
    lay = ExpertLayout(160, 192, (fp8.FP8,) * 3)
    assert lay.fp8 and lay.quantized
    assert lay.nbytes == 3 * 160 * 192 + 3 * 4 * (2 * 2)            # 1 byte a weight, 2 x 2 float32 scales a matrix
    odd = ExpertLayout(100, 150, (fp8.FP8,) * 3)                      # parts padded to 16 bytes where they are not
    assert odd.sizes == (15008 + 16, 15008 + 16, 15008 + 16) and odd.offsets == (0, 15024, 30048)


def test_experts_stay_fp8_from_the_file_to_the_store(dirs):
    path, _ = dirs
    src = HFSource(path)
    llm = LLM(path, ubatch_size=16, ctx_size=128, device="cpu", cpu_moe=True, moe_cache_mib=0)
    store = llm.engine.host.store
    lay = ExpertLayout(160, 192, (fp8.FP8,) * 3)
    weights = load_file(path + "/model.safetensors")
    for l in CFG.moe_layers:
        assert store.layouts[l] == lay and store.rows[l].dtype == torch.uint8
        assert store.rows[l].shape == (CFG.n_experts, lay.nbytes) == (CFG.n_experts, 3 * 160 * 192 + 48)
        assert torch.equal(store.rows[l][3], src.expert_bytes(l, 3))
        gate = f"model.layers.{l}.mlp.experts.3.gate_proj.weight"
        w13, _ = lay.dequantize(store.rows[l][3:4])
        assert torch.equal(w13[0, :160], fp8.dequantize(weights[gate], weights[fp8.scale_name(gate)]))
    assert store.expert_bytes == lay.nbytes
    llm.logits(_prompt(40, 0))
    per = llm.stats()["per_layer"]
    assert all(per[l]["uploaded_bytes"] == per[l]["misses"] * lay.nbytes > 0 for l in CFG.moe_layers)
    # dense FP8 tensors are widened at load; the router and the norms were never FP8
    assert src.tensor("blk.0.attn_q.weight").dtype == torch.float32
    assert llm.engine.dtype == torch.float32


def test_logits_are_the_dequantized_weights_and_bit_identical_across_placements(dirs):
    """Bit-identical to the dequantized float32 checkpoint (CPU, float32: a dequantized value is the same float32
    product on both sides), all on the device and over the cache at every size; the same greedy tokens, also with
    zero-copy decode reading the FP8 rows by address."""
    qpath, fpath = dirs
    ref = LLM(fpath, ubatch_size=16, ctx_size=128, device="cpu")
    want = [ref.logits(_prompt(40, s)) for s in range(2)]
    greedy = ref.generate(_prompt(12, 9), max_tokens=8, ignore_eos=True).sha256
    for kw in (dict(), dict(cpu_moe=True), dict(cpu_moe=True, moe_cache_mib=0), dict(cpu_moe=True, moe_cache_mib=1),
               dict(n_cpu_moe=2, moe_cache_mib=0, cache_policy="lru"), dict(cpu_moe=True, zero_copy_decode=True)):
        llm = LLM(qpath, ubatch_size=16, ctx_size=128, device="cpu", **kw)
        assert llm.engine.quantized
        for s, w in enumerate(want):
            assert torch.equal(llm.logits(_prompt(40, s)), w), (kw, s)
        assert llm.generate(_prompt(12, 9), max_tokens=8, ignore_eos=True).sha256 == greedy, kw


def _edit(path, tmp_path, config=None, drop=None):
    """A copy of checkpoint `path` with config.json's quantization_config replaced, or a tensor dropped."""
    import shutil
    out = tmp_path / "edited"
    shutil.copytree(path, out)
    if config is not None:
        d = json.loads((out / "config.json").read_text())
        d["quantization_config"] = config
        (out / "config.json").write_text(json.dumps(d))
    if drop is not None:
        weights = load_file(str(out / "model.safetensors"))
        del weights[drop]
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


@pytest.mark.parametrize("drop", ["model.layers.0.self_attn.q_proj.weight_scale_inv",
                                  "model.layers.2.mlp.experts.5.down_proj.weight_scale_inv"])
def test_an_fp8_tensor_without_its_scale_is_one_line_naming_it(dirs, tmp_path, drop):
    path = _edit(dirs[0], tmp_path, drop=drop)
    with pytest.raises(UserError) as e:
        LLM(path, ctx_size=64, device="cpu", cpu_moe=True)
    msg = str(e.value)
    assert "\n" not in msg and drop.replace("_scale_inv", "") in msg and drop in msg


@pytest.mark.parametrize("config,named", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "gptq"),
    ({"quant_method": "awq", "bits": 4}, "awq"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
    ({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [1, 128]}, "[1, 128]"),
])
def test_a_quantization_config_other_than_fp8_blocks_is_one_line_naming_it(dirs, tmp_path, config, named):
    path = _edit(dirs[0], tmp_path, config=config)
    with pytest.raises(UserError) as e:
        HFSource(path)
    assert "\n" not in str(e.value) and named in str(e.value)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_numerics_contract_of_an_fp8_checkpoint_on_cuda(dirs):
    """bf16 on the GPU (the grouped kernel over the Triton dequantizer's scratch, the Triton FP8 decode kernel
    reading slots and pinned host rows in place): bit-identical logits and the same greedy tokens all on the GPU
    and over the cache at every size; the prompt's logits near the dequantized checkpoint's (the same bf16 weights,
    summed in another order where the kernels differ)."""
    qpath, fpath = dirs
    kw = dict(ubatch_size=16, ctx_size=128, device="cuda", dtype="bfloat16")
    base = LLM(qpath, **kw)
    assert base.engine.quantized and base.engine.dtype == torch.bfloat16
    want = [base.logits(_prompt(40, s)) for s in range(2)]
    greedy = base.generate(_prompt(12, 9), max_tokens=12, ignore_eos=True).sha256
    ref = LLM(fpath, **kw)
    for s, w in enumerate(want):
        r = ref.logits(_prompt(40, s)).float()
        assert ((w.float() - r).norm() / r.norm()).item() < 2e-2
    for extra in (dict(cpu_moe=True), dict(cpu_moe=True, moe_cache_mib=0), dict(cpu_moe=True, moe_cache_mib=1)):
        llm = LLM(qpath, **kw, **extra)
        for s, w in enumerate(want):
            assert torch.equal(llm.logits(_prompt(40, s)), w), (extra, s)
        assert llm.generate(_prompt(12, 9), max_tokens=12, ignore_eos=True).sha256 == greedy, extra
