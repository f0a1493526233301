"""Multi-token prediction: the MTP head of Qwen3-Next and Qwen3.5-MoE (models/mtp.py) read from HF and GGUF, and
speculative decoding over it (runtime/speculate.py), float32 on the CPU.

transformers does not model the head (it drops mtp.* at load), so the test writes the head's tensors itself, beside
a checkpoint transformers saved, and checks the engine's head against a reference built of transformers' own blocks
(its decoder layer, RMSNorm and rotary embedding) as vLLM and llama.cpp define the head.

Bounds, and what was measured (these seeds): the trunk's hidden states and the head's output and logits against
the reference within 1e-4 (ATOL); greedy tokens with drafts equal those without, token for token, for every draft
count and every acceptance (the oracle right for the first j drafts of each step, for every j).
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from moestream import LLM, SamplingParams, UserError
from moestream.models.transformer import Segment
from moestream.runtime.speculate import greedy_tokens
from moestream.tools.spec_oracle import Oracle

from conftest import CUDA, VOCAB, hybrid_model, randomize_hybrid

ATOL = 1e-4
KW = dict(device="cpu", ctx_size=96)
FORMS = ("qwen3_next", "qwen3_5_moe")      # qwen3_5_moe: the multimodal checkpoint (language model nested)


def ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _text(model):
    """(the language model's decoder, its config): transformers' Qwen3NextModel or Qwen3_5MoeTextModel."""
    inner = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return inner, inner.config


def make_head(model):
    """A random MTP head as vLLM's Qwen3NextMTP holds it: fc, the two pre-fc norms, one decoder layer (a full
    attention layer with experts, transformers' own class), the final norm."""
    inner, cfg = _text(model)
    layer_cls = type(inner.layers[0])
    full = cfg.layer_types.index("full_attention")
    H = cfg.hidden_size
    norm_cls = type(inner.norm)
    head = torch.nn.ModuleDict(dict(fc=torch.nn.Linear(2 * H, H, bias=False),
                                    pre_fc_norm_embedding=norm_cls(H, eps=cfg.rms_norm_eps),
                                    pre_fc_norm_hidden=norm_cls(H, eps=cfg.rms_norm_eps),
                                    layers=torch.nn.ModuleList([layer_cls(cfg, full)]),
                                    norm=norm_cls(H, eps=cfg.rms_norm_eps))).eval()
    randomize_hybrid(head)
    return head


@pytest.fixture(scope="module", params=FORMS)
def mtp_checkpoint(request, tmp_path_factory):
    """(path, transformers model, head) of a hybrid checkpoint transformers wrote, with mtp.* tensors added."""
    torch.manual_seed(0)
    model = hybrid_model(request.param).eval()
    randomize_hybrid(model)
    path = tmp_path_factory.mktemp(f"mtp_{request.param}")
    model.save_pretrained(str(path))
    head = make_head(model)
    tensors = load_file(str(path / "model.safetensors"))
    tensors.update({f"mtp.{k}": v.contiguous() for k, v in head.state_dict().items()})
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (config.get("text_config") or config)["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    return str(path), model, head


@torch.no_grad()
def reference_head(model, head, tokens: list[int], following: list[int]):
    """(trunk's post-norm hidden states (T, H), the head's post-norm output (T, H), its logits (T, V)) over
    `tokens`, the head reading following[i] beside hidden state i, in plain torch of transformers' blocks."""
    inner, _ = _text(model)
    x = torch.tensor([tokens])
    h = inner(input_ids=x).last_hidden_state                               # (1, T, H), after model.norm
    e = inner.embed_tokens(torch.tensor([following]))
    y = head["fc"](torch.cat([head["pre_fc_norm_embedding"](e), head["pre_fc_norm_hidden"](h)], dim=-1))
    T = len(tokens)
    pos = torch.arange(T)[None]
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]           # causal, additive
    out = head["layers"][0](y, position_embeddings=inner.rotary_emb(y, pos), attention_mask=mask,
                            position_ids=pos)
    out = out[0] if isinstance(out, tuple) else out
    g = head["norm"](out)
    return h[0], g[0], model.lm_head(g)[0]


def test_the_head_is_read_and_computes_the_reference(mtp_checkpoint):
    path, model, head = mtp_checkpoint
    eng = LLM(path, spec_type="draft-mtp", **KW).engine
    cfg = eng.cfg
    assert cfg.nextn_layers == 1 and cfg.head_layers == [cfg.n_layers] and len(eng.kv.k) == 3
    tokens = ids(12)
    following = tokens[1:] + [7]
    h_ref, g_ref, logits_ref = reference_head(model, head, tokens, following)
    hidden = []
    eng.prefill(0, tokens, hidden=hidden)
    torch.testing.assert_close(torch.cat(hidden), h_ref, atol=ATOL, rtol=0)
    logits, out = eng.head_step(0, 0, following, torch.cat(hidden))
    torch.testing.assert_close(out, g_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[-1], logits_ref[-1], atol=ATOL, rtol=0)
    # the head's experts are layer n_layers of the same providers (one host store, cache and counters)
    host = LLM(path, spec_type="draft-mtp", cpu_moe=True, moe_cache_mib=0, **KW).engine
    assert cfg.n_layers in host.host.store.rows
    host.prefill(0, tokens, hidden=(hid := []))
    before = host.stats()["per_layer"].get(cfg.n_layers, {})
    assert torch.equal(host.head_step(0, 0, following, torch.cat(hid))[1], out)
    assert host.stats()["per_layer"][cfg.n_layers] != before


def test_without_spec_the_head_is_not_loaded_and_a_checkpoint_without_one_is_refused(mtp_checkpoint):
    path, _, _ = mtp_checkpoint
    eng = LLM(path, **KW).engine
    assert eng.cfg.nextn_layers == 0 and not any(k.startswith(f"blk.{eng.cfg.n_layers}.") for k in eng.model.w)


@pytest.mark.parametrize("n_max", [1, 3])
def test_greedy_with_the_head_equals_greedy_without(mtp_checkpoint, n_max):
    path, _, _ = mtp_checkpoint
    prompt = ids(9, seed=3)
    plain = LLM(path, **KW).generate(prompt, SamplingParams(max_tokens=14)).token_ids
    llm = LLM(path, spec_type="draft-mtp", spec_draft_n_max=n_max, **KW)
    out = llm.generate(prompt, SamplingParams(max_tokens=14))
    assert out.token_ids == plain
    assert out.timings["spec"]["drafted"] > 0


def test_rejection_at_every_position_rolls_back(mtp_checkpoint):
    """The oracle right for the first j drafts of each step and wrong after: j accepted a step, every j from 0
    (P = 0: none) to N (P = 1: all), and the tokens those of plain decoding."""
    path, _, _ = mtp_checkpoint
    prompt, n = ids(7, seed=5), 16
    plain = LLM(path, **KW).generate(prompt, SamplingParams(max_tokens=n)).token_ids
    eng = LLM(path, spec_type="draft-mtp", spec_draft_n_max=3, **KW).engine
    for right in range(4):
        truth = Oracle(len(prompt), plain, 1.0, VOCAB)
        wrong = Oracle(len(prompt), plain, 0.0, VOCAB)
        oracle = lambda pos, k: truth(pos, right)[:min(right, k)] + wrong(pos + right, max(0, k - right))
        tokens, counts = greedy_tokens(eng, prompt, n, 3, oracle)
        assert tokens == plain
        assert all(a == min(right, d) for a, d in zip(counts.accepted, counts.drafted))
    for p, rate in ((1.0, 1.0), (0.0, 0.0)):
        tokens, counts = greedy_tokens(eng, prompt, n, 2, Oracle(len(prompt), plain, p, VOCAB), measure=True)
        assert tokens == plain and counts.acceptance == rate
        assert len(counts.experts) == len(counts.drafted) and all(e >= 2 for e in counts.experts)


def test_the_deltanet_state_after_a_rollback_is_the_accepted_positions(mtp_checkpoint):
    """A verify step of 4 tokens keeps each token's state; rolled back to after token j, every DeltaNet layer's
    conv window and recurrent state are those of the prompt and tokens[:j + 1] run the plain way (sequence 1),
    within float32 rounding (the verify runs the recurrent rule, a prompt the chunked one)."""
    path, _, _ = mtp_checkpoint
    eng = LLM(path, spec_type="draft-mtp", n_seq=2, **KW).engine
    prompt, verify = ids(6, seed=2), ids(4, seed=9)
    for j in range(4):
        eng.prefill(0, prompt)
        eng.forward([Segment(0, len(prompt), 4)], verify, all_logits=True, is_prompt=True, keep_states=True)
        eng.kv.rollback(0, len(prompt) + j + 1)
        eng.prefill(1, prompt + verify[:j + 1])
        assert eng.kv.length[0] == eng.kv.length[1] == len(prompt) + j + 1
        for i in eng.kv.conv:
            torch.testing.assert_close(eng.kv.conv[i][0], eng.kv.conv[i][1], atol=1e-5, rtol=0)
            torch.testing.assert_close(eng.kv.ssm[i][0], eng.kv.ssm[i][1], atol=1e-5, rtol=0)
        # and the next token after it, as the plain way's
        a = eng.forward([Segment(0, len(prompt) + j + 1, 1)], [3])
        b = eng.forward([Segment(1, len(prompt) + j + 1, 1)], [3])
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_other_spec_types_are_refused_in_one_line(mtp_checkpoint):
    with pytest.raises(UserError, match="--spec-type 'eagle3' is not run"):
        LLM(mtp_checkpoint[0], spec_type="eagle3", **KW)


def test_a_gguf_holds_the_head_as_llama_cpp_writes_it(mtp_checkpoint, tmp_path):
    """The head as blk.{n_layers} with nextn.* tensors, block_count n_layers + 1 and nextn_predict_layers 1 (llama.cpp's
    converter's layout); read back, the same head as from HF: bit for bit (float32) from qwen3next, within 1e-5 from
    qwen35moe (its DeltaNet value heads are tiled in the file: the trunk's sums run in another order)."""
    from moestream.loading.gguf import read_gguf
    from moestream.loading.gguf_write import write_gguf
    from moestream.loading.source import open_source
    path, _, _ = mtp_checkpoint
    src = open_source(path)
    write_gguf(src, tmp_path / "m.gguf")
    reader = read_gguf(tmp_path / "m.gguf")
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    n = src.config.n_layers
    assert reader.fields[f"{arch}.block_count"].contents() == n + 1
    assert reader.fields[f"{arch}.nextn_predict_layers"].contents() == 1
    names = {t.name for t in reader.tensors}
    assert {f"blk.{n}.nextn.{t}.weight" for t in ("eh_proj", "enorm", "hnorm", "shared_head_norm")} <= names
    assert {f"blk.{n}.ffn_gate_exps.weight", f"blk.{n}.post_attention_norm.weight"} <= names
    tokens = ids(10, seed=4)
    outs = []
    for model in (path, str(tmp_path / "m.gguf")):
        eng = LLM(model, spec_type="draft-mtp", **KW).engine
        assert eng.cfg.nextn_layers == 1
        eng.prefill(0, tokens, hidden=(hidden := []))
        outs.append(eng.head_step(0, 0, tokens[1:] + [5], torch.cat(hidden)))
    for a, b in zip(*outs):
        if "qwen3_next" in path:
            assert torch.equal(a, b)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_sampling_with_drafts_runs_and_a_seed_replays(mtp_checkpoint):
    llm = LLM(mtp_checkpoint[0], spec_type="draft-mtp", **KW)
    params = SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=3)
    a, b = llm.generate(ids(5), params), llm.generate(ids(5), params)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12 and all(0 <= t < VOCAB for t in a.token_ids)
    assert a.timings["spec"]["drafted"] > 0


