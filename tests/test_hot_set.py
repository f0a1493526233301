"""experts/hot_set.py without a model: what several-token decode steps keep in the pool."""
from __future__ import annotations

import numpy as np
import torch

from moestream.experts.hot_set import HotSet
from moestream.experts.policy import make_policy
from moestream.experts.residency import Residency
from moestream.experts.stats import CacheStats
from moestream.experts.store import ExpertStore
from moestream.quant.layout import ExpertLayout

L, E, SLOTS = 2, 16, 12                # two layers share the pool: a share of 6 slots each


def _hot():
    res = Residency(SLOTS, L, E, make_policy("lfru", SLOTS))
    layout = ExpertLayout(4, 4)
    store = ExpertStore({l: torch.zeros(E, 3 * 16, dtype=torch.float32) for l in range(L)}, layout)
    return HotSet(res, CacheStats(), store, list(range(L))), res


def test_fill_uploads_the_regions_most_routed_experts_into_empty_slots_first():
    hot, res = _hot()
    counts = np.arange(E, dtype=float)              # expert e routed e times a step: the hottest are 15, 14, ...
    for l in range(L):
        hot.observe(np.array([l]), counts[None])
    now, behind = hot.fill(set(range(SLOTS)), room=2)
    # the region keeps its 12 slots less 2 a layer: 8 experts, the hottest of both layers ranked as one
    for l in range(L):
        assert sorted(np.flatnonzero(res.slot_of[l] >= 0).tolist()) == [12, 13, 14, 15]
    assert len(now) == 8 and not behind
    res.check()
    # layer 0's expert 11 turns hot while 4 slots are empty: it takes one, and 12, no longer wanted, stays
    hot.observe(np.array([0]), np.r_[np.zeros(11), 100, np.zeros(4)][None])
    now, behind = hot.fill(set(), room=2)
    assert sorted(res.resident(0).tolist()) == [11, 12, 13, 14, 15] and len(behind) == 1 and not now
    res.check()


def test_a_layer_whose_routing_spreads_takes_more_of_the_region_and_make_room_frees_the_least_routed():
    hot, res = _hot()
    hot.observe(np.array([0]), np.r_[np.zeros(14), 10, 10][None])     # layer 0: two experts take every choice
    hot.observe(np.array([1]), np.r_[np.arange(10, 0, -1), np.zeros(6)][None])  # layer 1: expert e routed 10 - e times
    now, _ = hot.fill(set(range(SLOTS)), room=2)
    # 12 slots less 2 a layer: 8, the hottest of both layers ranked as one (an equal share would give layer 1 four)
    assert sorted(res.resident(0).tolist()) == [14, 15] and sorted(res.resident(1).tolist()) == list(range(6))
    assert len(now) == 8
    # make_room: fewer than 2 free slots a layer, so the region's least routed residents go, never a pinned one
    res.ensure(1, np.array([6, 7]))
    res.pinned[res.slot_of[1, 7]] = True
    hot.make_room(2, writing=None)
    assert (res.owner[:, 0] < 0).sum() == 4
    assert sorted(res.resident(1).tolist()) == [0, 1, 2, 3, 4, 7]     # 6 and then 5 went; 7 is pinned
    res.check()


def test_nothing_is_kept_that_no_step_routed():
    hot, res = _hot()
    hot.observe(np.array([0]), np.zeros((1, E)))
    now, behind = hot.fill(set(range(SLOTS)), room=0)
    assert not now and not behind and (res.slot_of < 0).all()


def _step(hot, seqs_experts: dict[int, list[int]], k: int = 2):
    """One step of the given sequences, each token routing its k listed experts, in every layer."""
    seqs = list(seqs_experts)
    ids = np.array([e for s in seqs for e in seqs_experts[s][:k]], dtype=np.int64)
    for l in range(L):
        hot.observe(np.array([l]), np.bincount(ids, minlength=E)[None], ids[None], seqs)


