"""The expert cache: residency invariants, policies, bit-identical logits whatever the cache does, traces."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moestream import LLM, UserError
from moestream.experts.routing import RouteCallback
from moestream.experts.planner import CachePlanner
from moestream.experts.policy import make_policy
from moestream.experts.residency import CacheTooSmall, Residency
from moestream.experts.trace import TraceRecorder, load_trace, replay

L, E = 3, 12


# --- residency, without a model --------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(policy=st.sampled_from(["lfru", "lru", "cycle"]), n_slots=st.integers(4, 30),
       steps=st.lists(st.tuples(st.integers(0, L - 1), st.sets(st.integers(0, E - 1), min_size=1, max_size=6),
                                st.sets(st.integers(0, 29), max_size=3)), min_size=1, max_size=40))
def test_residency_invariants(policy, n_slots, steps):
    res = Residency(n_slots, L, E, make_policy(policy, n_slots, list(range(L))))
    for layer, experts, pins in steps:
        res.policy.at_layer(layer, sweeping=len(experts) > 3)       # (cycle's order by layers, some of the time)
        res.pinned[:] = False
        pins = [p for p in pins if p < n_slots]
        res.pinned[pins] = True
        before_owner = res.owner.copy()
        resident_before = set(res.resident(layer).tolist())
        experts = np.array(sorted(experts))
        held = set(pins) | set(res.slot_of[layer, experts][res.slot_of[layer, experts] >= 0].tolist())
        try:
            plan = res.ensure(layer, experts)
        except CacheTooSmall:
            assert len(set(experts.tolist()) - resident_before) > n_slots - len(held)
            assert (res.owner == before_owner).all()            # a refused call changes nothing
            continue
        res.check()
        # every asked expert is resident where the plan says; hits uploaded nothing; each miss once
        assert (res.slot_of[layer, experts] == plan.slots).all()
        missed = [e for e, _ in plan.misses]
        assert sorted(missed) == sorted(set(experts.tolist()) - resident_before)
        assert len(set(missed)) == len(missed)
        # a pinned slot is never a victim: its owner did not change
        for p in pins:
            assert (res.owner[p] == before_owner[p]).all()
        assert len(plan.evicted) <= len(plan.misses)


def test_ensure_never_evicts_what_it_hands_out():
    res = Residency(3, 1, 8, make_policy("lru", 3))
    res.ensure(0, np.array([0, 1, 2]))
    plan = res.ensure(0, np.array([0, 5]))           # 0 hits; 5 must not evict 0
    assert res.slot_of[0, 0] >= 0 and res.slot_of[0, 5] >= 0
    assert plan.evicted and plan.evicted[0][1] in (1, 2)


def _scan_then_decode(policy: str) -> tuple[int, float]:
    """Decode touches a working set W for a while, a long prompt streams every other expert through the cache,
    then decode resumes on W: how much of W survived the prompt, and the hit rate of the resumed decode.
    The cache (16 slots) holds W (8) and one prompt ubatch's experts (6): a policy that knows W is hot never has
    to evict it."""
    E_ = 64
    res = Residency(16, 1, E_, make_policy(policy, 16))
    rng = np.random.default_rng(0)
    W = np.arange(8)
    for _ in range(100):                         # decode: 3 experts of W per token
        res.policy.tick()
        res.ensure(0, np.sort(rng.choice(W, 3, replace=False)))
    others = np.arange(8, E_)
    for _ in range(8):                           # prompt: 8 ubatches, each touching 6 experts outside W
        res.policy.tick()
        res.ensure(0, np.sort(rng.choice(others, 6, replace=False)))
    kept = int((res.slot_of[0, W] >= 0).sum())
    hits = total = 0
    for _ in range(20):
        res.policy.tick()
        p = res.ensure(0, np.sort(rng.choice(W, 3, replace=False)))
        hits += 3 - len(p.misses)
        total += 3
    return kept, hits / total


def test_waves_take_the_resident_experts_first_and_half_the_pool_each():
    """A ubatch routing more of a layer's experts than the pool holds: the resident ones in the first waves (no
    later wave's uploads evict them), then waves of half the pool, so that one wave's uploads can land in slots the
    wave before it does not read; every wanted expert in exactly one wave, each wave made resident in turn."""
    planner = CachePlanner(6, 1, 16, "lfru", 1)
    planner.plan(0, np.array([4, 9, 12]))                          # resident before the ubatch
    wanted = np.arange(0, 16, 2)                                   # 8 of 16 experts; 4 and 12 resident
    groups = planner.groups(0, wanted)
    assert [len(g) for g in groups] == [3, 3, 2]
    assert set(groups[0][:2]) == {4, 12} and sorted(np.concatenate(groups)) == list(wanted)
    uploads = sum(len(planner.plan(0, g).misses) for g in groups)
    assert uploads == len(wanted) - 2                              # neither hit was evicted before its wave
    assert len(planner.groups(0, np.array([1, 2, 3]))) == 1        # what fits is one group


def test_long_prompt_keeps_decode_working_set_under_lfru_not_lru():
    kept, hit_rate = _scan_then_decode("lfru")
    assert kept == 8 and hit_rate == 1.0
    kept, hit_rate = _scan_then_decode("lru")
    assert kept == 0 and hit_rate < 0.9          # LRU let the scan flush all of W: 8 misses to fetch it back


# --- the cache in the engine --------------------------------------------------------------------------------------
def _prompt(n, seed):
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def base_logits():
    llm = LLM("synth:tiny", ubatch_size=16, ctx_size=128, device="cpu")
    return [llm.logits(_prompt(40, s)) for s in range(3)]


@pytest.mark.parametrize("mib", [None, 0, 1, 3, 1000])
@pytest.mark.parametrize("policy", ["lfru", "lru", "cycle"])
def test_logits_bit_identical_across_cache_sizes_and_policies(base_logits, mib, policy):
    """1 MiB (2 slots) runs in waves, 0 is one layer's 16 experts, 3 MiB is 7 slots, 1000 MiB holds every expert."""
    llm = LLM("synth:tiny", ubatch_size=16, ctx_size=128, device="cpu", cpu_moe=True, moe_cache_mib=mib,
              cache_policy=policy)
    for s, base in enumerate(base_logits):           # several prompts: the cache is warm and mixed by the second
        assert torch.equal(llm.logits(_prompt(40, s)), base), (mib, policy, s)