def test_a_verify_step_is_bit_identical_whatever_the_placement_and_cache(mtp_checkpoint):
    path, _, _ = mtp_checkpoint
    prompt, verify = ids(8, seed=6), ids(3, seed=7)
    outs = []
    for kw in ({}, dict(cpu_moe=True), dict(cpu_moe=True, moe_cache_mib=0), dict(n_cpu_moe=1)):
        eng = LLM(path, spec_type="draft-mtp", **kw, **KW).engine
        eng.prefill(0, prompt, hidden=(hidden := []))
        logits = eng.forward([Segment(0, len(prompt), 3)], verify, all_logits=True, is_prompt=True,
                             keep_states=True)
        outs.append((logits, eng.head_step(0, 0, prompt[1:] + verify[:1], torch.cat(hidden))[1]))
    for logits, head in outs[1:]:
        assert torch.equal(logits, outs[0][0]) and torch.equal(head, outs[0][1])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_greedy_with_drafts_is_the_same_on_every_placement(mtp_checkpoint, device):
    """The head's drafts and the oracle's (P = 0.6), on every placement, the same tokens and acceptances; and the
    tokens of plain decoding (on CUDA: bfloat16, decode steps in graphs with the zero-copy kernel, verify steps on
    the prompt path: their bits differ, the tokens must not)."""
    path, _, _ = mtp_checkpoint
    kw = dict(device=device, ctx_size=96, **({"dtype": "bfloat16"} if device == "cuda" else {}))
    prompt, n = ids(7, seed=8), 20
    plain = LLM(path, **kw).generate(prompt, SamplingParams(max_tokens=n)).token_ids
    seen = set()
    for place in ({}, dict(cpu_moe=True), dict(cpu_moe=True, moe_cache_mib=0), dict(n_cpu_moe=2)):
        eng = LLM(path, spec_type="draft-mtp", **place, **kw).engine
        for oracle in (None, Oracle(len(prompt), plain, 0.6, VOCAB, seed=1)):
            tokens, counts = greedy_tokens(eng, prompt, n, 2, oracle)
            assert tokens == plain
            seen.add((oracle is None, tuple(counts.accepted)))
    assert len(seen) == 2                   # one acceptance record for the head's, one for the oracle's


