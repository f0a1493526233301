"""--host-compute SHARE (experts/host_share.py): in zero-copy decode steps over the cache, the host's cores compute
a share of the experts a step would read from host memory. The mode leaves the numerics contract (the host's
experts are its float32 sums), so these tests hold it to a bound and to the greedy tokens, and check what it
counts: every host read is either the kernel's or the host's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moestream import LLM
from moestream.errors import UserError
from moestream.experts import host_share
from moestream.experts.host_share import HostShare
from moestream.experts.stats import CacheStats
from moestream.experts.store import ExpertStore
from moestream.kernels.host_experts import host_experts_reference
from moestream.quant.layout import ExpertLayout

from batched import decode_three

KW = dict(ctx_size=128, device="cpu", zero_copy_decode=True, cpu_moe=True)
PROMPT = "Once upon a time"


@pytest.fixture
def every_step_shares(monkeypatch):
    """Every step shares (on synth:tiny no step reads the 1 GB from host that makes a step worth sharing)."""
    monkeypatch.setattr(host_share, "MIN_STEP_BYTES", 0)


def _counts(llm) -> dict:
    t = llm.stats()["total"]
    return {k: t[k] for k in ("host_computed", "host_reads", "hits", "misses")}


@pytest.mark.parametrize("mib", [1, 3])
def test_one_token_steps_keep_their_greedy_tokens_and_every_host_read_is_counted_once(mib, every_step_shares):
    base = LLM("synth:tiny", **KW, moe_cache_mib=mib)
    want = base.generate(PROMPT, max_tokens=24, ignore_eos=True).sha256
    reads = _counts(base)["host_reads"]
    assert reads > 0 and _counts(base)["host_computed"] == 0
    for share in (0.5, 1.0):
        llm = LLM("synth:tiny", **KW, moe_cache_mib=mib, host_compute=share)
        assert llm.generate(PROMPT, max_tokens=24, ignore_eos=True).sha256 == want, share
        c = _counts(llm)
        assert c["host_computed"] + c["host_reads"] == reads and c["host_computed"] > 0
        assert (c["host_reads"] == 0) == (share == 1.0)
        assert {k: c[k] for k in ("hits", "misses")} == {k: _counts(base)[k] for k in ("hits", "misses")}


def test_several_token_steps_stay_within_the_hosts_rounding_and_pick_the_same_tokens(every_step_shares):
    want = decode_three(LLM("synth:tiny", **KW, moe_cache_mib=2, n_seq=3).engine)
    llm = LLM("synth:tiny", **KW, moe_cache_mib=2, n_seq=3, host_compute=0.5)
    got = decode_three(llm.engine)
    assert _counts(llm)["host_computed"] > 0
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-4, atol=1e-4)      # float32 sums in another order than the kernel's
        assert torch.equal(g.argmax(-1), w.argmax(-1))


def test_the_host_takes_the_experts_fewest_tokens_chose_and_the_kernel_reads_zeros_for_them():
    E, H, I, T, k = 6, 16, 8, 3, 2
    g = torch.Generator().manual_seed(0)
    layout = ExpertLayout(I, H)
    rows = torch.randn(E, 3 * I * H, generator=g)
    store = ExpertStore({0: rows}, layout)
    pool = torch.randn(4, 3 * I * H, generator=g)
    stats = CacheStats()
    share = HostShare(store, stats, 0.5, pool, top_k=k, reads_once=True)
    x, w = torch.randn(T, H, generator=g), torch.rand(T, k, generator=g)
    ids = torch.tensor([[0, 1], [0, 2], [0, 3]])              # from host: 0 (three tokens), 1, 2 (one each); 3 not
    from_host = np.array([True, True, True, False, False, False])
    addrs = torch.arange(T * k).view(T, k) + 1000
    assert share.split(0, x, ids, w, addrs, from_host) is None       # a step that does not share
    share.active = True
    new, compute = share.split(0, x, ids, w, addrs, from_host)
    # Two of the three host experts (share 0.5 of 3, rounded), the ones fewest tokens chose: 1 and 2. Their choices
    # read the zero row of their choice index (j = 1 here), so each token's addresses stay distinct.
    zero = share.zero_addrs.expand(T, k)
    assert torch.equal(new == zero, torch.tensor([[False, True], [False, True], [False, False]]))
    assert torch.equal(new[new != zero], addrs[new != zero])
    mine = torch.tensor([[-1, 1], [-1, 2], [-1, -1]])
    assert torch.allclose(compute(), host_experts_reference(x, rows, mine, w, layout), rtol=1e-5, atol=1e-6)
    assert stats.total[0].host_computed == 2 and stats.total[0].host_reads == -2     # the kernel's count, less 2
    assert not share.zero_rows.any() and share.zero_rows.shape == (k, pool.shape[1])


@pytest.mark.parametrize("bad", [-0.1, 1.5, True])
def test_a_share_outside_zero_to_one_is_a_one_line_error(bad):
    with pytest.raises(UserError, match="--host-compute must be a share from 0 to 1"):
        LLM("synth:tiny", **KW, moe_cache_mib=1, host_compute=bad)


def test_the_mode_turns_staging_off_and_keeps_read_through_for_the_steps_it_does_not_share():
    from moestream.engine_config import DecodeConfig
    d = DecodeConfig(zero_copy=True, stage=True, host_share=0.25)
    assert d.lands(False) and not d.stages(True)
    assert DecodeConfig(zero_copy=True).lands(False) and DecodeConfig(zero_copy=True, stage=True).stages(True)


def test_where_decode_does_not_read_in_place_over_a_cache_the_share_is_ignored_with_a_warning(caplog):
    llm = LLM("synth:tiny", ctx_size=128, device="cpu", cpu_moe=True, moe_cache_mib=2, host_compute=0.5)
    assert "--host-compute applies to zero-copy decode" in caplog.text
    llm.generate(PROMPT, max_tokens=4, ignore_eos=True)
    assert _counts(llm)["host_computed"] == 0


def test_steps_that_read_little_from_host_do_not_share_and_keep_their_bits(monkeypatch):
    """Below MIN_STEP_BYTES a step runs as without the mode: no host sync, read-through on, the same bits. Once the
    steps read more, they share (and the step after a shared one is judged by what that one read)."""
    want = decode_three(LLM("synth:tiny", **KW, moe_cache_mib=2, n_seq=3).engine)
    llm = LLM("synth:tiny", **KW, moe_cache_mib=2, n_seq=3, host_compute=0.5)
    got = decode_three(llm.engine)
    assert _counts(llm)["host_computed"] == 0 and all(torch.equal(g, w) for g, w in zip(got, want))
    reads = llm.stats()["total"]["host_read_bytes"]
    assert reads > 0
    monkeypatch.setattr(host_share, "MIN_STEP_BYTES", 1)
    llm = LLM("synth:tiny", **KW, moe_cache_mib=2, n_seq=3, host_compute=0.5)
    got = decode_three(llm.engine)
    assert _counts(llm)["host_computed"] > 0
    assert torch.equal(got[0], want[0])                 # the first step: nothing learned yet, not shared
    assert not all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_hosts_share_stays_within_bf16_rounding_of_the_kernels(every_step_shares):
    """bf16, the Triton decode kernel reading the rest, eager steps: three sequences, six steps, on the same tokens
    (bf16 rounding may flip a near tie, and a flipped token changes every later step)."""
    kw = dict(ctx_size=128, device="cuda", cpu_moe=True, moe_cache_mib=2, n_seq=3)
    spec = "synth:tiny:dtype=bfloat16"
    want = decode_three(LLM(spec, **kw).engine)
    llm = LLM(spec, **kw, host_compute=0.5)
    got = decode_three(llm.engine, follow=want)
    assert _counts(llm)["host_computed"] > 0
    for g, w in zip(got, want):
        assert torch.allclose(g.float(), w.float(), rtol=0.05, atol=0.05)


def test_a_token_whose_choices_the_host_takes_keeps_distinct_addresses():
    """Two host-computed choices of one token read two zero rows: the kernels' runs hold one choice a token (the
    grouped kernel left a choice unwritten when they shared one, on the GPU); the reference refuses equal ones."""
    E, H, I, T, k = 4, 16, 8, 2, 3
    g = torch.Generator().manual_seed(1)
    layout = ExpertLayout(I, H)
    store = ExpertStore({0: torch.randn(E, 3 * I * H, generator=g)}, layout)
    share = HostShare(store, CacheStats(), 1.0, torch.randn(4, 3 * I * H, generator=g), top_k=k, reads_once=True)
    share.active = True
    ids = torch.tensor([[0, 1, 2], [1, 2, 3]])
    x, w, addrs = torch.randn(T, H, generator=g), torch.rand(T, k, generator=g), torch.arange(T * k).view(T, k) + 10
    new, _ = share.split(0, x, ids, w, addrs, np.ones(E, dtype=bool))
    assert torch.equal(new, share.zero_addrs.expand(T, k))          # all host-computed, each choice its own row
    assert bool((new.sort(dim=1).values.diff(dim=1) != 0).all())
    from moestream.kernels.reference import AddressBook, experts_by_address_reference
    book = AddressBook()
    book.add(share.zero_rows)
    assert not experts_by_address_reference(x, new, w, layout, book=book).any()
    with pytest.raises(ValueError, match="distinct"):
        experts_by_address_reference(x, new[:, [0, 0, 1]], w, layout, book=book)
