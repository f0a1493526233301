"""DeepSeek-V3 (latent attention, group-limited sigmoid routing) and GLM-4.5 beyond what tests/test_models.py asks of
every family on conftest's checkpoints (logits against transformers, greedy, ubatches, placements, batched
decode): their GGUFs, the latent cache's size, the cache's bits, and the options moestream refuses.

Bound: a GGUF (float32) of a checkpoint gives its logits bit for bit (the split attn_k_b / attn_v_b are the same
values as kv_b); transformers' own logits are test_models.py's (5e-5; observed 0 on these checkpoints, whose top-2
combines add two terms, in either order the same).
"""
from __future__ import annotations

import dataclasses
import gguf
import pytest
import torch

from moestream import LLM
from moestream.arch.families import FAMILIES
from moestream.arch.hf_config import config_from_hf
from moestream.errors import UserError
from moestream.loading.gguf import GGUFSource
from moestream.loading.gguf_write import write_gguf
from moestream.loading.hf import HFSource
from moestream.loading.synth import SynthSource
from moestream.runtime.caches import make_cache
from moestream.runtime.kv_cache import cache_nbytes, describe_kv, kv_layout

from conftest import VOCAB, write_checkpoint
from gguf_edit import rewrite_gguf


def _ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=["glm4_moe", "deepseek_v3"])
def written(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    write_checkpoint(request.param, str(path / "hf"))
    return request.param, path


@pytest.mark.parametrize("split", [True, False])
def test_gguf_of_a_checkpoint_gives_its_logits(written, split, monkeypatch):
    """deepseek2 as llama.cpp b11549 writes it (attn_k_b and attn_v_b) and as older files hold it (attn_kv_b);
    glm4moe (ffn_norm as post_attention_norm, the router bias as exp_probs_b); the metadata read back to the same
    config (gating, groups, scale, dense and shared experts, latent sizes, YaRN's mscale_all_dim)."""
    family, path = written          # (glm4moe has no kv_b: either form of the flag writes the same file)
    monkeypatch.setitem(FAMILIES, "deepseek_v3", dataclasses.replace(FAMILIES["deepseek_v3"], gguf_split_kv_b=split))
    out = path / f"m{split}.gguf"
    src = HFSource(path / "hf")
    write_gguf(src, out, dtype="float32")
    names = {t.name for t in gguf.GGUFReader(out).tensors}
    if family == "deepseek_v3":
        assert ("blk.1.attn_k_b.weight" in names) == split and ("blk.1.attn_kv_b.weight" in names) != split
    else:
        assert "blk.1.post_attention_norm.weight" in names and "blk.1.exp_probs_b.bias" in names
    assert GGUFSource(out).config == src.config
    ids = _ids(24)
    want = LLM(str(path / "hf"), ctx_size=64, device="cpu").logits(ids)
    assert torch.equal(LLM(str(out), ctx_size=64, device="cpu").logits(ids), want)


def test_cache_sizes_give_the_same_bits(written):
    """A cache smaller than a layer's routed experts, one that holds them all, and none: the same logits."""
    family, path = written
    ids = _ids(30, seed=3)
    base = LLM(str(path / "hf"), ubatch_size=8, ctx_size=64, device="cpu").logits(ids)
    for kw in ({"cpu_moe": True, "moe_cache_mib": 1}, {"n_cpu_moe": 2, "moe_cache_mib": 1}, {"cpu_moe": True}):
        assert torch.equal(LLM(str(path / "hf"), ubatch_size=8, ctx_size=64, device="cpu", **kw).logits(ids), base)


def test_latent_cache_holds_576_values_a_token_and_layer():
    """DeepSeek-V3's shapes: the latent (512) and the rotary key (64) per token and layer, in the model's dtype;
    grouped-query attention keeping its 128 heads' keys and values would hold 128 x (192 + 128) = 40960."""
    cfg = SynthSource.from_spec("deepseek-v3").config
    assert kv_layout(cfg) == (1, 512, 64)
    ctx = 1024
    grows, fixed = cache_nbytes(cfg, 1, ctx, torch.bfloat16)
    assert (grows, fixed) == (61 * ctx * 576 * 2, 0)
    kv = make_cache(cfg.replace(n_layers=2, dense_layers=(0,)), 1, 8, torch.bfloat16, "cpu")
    assert [t.shape for t in kv.k + kv.v] == [(1, 1, 8, 512)] * 2 + [(1, 1, 8, 64)] * 2
    # what bench prints: a 128k-token sequence in 8.58 GiB, where 128 heads' keys and values would take 71x more
    line = describe_kv(cfg, 1, 4096, torch.bfloat16)
    assert "576 values a token and layer (latent; 40960 as 128 heads' keys and values, 71x more)" in line
    assert "68.6 KiB a token" in line and "8.58 GiB for 128k tokens" in line, line


def test_synth_presets_at_real_shapes():
    ds = SynthSource.from_spec("deepseek-v3:layers=4").config
    assert (ds.dense_layers, ds.n_group, ds.topk_group, ds.q_lora_rank, ds.kv_lora_rank) == ((0,), 8, 4, 1536, 512)
    glm = SynthSource.from_spec("glm-4.5-air:layers=4").config
    assert (glm.dense_layers, glm.rotary_dim, glm.shared_expert_intermediate_size) == ((0,), 64, 1408)
    assert SynthSource.from_spec("deepseek-v3").config.dense_layers == (0, 1, 2)


_V3 = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=64,
           num_hidden_layers=2, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
           n_shared_experts=1, first_k_dense_replace=0)