def test_greedy_decode_identical_with_and_without_cache():
    a = LLM("synth:tiny", ctx_size=128, device="cpu").generate("Once upon a time", max_tokens=20, ignore_eos=True)
    b = LLM("synth:tiny", ctx_size=128, device="cpu", n_cpu_moe=2, moe_cache_mib=1).generate(
        "Once upon a time", max_tokens=20, ignore_eos=True)
    assert a.sha256 == b.sha256


def test_repeated_prompt_hits_and_uploads_nothing():
    llm = LLM("synth:tiny", ubatch_size=16, ctx_size=128, device="cpu", cpu_moe=True, moe_cache_mib=1000)
    ids = _prompt(40, 7)
    llm.logits(ids)
    first = llm.stats()["prompt"]
    assert first["misses"] > 0 and first["uploaded_bytes"] > 0
    llm.logits(ids)
    again = llm.stats()["prompt"]
    assert again["misses"] == 0 and again["uploaded_bytes"] == 0 and again["hit_rate"] == 1.0
    tot = llm.stats()["total"]
    assert tot["misses"] == first["misses"] and tot["hits"] == first["hits"] + again["hits"]


def test_only_misses_cross_the_link_and_each_once_per_ubatch():
    llm = LLM("synth:tiny", ubatch_size=8, ctx_size=128, device="cpu", cpu_moe=True, moe_cache_mib=0)
    routed = []
    llm.engine.observe(RouteCallback(lambda layer, ids: routed.append(len(torch.unique(ids)))))
    llm.logits(_prompt(32, 8))
    st_ = llm.stats()["total"]
    assert st_["hits"] + st_["misses"] == sum(routed)          # every routed expert counted once per ubatch
    assert st_["copies"] == st_["misses"]
    assert st_["uploaded_bytes"] == st_["misses"] * llm.engine.host.store.expert_bytes


def test_stats_per_layer_add_up():
    llm = LLM("synth:tiny", ctx_size=128, device="cpu", cpu_moe=True, moe_cache_mib=2)
    llm.generate("Hello", max_tokens=5, ignore_eos=True)
    st_ = llm.stats()
    assert set(st_["per_layer"]) == set(llm.model_config.moe_layers)
    for key in ("hits", "misses", "evictions", "uploaded_bytes", "copies"):
        assert sum(v[key] for v in st_["per_layer"].values()) == st_["total"][key]
    assert st_["cache"]["slots"] == 2 * (1 << 20) // llm.engine.host.store.expert_bytes


def test_cache_size_errors():
    with pytest.raises(UserError, match="must be >= 0"):
        LLM("synth:tiny", device="cpu", cpu_moe=True, moe_cache_mib=-1)
    with pytest.raises(UserError, match="cache policy|must be one of lfru, lru, cycle"):
        LLM("synth:tiny", device="cpu", cpu_moe=True, moe_cache_mib=1, cache_policy="fifo")


# --- traces -------------------------------------------------------------------------------------------------------
def counts_only(d: dict) -> dict:
    """A counter dict without its timings (host times are measured, not replayed)."""
    return {k: v for k, v in d.items() if k not in ("sync_s", "host_s", "wait_s")}


