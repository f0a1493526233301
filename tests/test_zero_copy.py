"""Zero-copy decode on the CPU: the plain-torch oracle reads experts by address, so the address tables, the lagged
learning and the cache under it run here as on the GPU (where the Triton kernel reads the same addresses)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moestream import LLM
from moestream.experts.routing import RouteCallback
from moestream.kernels.reference import AddressBook, experts_by_address_reference, experts_reference
from moestream.models.moe import combine

from batched import decode_three

KW = dict(ctx_size=128, device="cpu", zero_copy_decode=True)
PROMPTS = ["Once upon a time", "The capital of France is"]


def test_address_oracle_is_the_expert_mlp_combined():
    E, H, I, T, k = 6, 16, 8, 3, 2
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(E, 3 * I * H, generator=g)
    book = AddressBook()
    book.add(rows)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    x, w = torch.randn(T, H, generator=g), torch.softmax(torch.randn(T, k, generator=g), -1)
    addrs = rows.data_ptr() + ids * rows.stride(0) * rows.element_size()
    w13, w2 = rows[:, :2 * I * H].view(E, 2 * I, H), rows[:, 2 * I * H:].view(E, H, I)
    want = combine(experts_reference(x, ids, w13, w2), w)
    assert torch.allclose(experts_by_address_reference(x, addrs, w, I, book=book), want, atol=1e-5)
    with pytest.raises(ValueError, match="no registered"):
        book.row(12345)


@pytest.fixture(scope="module")
def reference():
    """Every expert on the device, zero-copy decode: two prompts one after the other in one engine."""
    llm = LLM("synth:tiny", **KW)
    return [llm.generate(p, max_tokens=24, ignore_eos=True).sha256 for p in PROMPTS]


@pytest.mark.parametrize("kw", [{"cpu_moe": True}, {"cpu_moe": True, "moe_cache_mib": 0},
                                {"cpu_moe": True, "moe_cache_mib": 1}, {"cpu_moe": True, "moe_cache_mib": 3,
                                                                        "cache_policy": "lru"},
                                {"cpu_moe": True, "moe_cache_mib": 1000}, {"n_cpu_moe": 1, "moe_cache_mib": 2},
                                {"cpu_moe": True, "stage_host_reads": True},
                                {"cpu_moe": True, "moe_cache_mib": 3, "stage_host_reads": True}])
def test_greedy_tokens_identical_whatever_the_cache(reference, kw):
    llm = LLM("synth:tiny", **KW, **kw)
    assert llm.engine.decode_kernel is not None
    assert [llm.generate(p, max_tokens=24, ignore_eos=True).sha256 for p in PROMPTS] == reference


def test_zero_copy_and_fetching_decode_agree_on_the_cpu():
    """On the CPU both paths compute in float32: the same greedy tokens."""
    a = LLM("synth:tiny", **KW, cpu_moe=True, moe_cache_mib=2).generate(PROMPTS[0], max_tokens=24, ignore_eos=True)
    b = LLM("synth:tiny", ctx_size=128, device="cpu", cpu_moe=True, moe_cache_mib=2).generate(
        PROMPTS[0], max_tokens=24, ignore_eos=True)
    assert a.sha256 == b.sha256


def _check_table(cache):
    """A table as the next step would get it: every address points at its expert, its host row or the slot that
    holds it. (A table describes the cache when it was written: learning from the step after it moves experts.)"""
    zc = cache.zero_copy
    zc.begin_step()
    table = zc.table.numpy()
    slot = cache.residency.slot_of
    for l in cache.layers:
        for e in range(cache.n_experts):
            a = int(table[l, e])
            if a != zc.host_addr[l, e]:
                s = (a - zc.pool_addr) // zc.row_bytes
                assert slot[l, e] == s and tuple(cache.residency.owner[s]) == (l, e), (l, e)


def test_address_table_points_at_each_experts_bytes_and_misses_become_hits():
    llm = LLM("synth:tiny", **KW, cpu_moe=True, moe_cache_mib=1000)
    eng, cache = llm.engine, llm.engine.host
    eng.prefill(0, list(range(5, 25)))
    reads = []
    for pos in range(20, 32):                   # the same token again and again: the same routing every step
        before = llm.stats()["total"]["host_reads"]
        eng.decode([(0, 7, pos)])
        _check_table(cache)
        assert cache.zero_copy.pending is not None            # learned one step later, while the next one runs
        reads.append(llm.stats()["total"]["host_reads"] - before)
    assert reads[0] > 0                        # nothing of this token's routing had been seen before
    assert reads[-1] == 0 and reads[-2] == 0    # a pool that holds them all: every step after the lag hits
    st = llm.stats()["total"]                   # reading the counters learns from the last step too
    assert cache.zero_copy.pending is None
    assert st["host_read_bytes"] == st["host_reads"] * cache.store.expert_bytes


def test_small_pool_keeps_cycling_and_counts_add_up():
    llm = LLM("synth:tiny", **KW, cpu_moe=True, moe_cache_mib=1)     # 2 slots: fewer than one token's experts
    llm.generate(PROMPTS[0], max_tokens=12, ignore_eos=True)
    st = llm.stats()
    _check_table(llm.engine.host)
    llm.engine.host.residency.check()
    for key in ("hits", "misses", "host_reads", "uploaded_bytes"):
        assert sum(v[key] for v in st["per_layer"].values()) == st["total"][key]
    assert st["total"]["host_reads"] > 0


def test_routing_of_zero_copy_steps_reaches_the_callback():
    """The trace recorder and the server's slot statistics see each decode step's routing (reported after the
    step is queued)."""
    llm = LLM("synth:tiny", **KW, cpu_moe=True, moe_cache_mib=3)
    seen = []
    llm.engine.observe(RouteCallback(lambda layer, ids: seen.append((layer, tuple(ids.shape)))))
    eng = llm.engine
    eng.prefill(0, list(range(5, 15)))
    n_prompt = len(seen)
    eng.decode([(0, 3, 10)])
    k = llm.model_config.n_experts_used
    assert seen[n_prompt:] == [(l, (1, k)) for l in llm.model_config.moe_layers]


@pytest.mark.parametrize("read_through", [False, True])
def test_cache_under_zero_copy_keeps_its_invariants_and_a_reserve_of_empty_slots(read_through):
    """A pool that evicts: after every step the table points only at landed experts, residency holds, and each
    pool keeps empty slots that the step in flight cannot read (the next misses are copied into them at once);
    with read-through, less the landing slots the last step may have filled."""
    from moestream.experts.read_through import RESERVE
    llm = LLM("synth:tiny", **KW, cpu_moe=True, moe_cache_mib=12, read_through=read_through)
    eng, cache = llm.engine, llm.engine.host
    assert cache.n_slots >= len(cache.layers) * llm.model_config.n_experts_used       # big enough to upload
    eng.prefill(0, list(range(5, 25)))
    tok = 3
    for pos in range(20, 44):
        tok = int(eng.decode([(0, tok, pos)])[0].argmax()) if pos % 3 else (tok * 7 + 11) % 1000
        _check_table(cache)
        cache.residency.check()
        landed, n = cache.zero_copy.n_land * len(cache.layers), cache.n_slots
        if pos > 21:
            assert (cache.residency.owner[:, 0] < 0).sum() >= min(RESERVE + landed, n // 8) - landed
    st = llm.stats()["total"]
    assert st["evictions"] > 0 and st["host_reads"] > 0


def test_a_pool_smaller_than_a_step_keeps_the_hottest_experts():
    """8 layers x 4 routed > 16 slots: decode uploads nothing it would evict at the next step; the pool keeps the
    most routed experts of recent steps of all its layers, and the greedy tokens do not change."""
    spec = "synth:tiny:layers=8"
    want = LLM(spec, **KW).generate(PROMPTS[0], max_tokens=30, ignore_eos=True).sha256
    llm = LLM(spec, **KW, cpu_moe=True, moe_cache_mib=0)
    eng, cache = llm.engine, llm.engine.host
    assert cache.n_slots < len(cache.layers) * llm.model_config.n_experts_used
    assert llm.generate(PROMPTS[0], max_tokens=30, ignore_eos=True).sha256 == want
    eng.prefill(0, list(range(5, 25)))
    reads = []
    for pos in range(20, 50):                   # the same token: nearly the same routing every step
        before = llm.stats()["total"]["host_reads"]
        eng.decode([(0, 7, pos)])
        reads.append(llm.stats()["total"]["host_reads"] - before)
        _check_table(cache)
        cache.residency.check()
    hot = cache.zero_copy.hot
    layers, n = cache.layers, cache.n_slots     # the pool holds its hottest experts, ranked across its layers
    held = [(l, e) for l in layers for e in cache.residency.resident(l).tolist()]
    f = hot.freq[layers].ravel()
    top = np.argsort(-f, kind="stable")[:n]
    hottest = {(layers[i // hot.freq.shape[1]], i % hot.freq.shape[1]) for i in top.tolist()}
    assert len(held) <= n and set(held) <= hottest
    assert reads[-1] < reads[0]


@pytest.mark.parametrize("stage", [False, True])
@pytest.mark.parametrize("mib", [0, 2, 12, 1000])
def test_read_through_changes_no_token(reference, mib, stage):
    """Read-through (a one-token step writes the experts it reads from host memory into free slots, as the kernel
    reads them or staged: kernels/stage.py): the same greedy tokens, and the landed experts hold their own bytes
    (the table check below reads them)."""
    llm = LLM("synth:tiny", **KW, cpu_moe=True, moe_cache_mib=mib, read_through=True, stage_host_reads=stage)
    assert [llm.generate(p, max_tokens=24, ignore_eos=True).sha256 for p in PROMPTS] == reference
    _check_table(llm.engine.host)
    llm.engine.host.residency.check()


def test_read_through_serves_the_next_step_from_the_slot():
    """Without read-through a miss of step t is read in place again by step t+1 (its upload is learned while
    t+1 runs); with it, the experts step t landed are read from their slots by step t+1."""
    def reads(read_through):
        llm = LLM("synth:tiny", **KW, cpu_moe=True, moe_cache_mib=1000, read_through=read_through)
        eng, cache = llm.engine, llm.engine.host
        zc, k = cache.zero_copy, llm.model_config.n_experts_used
        eng.prefill(0, [5])                       # one token: most experts not yet resident
        out = []
        for _ in range(4):                        # the same token at the same position: the same routing
            eng.decode([(0, 900, 1)])
            p = zc.pending                        # this step: its table and routing (not learned from yet)
            routed = zc._routed(p)
            out.append(sum(int(p.from_host[l, routed[l, :k]].sum()) for l in cache.layers))
        _check_table(cache)
        cache.residency.check()
        return out, llm.stats()["total"]["landed"]
    plain, _ = reads(False)
    through, landed = reads(True)
    assert through[0] == plain[0] > 0
    assert through[1] < plain[1] and landed > 0
    assert through[2] == plain[2] == 0            # by the third step the uploads have landed too


@pytest.mark.parametrize("stage", [False, True])
def test_a_several_token_step_reads_each_missed_expert_once_and_lands_it(stage):
    """Three streams decoded in one step (the CPU reference follows the grouped kernel, or stages): a layer's host
    reads are its distinct host-read experts, however many tokens chose each; read-through lands them (the
    distinct ones, in ascending id, landing_slots_grouped; staged, in order of first choice, landed_experts) in
    free slots with their bytes, and the next step reads them there."""
    from moestream.kernels.decode import landing_slots_grouped
    from moestream.kernels.stage import landed_experts
    rule_of = landed_experts if stage else landing_slots_grouped
    llm = LLM("synth:tiny", **KW, cpu_moe=True, moe_cache_mib=1000, read_through=True, n_seq=3,
              stage_host_reads=stage)
    eng, cache = llm.engine, llm.engine.host
    zc, k = cache.zero_copy, llm.model_config.n_experts_used
    for s in range(3):
        eng.prefill(s, [5 + s])                 # one token each: most experts not resident yet
    count = lambda key: {l: llm.stats()["per_layer"].get(l, {}).get(key, 0) for l in cache.layers}  # noqa: E731
    reads, landed = count("host_reads"), count("landed")
    toks = [(s, 900, 1) for s in range(3)]
    eng.decode(toks)
    p = zc.pending                              # this step: its table and routing (not learned from yet)
    routed = zc._routed(p)[:, :3 * k]
    lands, choices, distinct = {}, 0, 0
    for l in cache.layers:
        on_host = p.from_host[l, routed[l]]
        choices += int(on_host.sum())
        distinct += len(set(routed[l][on_host].tolist()))
        rule = rule_of(routed[l], on_host, zc.rt.n_land_several)
        lands[l] = [(e, int(p.land_slots[l, r])) for e, r in rule if p.land_slots[l, r] >= 0]
    new_reads, new_landed = count("host_reads"), count("landed")       # (reading them learns from the step)
    for l in cache.layers:
        assert new_reads[l] - reads[l] == len(set(routed[l][p.from_host[l, routed[l]]].tolist()))
        assert new_landed[l] - landed[l] == len(lands[l])
        for e, slot in lands[l]:
            assert cache.residency.slot_of[l, e] == slot
            assert torch.equal(cache.pool[slot], cache.store.rows[l][e])       # the bytes the step read
    assert choices > distinct > 0               # host experts chosen by several tokens: read once each
    assert sum(map(len, lands.values())) > 0
    _check_table(cache)
    cache.residency.check()
    eng.decode(toks)                            # the same routing: what landed is read from its slot
    p = zc.pending
    assert not any(p.from_host[l, e] for l in cache.layers for e, _ in lands[l])


def _batched_logits(**kw):
    """Three sequences decoding together for six steps: each step's logits."""
    llm = LLM("synth:tiny", **KW, n_seq=3, **kw)
    outs = decode_three(llm.engine)
    if kw:
        _check_table(llm.engine.host)
        llm.engine.host.residency.check()
    return outs


