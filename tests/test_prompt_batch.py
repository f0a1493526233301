"""A prompt batch of several sequences (engine.prefill_parts, the server's): each ubatch gives the bits it gives
alone, at every placement and cache size; each sequence's prompt tail (the decode hot set's seed) is its own."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moestream import LLM
from moestream.errors import UserError

from conftest import CUDA

UB = 4
PLACES = {
    "all on the device": dict(),
    "host, no cache": dict(cpu_moe=True),
    "host, cache 0 (one layer)": dict(cpu_moe=True, moe_cache_mib=0),
    "host, cache 1 MiB (waves)": dict(cpu_moe=True, moe_cache_mib=1),
    "host, cache 32 MiB (all)": dict(cpu_moe=True, moe_cache_mib=32),
}
PROMPTS = {0: list(range(3, 10)), 1: [40, 41, 42, 43, 44], 2: list(range(60, 67))}    # 2 continues from 2 tokens


def make(model="synth:tiny", device="cpu", **kw) -> LLM:
    """On CUDA in bfloat16: zero-copy decode (the default there) needs 16-bit weights."""
    if device == "cuda":
        kw.setdefault("dtype", "bfloat16")
    return LLM(model, ubatch_size=UB, batch_size=64, ctx_size=64, n_seq=3, device=device, **kw)


def parts_of(prompts: dict[int, list[int]], starts: dict[int, int]) -> list[tuple[int, int, list[int]]]:
    """Each sequence's prompt from its start, cut into ubatches as the server cuts it, sequences one after another."""
    return [(q, s, p[s:s + UB]) for q, p in prompts.items() for s in range(starts[q], len(p), UB)]


@pytest.mark.parametrize("model", ["synth:tiny", "synth:tiny-next"])
@pytest.mark.parametrize("place", list(PLACES))
def test_prompt_batch_gives_each_ubatch_its_bits_alone(model, place):
    starts = {0: 0, 1: 0, 2: 2}
    batch, alone = make(model, **PLACES[place]), make(model, **PLACES[place])
    for eng in (batch.engine, alone.engine):
        eng.prefill(2, PROMPTS[2][:2], 0)            # sequence 2 holds its first two tokens already
    parts = parts_of(PROMPTS, starts)
    got = batch.engine.prefill_parts(parts)
    want = [alone.engine.prefill(q, t, s) for q, s, t in parts]
    assert len(got) == len(parts) == 6
    for (q, s, _), g, w in zip(parts, got, want):
        assert g.shape == (1, batch.model_config.vocab_size)
        assert torch.equal(g, w), (place, q, s)
    # what the batch left in each sequence's cache: the next token's logits are the same too
    for q, p in PROMPTS.items():
        assert torch.equal(batch.engine.prefill(q, [7], len(p)), alone.engine.prefill(q, [7], len(p)))


def test_prompt_batch_seeds_each_sequence_with_its_own_tail():
    """The hot set's seed (routing.prompts[seq].tail: the routing of a prompt's last tokens) is each sequence's
    own in a batch of several, as when each prompt runs alone; the batch's routing is recorded as each one's."""
    batch, alone = make(cpu_moe=True, moe_cache_mib=32), make(cpu_moe=True, moe_cache_mib=32)
    prompts = {0: list(range(3, 30)), 1: list(range(40, 49))}        # tails longer and shorter than prompt.TAIL
    batch.engine.prefill_parts(parts_of(prompts, {0: 0, 1: 0}))
    for q, p in prompts.items():
        alone.engine.prefill_parts(parts_of({q: p}, {q: 0}))
        got, want = batch.engine.routing.prompts[q].tail, alone.engine.routing.prompts[q].tail
        assert want.sum() > 0 and np.array_equal(got, want), q
    both = batch.engine.routing.prompts
    assert np.array_equal(both[0].current, both[1].current) and both[0].current.sum() > 0


