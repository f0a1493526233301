"""gpt-oss (family gpt_oss) against transformers, on a small random GptOssForCausalLM that transformers writes
(float32): sliding-window layers with a window of 4 under prompts of 40 tokens, non-zero sinks, q/k/v/o biases,
YaRN with its correction range not rounded (truncate: false), a biased router with its softmax over the chosen k,
clamped SwiGLU experts with biases, interleaved gate/up in HF's tensor; the same model from a GGUF; the placement
contract.

Bound: float32 logits within 1e-4 absolute of transformers' (logits O(5); what is left is the order of float32
sums: the experts combined in routing order, transformers adds them in expert order).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from moestream import LLM
from moestream.arch.blocks import Blocks
from moestream.arch.families import FAMILIES
from moestream.arch.hf_config import config_from_hf
from moestream.engine_config import EngineConfig
from moestream.errors import UserError
from moestream.kernels import OaiSwiglu, by_address_kernels, experts_reference
from moestream.loading.gguf import GGUFSource
from moestream.loading.gguf_write import write_gguf
from moestream.loading.hf import HFSource, write_hf
from moestream.runtime.plan import decode_plan, resolve

ATOL = 1e-4
VOCAB = 160
WINDOW = 4


def prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def gptoss(tmp_path_factory):
    """(path, transformers model) of a random GptOssForCausalLM transformers saved; expert weights large enough
    that the clamp at 7 bites, sinks of O(1)."""
    from transformers import GptOssConfig, GptOssForCausalLM
    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                       num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=512,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    model = GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("sinks"):
                p.normal_(1.0, 1.0)
            elif name.endswith("gate_up_proj"):
                p.normal_(0, 0.6)
            else:
                p.normal_(0, 0.2)
    path = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(str(path))
    return str(path), model


def test_config_as_transformers_writes_it(gptoss):
    path, model = gptoss
    cfg = HFSource(path).config
    assert cfg.family == "gpt_oss" and cfg.sliding_window == WINDOW and cfg.attn_bias
    assert cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert cfg.rope_type == "yarn" and cfg.rope["truncate"] is False and cfg.n_experts == 8
    assert cfg.moe_intermediate_size == 32 and cfg.dense_layers == ()


def test_the_clamp_bites_in_this_model(gptoss):
    """The test model's experts reach the clamp (so the logits test checks it)."""
    _, model = gptoss
    x = torch.randn(50, 64)
    with torch.no_grad():
        gu = x @ model.model.layers[0].mlp.experts.gate_up_proj[0]
    assert (gu[:, ::2] > 7).any() and (gu[:, 1::2].abs() > 7).any()


@pytest.mark.parametrize("ubatch", [512, 7])
def test_logits_match_transformers(gptoss, ubatch):
    """40 tokens, 10 windows of 4: sliding and full layers, sinks, the whole model."""
    path, model = gptoss
    ids = prompt(40)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float()
    out = LLM(path, ubatch_size=ubatch, ctx_size=64, device="cpu").logits(ids)
    err = (out - ref).abs().max().item()
    assert err < ATOL, err


def test_greedy_generation_matches_transformers(gptoss):
    """Decode steps past the window: the decode mask keeps the last 4 positions on sliding layers."""
    path, model = gptoss
    ids = prompt(6, seed=2)
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(ids):].tolist()
    out = LLM(path, ctx_size=64, device="cpu").generate(ids, max_tokens=12, ignore_eos=True)
    assert out.token_ids == ref


def test_ubatches_placements_and_caches_are_bit_identical(gptoss):
    """One ubatch, ubatches of 5, experts on the device, --cpu-moe with and without a cache, --n-cpu-moe: the same
    logits, bit for bit; decode steps too."""
    path, _ = gptoss
    ids = prompt(33, seed=3)
    base = LLM(path, ubatch_size=512, ctx_size=64, device="cpu").logits(ids)
    for kw in ({"ubatch_size": 5}, {"ubatch_size": 5, "cpu_moe": True}, {"cpu_moe": True, "moe_cache_mib": 0},
               {"cpu_moe": True, "moe_cache_mib": 1}, {"n_cpu_moe": 2, "moe_cache_mib": 0},
               {"cpu_moe": True, "zero_copy_decode": True}):
        kw = {"ubatch_size": 512, **kw}
        out = LLM(path, ctx_size=64, device="cpu", **kw).logits(ids)
        if kw["ubatch_size"] == 512:
            assert torch.equal(out, base), kw
        else:
            assert (out - base).abs().max() < 1e-5, kw
    gen = [LLM(path, ctx_size=64, device="cpu", **kw).generate(ids[:9], max_tokens=8, ignore_eos=True).token_ids
           for kw in ({}, {"cpu_moe": True, "moe_cache_mib": 0}, {"cpu_moe": True, "zero_copy_decode": True})]
    assert gen[0] == gen[1] == gen[2]


