"""No cache, decode over the upload buffer (experts/buffered.py): prompts upload through the buffer, decode steps
keep the same rows as the smallest cache, and the two take turns without changing a bit."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moestream import LLM
from moestream.experts import buffered
from moestream.experts.buffered import BufferedCache
from moestream.experts.cache import ExpertCache
from moestream.experts.upload import UploadPerUbatch
from moestream.runtime import placement

from batched import join_and_leave

KW = dict(ctx_size=128, device="cpu", zero_copy_decode=True)
TINY = "synth:tiny:layers=5"       # 16 rows, fewer than a token's 5 x 4 routed experts: the buffer decodes


MODES = ["buffer", "copy-ahead", "pool"]


def _mode(monkeypatch, mode: str) -> dict:
    """How prompt ubatches of 6 go: through the two sets of rows, copying ahead (a min_batch of 4) or not, or
    through one set and (ubatches above 4 tokens) the cache's prompt path."""
    if mode == "pool":
        monkeypatch.setattr(placement, "SECOND_ROWS_FREE", 1 << 62)        # no room for a second set
        monkeypatch.setattr(buffered, "POOL_PROMPT_TOKENS", 4)
    return {"prefetch_min_batch": 4} if mode == "copy-ahead" else {}


def _check_mode(eng, mode: str) -> None:
    assert eng.host.upload.pipelined == (mode != "pool")
    assert (eng.stats()["total"]["prefetched"] > 0) == (mode == "copy-ahead")


def _owned(cache: ExpertCache) -> int:
    return int((cache.residency.owner[:, 0] >= 0).sum())


def test_no_cache_with_zero_copy_decode_keeps_the_buffer_as_the_smallest_cache():
    eng = LLM(TINY, **KW, cpu_moe=True).engine
    host = eng.host
    assert isinstance(host, BufferedCache) and host.n_slots == eng.cfg.n_experts
    assert host.upload.buf.data_ptr() == host.pool.data_ptr()          # one set of rows, no second buffer
    st = eng.stats()
    assert st["cache"]["buffer"] and st["cache"]["slots"] == eng.cfg.n_experts
    # Without zero-copy decode the buffer has nobody to keep experts for: the plain upload path, no cache.
    plain = LLM(TINY, ctx_size=128, device="cpu", cpu_moe=True, zero_copy_decode=False).engine
    assert type(plain.host) is UploadPerUbatch and plain.stats()["cache"] is None


def test_rows_that_hold_a_token_of_every_layer_land_what_decode_reads_and_upload_nothing():
    """tiny's 4 layers route 16 experts a token, which its 16 rows hold: decode steps land what they read in the
    rows' free slots and upload nothing (buffered.py). Without read-through such rows would upload each miss and
    churn: they keep the plain buffer."""
    eng = LLM("synth:tiny", **KW, cpu_moe=True).engine
    host = eng.host
    assert type(host) is BufferedCache and host.zero_copy.rt.holds_a_step(eng.cfg.n_experts_used)
    tok = int(eng.prefill(0, list(range(5, 25)))[-1].argmax())
    before = eng.stats()["total"]
    for pos in range(20, 36):
        tok = int(eng.decode([(0, tok, pos)])[0].argmax())
    host.flush_decode()
    after = eng.stats()["total"]
    assert after["copies"] == before["copies"] and after["uploaded_bytes"] == before["uploaded_bytes"]
    assert after["landed"] > before["landed"] and after["hits"] > before["hits"]
    host.residency.check()
    assert type(LLM("synth:tiny", **KW, cpu_moe=True, read_through=False).engine.host) is UploadPerUbatch
    # five layers, four of them on the host: 16 choices, 16 rows (the host layers count); without read-through
    assert type(LLM(TINY, **KW, n_cpu_moe=4, read_through=False).engine.host) is UploadPerUbatch
    assert type(LLM(TINY, **KW, n_cpu_moe=5, read_through=False).engine.host) is BufferedCache