@pytest.mark.parametrize("stage", [False, True])
@pytest.mark.parametrize("mib", [0, 2, 12, 1000])
def test_several_token_steps_with_read_through_give_the_logits_of_every_expert_on_the_device(mib, stage):
    """Batched zero-copy steps that land what they read (read-through, staged or not): the logits of every expert
    on the device, step for step, on every cache size (a landed expert holds its own bytes)."""
    base = _batched_logits()
    got = _batched_logits(cpu_moe=True, moe_cache_mib=mib, read_through=True, stage_host_reads=stage)
    assert all(torch.equal(a, b) for a, b in zip(got, base))


def test_one_token_prompt_chunks_do_not_take_the_decode_path():
    """A prompt chunk of one token has a decode step's shape but not its address tables: it fetches its experts
    like any prompt ubatch (here after decode steps left a table behind, and on a fresh engine)."""
    base = LLM("synth:tiny", **KW, ubatch_size=16)
    llm = LLM("synth:tiny", **KW, ubatch_size=16, cpu_moe=True, moe_cache_mib=2, read_through=True)
    for ids in ([5], list(range(3, 20))):                 # one token; 17 tokens = 16 + a chunk of one
        assert torch.equal(llm.logits(ids), base.logits(ids))
    llm.generate(PROMPTS[0], max_tokens=6, ignore_eos=True)
    base.generate(PROMPTS[0], max_tokens=6, ignore_eos=True)
    assert torch.equal(llm.logits([7]), base.logits([7]))


