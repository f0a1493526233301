"""The MTP head's steps of several streams together (runtime/speculate.py's draft_together, Engine.head_steps): draft
position j of every speculating sequence in one head forward, the first one re-reading each sequence's accepted
positions, segments of different lengths in one batch. float32 on the CPU, synth models with a head (a hybrid
trunk with gated attention, and latent attention with the sigmoid router).

Bounds, and what was measured: a sequence's head logits and outputs beside others within 1e-5 of its own alone
(ATOL; measured: up to 3.5e-6, the GEMMs of several rows rounding otherwise than of one), its drafts equal; the
tokens of every stream equal greedy decoding without drafts.
"""
from __future__ import annotations

import pytest
import torch

from moestream import LLM, SamplingParams
from moestream.runtime.requests import Request
from moestream.runtime.serving import ServingLoop
from moestream.runtime.speculate import GREEDY, MTPDecode, draft_together, greedy_tokens
from moestream.tools.spec_oracle import Oracle

ATOL = 1e-5
KW = dict(device="cpu", ctx_size=64)
PROMPTS = [[5, 9, 13, 2, 7, 11, 3, 8, 1], [4, 6, 12], [10, 2, 9, 14, 5, 3]]


@pytest.fixture(scope="module", params=["tiny-next", "tiny-glm"])
def preset(request):
    return request.param


def _prefilled(eng, seq: int, prompt: list[int]) -> tuple[MTPDecode, int]:
    """A sequence's MTPDecode after its prompt, and its first token."""
    spec = MTPDecode(eng, seq, n_max=3)
    eng.begin_prompt(seq)
    return spec, int(spec.prefill(prompt)[-1].argmax())