def decode_steps(path, **kw) -> tuple[object, torch.Tensor]:
    """(the engine, the logits of its decode steps): two prompts prefilled, then steps of given tokens (so that every
    engine decodes the same tokens), three of one sequence and three of both together, (9, V)."""
    eng = LLM(path, ctx_size=64, device="cpu", n_seq=2, **kw).engine
    a, b, toks = prompt(9, seed=7), prompt(5, seed=8), prompt(6, seed=9)
    eng.prefill(0, a)
    eng.prefill(1, b)
    out = [eng.decode([(0, toks[i], len(a) + i)]) for i in range(3)]
    out += [eng.decode([(0, toks[3 + i], len(a) + 3 + i), (1, toks[i], len(b) + i)]) for i in range(3)]
    return eng, torch.cat(out)


def test_zero_copy_decode_steps_are_the_fetched_ones_and_bit_identical_over_the_cache(gptoss):
    """Zero-copy decode (on the CPU the by-address kernels' plain-torch oracle, with the OaiSwiglu: biases by expert
    id) is what the decode plan gives gpt-oss: its steps, of one token and of two, within 1e-5 of the steps that
    fetch their experts (float32 sums in another order; logits O(5)), and bit for bit the same all on the device,
    with --cpu-moe and no cache, and with caches and policies."""
    path, _ = gptoss
    eng, fetched = decode_steps(path)
    assert not eng.plan.zero_copy and eng.decode_kernel is None
    eng, want = decode_steps(path, zero_copy_decode=True)
    assert eng.plan.zero_copy and eng.decode_kernel is not None
    assert (want - fetched).abs().max() < 1e-5 and not torch.equal(want, fetched)
    for kw in ({"cpu_moe": True}, {"cpu_moe": True, "moe_cache_mib": 0}, {"cpu_moe": True, "moe_cache_mib": 1},
               {"n_cpu_moe": 2, "moe_cache_mib": 1, "cache_policy": "lru"}):
        eng, got = decode_steps(path, zero_copy_decode=True, **kw)
        assert eng.plan.zero_copy and torch.equal(got, want), kw


def test_several_sequences_decoded_together_equal_each_alone(gptoss):
    path, _ = gptoss
    a, b = prompt(9, seed=5), prompt(14, seed=6)
    llm = LLM(path, ctx_size=64, device="cpu", n_seq=2)
    alone_a, alone_b = llm.logits(a + [7])[-1], llm.logits(b + [11])[-1]
    eng = llm.engine
    eng.prefill(0, a)
    eng.prefill(1, b)
    both = eng.decode([(0, 7, len(a)), (1, 11, len(b))])
    assert (both[0] - alone_a).abs().max() < 1e-5 and (both[1] - alone_b).abs().max() < 1e-5


def test_gguf_of_the_same_weights_gives_the_same_logits(gptoss, tmp_path):
    """write_gguf writes llama.cpp's gpt-oss names and keys; read back, the model is the HF one but for YaRN's
    rounding: a GGUF cannot say truncate, and llama.cpp rounds, so its logits are those of the HF directory with
    truncate: true."""
    path, _ = gptoss
    gguf_path = write_gguf(HFSource(path), tmp_path / "m.gguf")
    src = GGUFSource(gguf_path)
    names = {t.name for t in src._reader.tensors}
    assert {"blk.0.attn_sinks.weight", "blk.0.post_attention_norm.weight", "blk.0.attn_output.bias",
            "blk.0.ffn_gate_inp.bias", "blk.0.ffn_gate_exps.bias", "blk.0.ffn_up_exps.bias",
            "blk.0.ffn_down_exps.bias", "blk.0.ffn_gate_exps.weight"} <= names
    fields = src._reader.fields
    assert fields["general.architecture"].contents() == "gpt-oss"
    assert fields["gpt-oss.attention.sliding_window"].contents() == WINDOW
    assert fields["gpt-oss.expert_feed_forward_length"].contents() == 32
    assert "gpt-oss.attention.sliding_window_pattern" not in fields     # llama.cpp's default: even layers slide
    hf = HFSource(path).config
    assert "truncate" not in src.config.rope
    assert src.config == hf.replace(rope_scaling=tuple(kv for kv in hf.rope_scaling if kv[0] != "truncate"))
    rounded = tmp_path / "rounded"
    shutil.copytree(path, rounded)
    c = json.loads((rounded / "config.json").read_text())
    c["rope_parameters"]["truncate"] = True
    (rounded / "config.json").write_text(json.dumps(c))
    ids = prompt(20, seed=4)
    a = LLM(str(gguf_path), ctx_size=64, device="cpu").logits(ids)
    assert torch.equal(a, LLM(str(rounded), ctx_size=64, device="cpu").logits(ids))
    assert not torch.equal(a, LLM(path, ctx_size=64, device="cpu").logits(ids))      # the rounding shows


def test_written_hf_directory_loads_into_transformers(gptoss, tmp_path):
    from transformers import AutoModelForCausalLM
    path, model = gptoss
    write_hf(HFSource(path), tmp_path / "hf")
    again, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in model.state_dict().items())
    assert HFSource(tmp_path / "hf").config == HFSource(path).config