def test_not_given_the_engine_drafts_two_but_none_where_each_drafts_experts_cross_the_link(mtp_checkpoint,
                                                                                          monkeypatch):
    """--spec-draft-n-max not given: two drafts a step, none on CUDA with host experts and no cache (runtime/plan.py's
    draft_n_max; the rule is stood in for CUDA on this CPU engine), again after reconfigure_cache; a given figure
    always wins. Where the engine's choice is none, generate decodes without drafts (the same greedy tokens) and a
    request speculates only where it names its own n-max."""
    from moestream.engine_config import SpecConfig
    from moestream.runtime import engine_heads, plan
    from moestream.runtime.requests import Request, speculates
    auto = SpecConfig(type="draft-mtp")
    assert auto.draft_n_max is None and auto.most == 2 and auto.drafts
    assert plan.draft_n_max(auto, True, True, 0) == plan.draft_n_max(auto, True, True, (0, 0)) == 0
    for cuda, host, mib in ((True, True, 4000), (True, True, (0, 512)), (True, False, 0), (False, True, 0)):
        assert plan.draft_n_max(auto, cuda, host, mib) == 2
    assert plan.draft_n_max(SpecConfig(type="draft-mtp", draft_n_max=3), True, True, 0) == 3
    path, _, _ = mtp_checkpoint
    prompt, params = ids(9, seed=3), SamplingParams(max_tokens=10)
    plain = LLM(path, **KW).generate(prompt, params).token_ids
    llm = LLM(path, spec_type="draft-mtp", cpu_moe=True, moe_cache_mib=0, **KW)
    eng = llm.engine
    assert eng.draft_n_max == 2                     # on the CPU the experts lie in the memory steps read
    monkeypatch.setattr(engine_heads, "draft_n_max", lambda spec, cuda, host, mib: plan.draft_n_max(spec, True, host,
                                                                                                     mib))
    assert eng.draft_n_max == 0
    out = llm.generate(prompt, params)
    assert out.token_ids == plain and "spec" not in out.timings
    assert not speculates(eng, Request(prompt, params, None))
    assert speculates(eng, Request(prompt, params, None, draft_n_max=1))
    eng.reconfigure_cache(moe_cache_mib=16)
    assert eng.draft_n_max == 2
    out = llm.generate(prompt, params)
    assert out.token_ids == plain and out.timings["spec"]["drafted"] > 0
    given = LLM(path, spec_type="draft-mtp", spec_draft_n_max=1, cpu_moe=True, moe_cache_mib=0, **KW).engine
    assert given.draft_n_max == 1