def test_a_new_cache_takes_over_the_decode_and_frees_the_old_pool(reference):
    """reconfigure_cache (bench's cache sweeps): the new pool's tables serve the decode, and nothing keeps the old
    pool alive."""
    llm = LLM("synth:tiny", **KW, cpu_moe=True, moe_cache_mib=2)
    spans = len(llm.engine.book.spans)
    for mib in (12, 0, 1000):
        old = llm.engine.host.pool
        llm.engine.reconfigure_cache(moe_cache_mib=mib)
        assert len(llm.engine.book.spans) == spans and all(s[2] is not old for s in llm.engine.book.spans)
        assert [llm.generate(p, max_tokens=24, ignore_eos=True).sha256 for p in PROMPTS] == reference


@pytest.mark.parametrize("mib,prefetch,read_through,stage", [(2, False, False, False), (12, True, False, False),
                                                             (12, False, True, False), (0, True, False, False),
                                                             (12, False, True, True), (2, True, False, True)])
def test_trace_replay_predicts_zero_copy_decode(tmp_path, mib, prefetch, read_through, stage):
    """`moestream replay --zero-copy [--stage-host-reads]` runs the live cache's own zero-copy code on a recorded
    trace: the same counts as the live run, host reads and landed experts included."""
    from moestream.experts.prefetch import PrefetchConfig
    from moestream.experts.trace import TraceRecorder, load_trace, replay
    llm = LLM("synth:tiny:layers=8", **KW, ubatch_size=16, cpu_moe=True, moe_cache_mib=mib, prefetch=prefetch,
              prefetch_min_batch=8, read_through=read_through, stage_host_reads=stage)
    cfg = llm.model_config
    rec = TraceRecorder(cfg.n_layers, cfg.n_experts, llm.engine.host.store.expert_bytes)
    llm.engine.observe(rec)
    for p in PROMPTS:
        llm.generate(p, max_tokens=12, ignore_eos=True)
    path = tmp_path / "zc.npz"
    rec.save(str(path))
    got = replay(load_trace(str(path)), llm.stats()["cache"]["slots"], llm.engine.ecfg.cache.policy,
                 PrefetchConfig(min_batch=8) if prefetch else None, zero_copy=True, read_through=read_through,
                 staged=stage)
    live = llm.stats()
    assert live["total"]["host_reads"] > 0 and (live["total"]["landed"] > 0) == read_through
    drop = ("sync_s", "host_s", "wait_s")
    assert {k: v for k, v in got["total"].items() if k not in drop} == \
        {k: v for k, v in live["total"].items() if k not in drop}