def test_decode_hits_in_the_buffer_and_a_prompt_empties_it():
    llm = LLM(TINY, **KW, cpu_moe=True)
    eng, host = llm.engine, llm.engine.host
    llm.generate("Once upon a time", max_tokens=24, ignore_eos=True)
    eng.host.flush_decode()
    t = eng.stats()["total"]
    assert t["hits"] > 0                              # decode steps found experts earlier steps had kept
    assert _owned(host) > 0
    host.residency.check()
    ids = list(range(3, 20))
    eng.begin_prompt(0)
    eng.prefill(0, ids)
    assert host.buffering and _owned(host) == 0      # the buffer's uploads took the rows: nothing is resident
    host.residency.check()
    # The prompt uploaded what uploads per ubatch do: each layer's distinct routed experts, once, no hit.
    plain = LLM(TINY, ctx_size=128, device="cpu", cpu_moe=True, zero_copy_decode=False).engine
    plain.begin_prompt(0)
    plain.prefill(0, ids)
    got, want = eng.stats()["prompt"], plain.stats()["prompt"]
    assert got["hits"] == 0 and got["misses"] == want["misses"] > 0
    assert got["uploaded_bytes"] == want["uploaded_bytes"]
    eng.decode([(0, 7, len(ids))])
    assert not host.buffering


def test_decode_keeps_the_hottest_and_uploads_no_miss(monkeypatch):
    """The buffer's E rows keep each layer's most routed experts (hot_set.py) and read misses where they lie: a
    miss uploaded into so few rows would evict what the next step reads (Qwen3-Next's reference, 512 rows for 12
    layers of top-10: 21.5% hit and 114 against 162 tok/s, bench/RESULTS.md); the buffer never plans one."""
    llm = LLM(TINY, **KW, cpu_moe=True)
    host = llm.engine.host

    def no_plan(*a, **k):
        raise AssertionError("a decode miss was planned for upload")
    monkeypatch.setattr(host.planner, "plan", no_plan)
    llm.generate("Once upon a time", max_tokens=16, ignore_eos=True)
    host.flush_decode()
    assert llm.engine.stats()["total"]["hits"] > 0


@pytest.mark.parametrize("mode", MODES)
def test_prompts_and_decode_through_the_buffer_give_the_all_device_bits(monkeypatch, mode):
    """Two sequences joining and leaving, ubatches of 6: every prompt ubatch through the buffer's two sets of rows
    (upload.py), with their copy-ahead or not, or through one set, the full ubatches through the cache's prompt
    path and the short last ones through the buffer (pool); each prompt's and step's logits equal the all-device
    engine's."""
    kw = dict(device="cpu", ctx_size=128, n_seq=2, zero_copy_decode=True, ubatch_size=6)
    want = join_and_leave(LLM(TINY, **kw).engine)
    kw.update(_mode(monkeypatch, mode))
    eng = LLM(TINY, **kw, cpu_moe=True).engine
    assert isinstance(eng.host, BufferedCache)
    got = join_and_leave(eng)
    assert len(got) == len(want)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    eng.host.residency.check()
    _check_mode(eng, mode)


def test_empty_leaves_no_expert_and_no_prefetch_claim():
    eng = LLM(TINY, **KW, cpu_moe=True).engine
    host = eng.host
    host.residency.place(np.full(4, 1), np.arange(4), np.arange(4))
    host.slots.prefetched[:3] = True
    host.empty()
    assert _owned(host) == 0 and not host.slots.prefetched.any()
    assert (host.residency.slot_of == -1).all()
    host.residency.check()
    assert np.all(host.residency.owner == -1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("extra", [{}, {"stage_host_reads": True}, {"cuda_graphs": False}])
@pytest.mark.parametrize("mode", MODES)
def test_buffer_and_pool_take_turns_with_the_all_gpu_bits_on_cuda(monkeypatch, mode, extra):
    """On CUDA the buffer's uploads (compute stream and, copied ahead, the second set's copy stream) follow the
    cache's copies (copy stream) and the decode steps' landings: the same logits as all on the GPU, in
    read-in-place, staged and eager decode."""
    kw = dict(device="cuda", ctx_size=128, n_seq=2, ubatch_size=6)
    want = join_and_leave(LLM(TINY + ":dtype=bfloat16", **kw).engine)
    kw.update(_mode(monkeypatch, mode))
    eng = LLM(TINY + ":dtype=bfloat16", **kw, cpu_moe=True, **extra).engine
    assert isinstance(eng.host, BufferedCache)
    got = join_and_leave(eng)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    _check_mode(eng, mode)
