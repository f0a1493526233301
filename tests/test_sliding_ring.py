"""gpt-oss's sliding layers keep a ring of window + ubatch positions (runtime/sliding_kv.py): synth:tiny-gptoss (a
window of 16) at -ub 8 keeps 24 positions a sequence on its sliding layers, and every test runs a context several
times that. The contract: the logits are the linear cache's bit for bit (torch.equal: the same keys in the same
order), for prompts in ubatches, batch-by-layer prompts, decode steps of one and two sequences, a verify-like
forward rolled back, a ring grown by a larger -ub, CUDA graph warm-ups (kept); prefix reuse keeps a prefix only
where the ring still holds its window, else starts again from 0 (the fresh run's bits). Against runs with other
ubatch cuts or batches: within 1e-4, the family's bound (float32 sums of other GEMM shapes; logits O(3)). The
kernels' ring reads under Triton's interpreter (tests/interpreted.py), bit for bit against their linear reads; the
compiled ones: `cuda`-marked."""
from __future__ import annotations

import sys

import pytest
import torch

from batched import served
from interpreted import run_check
from moestream import LLM
from moestream.errors import UserError
from moestream.models.transformer import Segment
from moestream.runtime.caches import make_cache
from moestream.runtime.kv_cache import cache_nbytes, describe_kv
from moestream.runtime.scheduler import Scheduler
from moestream.runtime.sliding_kv import SlidingKVCache, ring_positions

CTX, UB, W = 128, 8, 16
IDS = [(7 * i + 3) % 250 + 3 for i in range(70)]          # 70 tokens: four windows and more, nine ubatches


def engines(n_seq: int = 1, **kw):
    """(ring engine, linear engine): the same weights and -ub, the second's cache every position of every layer."""
    ring = LLM("synth:tiny-gptoss", device="cpu", ctx_size=CTX, n_seq=n_seq, ubatch_size=UB, **kw).engine
    lin = LLM("synth:tiny-gptoss", device="cpu", ctx_size=CTX, n_seq=n_seq, ubatch_size=UB, **kw).engine
    lin.kv = make_cache(lin.cfg, n_seq, CTX, lin.dtype, "cpu")
    assert isinstance(ring.kv, SlidingKVCache) and ring.kv.ring == [W + UB, 0, W + UB, 0]
    assert not any(lin.kv.ring)
    return ring, lin


def script(eng) -> torch.Tensor:
    """A prompt of 70 in ubatches (every token's logits), 20 decode steps, then a verify-like forward of 5 tokens
    at 90 rolled back to 92 and 6 more steps from there: every logit, (70 + 20 + 5 + 6, V)."""
    out = [eng.prefill(0, IDS, all_logits=True)]
    out += [eng.decode([(0, 5 + i, 70 + i)]) for i in range(20)]
    out.append(eng.forward([Segment(0, 90, 5)], [9, 8, 7, 6, 5], all_logits=True))
    eng.kv.rollback(0, 92)
    out += [eng.decode([(0, 11 + i, 92 + i)]) for i in range(6)]
    return torch.cat(out)


@pytest.mark.parametrize("kw", [{}, {"cpu_moe": True, "batch_size": 32}])
def test_the_ring_gives_the_linear_cache_bits(kw):
    """Prompt ubatches (batch by layer with host experts: four parts of a sequence in one forward), decode steps
    past the ring many times over, a rolled-back verify: the linear cache's logits, bit for bit."""
    ring, lin = engines(**kw)
    assert torch.equal(script(ring), script(lin))
    assert ring.kv.top == [98]


def test_several_sequences_decoded_together_equal_each_alone():
    """Two sequences' prompts (70 and 50) then steps of both together: each row the step of its sequence alone
    (the ring read by each token's own sequence) within 1e-4 (steps of two tokens run other GEMM shapes; twelve
    steps of differences of 1e-6), and the linear cache's bits."""
    ring, lin = engines(n_seq=2)
    b = IDS[10:60]

    def together(eng):
        eng.prefill(0, IDS)
        eng.prefill(1, b)
        return torch.cat([eng.decode([(0, 5 + i, 70 + i), (1, 9 + i, 50 + i)]) for i in range(12)])

    def alone(seq, prompt, first):
        eng = engines(n_seq=2)[0]
        eng.prefill(seq, prompt)
        return torch.cat([eng.decode([(seq, first + i, len(prompt) + i)]) for i in range(12)])
    both = together(ring)
    assert torch.equal(both, together(lin))
    assert (both[0::2] - alone(0, IDS, 5)).abs().max() < 1e-4
    assert (both[1::2] - alone(1, b, 9)).abs().max() < 1e-4