class LaggingQueue:
    """A copy queue whose newest batch is still in flight: its copies land when the next batch is submitted, or
    (polls=N) at the N-th poll after its submission, as on the GPU, where a copy learned while a step runs lands
    later."""

    def __init__(self, inner, polls=None):
        self.seq = self.done = inner.poll()
        self.polls = polls
        self.held = []                                   # [seq, [(dst, src)], polls left] not landed yet

    def submit(self, pairs, speculative, after=None):
        self.land(self.seq)
        self.seq += 1
        self.held.append([self.seq, list(pairs), self.polls])
        return self.seq

    def land(self, seq):
        while self.held and self.held[0][0] <= seq:
            n, pairs, _ = self.held.pop(0)
            for dst, src in pairs:
                dst.copy_(src)
            self.done = n

    def poll(self):
        if self.polls is not None and self.held:
            for h in self.held:
                h[2] -= 1
            self.land(max([h[0] for h in self.held if h[2] <= 0], default=0))
        return self.done

    def speculative_inflight(self):
        return 0


@pytest.mark.parametrize("mib,polls", [(8, None), (12, None), (16, None), (12, 2), (16, 2)])
def test_read_through_never_lands_in_a_slot_a_copy_is_still_writing(mib, polls):
    """A slot emptied while its upload is in flight is not handed to a step to land in: the late copy would
    overwrite the landed expert (on the H200 the greedy hash changed). Decode steps with a lagging copy queue give
    the logits of every expert on the device. With polls=2 copies in flight when a table is prepared (while the
    step before runs) land before the step: begin_step patches them in. (One-token steps land their misses and
    upload nothing; every other step decodes a second sequence too, whose hot set uploads.)"""
    ids = list(range(5, 40))
    handed, waiting = [], []

    def run(**kw):
        llm = LLM("synth:tiny", **KW, n_seq=2, **kw)
        eng, cache = llm.engine, llm.engine.host
        tok, outs = int(eng.prefill(0, ids)[-1].argmax()), []
        other = int(eng.prefill(1, ids[::-1])[-1].argmax())
        if cache is not None:
            cache.slots.queue = LaggingQueue(cache.slots.queue, polls)
            zc, begin, prepare = cache.zero_copy, cache.zero_copy.begin_step, cache.zero_copy._prepare

            def prepared(*a, **kw):
                p = prepare(*a, **kw)
                waiting.append(len(p.waiting))
                return p
            zc._prepare = prepared

            def checked(*a, **kw):
                begin(*a, **kw)
                given = zc.land_slots[zc.land_slots >= 0]
                handed.append(len(given))
                assert (cache.slots.ready[given] <= cache.slots.queue.done).all(), "a landing slot has a copy in flight"
                slot = cache.residency.slot_of
                landed = slot >= 0
                landed[landed] = cache.slots.ready[slot[landed]] <= cache.slots.queue.done
                assert not (zc.from_host & landed).any(), "the table reads a landed expert from host memory"
            zc.begin_step = checked
        for i, pos in enumerate(range(len(ids), len(ids) + 40)):
            both = pos % 2 == 0                      # (sequence 1 then is at position len(ids) + i // 2)
            lg = eng.decode([(0, tok, pos)] + ([(1, other, len(ids) + i // 2)] if both else []))
            outs.append(lg.clone())
            tok = int(lg[0].argmax())
            other = int(lg[1].argmax()) if both else other
        return outs
    ref, got = run(), run(cpu_moe=True, moe_cache_mib=mib, read_through=True)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert sum(handed) > 0 and sum(waiting) > 0
