"""The prompt-path prefetch rules, from given statistics, and the contract that prefetching changes no output."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moestream import LLM
from moestream.experts.prefetch import PrefetchConfig, RoutingStats, choose_seed, predicted

CFG = PrefetchConfig(min_batch=256)


def stats_with(previous=False, own_ubatches=0, last_tokens=0):
    s = RoutingStats(2, 8)
    if previous:
        s.begin_prompt()
        s.begin_ubatch(1024)
        s.record(0, np.bincount([1, 2, 1, 3], minlength=8))
        s.record(1, np.bincount([4, 4, 5, 4], minlength=8))
        s.begin_prompt()                                  # that prompt is now the previous one
    for _ in range(own_ubatches):
        s.begin_ubatch(last_tokens)
        s.record(0, np.bincount([6, 7, 6, 6], minlength=8))
    return s


def test_first_big_chunk_seeds_from_the_previous_prompt():
    seed = choose_seed(1024, True, stats_with(previous=True), CFG)
    assert seed.rule == "first-chunk"
    assert list(predicted(seed.counts[0], 8)) == [1, 2, 3]          # most-routed first
    assert list(predicted(seed.counts[1], 8)) == [4, 5]


def test_first_big_chunk_without_history_or_with_seeding_off_prefetches_nothing():
    assert choose_seed(4096, True, stats_with(previous=False), CFG) is None
    off = PrefetchConfig(min_batch=256, seed_previous=False)
    assert choose_seed(4096, True, stats_with(previous=True), off) is None


def test_first_chunk_all_option_copies_every_expert():
    seed = choose_seed(1024, True, stats_with(previous=True), PrefetchConfig(first_chunk_all=True))
    assert seed.rule == "all" and list(predicted(None, 8)) == list(range(8))


def test_a_first_chunk_below_four_times_min_batch_does_not_seed_from_the_previous_prompt():
    assert choose_seed(512, True, stats_with(previous=True), CFG) is None


def test_later_chunks_seed_from_their_own_prompt():
    seed = choose_seed(512, True, stats_with(previous=True, own_ubatches=1, last_tokens=512), CFG)
    assert seed.rule == "own-prompt"
    assert list(predicted(seed.counts[0], 8)) == [6, 7]             # the own prompt, not the previous one


def test_short_chunk_prefetches_nothing_but_a_tail_reads_the_big_ubatch_before_it():
    assert choose_seed(100, True, stats_with(previous=True), CFG) is None
    assert choose_seed(100, True, stats_with(own_ubatches=1, last_tokens=100), CFG) is None
    tail = choose_seed(100, True, stats_with(own_ubatches=2, last_tokens=2048), CFG)
    assert tail.rule == "tail" and list(predicted(tail.counts[0], 8)) == [6, 7]


def test_decode_and_disabled_prefetch_choose_nothing():
    s = stats_with(previous=True, own_ubatches=1, last_tokens=4096)
    assert choose_seed(4096, False, s, CFG) is None
    assert choose_seed(4096, True, s, PrefetchConfig(enabled=False)) is None


def test_routing_stats_roll_over_and_save(tmp_path):
    s = stats_with(previous=True, own_ubatches=1, last_tokens=300)
    s.save(str(tmp_path / "r.npz"))
    t = RoutingStats.load(str(tmp_path / "r.npz"))
    assert (t.current == s.current).all() and (t.previous == s.previous).all()


# --- in the engine --------------------------------------------------------------------------------------------
def _prompt(n, seed):
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _llm(mib=2, **kw):
    """2 MiB is 5 slots of the tiny model's 64 experts: waves, evictions and prefetches all interleave."""
    return LLM("synth:tiny", ubatch_size=32, ctx_size=256, device="cpu", cpu_moe=True, moe_cache_mib=mib,
               prefetch_min_batch=8, **kw)