PAUSING = {k: v for k, v in PLACES.items() if k != "host, no cache"}      # (there prompts cannot pause)
PAUSING["host, cache 32 MiB, zero-copy decode"] = dict(cpu_moe=True, moe_cache_mib=32, zero_copy_decode=True)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("model", ["synth:tiny", "synth:tiny-next"])
@pytest.mark.parametrize("place", list(PAUSING))
def test_a_prompt_batch_paused_for_decode_steps_gives_its_bits_and_routing_unpaused(model, place, device):
    """engine.prompt_steps (the server's --prefill-layers), paused after every layer for a decode step of another
    sequence: each part's logits, and each step's, are the bits they are with the batch run whole before the steps;
    each sequence's prompt routing (the prefetch seeds, the hot set's tail) is recorded as unpaused. (On CUDA the
    steps are zero-copy and captured, and the prompt's copies ahead may be in flight across them.)"""
    paused, whole = make(model, device, **PAUSING[place]), make(model, device, **PAUSING[place])
    assert paused.engine.pauses_prompts
    generating = list(range(20, 26))                     # sequence 2 generates while 0 and 1 read their prompts
    for eng in (paused.engine, whole.engine):
        eng.prefill(2, generating, 0)
    parts = parts_of({0: PROMPTS[0], 1: PROMPTS[1]}, {0: 0, 1: 0})
    steps, got_steps = paused.engine.prompt_steps(parts, 1), []
    while True:
        try:
            next(steps)
        except StopIteration as done:
            got = done.value
            break
        pos = len(generating) + len(got_steps)
        got_steps.append(paused.engine.decode([(2, 5 + len(got_steps), pos)]))
    n = paused.model_config.n_layers
    assert len(got_steps) == n - 1
    want = whole.engine.prefill_parts(parts)
    want_steps = [whole.engine.decode([(2, 5 + i, len(generating) + i)]) for i in range(n - 1)]
    assert all(torch.equal(g, w) for g, w in zip(got, want)) and len(got) == len(want)
    assert all(torch.equal(g, w) for g, w in zip(got_steps, want_steps))
    for q in (0, 1):
        a, b = paused.engine.routing.prompts[q], whole.engine.routing.prompts[q]
        for field in ("current", "last_ubatch", "tail"):
            assert np.array_equal(getattr(a, field), getattr(b, field)), (q, field)
        assert a.ubatches == b.ubatches == (paused.engine.host is not None)     # (the cache records them)
        assert (a.current.sum() > 0) == (paused.engine.host is not None)


@pytest.mark.parametrize("place", ["all on the device", "host, cache 32 MiB (all)"])
def test_prompt_batch_refuses_bad_parts(place):
    eng = make(**PLACES[place]).engine
    with pytest.raises(UserError, match="not consecutive"):
        eng.prefill_parts([(0, 0, [1, 2]), (0, 3, [3])])
    with pytest.raises(UserError, match="longer than -ub"):
        eng.prefill_parts([(0, 0, [1] * (UB + 1))])
    with pytest.raises(UserError, match="empty prompt part"):
        eng.prefill_parts([(0, 0, [])])
    with pytest.raises(UserError, match="context"):
        eng.prefill_parts([(1, 62, [1, 2, 3])])


@pytest.mark.parametrize("mib", [2, 12])
def test_trace_replay_of_prompt_batches_predicts_the_live_cache(tmp_path, mib):
    """A trace of several sequences' prompts read in batches, then decoded together, replays to the live cache's
    counters: each batch's begun prompts, its sequences and tails travel in the trace."""
    from moestream.experts.prefetch import PrefetchConfig
    from moestream.experts.trace import TraceRecorder, load_trace, replay
    from moestream.tools.bench_parallel import decode_together
    llm = LLM("synth:tiny", ubatch_size=8, batch_size=16, ctx_size=128, n_seq=3, device="cpu", cpu_moe=True,
              moe_cache_mib=mib, prefetch_min_batch=8, lookahead_layers=1)
    cfg = llm.model_config
    rec = TraceRecorder(cfg.n_layers, cfg.n_experts, llm.engine.host.store.expert_bytes)
    llm.engine.observe(rec)
    g = torch.Generator().manual_seed(5)
    for _ in range(2):
        prompts = [torch.randint(0, cfg.vocab_size, (20,), generator=g).tolist() for _ in range(3)]
        decode_together(llm.engine, prompts, 20, 4)
    rec.save(str(tmp_path / "run.npz"))
    trace = load_trace(str(tmp_path / "run.npz"))
    assert any(len(set(s.tolist())) > 1 for s, (_, _, p, _) in zip(trace.step_seqs, trace.ubatches.tolist())
               if p and s is not None)                   # a prompt batch held several sequences
    got = replay(trace, llm.stats()["cache"]["slots"], llm.engine.ecfg.cache.policy,
                 PrefetchConfig(min_batch=8, lookahead_layers=1))
    live = llm.stats()
    drop = ("sync_s", "host_s", "wait_s")
    assert {k: v for k, v in got["total"].items() if k not in drop} == \
        {k: v for k, v in live["total"].items() if k not in drop}
