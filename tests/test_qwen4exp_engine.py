"""Qwen3.8-Flash-Next (qwen4_exp) through the engine (LLM: models/transformer.py with QSA attention, the hyper
residual and the PLE block; runtime/kv_cache.py's Qwen4Cache), from the checkpoint transformers writes (conftest's
qwen4_checkpoint), float32 on the CPU.

Bounds, and what was measured (these seeds; logits O(3)):
- logits against transformers' within 1e-4 (ATOL) over a 48-token prompt (a QSA budget of 8 tokens: most blocks
  dropped; EOS inside, so n-grams restart): measured 5.2e-6;
- the prompt in ubatches of 7 and 1 against one ubatch within 2e-4 (SPLIT_ATOL, the hybrid families' bound: the
  chunked delta rule from each ubatch's state): measured 5.3e-6 and 1.3e-5;
- greedy generation: transformers' tokens (its cached indexer keys, n-gram context and PLE conv);
- three sequences in one decode step against each alone within 5e-5 (BATCH_ATOL);
- placements (--cpu-moe, --n-cpu-moe, cache sizes, policies, batches by layer): bit-identical (torch.equal).
"""
from __future__ import annotations

import pytest
import torch

from moestream import LLM, UserError
from moestream.runtime.kv_cache import Qwen4Cache, cache_nbytes

from conftest import (QWEN4_EOS as EOS, QWEN4_TEXT, VOCAB, greedy_steps, logits_and_steps, lower_index_ties,
                      randomize_hybrid)

ATOL = 1e-4
SPLIT_ATOL = 2e-4
BATCH_ATOL = 5e-5
KW = dict(device="cpu", ctx_size=96)


