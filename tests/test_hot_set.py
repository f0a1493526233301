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

L, E, SLOTS = 2, 16, 12                # two layers share one region: a share of 6 slots each


def _hot():
    res = Residency(SLOTS, L, E, make_policy("lfru", SLOTS))
    layout = ExpertLayout(4, 4)
    store = ExpertStore({l: torch.zeros(E, 3 * 16, dtype=torch.float32) for l in range(L)}, layout)
    return HotSet(res, CacheStats(), store, list(range(L))), res


def test_fill_uploads_the_most_routed_experts_of_each_share_and_make_room_frees_the_least_routed():
    hot, res = _hot()
    assert hot.share(0) == hot.share(1) == SLOTS // L
    counts = np.arange(E, dtype=float)              # expert e routed e times a step: the hottest are 15, 14, ...
    for l in range(L):
        hot.observe(l, counts)
    now, behind = hot.fill(set(range(SLOTS)), room=2)
    # each layer keeps its top share - room = 4 experts, all copied into slots that were empty
    for l in range(L):
        assert sorted(np.flatnonzero(res.slot_of[l] >= 0).tolist()) == [12, 13, 14, 15]
    assert len(now) == 8 and not behind
    res.check()
    # hotter experts appear in layer 0: the next fill replaces its coldest residents, not layer 1's
    hot.observe(0, np.r_[np.zeros(8), np.full(8, 100.0)])
    hot.fill(set(), room=2)
    assert sorted(np.flatnonzero(res.slot_of[1] >= 0).tolist()) == [12, 13, 14, 15]
    assert set(np.flatnonzero(res.slot_of[0] >= 0).tolist()) >= {14, 15}
    res.check()
    # make_room: a share holding more than share - room gives back its least routed experts, never a pinned one
    for e in (0, 1):
        res.ensure(1, np.array([e]))
    pinned = res.slot_of[1, 0]
    res.pinned[pinned] = True
    hot.make_room(2, writing=None)
    held = np.flatnonzero(res.slot_of[1] >= 0)
    assert len(held) == hot.share(1) - 2 and 0 in held and 1 not in held      # 1 evicted, 0 kept (pinned)
    res.check()


def test_nothing_is_kept_that_no_step_routed():
    hot, res = _hot()
    hot.observe(0, np.zeros(E))
    now, behind = hot.fill(set(range(SLOTS)), room=0)
    assert not now and not behind and (res.slot_of < 0).all()