@pytest.mark.parametrize("change, named", [({"swiglu_limit": 5.0}, "swiglu_limit 5.0"),
                                           ({"swiglu_alpha": 2.0}, "swiglu_alpha 2.0"),
                                           ({"sliding_window": 0}, "sliding_window 0")])
def test_an_option_not_run_is_a_one_line_error(gptoss, change, named):
    c = json.loads((Path(gptoss[0]) / "config.json").read_text()) | change
    with pytest.raises(UserError) as e:
        config_from_hf(c)
    assert named in str(e.value) and "\n" not in str(e.value)


def test_mxfp4_blocks_and_scales_that_disagree_are_one_line(gptoss, tmp_path):
    """OpenAI's packed experts (*_blocks / *_scales) whose shapes disagree: one line naming the tensor."""
    from safetensors.torch import load_file, save_file
    path, _ = gptoss
    shutil.copytree(path, tmp_path / "mx")
    sd = load_file(str(tmp_path / "mx" / "model.safetensors"))
    for layer in range(3):
        p = f"model.layers.{layer}.mlp.experts."
        for proj in ("gate_up_proj", "down_proj"):
            del sd[p + proj]
            sd[p + proj + "_blocks"] = torch.zeros(8, 64, 2, 16, dtype=torch.uint8)
            sd[p + proj + "_scales"] = torch.zeros(8, 64, 3, dtype=torch.uint8)
    save_file(sd, str(tmp_path / "mx" / "model.safetensors"))
    with pytest.raises(UserError, match="gate_up_proj_blocks.*disagree") as e:
        HFSource(tmp_path / "mx")
    assert "\n" not in str(e.value)


def test_the_clamped_swiglu_with_biases_per_expert_id():
    """experts_reference with an OaiSwiglu against transformers' GptOssExperts formula, expert by expert; an
    expert's result does not depend on its slot (the biases go by expert id)."""
    g = torch.Generator().manual_seed(0)
    E, H, I, T, k = 5, 16, 8, 7, 2
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) * 2, torch.randn(E, H, I, generator=g)
    b13, b2 = torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    out = experts_reference(x, ids, w13, w2, OaiSwiglu(ids, b13, b2))
    for t in range(T):
        for j in range(k):
            e = ids[t, j]
            gu = x[t] @ w13[e].T + b13[e]
            gate, up = gu[:I].clamp(max=7), gu[I:].clamp(-7, 7)
            want = ((up + 1) * gate * torch.sigmoid(gate * 1.702)) @ w2[e].T + b2[e]
            assert torch.allclose(out[t, j], want, rtol=1e-6, atol=1e-4)       # outputs O(100)
    perm = torch.tensor([3, 0, 4, 1, 2])            # the same experts in other slots
    moved = experts_reference(x, perm[ids], w13[perm.argsort()], w2[perm.argsort()], OaiSwiglu(ids, b13, b2))
    assert torch.equal(moved, out)


def test_decode_plan_gives_gpt_oss_the_zero_copy_kernels():
    """The zero-copy decode kernels compute gpt-oss's clamped SwiGLU with biases (an OaiSwiglu, tests/
    test_oai_decode.py): its decode steps read experts by address, float or quantized, over the cache in graphs. An
    expert MLP they do not compute would fetch (eager with host experts, graphs where all are on the GPU)."""
    assert by_address_kernels(Blocks()) and by_address_kernels(FAMILIES["gpt_oss"].blocks)
    ecfg = resolve(EngineConfig(), torch.float32).updated({"decode.zero_copy": True, "kernel": "grouped"})
    for quantized in (False, True):
        plan = decode_plan(ecfg, True, quantized, True, True, by_address_kernels(FAMILIES["gpt_oss"].blocks))
        assert plan.zero_copy and plan.graphs and plan.lands and plan.staged == quantized
    plan = decode_plan(ecfg, True, False, True, True, by_address=False)
    assert not plan.zero_copy and not plan.lands and not plan.graphs        # host experts: eager, fetched
    assert decode_plan(ecfg, True, False, False, True, by_address=False).graphs    # all on the GPU: graphs


def test_synth_presets():
    from moestream.loading.synth import SynthSource
    big = SynthSource.from_spec("gpt-oss-120b:layers=3").config
    assert (big.n_layers, big.n_experts, big.hidden_size, big.moe_intermediate_size, big.sliding_window) == (
        3, 128, 2880, 2880, 128)
    assert big.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert SynthSource.from_spec("gpt-oss-20b").config.n_experts == 32
    llm = LLM("synth:tiny-gptoss", ctx_size=64, device="cpu")
    ids = list(range(1, 30))             # past the window of 16
    assert torch.equal(llm.logits(ids), LLM("synth:tiny-gptoss", ctx_size=64, device="cpu", cpu_moe=True,
                                            moe_cache_mib=0).logits(ids))