def test_a_prompt_in_ubatches_equals_one_ubatch():
    """The prompt in nine ubatches of 8 against one of 70 (its ring 86 positions): within 1e-4 (other GEMM shapes:
    differences of 1e-5 at most here)."""
    ring, _ = engines()
    whole = LLM("synth:tiny-gptoss", device="cpu", ctx_size=CTX, ubatch_size=70).engine
    assert whole.kv.ring[0] == 86
    assert (ring.prefill(0, IDS, all_logits=True) - whole.prefill(0, IDS, all_logits=True)).abs().max() < 1e-4


def test_prefix_reuse_fits_or_starts_again():
    """A sequence that reached position 69 (plus a step at 70): a prompt sharing its first 66 tokens reuses them
    (the ring still holds positions 47..70; the window before 66 is 51..65): the linear cache's bits, within 1e-4
    of a fresh run. One sharing its first 40 reuses nothing (positions 25..39 were overwritten), runs from 0 with a
    fresh run's bits, and a segment forced to start at 40 is refused."""
    ring, lin = engines()
    fresh = engines()[0]
    near, far = IDS[:66] + [200, 201, 202], IDS[:40] + [210, 211]
    for eng in (ring, lin):
        eng.prefill(0, IDS)
        eng.decode([(0, 5, 70)])
    cached = IDS + [5]
    assert ring.kv.top == [71]
    assert ring.reusable_prefix(cached, near, 0) == lin.reusable_prefix(cached, near, 0) == 66
    got = ring.prefill(0, near[66:], start=66, all_logits=True)
    assert torch.equal(got, lin.prefill(0, near[66:], start=66, all_logits=True))
    assert (got - fresh.prefill(0, near, all_logits=True)[66:]).abs().max() < 1e-4
    # the ring reached 71 (the earlier run's step at 70): 71 - 40 is more than R - W + 1 = 9
    assert ring.kv.top == [71] and lin.reusable_prefix(cached, far, 0) == 40
    assert ring.reusable_prefix(cached, far, 0) == 0 and ring.reusable_prefix(near, far, 0) == 0
    with pytest.raises(UserError, match="no longer holds the sliding window before position 40"):
        ring.prefill(0, far[40:], start=40)
    assert torch.equal(ring.prefill(0, far, all_logits=True), fresh.prefill(0, far, all_logits=True))
    assert ring.kv.top == [42]


def test_the_server_reuses_a_prefix_only_where_the_ring_holds_its_window():
    """One slot: a continuation of what it holds reuses all of it; a prompt sharing only its first 20 tokens reuses
    none (the slot's sequence reached 50 or so: positions 5..19 are gone), where a linear cache would reuse 20;
    each request's tokens are a fresh engine's."""
    llm = LLM("synth:tiny-gptoss", device="cpu", ctx_size=CTX, ubatch_size=UB)
    ref = LLM("synth:tiny-gptoss", device="cpu", ctx_size=CTX, ubatch_size=UB)
    sched = Scheduler(llm, n_slots=1, max_queue=4)
    sched.start()
    try:
        first = served(sched, IDS[:40])
        held = IDS[:40] + first.token_ids[:-1]        # what the slot's sequence has run (the last token is not fed)
        second = served(sched, held + IDS[50:60])
        assert second.cached_tokens == len(held)
        assert second.token_ids == ref.generate(held + IDS[50:60], max_tokens=4).token_ids
        third = served(sched, IDS[:20] + IDS[60:70])
        assert third.cached_tokens == 0
        assert third.token_ids == ref.generate(IDS[:20] + IDS[60:70], max_tokens=4).token_ids
    finally:
        sched.stop()


def test_a_larger_ubatch_grows_the_ring_keeping_what_it_holds():
    """set_batching to -ub 32 after a prompt: the ring grows to 48 with the positions it held moved, and the next
    ubatches and steps give the linear cache's bits (which takes any -ub)."""
    ring, lin = engines()
    outs = []
    for eng in (ring, lin):
        a = eng.prefill(0, IDS[:45], all_logits=True)
        eng.set_batching(32, 32)
        outs.append(torch.cat([a, eng.prefill(0, IDS[45:], start=45, all_logits=True),
                               *[eng.decode([(0, 5 + i, 70 + i)]) for i in range(5)]]))
    assert ring.kv.ring == [48, 0, 48, 0] and ring.kv.k[0].shape[2] == 48
    assert torch.equal(*outs)