def ids(n: int, seed: int = 1) -> list[int]:
    out = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))
    out[n // 3] = EOS                   # n-grams restart after an EOS
    return out.tolist()


def test_the_engine_builds_the_family_and_its_cache(qwen4_checkpoint):
    path, _ = qwen4_checkpoint
    eng = LLM(path, n_seq=2, **KW).engine
    cfg = eng.cfg
    assert [type(m).__name__ for m in eng.model.mixers] == ["DeltaNet", "QSA", "DeltaNet", "QSA"]
    assert type(eng.model.residual).__name__ == "Hyper" and not eng.model.capturable
    kv = eng.kv
    assert isinstance(kv, Qwen4Cache) and kv.exact_prefix_only
    assert [t.shape for t in kv.index_keys] == [(2, 96, 16)] * 2
    assert kv.ngram.device.type == "cpu" and kv.ngram.tolist() == [[EOS, EOS]] * 2
    assert list(kv.ple_conv) == [0] and kv.ple_conv[0].shape == (2, (4 - 1) * 3, 3 * 64)
    # the n-gram table stays in host memory and counts in no device budget
    assert eng.model.ple.table.table.device.type == "cpu"
    assert "per_layer_token_embd.weight" not in eng.model.w
    grows, fixed = cache_nbytes(cfg, 2, 96, torch.float32)
    assert [t.shape for t in kv.block_keys] == [(2, 96 // 4, 16)] * 2
    assert grows == 2 * 2 * (96 * (2 * 2 * 16 + 16) + 96 // 4 * 16) * 4   # K, V, index and block keys, 2 layers
    assert fixed == 2 * 2 * 4 * (96 * 3 + 4 * 16 * 8) + 2 * 9 * 192 * 4     # DeltaNet (conv, ssm), PLE conv


def test_logits_match_transformers_and_ple_bytes_are_counted(qwen4_checkpoint):
    path, model = qwen4_checkpoint
    prompt = ids(48)
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0]
    llm = LLM(path, **KW)
    got = llm.logits(prompt)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < ATOL
    table = llm.engine.model.ple.table
    assert llm.stats()["ple_bytes"] == 48 * 4 * table.row_bytes               # tokens x heads x row bytes


def test_a_prompt_past_the_budget_in_ubatches_equals_one_ubatch(qwen4_checkpoint):
    path, _ = qwen4_checkpoint
    prompt = ids(40, seed=3)
    one = LLM(path, **KW).logits(prompt)
    for ub in (7, 1):
        err = (LLM(path, ubatch_size=ub, **KW).logits(prompt) - one).abs().max().item()
        assert err < SPLIT_ATOL, (ub, err)


def test_greedy_generation_matches_transformers(qwen4_checkpoint):
    """Transformers' tokens, its indexer breaking ties as ours (tied blocks straddle the cut in these steps)."""
    path, model = qwen4_checkpoint
    prompt = ids(20, seed=2)
    with torch.no_grad(), lower_index_ties():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
    for ub in (512, 6):
        out = LLM(path, ubatch_size=ub, **KW).generate(prompt, max_tokens=10, ignore_eos=True)
        assert out.token_ids == want, ub


def test_several_sequences_decoded_together_equal_each_alone(qwen4_checkpoint):
    path, _ = qwen4_checkpoint
    prompts = [ids(9, seed=5), ids(14, seed=6), ids(30, seed=7)]
    eng = LLM(path, n_seq=3, **KW).engine
    alone = [greedy_steps(eng, p, 4) for p in prompts]      # each alone, in sequence 0: its prompt, 4 steps
    toks = [int(eng.prefill(s, p)[-1].argmax()) for s, p in enumerate(prompts)]
    order = [2, 0, 1]               # not in sequence order: each row reads its own sequence's state
    for step in range(4):
        out = eng.decode([(s, toks[s], len(prompts[s]) + step) for s in order])
        for row, s in zip(out, order):
            assert (row - alone[s][step]).abs().max() < BATCH_ATOL, (s, step)
            toks[s] = int(row.argmax())


def test_placements_caches_and_policies_are_bit_identical(qwen4_checkpoint):
    path, _ = qwen4_checkpoint
    prompt = ids(26, seed=3)

    def run(**kw):
        llm = LLM(path, ubatch_size=5, **KW, **kw)
        return *logits_and_steps(llm, prompt, 3), llm
    base, base_steps, _ = run()
    for kw in ({"cpu_moe": True}, {"n_cpu_moe": 1}, {"cpu_moe": True, "moe_cache_mib": 0},
               {"cpu_moe": True, "moe_cache_mib": 1, "cache_policy": "lru"},
               {"cpu_moe": True, "batch_size": 10}, {"cpu_moe": True, "batch_by_layer": False}):
        logits, steps, llm = run(**kw)
        assert torch.equal(logits, base) and torch.equal(steps, base_steps), kw
        assert llm.stats()["uploaded_experts"] > 0
    # zero-copy decode (its plain-torch oracle here): a cache's steps give those with every expert on the device
    zc_logits, zc_steps, _ = run(zero_copy_decode=True)
    logits, steps, _ = run(zero_copy_decode=True, cpu_moe=True, moe_cache_mib=1)
    assert torch.equal(zc_logits, base) and torch.equal(logits, base) and torch.equal(steps, zc_steps)


def test_states_start_again_continue_and_are_kept(qwen4_checkpoint):
    """A segment continues its sequence's states (n-gram context, PLE conv, DeltaNet) or starts them again at 0;
    forwards inside kv.kept() (graph warm-ups) leave them as they were; a prefix is reused only as an exact
    continuation."""
    path, _ = qwen4_checkpoint
    eng = LLM(path, n_seq=2, **KW).engine
    a, b = ids(20, seed=8), ids(6, seed=12)
    first = eng.prefill(0, a[:12], all_logits=True)
    rest = eng.prefill(0, a[12:], start=12, all_logits=True)
    assert eng.kv.ngram[0].tolist() == a[-2:]
    whole = LLM(path, **KW).engine.prefill(0, a, all_logits=True)
    assert (torch.cat([first, rest]) - whole).abs().max() < SPLIT_ATOL
    with pytest.raises(UserError, match="not at position 5"):
        eng.prefill(0, a[:3], start=5)
    assert torch.equal(eng.prefill(1, a[:12], all_logits=True), first)   # another sequence, from its own state
    assert torch.equal(eng.prefill(0, a[:12], all_logits=True), first)   # position 0 starts it again

    def after(interlude: bool):
        e = LLM(path, n_seq=2, **KW).engine
        e.prefill(0, a)
        e.prefill(1, b)
        if interlude:
            with e.kv.kept():
                e.decode([(0, 5, 40), (1, 6, 30)])
                e.prefill(1, a[:4], start=17)         # positions neither sequence is at
        return e.decode([(0, 7, len(a)), (1, 8, len(b))])
    assert torch.equal(after(False), after(True))
    assert eng.reusable_prefix(a, a + [1, 2]) == len(a) and eng.reusable_prefix(a, a[:10] + [1, 2]) == 0


@pytest.fixture(scope="module")
def sigmoid_checkpoint(tmp_path_factory):
    """(path, model) of a checkpoint whose DeltaNet gates by sigmoid (output_gate_type), as llama.cpp's qwen4exp."""
    import transformers as tf
    torch.manual_seed(1)
    model = tf.Qwen4ExpForCausalLM(tf.Qwen4ExpTextConfig(**QWEN4_TEXT, output_gate_type="sigmoid")).eval()
    randomize_hybrid(model)
    path = tmp_path_factory.mktemp("qwen4_sigmoid")
    model.save_pretrained(str(path))
    return str(path), model


def test_a_sigmoid_output_gate_matches_transformers(sigmoid_checkpoint):
    """output_gate_type sigmoid (llama.cpp's qwen4exp always gates so): the DeltaNet's output norm gated by
    sigmoid(z), in prompts (chunked) and decode steps (recurrent, around the one-launch kernel, which gates by silu).
    Transformers' indexer breaks ties as ours (tied blocks straddle the cut here)."""
    path, model = sigmoid_checkpoint
    prompt = ids(20, seed=4)
    with torch.no_grad(), lower_index_ties():
        want = model(torch.tensor([prompt])).logits[0]
        tokens = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(path, **KW)
    assert llm.model_config.deltanet_gate == "sigmoid"
    assert (llm.logits(prompt) - want).abs().max().item() < ATOL
    assert llm.generate(prompt, max_tokens=6, ignore_eos=True).token_ids == tokens


def test_a_gguf_of_the_checkpoint_gives_its_logits(sigmoid_checkpoint, qwen4_checkpoint, tmp_path):
    """llama.cpp's qwen4exp as make_reference_qwen4exp_gguf.py writes it: write_gguf of the checkpoint reads back
    as its config and, float32, its logits bit for bit; the n-gram table is read by row from the map."""
    import dataclasses
    import gguf
    from moestream.loading.gguf import GGUFSource
    from moestream.loading.gguf_write import write_gguf
    from moestream.loading.hf import HFSource
    path, _ = sigmoid_checkpoint
    src = HFSource(path)
    write_gguf(src, tmp_path / "m.gguf")
    back = GGUFSource(tmp_path / "m.gguf")
    # the file holds the hash's primes: its first head's is the row base (HF's 50 derives the same primes from 53)
    assert dataclasses.replace(back.config, ngram_vocab_base=50) == src.config and back.arch == "qwen4exp"
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    names = {t.name for t in reader.tensors}
    assert {"output_hc_norm.weight", "per_layer_token_embd.weight", "blk.0.hc_attn_inject.weight",
            "blk.0.ple_conv1d.weight", "blk.0.attn_qkv.weight", "blk.1.indexer.k_proj.weight"} <= names
    assert "output_norm.weight" not in names and "blk.0.attn_norm.weight" not in names
    assert reader.fields["qwen4exp.ple.layers"].contents() == [0]
    assert reader.fields["qwen4exp.attention.compress_ratios"].contents() == [0, 4, 0, 4]
    prompt = ids(30, seed=5)
    want = LLM(path, **KW).logits(prompt)
    llm = LLM(str(tmp_path / "m.gguf"), **KW)
    assert llm.engine.model.ple.table.mapped
    assert torch.equal(llm.logits(prompt), want)
    assert llm.stats()["ple_bytes"] == 30 * 4 * 8 * 4
    with pytest.raises(UserError, match="sigmoid") as e:            # llama.cpp's qwen4exp has no silu gate
        write_gguf(HFSource(qwen4_checkpoint[0]), tmp_path / "silu.gguf")
    assert "\n" not in str(e.value)


def _reference_writer():
    from pathlib import Path
    here = Path(__file__).resolve().parent
    for shared in (here.parent.parent / "shared", here.parent.parent.parent / "shared"):
        script = shared / "bench" / "make_reference_qwen4exp_gguf.py"
        if script.exists():
            return script
    pytest.skip("../shared/bench/make_reference_qwen4exp_gguf.py is not here")


def test_the_reference_file_of_llama_cpp_layout_runs(tmp_path):
    """make_reference_qwen4exp_gguf.py --tiny (BF16, its PLE on layer 1, (1, H) shared-expert gates, no
    tokenizer): moestream reads its keys and tensors, and decodes with its table mapped."""
    import subprocess
    import sys
    out = tmp_path / "ref.gguf"
    subprocess.run([sys.executable, str(_reference_writer()), str(out), "4", "--tiny"], check=True,
                   capture_output=True)
    llm = LLM(str(out), **KW)
    cfg = llm.model_config
    assert (cfg.hc_count, cfg.ple_layers, cfg.indexer_block, cfg.deltanet_gate, cfg.eos_token_ids) == (
        4, (1,), 4, "sigmoid", (2,))
    assert cfg.attention_layers == [3] and llm.engine.model.ple.table.mapped
    assert len(llm.generate([5, 6, 7, 2, 9, 10, 11, 12, 13, 14], max_tokens=3, ignore_eos=True).token_ids) == 3
    assert llm.stats()["ple_bytes"] == 12 * 16 * 16 * 2         # 10 + 2 tokens, 16 heads of 16 BF16 values


def test_quantized_experts_of_mixed_types_stay_quantized(sigmoid_checkpoint, tmp_path):
    """A GGUF whose ffn_down_exps has another type than gate and up (llama-quantize's fallback for rows that are
    not whole super-blocks): the experts stay quantized, and the placements give the same bits."""
    from gguf import GGMLQuantizationType as Q, LlamaFileType
    from moestream.loading.gguf_write import write_gguf
    from moestream.loading.hf import HFSource

    def types(name, shape):
        if name.endswith(("ffn_gate_exps.weight", "ffn_up_exps.weight")):
            return Q.Q8_0
        return Q.Q4_0 if name.endswith("ffn_down_exps.weight") else Q.F32
    write_gguf(HFSource(sigmoid_checkpoint[0]), tmp_path / "q.gguf", types=types, file_type=LlamaFileType.MOSTLY_Q8_0)
    prompt = ids(20, seed=6)
    dev = LLM(str(tmp_path / "q.gguf"), **KW)
    assert dev.engine.quantized and dev.engine.experts.layout(0).quantized
    assert "Q4_0" in dev.engine.describe_experts() and "Q8_0" in dev.engine.describe_experts()
    want = dev.logits(prompt)
    cached = LLM(str(tmp_path / "q.gguf"), cpu_moe=True, moe_cache_mib=1, **KW)
    assert torch.equal(cached.logits(prompt), want)
    assert (cached.generate(prompt, max_tokens=4, ignore_eos=True).token_ids
            == dev.generate(prompt, max_tokens=4, ignore_eos=True).token_ids)


def test_synth_presets():
    """tiny-flash-next runs on the CPU; qwen3.8-flash-next has the real shapes (make_reference_qwen4exp_gguf.py's),
    its 320M-row n-gram table made by row when gathered, never whole."""
    from moestream.arch.names import dense_numel
    from moestream.loading.synth import SynthSource
    llm = LLM("synth:tiny-flash-next", **KW)
    cfg = llm.model_config
    assert cfg.family == "qwen4_exp" and cfg.attention_layers == [1, 3] and cfg.ple_layers == (0,)
    assert len(llm.generate("Once upon a time", max_tokens=6, ignore_eos=True).token_ids) == 6
    big = SynthSource.from_spec("qwen3.8-flash-next:layers=8")
    c = big.config
    assert (c.hidden_size, c.vocab_size, c.n_experts, c.n_experts_used, c.moe_intermediate_size, c.hc_count,
            c.hc_lowrank, c.indexer_budget, c.deltanet_gate) == (2560, 248320, 512, 10, 640, 4, 320, 2048, "sigmoid")
    assert c.attention_layers == [3, 7] and c.ple_layers == (1,) and c.rotary_dim == 64
    table = big.rows("per_layer_token_embd.weight")
    assert table.shape == (320_001_536, 160)
    rows = table.take(torch.tensor([320_001_535, 7, 3]))
    assert torch.equal(rows[1:], table.take(torch.tensor([7, 3]))) and rows.dtype == torch.bfloat16
    assert big.tensor("blk.3.indexer.q_proj.weight").shape == (4 * 128, 2560)
    assert big.tensor("blk.0.hc_attn_down.weight").shape == (320, 4 * 2560)
    assert dense_numel(c) < 3e9          # the table (51.2B values) counts in no device budget


def test_make_model_writes_both_formats(tmp_path):
    """make-model of tiny-flash-next as a Hugging Face directory (which transformers loads: its logits within ATOL)
    and as a GGUF: both read back as the preset's config and weights, the GGUF with its logits bit for bit, the HF
    directory within 1e-5 (on the CPU the loader keeps safetensors' mapped tensors where they lie, not 64-byte
    aligned, and BLAS then sums in another order: aligned copies of them give the preset's bits); a Q8_0 file's
    n-gram rows, read by row from the map, are its table's dequantized rows."""
    import transformers as tf
    from moestream.loading.gguf import GGUFSource
    from moestream.loading.gguf_write import write_gguf
    from moestream.loading.synth import SynthSource
    from moestream.quant.mix import Mix
    from moestream.tools.make_model import make_model
    synth = LLM("synth:tiny-flash-next", **KW)
    prompt = synth.encode("Once upon a time there was a house by the sea") * 2      # past the budget of 16
    want = synth.logits(prompt)
    for out, bound in ((tmp_path / "hf", 1e-5), (tmp_path / "m.gguf", 0)):
        make_model("synth:tiny-flash-next", out, progress=False)
        back = LLM(str(out), **KW)
        assert back.model_config == synth.model_config
        assert (back.logits(prompt) - want).abs().max() <= bound, out
    model = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    with torch.no_grad(), lower_index_ties():
        assert (model(torch.tensor([prompt])).logits[0] - want).abs().max() < ATOL
    src = SynthSource.from_spec("tiny-flash-next")
    mix = Mix.for_config(src.config, "Q8_0")
    write_gguf(src, tmp_path / "q.gguf", types=mix.type, file_type=mix.file_type)
    q = GGUFSource(tmp_path / "q.gguf")
    rows = q.rows("per_layer_token_embd.weight")
    assert rows.qtype.name == "Q8_0"
    idx = torch.tensor([700, 3, 3, 64])
    assert torch.equal(rows.take(idx), q.tensor("per_layer_token_embd.weight")[idx])


def test_fused_decode_ops_stay_off_the_streams_and_qsa():
    """A decode step with the fused kernels (on CUDA; stand-ins with the eager math here) takes the eager ops
    where they assume one plain residual stream (add + norm, norm + projection, norm + route) or dense attention
    (QSA), and the fused GEMVs and shared expert elsewhere: the same tokens as without them."""
    from test_decode_paths import _stand_in_fused, _stand_in_gated_attention

    def run(fused: bool):
        llm = LLM("synth:tiny-flash-next", zero_copy_decode=True, **KW)
        calls = []
        if fused:
            llm.engine.fused = _stand_in_gated_attention(_stand_in_fused(calls), calls)
        return llm.generate(ids(24, seed=10), max_tokens=5, ignore_eos=True).token_ids, set(calls)
    (plain, _), (fused, calls) = run(False), run(True)
    assert plain == fused
    assert "linear" in calls and "shared_expert" in calls
    assert not calls & {"add_rms_norm", "norm_linear", "norm_route", "gated_qk_rope_kv", "decode_attention"}


def test_the_server_reuses_only_an_exact_continuation():
    """The serving loop's prefix reuse on a slot of this family: a prompt that extends what the slot holds runs
    only its new tokens, from the slot's n-gram context, PLE conv rows, index keys and DeltaNet states, and gives
    what a fresh sequence gives; a prompt that shares only a prefix runs whole."""
    from batched import served
    from moestream.runtime.scheduler import Scheduler
    llm = LLM("synth:tiny-flash-next", device="cpu", ctx_size=128, n_seq=2)
    ref = LLM("synth:tiny-flash-next", device="cpu", ctx_size=128)
    sched = Scheduler(llm, n_slots=2, max_queue=4)
    sched.start()
    try:
        prompt = ref.encode("The market opens at dawn. Farmers unload baskets")
        first = served(sched, prompt)
        held = prompt + first.token_ids[:-1]
        longer = held + ref.encode(" of onions and leeks")
        second = served(sched, longer)
        assert second.cached_tokens == len(held)
        assert second.token_ids == ref.generate(longer, max_tokens=4).token_ids
        partial = prompt + ref.encode(" of onions")
        third = served(sched, partial)
        assert third.cached_tokens == 0 and third.token_ids == ref.generate(partial, max_tokens=4).token_ids
    finally:
        sched.stop()