def test_a_sequence_that_begins_a_new_request_leaves_the_hot_set():
    hot, res = _hot()
    for _ in range(30):                             # sequences 0 and 1 decode together for a while
        _step(hot, {0: [0, 1], 1: [2, 3]})
    hot.forget(0)                                   # sequence 0 takes a new request: its experts 0 and 1 leave
    _step(hot, {0: [4, 5], 1: [2, 3]})
    assert hot.freq[0, [0, 1]].max() < 1e-9 and hot.freq[0, [2, 3]].min() > 10
    np.testing.assert_allclose(hot.freq, hot.by_seq.sum(0))             # the sum is the sequences' counts
    hot.fill(set(range(SLOTS)), room=3)             # 12 slots less 3 a layer: 2, 3 of each layer (sequence 1)
    for l in range(L):                              # and 4, 5 of one (sequence 0), not 0, 1
        assert {2, 3} <= set(res.resident(l).tolist()) and not set(res.resident(l).tolist()) & {0, 1}
    assert len(res.resident(0)) + len(res.resident(1)) == 6
    res.check()


def test_steps_whose_sequences_are_not_told_fade_as_one_sum():
    hot, _ = _hot()
    hot.observe(np.array([0]), np.bincount([0, 1], minlength=E)[None])   # no ids or sequences: never forgotten
    hot.forget(0)
    assert hot.freq[0, 0] == 1 and not hot.by_seq.any()


def _two_requests_trace(k: int = 2, steps: int = 12):
    """Sequences 0 and 1 each read a prompt and decode `steps` steps together, twice: the first requests route
    experts 0-3 of each layer, the second ones 8-11 (prompt and decode alike)."""
    from moestream.experts.trace import Trace
    layers, ids, ubatches, ub_of, step_seqs = [], [], [], [], []

    def ubatch(seq, rows, is_prompt, seqs=None):
        ubatches.append([seq, len(rows), int(is_prompt), int(is_prompt)])
        step_seqs.append(None if seqs is None else np.array(seqs))
        for l in range(L):
            layers.append(l)
            ids.append(np.array(rows, dtype=np.int16))
            ub_of.append(len(ubatches) - 1)

    for base in (0, 8):
        mine = {0: [base, base + 1], 1: [base + 2, base + 3]}
        for s in (0, 1):
            ubatch(s, [mine[s]] * 8, True)
        for _ in range(steps):
            ubatch(0, [mine[0], mine[1]], False, [0, 1])
    return Trace(np.array(layers), ids, L, E, 1000, np.array(ub_of), np.array(ubatches), None, False, step_seqs)


def test_fresh_requests_read_fewer_experts_from_host_when_the_hot_set_forgets_the_old_ones():
    """The hot set's counts by sequence: the fresh requests find their experts. (One decaying sum,
    MOESTREAM_HOT_SET=sum, read 18 from host here; removed at stop 47.)"""
    from moestream.experts import trace
    tr = _two_requests_trace()
    reads = trace.replay(tr, 2 * 8, "lfru", zero_copy=True, read_through=True)["total"]["host_reads"]
    assert reads < 18 and reads == 0


def test_a_prompts_last_tokens_seed_its_sequence_at_its_first_step():
    from moestream.device import Device
    from moestream.experts import prompt
    from moestream.experts.cache import ExpertCache
    store = ExpertStore({l: torch.zeros(E, 3, dtype=torch.uint8) for l in range(L)}, ExpertLayout(1, 1))
    c = ExpertCache(store, SLOTS, L, E, Device("cpu"), "lfru", host_layers=list(range(L)), n_seq=2, top_k=2)
    c.enable_zero_copy(16, read_through=True)
    c.begin_prompt(1)
    c.begin_ubatch(1, 64, True)
    ids = torch.tensor([[0, 1]] * (64 - prompt.TAIL) + [[6, 7]] * prompt.TAIL)     # its last tokens route 6 and 7
    for l in range(L):
        c.fetch(l, ids)
        c.experts_launched(l)
    assert (c.routing.prompts[1].tail[:, [6, 7]] == prompt.TAIL).all() and c.routing.prompts[1].tail.sum() == 64
    zc = c.zero_copy
    for _ in range(2):                                 # its first step is learned while the second one is queued
        c.begin_ubatch(1, 2, False)
        c.begin_decode_step([1, 0])
        for l in range(L):
            zc.replay_route(l, np.array([[2, 3], [4, 5]]))
        c.end_decode_step(2)
    f = zc.hot.by_seq[1]
    assert (f[:, [6, 7]] >= prompt.TAIL * 0.98).all() and (f[:, [2, 3]] == 1).all() and 1 not in zc.hot.unseeded
    assert not zc.hot.by_seq[0][:, [6, 7]].any()                                # the seed is sequence 1's alone