@pytest.mark.parametrize("change, says", [
    (dict(scoring_func="relu"), "scoring_func 'relu'"),
    (dict(topk_method="group_limited_greedy", scoring_func="softmax"), "topk_method 'group_limited_greedy'"),
    (dict(topk_method="greedy"), "topk_method 'greedy' with scoring_func 'sigmoid'"),
    (dict(index_topk=2048), "sparse attention (index_topk)"),
    (dict(model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"]), "DeepSeek-V3.2's sparse attention"),
    (dict(n_group=3), "8 experts in n_group 3 groups"),
    (dict(attention_bias=True), "attention_bias=true"),
])
def test_options_moestream_does_not_run_are_one_line(change, says):
    with pytest.raises(UserError) as e:
        config_from_hf(_V3 | change)
    assert says in str(e.value) and "\n" not in str(e.value)
    assert config_from_hf(_V3).gating == "sigmoid"          # transformers' DeepseekV3 router: sigmoid
    softmax = config_from_hf(_V3 | dict(scoring_func="softmax", topk_method="greedy", n_group=4, topk_group=2))
    assert (softmax.gating, softmax.router_bias, softmax.n_group) == ("softmax", False, 1)


def test_gguf_gating_func_read_and_refused(written, tmp_path):
    family, path = written
    out = path / "plain.gguf"
    if not out.exists():
        write_gguf(HFSource(path / "hf"), out, dtype="float32")
    arch = FAMILIES[family].gguf_arch
    assert GGUFSource(rewrite_gguf(out, tmp_path / "a.gguf", {f"{arch}.expert_gating_func": 1})).config.gating \
        == "softmax"
    default = GGUFSource(rewrite_gguf(out, tmp_path / "b.gguf", {f"{arch}.expert_gating_func": None})).config.gating
    assert default == ("softmax" if arch == "deepseek2" else "sigmoid")       # llama.cpp's defaults
    with pytest.raises(UserError, match=f"{arch}.expert_gating_func = 3, a gating moestream does not run"):
        GGUFSource(rewrite_gguf(out, tmp_path / "c.gguf", {f"{arch}.expert_gating_func": 3}))


def test_an_fp8_checkpoint_gives_its_dequantized_weights_logits(tmp_path):
    """DeepSeek-V3's release form: e4m3 weights with 128 x 128 block scales (experts kept FP8, the latent attention's
    dense FP8 tensors widened at load) give the logits of the same checkpoint with the weights dequantized, bit for
    bit (float32 on the CPU: a dequantized value is the same float32 product on both sides)."""
    from fp8_checkpoint import fp8_checkpoint
    write_checkpoint("deepseek_v3", str(tmp_path / "float"))
    fp8_checkpoint(tmp_path / "float", tmp_path / "fp8", tmp_path / "deq")
    want = LLM(str(tmp_path / "deq"), ubatch_size=16, ctx_size=64, device="cpu").logits(_ids(20))
    for kw in ({}, dict(cpu_moe=True, moe_cache_mib=0)):
        llm = LLM(str(tmp_path / "fp8"), ubatch_size=16, ctx_size=64, device="cpu", **kw)
        assert llm.engine.quantized and torch.equal(llm.logits(_ids(20)), want), kw
