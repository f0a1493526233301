"""The MTP heads of DeepSeek-V3 and GLM-4.5 (models/mtp.py: HF's model.layers.{n_layers}.*, GGUF's blk.{n}.nextn.*)
read and run by speculative decoding, float32 on the CPU.

transformers does not model these heads (it ignores model.layers.{n} at load), so the test writes the head's
tensors beside a checkpoint transformers saved: eh_proj, enorm, hnorm, shared_head.norm, shared_head.head and
embed_tokens, and one decoder layer of transformers' own class at index n_layers (latent attention or GQA, the
sigmoid router, routed and shared experts). The reference is that layer and those tensors in plain torch, as vLLM's
deepseek_mtp and llama.cpp's graph_mtp define the head (but vLLM's zeroed embedding at position 0, which llama.cpp
does not do). DeepSeek-V3's head here ships copies of the trunk's embedding and lm_head (as the published
checkpoints do: the engine keeps them once); GLM-4.5's its own.

Bounds, and what was measured (these seeds): the head's output and logits against the reference within 1e-4
(ATOL); greedy tokens with drafts equal those without, token for token (in bfloat16 on a GPU, up to a near-tie:
the CUDA test); the head's output from a GGUF of the same
weights bit for bit the HF one's, its logits within 1e-5 (measured 1e-6: the CPU GEMV's bits follow the lm_head's
alignment in memory, which the file's layout sets).
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from moestream import LLM, SamplingParams, UserError
from moestream.loading.source import open_source
from moestream.runtime.speculate import greedy_tokens
from moestream.tools.spec_oracle import Oracle

from conftest import VOCAB, greedy_steps, write_checkpoint

ATOL = 1e-4
NEAR_TIE = 0.125          # 4 of bfloat16's steps between logits of 4 and 8: within a verify row's noise
KW = dict(device="cpu", ctx_size=64)


def ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_head(model, own_io: bool):
    """A random head as the checkpoints hold it: transformers' decoder layer at index n_layers and the head's own
    tensors (own_io: an embedding and output head of its own, else copies of the trunk's)."""
    inner, cfg = model.model, model.config
    H, n = cfg.hidden_size, cfg.num_hidden_layers
    norm = type(inner.norm)
    head = torch.nn.ModuleDict(dict(block=type(inner.layers[-1])(cfg, n), eh_proj=torch.nn.Linear(2 * H, H, bias=False),
                                    enorm=norm(H, eps=cfg.rms_norm_eps), hnorm=norm(H, eps=cfg.rms_norm_eps),
                                    shared_norm=norm(H, eps=cfg.rms_norm_eps),
                                    embed=torch.nn.Embedding(cfg.vocab_size, H),
                                    lm=torch.nn.Linear(H, cfg.vocab_size, bias=False))).eval()
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
        for name, b in head.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
        if not own_io:
            head["embed"].weight.copy_(inner.embed_tokens.weight)
            head["lm"].weight.copy_(model.lm_head.weight)
    return head


def hf_head_tensors(head, n: int) -> dict[str, torch.Tensor]:
    """The head as model.layers.{n}.* (the block in the layout transformers saves the trunk's layers in)."""
    p = f"model.layers.{n}."
    own = {"eh_proj.weight": head["eh_proj"].weight, "enorm.weight": head["enorm"].weight,
           "hnorm.weight": head["hnorm"].weight, "shared_head.norm.weight": head["shared_norm"].weight,
           "shared_head.head.weight": head["lm"].weight, "embed_tokens.weight": head["embed"].weight}
    block = {**dict(head["block"].named_parameters()), **dict(head["block"].named_buffers())}
    return {p + k: v.detach().contiguous() for k, v in {**own, **block}.items()}


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe"])
def head_checkpoint(request, tmp_path_factory):
    """(family, path, transformers model, head) of a checkpoint transformers wrote, with its MTP head added."""
    family = request.param
    path = tmp_path_factory.mktemp(f"mtp_{family}")
    model = write_checkpoint(family, str(path))
    torch.manual_seed(1)
    head = make_head(model, own_io=family == "glm4_moe")
    tensors = load_file(str(path / "model.safetensors"))
    tensors.update(hf_head_tensors(head, model.config.num_hidden_layers))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    return family, str(path), model, head


@torch.no_grad()
def reference_head(model, head, tokens: list[int], following: list[int]):
    """(the head's post-norm output (T, H), its logits (T, V)) over `tokens`, reading following[i] beside the
    trunk's post-norm hidden state i: llama.cpp's graph_mtp in plain torch of transformers' blocks."""
    inner = model.model
    h = inner(input_ids=torch.tensor([tokens])).last_hidden_state              # (1, T, H), after model.norm
    e = head["embed"](torch.tensor([following]))
    y = head["eh_proj"](torch.cat([head["enorm"](e), head["hnorm"](h)], dim=-1))
    T = len(tokens)
    pos = torch.arange(T)[None]
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    out = head["block"](y, position_embeddings=inner.rotary_emb(y, pos), attention_mask=mask, position_ids=pos)
    g = head["shared_norm"](out[0] if isinstance(out, tuple) else out)
    return g[0], head["lm"](g)[0]


def test_the_head_is_read_and_computes_the_reference(head_checkpoint):
    family, path, model, head = head_checkpoint
    eng = LLM(path, spec_type="draft-mtp", **KW).engine
    cfg = eng.cfg
    n = cfg.n_layers
    assert cfg.nextn_layers == 1 and cfg.head_layers == [n] and len(eng.kv.k) == n + 1
    own = {k for k in eng.model.layers[n] if k in ("nextn.embed_tokens.weight", "nextn.shared_head_head.weight")}
    assert own == (set() if family == "deepseek_v3" else {"nextn.embed_tokens.weight",
                                                         "nextn.shared_head_head.weight"})  # copies kept once
    tokens = ids(12)
    following = tokens[1:] + [7]
    g_ref, logits_ref = reference_head(model, head, tokens, following)
    eng.prefill(0, tokens, hidden=(hidden := []))
    logits, out = eng.head_step(0, 0, following, torch.cat(hidden))
    torch.testing.assert_close(out, g_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[-1], logits_ref[-1], atol=ATOL, rtol=0)
    # the head's experts are layer n_layers of the host store, beside the trunk's, with the same bits
    host = LLM(path, spec_type="draft-mtp", cpu_moe=True, moe_cache_mib=1, **KW).engine
    assert n in host.host.store.rows
    host.prefill(0, tokens, hidden=(hid := []))
    assert torch.equal(host.head_step(0, 0, following, torch.cat(hid))[1], out)


@pytest.mark.parametrize("n_max", [1, 3])
def test_greedy_with_the_head_equals_greedy_without(head_checkpoint, n_max):
    _, path, _, _ = head_checkpoint
    prompt = ids(9, seed=3)
    plain = LLM(path, **KW).generate(prompt, SamplingParams(max_tokens=12)).token_ids
    for place in ({}, dict(cpu_moe=True, moe_cache_mib=1)):
        out = LLM(path, spec_type="draft-mtp", spec_draft_n_max=n_max, **place, **KW).generate(
            prompt, SamplingParams(max_tokens=12))
        assert out.token_ids == plain and out.timings["spec"]["drafted"] > 0


def test_a_latent_verify_step_runs_the_decode_steps_form(monkeypatch):
    """DeepSeek's verify steps (a few tokens continuing the sequence) take MLA's absorbed form, as its decode steps
    do, never expanding the cache again: only the prompt's segments expand it."""
    from moestream.models.mla import MLA
    forms = []
    for name in ("_expanded", "_absorbed"):
        def spy(self, *a, _f=getattr(MLA, name), _name=name, **kw):
            forms.append((_name, a[5]))                                  # (the form, its batch)
            return _f(self, *a, **kw)
        monkeypatch.setattr(MLA, name, spy)
    model, prompt = "synth:tiny-deepseek:mtp=1", ids(9, seed=3)
    plain = LLM(model, **KW).generate(prompt, SamplingParams(max_tokens=8)).token_ids
    forms.clear()
    out = LLM(model, spec_type="draft-mtp", spec_draft_n_max=2, **KW).generate(prompt, SamplingParams(max_tokens=8))
    assert out.token_ids == plain and out.timings["spec"]["drafted"] > 0
    assert all(b.segments[0].start == 0 for name, b in forms if name == "_expanded")
    assert any(name == "_absorbed" and b.segments[0].n == 3 for name, b in forms)     # a verify step of 2 drafts


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_greedy_with_the_head_on_cuda(head_checkpoint):
    """bfloat16 on the GPU, every placement (decode steps in graphs over the latent cache's kernels, verify and head
    steps eager on the prompt path, the draft seed on the copy stream): one list of tokens whatever the placement
    (the numerics contract), and plain decoding's up to a near-tie. A verify step computes its rows as a prompt
    does and a decode step as one token, so where plain decoding's top two logits lie within bfloat16's noise the
    two may break the tie differently and go on with different texts (on an H100, the deepseek_v3 checkpoint's
    fifth token: 108 and 45, 4.525 and 4.477 in float32). With no cache the engine drafts nothing unless asked."""
    _, path, _, _ = head_checkpoint
    kw = dict(device="cuda", dtype="bfloat16", ctx_size=64)
    prompt, params = ids(9, seed=3), SamplingParams(max_tokens=16)
    plain = LLM(path, **kw).generate(prompt, params).token_ids
    steps = greedy_steps(LLM(path, **kw).engine, prompt, len(plain) - 1)       # plain decoding's logits, step by step
    assert [int(s.argmax()) for s in steps] == plain[1:]
    unasked = LLM(path, spec_type="draft-mtp", cpu_moe=True, moe_cache_mib=0, **kw)
    out = unasked.generate(prompt, params)
    assert unasked.engine.draft_n_max == 0 and "spec" not in out.timings and out.token_ids == plain
    runs = []
    for place in ({}, dict(cpu_moe=True), dict(cpu_moe=True, moe_cache_mib=0, spec_draft_n_max=2), dict(n_cpu_moe=1)):
        out = LLM(path, spec_type="draft-mtp", **place, **kw).generate(prompt, params)
        assert out.timings["spec"]["drafted"] > 0
        runs.append(out.token_ids)
    assert all(run == runs[0] for run in runs)
    first = next((i for i, (a, b) in enumerate(zip(plain, runs[0])) if a != b), None)
    if first is not None:                       # (the prompt's logits are the same rows in both: never at 0)
        row = steps[first - 1].float()
        assert first > 0 and row[plain[first]] - row[runs[0][first]] <= NEAR_TIE, (first, row.topk(3))


def test_rejected_drafts_roll_back_the_latent_and_gqa_caches(head_checkpoint):
    """An oracle's drafts all right (P = 1) and all wrong (P = 0), 3 a step: the tokens of plain decoding."""
    _, path, _, _ = head_checkpoint
    prompt, n = ids(7, seed=5), 12
    plain = LLM(path, **KW).generate(prompt, SamplingParams(max_tokens=n)).token_ids
    eng = LLM(path, spec_type="draft-mtp", **KW).engine
    for p, rate in ((1.0, 1.0), (0.0, 0.0)):
        tokens, counts = greedy_tokens(eng, prompt, n, 3, Oracle(len(prompt), plain, p, VOCAB))
        assert tokens == plain and counts.acceptance == rate


def test_a_gguf_of_the_same_weights_gives_the_same_head(head_checkpoint, tmp_path):
    """The head as llama.cpp's converter lays it out: blk.{n} with nextn.* (the own embedding and output head too,
    where they are the head's own), block_count n + 1, nextn_predict_layers 1; its drafts bit for bit the HF
    checkpoint's."""
    from moestream.loading.gguf import read_gguf
    from moestream.loading.gguf_write import write_gguf
    family, path, _, _ = head_checkpoint
    src = open_source(path)
    write_gguf(src, tmp_path / "m.gguf", dtype="float32")
    reader = read_gguf(tmp_path / "m.gguf")
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    n = src.config.n_layers
    assert reader.fields[f"{arch}.block_count"].contents() == n + 1
    assert reader.fields[f"{arch}.nextn_predict_layers"].contents() == 1
    names = {t.name for t in reader.tensors}
    own = {f"blk.{n}.nextn.{t}.weight" for t in ("embed_tokens", "shared_head_head")}
    assert {f"blk.{n}.nextn.{t}.weight" for t in ("eh_proj", "enorm", "hnorm", "shared_head_norm")} <= names
    assert own <= names and f"blk.{n}.ffn_gate_exps.weight" in names and f"blk.{n}.exp_probs_b.bias" in names
    tokens, outs = ids(10, seed=4), []
    for model in (path, str(tmp_path / "m.gguf")):
        eng = LLM(model, spec_type="draft-mtp", **KW).engine
        assert eng.cfg.nextn_layers == 1
        eng.prefill(0, tokens, hidden=(hidden := []))
        outs.append(eng.head_step(0, 0, tokens[1:] + [5], torch.cat(hidden)))
    (logits_hf, out_hf), (logits_gguf, out_gguf) = outs
    assert torch.equal(out_hf, out_gguf)
    # the same lm_head values: but the CPU's GEMV gives other last bits for a tensor at another alignment (the
    # safetensors file maps it at offset 24 mod 64 here, the GGUF at 32)
    torch.testing.assert_close(logits_hf, logits_gguf, atol=1e-5, rtol=0)


def test_a_checkpoint_without_its_head_is_refused_in_one_line(head_checkpoint, tmp_path):
    """config.json announcing a head whose tensors are not there (transformers' own saves): no head, and
    --spec-type draft-mtp says where the head would be."""
    family, _, model, _ = head_checkpoint
    model.save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert open_source(str(tmp_path)).config.nextn_layers == 0
    with pytest.raises(UserError, match=r"ships no MTP head \(HF: model\.layers\.\{n\}\.eh_proj"):
        LLM(str(tmp_path), spec_type="draft-mtp", **KW)


def test_a_family_without_a_read_head_is_refused_in_one_line():
    with pytest.raises(UserError, match="reads no MTP head of a gpt-oss model"):
        LLM("synth:tiny-gptoss", spec_type="draft-mtp", **KW)


def test_the_verify_step_copies_ahead_the_experts_its_drafts_guess(head_checkpoint):
    """Host experts behind a cache: each head step's last token's MoE input goes through the routers of the first
    two host MoE layers (the head's MoE sits in the trunk's embedding space), and the verify step after the drafts
    begins with those experts of its first layer resident (copied ahead: the prefetch's "draft" seed) and the next
    layer's queued as fill. The tokens, and every verify step's logits, are those of the same engine without
    prefetch (bit for bit)."""
    _, path, _, _ = head_checkpoint
    prompt, n = ids(8, seed=6), 10
    runs = []
    for prefetch in (True, False):
        eng = LLM(path, spec_type="draft-mtp", cpu_moe=True, moe_cache_mib=1, prefetch=prefetch, **KW).engine
        first = eng.seed_layers
        assert first == (tuple(eng.cfg.moe_layers[:2]) if prefetch else ())
        cache, verify_logits, seeds, copied = eng.host.prompt, [], [], []
        begin, forward, prefetch_ahead = cache.begin_ubatch, eng.forward, cache._prefetch
        cache._prefetch = lambda layer, experts, *a: (copied.append((layer, list(experts))),
                                                      prefetch_ahead(layer, experts, *a))[1]

        def seeded_begin(*a, **k):
            hint = cache.hint
            copied.clear()
            begin(*a, **k)
            if hint is not None:        # the draft's guesses (2 head steps, k each a layer): the first layer's
                assert cache.seed.rule == "draft" and hint[list(first)].sum() == 2 * 2 * eng.cfg.n_experts_used
                assert not hint[[l for l in range(len(hint)) if l not in first]].any()
                guessed = hint[first[0]].nonzero()[0]           # copied ahead at once, and resident now
                assert copied[0][0] == first[0] and sorted(copied[0][1]) == sorted(guessed)
                assert (cache.residency.slot_of[first[0], guessed] >= 0).all()
                assert [l for l, _ in cache.fill] == [first[1]]
                assert sorted(cache.fill[0][1]) == sorted(hint[first[1]].nonzero()[0])
                seeds.append(hint)

        def recorded(segments, tokens, *a, **k):
            logits = forward(segments, tokens, *a, **k)
            if k.get("keep_states"):
                verify_logits.append(logits)
            return logits

        cache.begin_ubatch, eng.forward = seeded_begin, recorded
        tokens, counts = greedy_tokens(eng, prompt, n, 2)
        runs.append((tokens, verify_logits))
        assert counts.drafted and len(seeds) == (len(counts.drafted) if prefetch else 0)
    (tokens, logits), (plain_tokens, plain_logits) = runs
    assert tokens == plain_tokens and len(logits) == len(plain_logits)
    assert all(torch.equal(a, b) for a, b in zip(logits, plain_logits))


@pytest.mark.parametrize("preset", ["tiny-glm", "tiny-next"])
def test_a_synth_model_with_a_head(preset):
    """synth:NAME:mtp=1 draws a head after the trunk (the GPU benches' real shapes with a head): drafts run, greedy
    tokens are those without."""
    prompt, params = [5, 9, 13, 2, 7], SamplingParams(max_tokens=8)
    plain = LLM(f"synth:{preset}", **KW).generate(prompt, params).token_ids
    out = LLM(f"synth:{preset}:mtp=1", spec_type="draft-mtp", cpu_moe=True, **KW).generate(prompt, params)
    assert out.token_ids == plain and out.timings["spec"]["drafted"] > 0