@pytest.mark.parametrize("policy,mib", [("lfru", 1), ("lru", 3), ("lfru", 0), ("cycle", 1), ("cycle", 3)])
def test_trace_replay_predicts_the_live_cache(tmp_path, policy, mib):
    llm = LLM("synth:tiny", ubatch_size=16, ctx_size=128, device="cpu", cpu_moe=True, moe_cache_mib=mib,
              cache_policy=policy, prefetch=False)       # the replay models demand misses, not prefetch
    cfg = llm.model_config
    rec = TraceRecorder(cfg.n_layers, cfg.n_experts, llm.engine.host.store.expert_bytes)
    llm.engine.observe(rec)
    llm.generate(_prompt(40, 1), max_tokens=10, ignore_eos=True)
    llm.generate(_prompt(25, 2), max_tokens=10, ignore_eos=True)
    path = tmp_path / "run.npz"
    rec.save(str(path))
    got = replay(load_trace(str(path)), llm.stats()["cache"]["slots"], policy)
    live = llm.stats()
    assert counts_only(got["total"]) == counts_only(live["total"])
    assert ({l: counts_only(c) for l, c in got["per_layer"].items()}
            == {l: counts_only(c) for l, c in live["per_layer"].items()})


@pytest.mark.parametrize("mib,lookahead", [(2, False), (12, False), (12, True), (2, True)])
def test_trace_replay_with_prefetch_predicts_the_live_cache(tmp_path, mib, lookahead):
    """Prompts in ubatches of 32 with prefetch from 8 tokens: first chunks, own-prompt chunks, tails, waves; with
    lookahead, the guesses the trace recorded drive the replay's copies ahead as they drove the live cache's (one
    layer ahead: a trace keeps one guess per layer)."""
    llm = LLM("synth:tiny", ubatch_size=32, ctx_size=256, device="cpu", cpu_moe=True, moe_cache_mib=mib,
              prefetch_min_batch=8, lookahead=lookahead, lookahead_layers=1, batch_by_layer=False)
    cfg = llm.model_config
    rec = TraceRecorder(cfg.n_layers, cfg.n_experts, llm.engine.host.store.expert_bytes)
    llm.engine.observe(rec)
    for s in range(3):
        llm.generate(_prompt(70, s), max_tokens=6, ignore_eos=True)
    path = tmp_path / "run.npz"
    rec.save(str(path))
    from moestream.experts.prefetch import PrefetchConfig
    got = replay(load_trace(str(path)), llm.stats()["cache"]["slots"], llm.engine.ecfg.cache.policy,
                 PrefetchConfig(min_batch=8, lookahead=lookahead))
    live = llm.stats()
    assert live["total"]["prefetched"] > 0
    assert (live["total"]["lookahead_tp"] > 0) == lookahead
    assert counts_only(got["total"]) == counts_only(live["total"])


def test_bad_trace_file_is_a_user_error(tmp_path):
    p = tmp_path / "x.npz"
    p.write_bytes(b"not a trace")
    with pytest.raises(UserError, match="is not a routing trace; record one with generate --trace"):
        load_trace(str(p))
    with pytest.raises(UserError, match="cannot read routing trace"):
        load_trace(str(tmp_path / "missing.npz"))


def test_reconfigure_cache_keeps_logits_and_restarts_counters():
    llm = LLM("synth:tiny", ubatch_size=16, ctx_size=128, device="cpu", cpu_moe=True, moe_cache_mib=1000)
    ids = _prompt(40, 3)
    base = llm.logits(ids)
    for mib, policy in ((0, "lru"), (3, "lfru"), (None, "lfru")):
        llm.engine.reconfigure_cache(moe_cache_mib=mib, cache_policy=policy)
        assert torch.equal(llm.logits(ids), base)
        assert llm.stats()["total"]["misses"] == llm.stats()["prompt"]["misses"] > 0
    with pytest.raises(UserError, match="host memory"):
        LLM("synth:tiny", device="cpu").engine.reconfigure_cache(moe_cache_mib=1)



def test_copying_ahead_takes_no_more_than_the_pool_holds():
    """A pool smaller than a layer's experts (as Qwen3-Next's 512 experts were in a region of a 4000 MiB pool):
    copying the next layer's experts ahead (here every one of them, --prefetch-first-all) takes what fits in the
    pool's unpinned slots (it raised CacheTooSmall), and changes no logits."""
    ids = _prompt(70, 3)
    want = LLM("synth:tiny", device="cpu", ubatch_size=32, ctx_size=128).logits(ids)
    llm = LLM("synth:tiny", device="cpu", ubatch_size=32, ctx_size=128, cpu_moe=True, moe_cache_mib=4,
              prefetch_first_all=True, prefetch_min_batch=8)
    res = llm.engine.host.residency
    assert res.n_slots < llm.engine.cfg.n_experts
    assert torch.equal(llm.logits(ids), want)
    assert llm.engine.stats()["total"]["prefetched"] > 0
    res.check()