@pytest.mark.parametrize("variant", [{}, {"prefetch_seed": False}, {"prefetch_first_all": True},
                                     {"lookahead": False}, {"prompt_lookahead": False}])
def test_prefetch_changes_no_logits_and_no_tokens(variant):
    off = _llm(prefetch=False)
    on = _llm(**variant)
    for s in range(3):                                  # different prompts one after another, as a server sees them
        ids = _prompt(70, s)                            # ubatches of 32, 32 and a 6-token tail
        assert torch.equal(on.logits(ids), off.logits(ids)), (variant, s)
    a = off.generate("Once upon a time", max_tokens=16, ignore_eos=True)
    b = on.generate("Once upon a time", max_tokens=16, ignore_eos=True)
    assert a.token_ids == b.token_ids


def test_the_second_prompt_copies_ahead_and_uses_what_it_copied():
    llm = _llm(mib=12)                                  # 31 slots: room for the next layer's experts
    llm.logits(_prompt(70, 1))
    first = llm.stats()["prompt"]
    llm.logits(_prompt(70, 2))
    second = llm.stats()["prompt"]
    assert second["prefetched"] > 0 and second["prefetch_used"] > 0
    assert second["prefetched_bytes"] == second["prefetched"] * llm.engine.host.store.expert_bytes
    assert second["uploaded_bytes"] == (second["misses"] + second["prefetched"]) * llm.engine.host.store.expert_bytes
    # The first prompt's bytes are its misses and its copies ahead too (lookahead copies ahead without a seed).
    assert first["uploaded_bytes"] == (first["misses"] + first["prefetched"]) * llm.engine.host.store.expert_bytes


def test_no_prefetch_means_only_demand_copies():
    llm = _llm(prefetch=False)
    llm.logits(_prompt(70, 1))
    llm.generate("Hello", max_tokens=8, ignore_eos=True)
    t = llm.stats()["total"]
    assert t["prefetched"] == 0 and t["copies"] == t["misses"]


def test_prompt_lookahead_guesses_a_big_ubatch_s_experts_and_copies_them_ahead():
    """A prompt alone (no earlier prompt to seed from): every host layer after the first is predicted through its
    router on the layer before, and what was copied ahead gets used."""
    llm = _llm(mib=12)
    llm.logits(_prompt(64, 1))                          # two ubatches of 32 >= prefetch_min_batch 8
    t = llm.stats()["total"]
    n_layers = llm.model_config.n_layers
    assert t["lookahead_tp"] > 0 and t["lookahead_precision"] > 0.3 and t["lookahead_recall"] > 0.3
    assert t["prefetched"] > 0 and t["prefetch_used"] > 0
    off = _llm(mib=12, prompt_lookahead=False)
    off.logits(_prompt(64, 1))
    assert off.stats()["total"]["lookahead_tp"] == 0 and n_layers > 1


def test_decode_lookahead_reports_precision_and_recall():
    llm = _llm()
    llm.generate("Once upon a time there was", max_tokens=24, ignore_eos=True)
    t = llm.stats()["total"]
    assert t["lookahead_tp"] + t["lookahead_fp"] > 0
    assert 0.0 < t["lookahead_precision"] <= 1.0 and 0.0 < t["lookahead_recall"] <= 1.0


def test_min_use_keeps_only_experts_the_ubatch_is_likely_to_route():
    counts = np.array([1000, 10, 1, 0, 300])          # shares of 1311 routings
    assert list(predicted(counts, 5)) == [0, 4, 1, 2]
    # 64 routings: expert 0 (p = 0.76) and 4 (0.23) are near-certain, 1 (0.0076) is a coin flip, 2 is unlikely
    assert list(predicted(counts, 5, n_routings=64, min_use=0.5)) == [0, 4]
    assert list(predicted(counts, 5, n_routings=64, min_use=0.3)) == [0, 4, 1]
    assert list(predicted(counts, 5, n_routings=100000, min_use=0.9)) == [0, 4, 1, 2]
