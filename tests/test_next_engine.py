"""Qwen3-Next and Qwen3.5-MoE through the engine (models/ blocks, runtime/kv_cache.py's HybridCache), from the
checkpoints transformers writes (conftest's hybrid_checkpoint: qwen3_next, qwen3_5_moe's multimodal form and its
text-only form), float32 on the CPU.

Bounds, and what was measured (these seeds; logits O(7)):
- logits against transformers' within 1e-4 (ATOL) over a 100-token prompt in one ubatch: measured 2.1e-5
  (qwen3_next), 1.1e-5 (qwen3_5_moe), 1.5e-5 (its text form);
- the prompt in ubatches of 7, 64 and 1 token against one ubatch within 2e-4 (SPLIT_ATOL): measured 9.4e-5
  (qwen3_next, ubatches of 7), at most 6.6e-5 otherwise, 0 for 64 (the chunked rule's own chunks). A ubatch runs
  the chunked delta rule from the state the last one left, so float32 sums are grouped otherwise; against a
  float64 forward every split is within 6e-5, none the more exact one. (Against transformers the 7-token split of
  qwen3_next is 1.1e-4 off: the two differences add up.)
- greedy generation: the same tokens as transformers' generate (its recurrent delta rule and conv update);
- three sequences in one decode step against each alone within 5e-5 (BATCH_ATOL): measured 2.5e-5 (the GEMMs of
  three rows against those of one, the recurrent step batched);
- placements (--cpu-moe, --n-cpu-moe, cache sizes, policies): bit-identical (torch.equal), prompts and decode
  steps; zero-copy decode's steps bit-identical over placements too;
- a float32 GGUF (llama.cpp's qwen3next) written from a Qwen3-Next checkpoint: the checkpoint's logits, bit for bit.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from moestream import LLM, UserError
from moestream.runtime.kv_cache import HybridCache
from moestream.runtime.scheduler import Scheduler

from batched import served
from conftest import VOCAB, greedy_steps, logits_and_steps

ATOL = 1e-4
SPLIT_ATOL = 2e-4
BATCH_ATOL = 5e-5
KW = dict(device="cpu", ctx_size=128)


def ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_engine_holds_kv_for_attention_layers_only(hybrid_checkpoint):
    _, path, _ = hybrid_checkpoint
    eng = LLM(path, n_seq=3, **KW).engine
    cfg = eng.cfg
    # the family's blocks: a DeltaNet mixer on layers 0 and 2, gated attention on the others
    assert isinstance(eng.kv, HybridCache)
    assert [type(m).__name__ for m in eng.model.mixers] == ["DeltaNet", "GatedAttention", "DeltaNet",
                                                             "GatedAttention"]
    assert len(eng.kv.k) == len(cfg.attention_layers) == 2
    assert sorted(eng.kv.conv) == sorted(eng.kv.ssm) == cfg.linear_layers == [0, 2]
    assert eng.kv.conv[0].shape == (3, 2 * 2 * 16 + 4 * 8, 3) and eng.kv.ssm[0].shape == (3, 4, 16, 8)
    assert eng.kv.ssm[0].dtype == torch.float32 and eng.model.layers[0]["ssm_a"].dtype == torch.float32
    assert type(eng.decoder).__name__ == "EagerDecode" and eng.model.capturable      # graphs on CUDA only
    assert eng.reuses_prefix_exactly_only


def test_logits_match_transformers(hybrid_checkpoint):
    form, path, model = hybrid_checkpoint
    prompt = ids(100)
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0]
    got = LLM(path, **KW).logits(prompt)
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err < ATOL, (form, err)


def test_a_prompt_in_ubatches_equals_one_ubatch(hybrid_checkpoint):
    form, path, _ = hybrid_checkpoint
    prompt = ids(100)
    one = LLM(path, **KW).logits(prompt)
    for ub in (7, 64, 1):
        err = (LLM(path, ubatch_size=ub, **KW).logits(prompt) - one).abs().max().item()
        assert err < SPLIT_ATOL, (form, ub, err)


def test_greedy_generation_matches_transformers(hybrid_checkpoint):
    form, path, model = hybrid_checkpoint
    prompt = ids(20, seed=2)
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
    for ub in (512, 6):
        out = LLM(path, ubatch_size=ub, **KW).generate(prompt, max_tokens=12, ignore_eos=True)
        assert out.token_ids == want, (form, ub)


def test_several_sequences_decoded_together_equal_each_alone(hybrid_checkpoint):
    _, path, _ = hybrid_checkpoint
    prompts = [ids(9, seed=5), ids(14, seed=6), ids(30, seed=7)]
    llm = LLM(path, n_seq=3, **KW)
    eng = llm.engine
    alone = [greedy_steps(eng, p, 5) for p in prompts]      # each alone, in sequence 0: its prompt, 5 steps
    toks = [int(eng.prefill(s, p)[-1].argmax()) for s, p in enumerate(prompts)]
    order = [2, 0, 1]               # not in sequence order: each row reads its own sequence's state
    for step in range(5):
        out = eng.decode([(s, toks[s], len(prompts[s]) + step) for s in order])
        for row, s in zip(out, order):
            assert (row - alone[s][step]).abs().max() < BATCH_ATOL, (s, step)
            toks[s] = int(row.argmax())


def test_placements_caches_and_policies_are_bit_identical(hybrid_checkpoint):
    """Prompt logits and decode steps: --cpu-moe, --n-cpu-moe, cache sizes and policies give the bits of every expert
    on the device (with host experts a batch's ubatches run layer by layer, the DeltaNet states and KV of each ubatch
    continuing its predecessor's within the layer; -b 10 and --no-batch-by-layer too); with zero-copy decode (its
    plain-torch oracle here: another expert kernel, so other bits than fetching decode's) the cache's steps give those
    of zero-copy decode with every expert on the device."""
    _, path, _ = hybrid_checkpoint
    prompt = ids(33, seed=3)

    def run(**kw):
        llm = LLM(path, ubatch_size=5, **KW, **kw)
        return *logits_and_steps(llm, prompt, 4), llm
    base, base_steps, _ = run()
    for kw in ({"cpu_moe": True}, {"n_cpu_moe": 1}, {"cpu_moe": True, "moe_cache_mib": 0},
               {"cpu_moe": True, "moe_cache_mib": 1, "cache_policy": "lru"},
               {"cpu_moe": True, "batch_size": 10}, {"cpu_moe": True, "batch_by_layer": False}):
        logits, steps, llm = run(**kw)
        assert torch.equal(logits, base) and torch.equal(steps, base_steps), kw
        assert llm.stats()["uploaded_experts"] > 0
    zc_logits, zc_steps, _ = run(zero_copy_decode=True)
    assert torch.equal(zc_logits, base) and (zc_steps - base_steps).abs().max() < 1e-5
    for kw in ({"cpu_moe": True, "moe_cache_mib": 1}, {"cpu_moe": True, "moe_cache_mib": 0, "cache_policy": "lru"}):
        logits, steps, _ = run(zero_copy_decode=True, **kw)
        assert torch.equal(logits, base) and torch.equal(steps, zc_steps), kw


def test_a_segment_continues_its_state_or_starts_at_zero(hybrid_checkpoint):
    _, path, _ = hybrid_checkpoint
    eng = LLM(path, n_seq=2, **KW).engine
    a = ids(20, seed=8)
    first = eng.prefill(0, a[:12], all_logits=True)
    rest = eng.prefill(0, a[12:], start=12, all_logits=True)             # exactly where the state stopped
    whole = LLM(path, **KW).engine.prefill(0, a, all_logits=True)
    assert (torch.cat([first, rest]) - whole).abs().max() < SPLIT_ATOL
    for start in (5, 25):                                                # cut back, or skip ahead
        with pytest.raises(UserError) as e:
            eng.prefill(0, a[:3], start=start)
        assert "at position 20" in str(e.value) and f"not at position {start}" in str(e.value)
        assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="not at position 7"):
        eng.decode([(0, 1, 7)])
    with pytest.raises(UserError, match="appears twice"):
        eng.decode([(1, 1, 0), (1, 2, 0)])
    assert torch.equal(eng.prefill(0, a[:12], all_logits=True), first)   # position 0 starts it again
    assert torch.equal(eng.prefill(1, a[:12], all_logits=True), first)   # another sequence, from its own state


def test_a_failed_forward_leaves_the_state_to_start_again(hybrid_checkpoint, monkeypatch):
    _, path, _ = hybrid_checkpoint
    eng = LLM(path, **KW).engine
    a = ids(10, seed=9)
    want = eng.prefill(0, a)
    real = eng.model.forward_parts              # (what the engine's every forward calls)

    def boom(*args):
        raise RuntimeError("boom")
    monkeypatch.setattr(eng.model, "forward_parts", boom)
    with pytest.raises(RuntimeError):
        eng.prefill(0, [1, 2], start=10)
    monkeypatch.setattr(eng.model, "forward_parts", real)
    with pytest.raises(UserError, match="unknown"):
        eng.prefill(0, [1, 2], start=10)
    assert torch.equal(eng.prefill(0, a), want)


def test_reusable_prefix_is_an_exact_continuation_only():
    eng = LLM("synth:tiny-next", device="cpu", ctx_size=64).engine
    plain = LLM("synth:tiny", device="cpu", ctx_size=64).engine
    cached = [5, 6, 7, 8]
    for prompt, hybrid, kv in (([5, 6, 7, 8, 9, 10], 4, 4),     # extends the cache: reused whole
                               ([5, 6, 7, 9, 10], 0, 3),        # shares a prefix only: a KV cache cuts back
                               ([5, 6, 7, 8], 0, 3),            # the cache itself: one token must run
                               ([5, 6], 0, 1), ([1, 2], 0, 0)):
        assert (eng.reusable_prefix(cached, prompt), plain.reusable_prefix(cached, prompt)) == (hybrid, kv)
    assert eng.reusable_prefix([], [1, 2]) == 0 and eng.reuses_prefix_exactly_only
    assert not plain.reuses_prefix_exactly_only


def test_the_server_reuses_only_an_exact_continuation():
    llm = LLM("synth:tiny-next", device="cpu", ctx_size=128, n_seq=2)
    ref = LLM("synth:tiny-next", device="cpu", ctx_size=128)
    sched = Scheduler(llm, n_slots=2, max_queue=4)
    sched.start()
    try:
        prompt = ref.encode("The market opens at dawn. Farmers unload baskets")
        first = served(sched, prompt)
        held = prompt + first.token_ids[:-1]          # what the slot's state has run (the last token is not fed)
        longer = held + ref.encode(" of onions")
        second = served(sched, longer)
        assert second.cached_tokens == len(held)
        assert second.token_ids == ref.generate(longer, max_tokens=4).token_ids
        partial = prompt + ref.encode(" of onions")      # shares the prompt, not what the slot holds after it
        third = served(sched, partial)
        assert third.cached_tokens == 0
        assert third.token_ids == ref.generate(partial, max_tokens=4).token_ids
    finally:
        sched.stop()


def test_synth_presets():
    llm = LLM("synth:tiny-next", device="cpu", ctx_size=64)
    cfg = llm.model_config
    assert cfg.family == "qwen3_next" and cfg.linear_layers == [0, 2] and cfg.attention_layers == [1, 3]
    out = llm.generate("Once upon a time", max_tokens=6, ignore_eos=True)
    assert len(out.token_ids) == 6
    from moestream.loading.synth import SynthSource
    big = SynthSource.from_spec("qwen3-next-80b-a3b")
    c = big.config
    assert (c.hidden_size, c.n_layers, c.n_experts, c.n_experts_used, c.moe_intermediate_size,
            c.shared_expert_intermediate_size) == (2048, 48, 512, 10, 512, 512)
    assert c.attention_layers == list(range(3, 48, 4)) and c.rotary_dim == 64
    assert big.tensor("blk.0.ssm_in.weight").shape == (2 * 2048 + 2 * 4096, 2048)
    assert big.tensor("blk.3.attn_q.weight").shape == (2 * 16 * 256, 2048)
    assert (big.tensor("blk.0.ssm_a") < 0).all() and big.tensor("blk.0.ssm_a").dtype == torch.float32
    six = SynthSource.from_spec("qwen3-next-80b-a3b:layers=6").config
    assert six.n_layers == 6 and six.attention_layers == [3]


def test_an_unsupported_layer_type_or_option_is_one_line(tmp_path):
    from conftest import hybrid_model
    path = tmp_path / "ok"
    hybrid_model("qwen3_next").save_pretrained(str(path))
    for change, named in (({"layer_types": ["linear_attention", "sliding_attention"] * 2}, "'sliding_attention'"),
                          ({"hidden_act": "gelu"}, "hidden_act 'gelu'")):
        out = tmp_path / named.replace("'", "").replace(" ", "_")
        shutil.copytree(path, out)
        c = json.loads((out / "config.json").read_text()) | change
        (out / "config.json").write_text(json.dumps(c))
        with pytest.raises(UserError) as e:
            LLM(str(out), **KW)
        assert named in str(e.value) and "\n" not in str(e.value)


def test_decode_steps_take_the_fused_kernels_the_gated_attention_among_them(hybrid_checkpoint):
    """On CUDA a decode step runs the fused add + RMSNorm, top-k, shared expert and gated attention (Triton);
    stand-ins with the eager ops' math take their place here (the kernels themselves: tests/test_triton_kernels.py's
    gated_attention, hybrid_decode and shared_expert, in Triton's interpreter)."""
    from test_decode_paths import _stand_in_fused, _stand_in_gated_attention
    _, path, _ = hybrid_checkpoint

    def run(fused):
        llm = LLM(path, zero_copy_decode=True, **KW)
        calls = []
        if fused:
            llm.engine.fused = _stand_in_gated_attention(_stand_in_fused(calls), calls)
        out = llm.generate(ids(12, seed=10), max_tokens=6, ignore_eos=True).token_ids
        return out, calls
    (plain, _), (fused, calls) = run(False), run(True)
    assert plain == fused
    assert {"norm_linear", "linear", "norm_route", "shared_expert", "gated_qk_rope_kv", "decode_attention"} <= set(calls)


def test_a_hybrid_model_decodes_in_graphs_where_other_families_do():
    """Where another family's decode steps replay CUDA graphs (CUDA, graphs on, all experts on the device), a
    hybrid model's do too (the decode plan: the choice only, nothing is captured; the captured steps themselves are
    tests/test_cuda_delta.py's)."""
    from moestream.engine_config import EngineConfig
    from moestream.models.transformer import MoETransformer
    from moestream.runtime.plan import decode_plan
    # one decoder for every family, whatever blocks its entry picks (DeltaNet layers too): capturable is its own
    ecfg = EngineConfig(kernel="grouped")
    from moestream.loading.synth import SynthSource
    cfg = SynthSource.from_spec("tiny-next").config
    assert decode_plan(ecfg, cuda=True, quantized=False, host=False, capturable=MoETransformer.capturable_for(cfg)).graphs


def test_forwards_kept_apart_from_every_sequence_leave_the_states_as_they_were(hybrid_checkpoint):
    """kv.kept(): the steps of a graph's warm-up and the server's captures run at positions past the sequences'
    own (where their KV writes are not read) on sequences that hold states, and leave every state and position as
    it was: what follows gives the same bits as without them."""
    _, path, _ = hybrid_checkpoint
    a, b = ids(10, seed=11), ids(6, seed=12)

    def run(interlude: bool):
        eng = LLM(path, n_seq=2, **KW).engine
        eng.prefill(0, a)
        eng.prefill(1, b)
        if interlude:
            with eng.kv.kept():
                eng.decode([(0, 5, 40), (1, 6, 30)])         # positions neither sequence's state is at
                eng.prefill(1, a[:4], start=17)
        return eng.decode([(0, 7, len(a)), (1, 8, len(b))]), eng.decode([(0, 9, len(a) + 1)])
    plain, kept = run(False), run(True)
    assert all(torch.equal(x, y) for x, y in zip(plain, kept))


def test_a_gguf_of_the_same_weights_gives_the_same_logits(tmp_path):
    """llama.cpp's qwen3next: write_gguf of a Qwen3-Next checkpoint reads back as the same config and, float32,
    the same logits bit for bit (GGUF holds the canonical values: 1 + w norms, -exp(A_log))."""
    import gguf
    from conftest import hybrid_model, randomize_hybrid
    from moestream.loading.gguf import GGUFSource
    from moestream.loading.gguf_write import write_gguf
    from moestream.loading.hf import HFSource
    torch.manual_seed(0)
    model = hybrid_model("qwen3_next").eval()
    randomize_hybrid(model)
    model.save_pretrained(str(tmp_path / "hf"))
    src = HFSource(tmp_path / "hf")
    write_gguf(src, tmp_path / "m.gguf")
    back = GGUFSource(tmp_path / "m.gguf")
    assert back.config == src.config and back.arch == "qwen3next"
    names = {t.name for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert "blk.0.post_attention_norm.weight" in names and "blk.0.ffn_norm.weight" not in names
    assert {"blk.0.attn_qkv.weight", "blk.0.attn_gate.weight", "blk.0.ssm_ba.weight", "blk.0.ssm_a",
            "blk.0.ssm_dt.bias"} <= names and "blk.0.ssm_in.weight" not in names      # as llama.cpp writes them
    assert torch.equal(back.tensor("blk.0.ssm_in.weight"), src.tensor("blk.0.ssm_in.weight"))
    prompt = ids(40, seed=11)
    want = LLM(str(tmp_path / "hf"), **KW).logits(prompt)
    assert torch.equal(LLM(str(tmp_path / "m.gguf"), **KW).logits(prompt), want)


def test_a_quantized_gguf_runs_and_its_placements_are_bit_identical(tmp_path):
    from moestream.loading.gguf_write import write_gguf
    from moestream.loading.synth import SynthSource
    from moestream.quant.mix import Mix
    src = SynthSource.from_spec("tiny-next")
    mix = Mix.for_config(src.config, "Q8_0")
    assert mix.type("blk.0.ssm_conv1d.weight", (1, 4)).name == "F32"        # never quantized, as llama.cpp
    write_gguf(src, tmp_path / "q.gguf", types=mix.type, file_type=mix.file_type)
    prompt = ids(20, seed=12)
    dev = LLM(str(tmp_path / "q.gguf"), **KW)
    assert dev.engine.quantized
    want = dev.logits(prompt)
    cached = LLM(str(tmp_path / "q.gguf"), cpu_moe=True, moe_cache_mib=1, **KW)
    assert torch.equal(cached.logits(prompt), want)
    assert (cached.generate(prompt, max_tokens=6, ignore_eos=True).token_ids
            == dev.generate(prompt, max_tokens=6, ignore_eos=True).token_ids)


def test_llama_cpp_split_ssm_in_is_the_same_layer():
    """A DeltaNet layer with ssm_in split as llama.cpp writes it (attn_qkv: q, k, v of every head; attn_gate: z)
    computes what the fused one does, and the split turns back into the same bits."""
    from moestream.loading.synth import SynthSource
    from moestream.models.deltanet import gated_deltanet
    from moestream.arch.hybrid_names import fuse_qkvz, layer_names, split_qkvz
    src = SynthSource.from_spec("tiny-next")
    cfg = src.config
    lw = {n: src.tensor(f"blk.0.{n}") for n in layer_names(cfg, 0) if "_exps" not in n}
    qkv, gate = split_qkvz(cfg, lw["ssm_in.weight"])
    assert torch.equal(fuse_qkvz(cfg, qkv, gate), lw["ssm_in.weight"])
    split = {k: v for k, v in lw.items() if k != "ssm_in.weight"} | {"attn_qkv.weight": qkv, "attn_gate.weight": gate}
    x = torch.randn(1, 9, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(gated_deltanet(x, split, cfg)[0], gated_deltanet(x, lw, cfg)[0], atol=1e-5)


def test_a_refused_step_leaves_the_cache_and_its_counters_as_they_were():
    """With host experts under a cache and zero-copy decode, a decode step at a wrong position is refused before
    the step's address table or counters start; the next right step gives the bits it would have given."""
    kw = dict(device="cpu", ctx_size=64, cpu_moe=True, moe_cache_mib=1, zero_copy_decode=True)
    a, b = LLM("synth:tiny-next", **kw).engine, LLM("synth:tiny-next", **kw).engine
    prompt = ids(10, seed=13)
    for eng in (a, b):
        eng.prefill(0, prompt)
    with pytest.raises(UserError, match="not at position 3"):
        a.decode([(0, 5, 3)])
    assert torch.equal(a.decode([(0, 5, 10)]), b.decode([(0, 5, 10)]))
    counts = [{k: v for k, v in e.stats()["total"].items() if not k.endswith("_s")} for e in (a, b)]   # not times
    assert counts[0] == counts[1]