def test_the_serving_loop_verifies_speculating_and_plain_requests_in_one_step(mtp_checkpoint):
    """Two streams, one speculating and one not ("speculative": false), the first step's prompt read in the same
    batch: each stream's greedy tokens are those it gets alone without drafts; steps with drafts run one forward
    for both (the plain stream's token is a segment of one beside the other's drafts)."""
    from moestream.runtime.requests import Request
    from moestream.runtime.serving import ServingLoop
    path, _, _ = mtp_checkpoint
    prompts, params = [ids(7, seed=11), ids(9, seed=12)], SamplingParams(max_tokens=12)
    plain = [LLM(path, **KW).generate(p, params).token_ids for p in prompts]
    eng = LLM(path, spec_type="draft-mtp", spec_draft_n_max=2, n_seq=2, **KW).engine
    loop = ServingLoop(eng, None, n_slots=2, warm_up=False)
    done = {}
    reqs = [Request(p, params, lambda e: done.__setitem__(e[1], e[2]) if e[0] == "done" else None, index=i,
                    speculative=i == 0) for i, p in enumerate(prompts)]
    forwards = []
    eng_forward = eng.forward
    eng.forward = lambda segs, *a, **k: (forwards.append([s.n for s in segs]), eng_forward(segs, *a, **k))[1]
    loop.submit(reqs)
    while loop.busy:
        loop.step()
    assert [done[i].token_ids for i in range(2)] == plain
    assert any(len(f) == 2 and f[0] == 3 and f[1] == 1 for f in forwards)      # drafts beside a plain token
    assert loop.slots[0].run is None and reqs[1].speculative is False
    from moestream.server.schemas import CompletionRequest         # the server's request field for it
    assert CompletionRequest.model_validate({"prompt": "x", "speculative": False}).speculative is False