def test_a_ring_growth_the_device_cannot_hold_is_one_line_and_leaves_the_cache():
    """make_room with the device's free bytes: a growth that needs more is refused in one line, naming the bytes
    and the way out; the rings and what they hold stay as they were."""
    ring, _ = engines()
    ring.prefill(0, IDS[:45])
    before = [t.clone() for t in (ring.kv.k[0], ring.kv.v[0])]
    per = sum(t[0][:, :, :1].nelement() * t[0].element_size() for t in (ring.kv.k, ring.kv.v))   # a position, k + v
    with pytest.raises(UserError, match="rings grown to 48 positions .* use a smaller -ub"):
        ring.kv.make_room(32, free=2 * 48 * per - 1)          # two sliding layers of 48 positions: one byte short
    assert ring.kv.ring == [24, 0, 24, 0]
    assert torch.equal(ring.kv.k[0], before[0]) and torch.equal(ring.kv.v[0], before[1])
    assert ring.kv.make_room(32, free=2 * 48 * per)
    assert ring.kv.ring == [48, 0, 48, 0]


def test_kept_forwards_leave_the_ring_as_it_was():
    """A CUDA graph's warm-up (engine.warm_up_decode's steps at each span's last position, which land in ring
    slots of live positions) inside kept(): the rings and each sequence's top are put back."""
    ring, _ = engines()
    ring.prefill(0, IDS)
    rings = lambda: [ring.kv.k[0], ring.kv.v[0], ring.kv.k[2], ring.kv.v[2]]        # the sliding layers'
    before = [t.clone() for t in rings()]
    with ring.kv.kept():
        ring.decode([(0, 0, CTX - 1)])
        assert not all(torch.equal(a, b) for a, b in zip(before, rings()))
    assert all(torch.equal(a, b) for a, b in zip(before, rings())) and ring.kv.top == [70]


def test_a_forward_longer_than_the_ring_takes_is_one_line():
    ring, _ = engines()
    with pytest.raises(UserError, match="a forward of 9 tokens of one sequence is more than the sliding layers' ring"):
        ring.forward([Segment(0, 0, 9)], list(range(3, 12)))


def test_the_ring_size_and_the_memory_it_saves():
    """R = window + the most tokens a forward writes (a ubatch, or drafts + 1), none where that is the context; at
    gpt-oss-120b's shapes a 128k context keeps half the bytes (18 of 36 layers slide) plus 22.5 MiB of rings."""
    from moestream.loading.synth import SynthSource
    cfg = SynthSource.from_spec("gpt-oss-120b").config
    assert ring_positions(cfg, 512, 0, 131072) == 640 and ring_positions(cfg, 512, 600, 131072) == 729
    assert ring_positions(cfg, 4096, 0, 4096) == 0
    grows, fixed = cache_nbytes(cfg, 1, 131072, torch.bfloat16, 640)
    assert 2 * grows == cache_nbytes(cfg, 1, 131072, torch.bfloat16)[0] and fixed == 18 * 640 * 2048
    line = describe_kv(cfg, 1, 131072, torch.bfloat16, 640)
    assert ("36.0 KiB a token" in line and "a ring of 640 positions (22.5 MiB a sequence), 4.52 GiB for 128k tokens "
            "(9.00 GiB keeping every position: 72.0 KiB a token)" in line), line


# --- the kernels' ring reads under Triton's interpreter --------------------------------------------------------

@pytest.mark.parametrize("check", ["decode_ring", "prompt_ring"])
def test_ring_kernels_in_the_interpreter(check):
    pytest.importorskip("triton")
    run_check(__file__, check, timeout=600)


def _ring_of(cache: torch.Tensor, top: torch.Tensor, R: int) -> torch.Tensor:
    """A linear cache (n_seq, nkv, ctx, hd) as rings of R positions, each sequence holding its last R below top,
    the other slots poisoned with NaN."""
    ring = torch.full(cache.shape[:2] + (R,) + cache.shape[3:], float("nan"))
    for s, t in enumerate(top.tolist()):
        pos = torch.arange(max(0, t - R), t)
        ring[s, :, pos % R] = cache[s, :, pos]
    return ring