def test_head_steps_of_several_sequences_equal_each_alone(preset):
    """Reads of 9, 3 and 1 tokens (whole prompts again after prefill, and a chained draft's one token), with -ub 4:
    the 9-token read runs in three forwards, the last round holding every read's last ubatch in forwards of at most
    4 tokens; each read's logits and outputs are those of its head step alone, and the verify step's seed guesses
    are each sequence's."""
    eng = LLM(f"synth:{preset}:mtp=1", spec_type="draft-mtp", cpu_moe=True, moe_cache_mib=1, ubatch_size=4,
              n_seq=3, **KW).engine
    reads = []
    for seq, prompt in enumerate(PROMPTS[:2]):
        spec, token = _prefilled(eng, seq, prompt)
        reads.append(spec.first_read(token))
    _, out = eng.head_step(*reads[1])
    reads.append((1, len(PROMPTS[1]), [7], out[-1:]))              # a chained draft of sequence 1 ...
    reads[1] = (2, *reads[1][1:])                                  # ... and sequence 1's first read as sequence 2's
    eng.draft_guesses.clear()
    alone = []
    for read in reads:
        alone.append(eng.head_step(*read))
    guesses_alone, eng.draft_guesses = eng.draft_guesses, []
    forwards = []
    model_forward = eng.model.forward
    eng.model.forward = lambda batch, *a: (forwards.append([s.n for s in batch.segments]), model_forward(batch, *a))[1]
    logits, outs = eng.head_steps(reads)
    assert forwards == [[4], [4], [1, 3], [1]]                     # -ub 4: 9 tokens in three, aligned to the end
    assert logits.shape[0] == 3 and [len(o) for o in outs] == [9, 3, 1]
    for (a_logits, a_out), row, out in zip(alone, logits, outs):
        torch.testing.assert_close(row, a_logits[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(out, a_out, atol=ATOL, rtol=0)
        assert int(row.argmax()) == int(a_logits[0].argmax())
    k, seed = eng.cfg.n_experts_used, eng.seed_layers
    assert seed and len(eng.draft_guesses) == 2                    # the last round's two forwards
    together = torch.cat(eng.draft_guesses, 1)
    assert together.shape == (len(seed), 3 * k)
    together = together.view(len(seed), 3, k)
    for i, g in enumerate(guesses_alone):                          # the union: each sequence's own guesses
        assert torch.equal(together[:, i], g)


def test_drafts_together_equal_drafts_alone_at_every_acceptance(preset):
    """Three sequences after one step whose oracle drafts were accepted 3, 1 and 0 times (first reads of 4, 2 and
    1 positions), greedy and sampling, n_max 3, 2 and 1: each sequence's drafts (and q) are those it gets alone, one
    head forward a draft position, and a sequence leaves once its drafts are done."""
    eng = LLM(f"synth:{preset}:mtp=1", spec_type="draft-mtp", n_seq=3, **KW).engine
    specs, tokens = [], []
    for seq, (prompt, right) in enumerate(zip(PROMPTS, (3, 1, 0))):
        plain, _ = greedy_tokens(eng, prompt, 6, 0, seq=seq)
        spec, token = _prefilled(eng, seq, prompt)
        spec.oracle = lambda pos, n, c=plain, s=len(prompt), r=right: [                # right for `right` drafts
            c[pos - s] if j < r else (c[pos - s] + 1) % 1024 for j, pos in enumerate(range(pos, pos + n))]
        new = spec.step(token, GREEDY)
        assert spec.counts.accepted == [right] and new == plain[1:right + 2]
        spec.oracle, spec.n_max = None, 3 - seq
        specs.append(spec)
        tokens.append(new[-1])
    assert [len(s.pending) + 1 for s in specs] == [4, 2, 1]
    for params in (GREEDY, SamplingParams(temperature=0.9, top_k=40)):
        gens = lambda: [torch.Generator().manual_seed(seq) for seq in range(3)]  # noqa: E731
        alone = [spec.draft(t, params, g) for spec, t, g in zip(specs, tokens, gens())]
        forwards = []
        head_steps = eng.head_steps
        eng.head_steps = lambda reads: (forwards.append(len(reads)), head_steps(reads))[1]
        together = draft_together(eng, [(s, t, params, g) for s, t, g in zip(specs, tokens, gens())])
        del eng.head_steps
        assert forwards == [3, 2, 1]                               # n_max 3, 2, 1: 3 head forwards, not 6
        for (d, q), (d_alone, q_alone) in zip(together, alone):
            assert d == d_alone and len(d) in (1, 2, 3)
            if params.greedy:
                assert q is None and q_alone is None
            else:
                torch.testing.assert_close(q, q_alone, atol=ATOL, rtol=0)


def _serve(eng, prompts, params, speculative=(True, True, True), n_max=None):
    """Each request's tokens through a serving loop, the drafts each slot committed, and per loop turn the head
    forwards' segment counts."""
    loop = ServingLoop(eng, None, n_slots=len(prompts), warm_up=False)
    done, drafts, turns = {}, {i: [] for i in range(len(prompts))}, []
    reqs = [Request(p, params, lambda e: done.__setitem__(e[1], e[2]) if e[0] == "done" else None, index=i,
                    speculative=speculative[i]) for i, p in enumerate(prompts)]
    model_forward = eng.model.forward
    eng.model.forward = lambda batch, *a: (turns[-1].append(len(batch.segments)) if batch.head is not None else None,
                                           model_forward(batch, *a))[1]
    loop.submit(reqs)
    loop.admit()
    for s in loop.slots:
        if s.run.spec is not None:
            s.run.spec.n_max = n_max[s.id] if n_max else s.run.spec.n_max
            commit = s.run.spec.commit
            s.run.spec.commit = lambda *a, c=commit, i=s.id: (drafts[i].append(list(a[2])), c(*a))[1]
    while loop.busy:
        turns.append([])
        loop.step()
    del eng.model.forward
    return [done[i].token_ids for i in range(len(prompts))], drafts, turns


def test_the_serving_loop_drafts_every_speculating_slot_in_one_head_forward_a_position(preset):
    """Three speculating streams, n_max 2, host experts behind a cache: a turn with drafts runs 2 head forwards of
    every slot (not 6), the verify step's draft seed is the union of every slot's guesses, each slot's drafts are
    those it drafts alone (MTPDecode, one sequence), and its tokens those of greedy decoding without drafts."""
    params, n = SamplingParams(max_tokens=10, ignore_eos=True), 10
    plain = [LLM(f"synth:{preset}", **KW).generate(p, params).token_ids for p in PROMPTS]
    eng = LLM(f"synth:{preset}:mtp=1", spec_type="draft-mtp", spec_draft_n_max=2, n_seq=3, cpu_moe=True,
              moe_cache_mib=1, **KW).engine
    alone = []
    for seq, prompt in enumerate(PROMPTS):
        spec = MTPDecode(eng, seq, 2)
        seen, commit = [], spec.commit
        spec.commit = lambda *a, c=commit, s=seen: (s.append(list(a[2])), c(*a))[1]
        out = [int(spec.prefill(prompt)[-1].argmax())]
        while len(out) < n:
            out += spec.step(out[-1], GREEDY)
        assert out[:n] == plain[seq]
        alone.append(seen)
    seeds, seed_next = [], eng.host.seed_next
    eng.host.seed_next = lambda counts: (seeds.append(counts), seed_next(counts))[1]
    tokens, drafts, turns = _serve(eng, PROMPTS, params)
    assert tokens == plain
    k, first = eng.cfg.n_experts_used, eng.seed_layers
    assert first and len(seeds) == len([t for t in turns if t])
    assert all(c[list(first)].sum() == len(first) * 2 * 3 * k for c in seeds)     # 2 positions x 3 slots x k
    for seq in range(3):                    # the same drafts, step for step (the loop stops at max_tokens)
        assert drafts[seq] == alone[seq][:len(drafts[seq])] and drafts[seq]
    drafting = [t for t in turns if t]
    assert drafting and all(len(t) == 2 for t in drafting)        # N head forwards a turn, never B x N
    assert [3, 3] in drafting


def test_slots_with_other_n_max_or_no_speculation_drop_out(preset):
    """n_max 3 and 1 and a request with "speculative": false: head forwards of 2 slots, then 1, then 1; every
    stream's tokens those of greedy decoding without drafts."""
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    plain = [LLM(f"synth:{preset}", **KW).generate(p, params).token_ids for p in PROMPTS]
    eng = LLM(f"synth:{preset}:mtp=1", spec_type="draft-mtp", n_seq=3, **KW).engine
    tokens, drafts, turns = _serve(eng, PROMPTS, params, speculative=(True, True, False), n_max=[3, 1, 0])
    assert tokens == plain and not drafts[2]
    assert {len(d) for d in drafts[0]} == {3} and {len(d) for d in drafts[1]} == {1}
    drafting = [t for t in turns if t]
    assert drafting and all(t == [2, 1, 1] for t in drafting)