def decode_ring():
    """qk_rope_kv writes a token's key at position % R; decode_attention with ring=True over rings (the slots no
    token attends NaN) gives the linear cache's bits, with sinks, a window of 16 across chunks, and a span past
    the ring many times over."""
    from moestream.kernels import fused
    g = torch.Generator().manual_seed(5)
    nh, nkv, hd, n, window, R = 8, 2, 32, 256, 16, 40
    kc, vc = torch.randn(3, nkv, 512, hd, generator=g), torch.randn(3, nkv, 512, hd, generator=g)
    seq, pos = torch.tensor([1, 0, 2, 1]), torch.tensor([200, 63, 255, 200])
    q, sinks = torch.randn(4, nh, hd, generator=g), torch.randn(nh, generator=g)
    top = torch.tensor([64, 201, 256])
    out = fused.decode_attention(q, kc, vc, seq, pos, n, sinks=sinks, window=window)
    kr, vr = _ring_of(kc, top, R), _ring_of(vc, top, R)
    assert torch.equal(fused.decode_attention(q, kr, vr, seq, pos, n, sinks=sinks, window=window, ring=True), out)
    cos, sin = torch.randn(2, hd, generator=g), torch.randn(2, hd, generator=g)
    qkv = torch.randn(2, (nh + 2 * nkv) * hd, generator=g)
    at_seq, at_pos = torch.tensor([0, 2]), torch.tensor([130, 41])
    fused.qk_rope_kv(qkv, None, 1e-6, cos, sin, kc, vc, at_seq, at_pos, nh, nkv)
    fused.qk_rope_kv(qkv, None, 1e-6, cos, sin, kr, vr, at_seq, at_pos, nh, nkv, ring=True)
    for s, p in zip(at_seq.tolist(), at_pos.tolist()):
        assert torch.equal(kr[s, :, p % R], kc[s, :, p]) and torch.equal(vr[s, :, p % R], vc[s, :, p])


def prompt_ring():
    """sink_attention and attention_sinks with `start` over a ring of R = window + chunk positions (the others
    NaN) against their linear reads: the same bits, each; a chunk after a prefix longer than the ring, and one
    from position 0."""
    from moestream.kernels.sink_attention import sink_attention
    from moestream.models.layers import attention_sinks
    g = torch.Generator().manual_seed(6)
    nh, nkv, hd, window, block = 4, 2, 16, 20, 16
    for start, Tq in ((150, 37), (0, 30)):
        R = window + Tq
        cache_k, cache_v = torch.randn(1, nkv, 256, hd, generator=g), torch.randn(1, nkv, 256, hd, generator=g)
        end = start + Tq
        k, v = cache_k[:, :, :end], cache_v[:, :, :end]
        kr, vr = _ring_of(cache_k, torch.tensor([end]), R), _ring_of(cache_v, torch.tensor([end]), R)
        q = torch.randn(Tq, nh, hd, generator=g).transpose(0, 1).unsqueeze(0)
        sinks = torch.randn(nh, generator=g)
        for fn, kw in ((sink_attention, {"block": block}), (attention_sinks, {})):
            assert torch.equal(fn(q, kr, vr, sinks, window, start=start, **kw), fn(q, k, v, sinks, window, **kw))


def check(name):
    {"decode_ring": decode_ring, "prompt_ring": prompt_ring}[name]()


# --- on a CUDA GPU ---------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_ring_decodes_in_graphs_with_the_linear_cache_bits():
    """tiny-gptoss in bf16 on the GPU at -ub 8: its prompt through sink_attention, its decode steps through the
    fused kernels in CUDA graphs (ring=True on the sliding layers) and two sequences together: the linear cache's
    logits bit for bit."""
    from batched import join_and_leave

    def run(linear: bool):
        eng = LLM("synth:tiny-gptoss:dtype=bfloat16", device="cuda", ctx_size=CTX, n_seq=2, ubatch_size=UB).engine
        if linear:          # before any step: the graphs are captured over this cache
            eng.kv = make_cache(eng.cfg, 2, CTX, eng.dtype, eng.device.torch)
        assert eng.fused is not None and eng.decoder.captures
        out = [eng.prefill(0, IDS, all_logits=True).float().cpu()]
        out += [eng.decode([(0, 5 + i, 70 + i)]).float().cpu() for i in range(40)]
        eng.warm_up_decode(2)
        return out + join_and_leave(eng)
    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


if __name__ == "__main__":
    check(sys.argv[1])
