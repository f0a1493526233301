"""gpt-oss's attention kernels: the fused decode attention with sinks and a window (kernels/fused.py) and the prompt's
flash-style sink_attention (kernels/sink_attention.py), under Triton's interpreter (tests/interpreted.py) against
their plain-torch oracles, models/layers.py's decode_attention and attention_sinks, in float32 within `close`'s
relative 1e-5 (the other kernel checks' bound); tiny-gptoss's decode steps with the fused kernels against its eager
ones. The compiled kernels, in bf16 at gpt-oss's shapes: tests/test_cuda_sink_attention.py."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from interpreted import close, run_check

CHECKS = ["decode", "decode_batch", "prompt", "model_prompt", "model_decode"]


@pytest.mark.parametrize("check", CHECKS)
def test_sink_attention_in_the_interpreter(check):
    pytest.importorskip("triton")
    run_check(__file__, check, timeout=600)


def _window_mask(n: int, pos: torch.Tensor, window: int) -> torch.Tensor:
    """(B, n): the keys up to each token's position, and with a window only its last `window`."""
    keys = torch.arange(n)[None, :]
    mask = keys <= pos[:, None]
    return mask & (keys > pos[:, None] - window) if window else mask


def decode():
    """Four tokens of three sequences (positions inside the first chunk, at a chunk's edge, at the span's end) with
    sinks (small, and large enough to hold the max) and windows (within a chunk, across chunks, none); the keys a
    token does not attend, poisoned with NaN, change no bit (whole chunks of them are masked off)."""
    from moestream.kernels import fused
    from moestream.models.layers import decode_attention
    g = torch.Generator().manual_seed(2)
    for nh, nkv, hd, n, window, sink in ((8, 2, 32, 256, 16, 1.0), (8, 2, 32, 256, 100, 8.0),
                                         (4, 4, 32, 128, 0, 1.0), (8, 2, 32, 128, 5, None)):
        kc = torch.randn(3, nkv, 512, hd, generator=g)
        vc = torch.randn_like(kc)
        seq, pos = torch.tensor([1, 0, 2, 1]), torch.tensor([0, 63, n - 1, 100])
        q = torch.randn(4, nh, hd, generator=g)
        sinks = None if sink is None else sink * torch.randn(nh, generator=g)
        mask = _window_mask(n, pos, window)
        out = fused.decode_attention(q, kc, vc, seq, pos, n, sinks=sinks, window=window)
        close(out, decode_attention(q, kc[seq, :, :n], vc[seq, :, :n], mask, sinks))
        for s in range(3):           # the keys of sequence s that none of its tokens attends
            off = ~mask[seq == s].any(0)
            kc[s, :, :n][:, off] = vc[s, :, :n][:, off] = float("nan")
        kc[:, :, n:] = vc[:, :, n:] = float("nan")                     # past the span
        assert torch.equal(fused.decode_attention(q, kc, vc, seq, pos, n, sinks=sinks, window=window), out)


def decode_batch():
    """The same bits whatever the batch: each token alone, and the batch reversed, against the batch of four."""
    from moestream.kernels import fused
    g = torch.Generator().manual_seed(3)
    nh, nkv, hd, n = 8, 2, 32, 256
    kc = torch.randn(3, nkv, 512, hd, generator=g)
    vc = torch.randn_like(kc)
    seq, pos = torch.tensor([1, 0, 2, 1]), torch.tensor([0, 63, n - 1, 100])
    q, sinks = torch.randn(4, nh, hd, generator=g), torch.randn(nh, generator=g)
    for window in (16, 0):
        out = fused.decode_attention(q, kc, vc, seq, pos, n, sinks=sinks, window=window)
        for i in range(4):
            alone = fused.decode_attention(q[i:i + 1], kc, vc, seq[i:i + 1], pos[i:i + 1], n, sinks=sinks,
                                           window=window)
            assert torch.equal(alone[0], out[i])
        back = fused.decode_attention(q.flip(0), kc, vc, seq.flip(0), pos.flip(0), n, sinks=sinks, window=window)
        assert torch.equal(back.flip(0), out)


def prompt():
    """sink_attention against attention_sinks: chunks after a cached prefix and whole prompts, grouped and plain
    heads, windows across blocks, inside one and none, sinks small, large and none, blocks of 16 and the default;
    q, k, v views of a cache as models/attention.py's attend passes them. The key blocks before the first query's
    window and the cache past the chunk, poisoned with NaN, change no bit (they are never read)."""
    from moestream.kernels.sink_attention import BLOCK, sink_attention
    from moestream.models.layers import attention_sinks
    g = torch.Generator().manual_seed(4)
    for nh, nkv, hd, Tq, Tk, window, block in ((4, 2, 16, 37, 100, 20, 16), (4, 4, 32, 50, 50, 0, 16),
                                               (8, 2, 16, 70, 70, 16, BLOCK), (4, 2, 16, 40, 200, 7, 16)):
        cache_k = torch.randn(3, nkv, 256, hd, generator=g)
        cache_v = torch.randn_like(cache_k)
        k, v = cache_k[1:2, :, :Tk], cache_v[1:2, :, :Tk]                  # (1, nkv, Tk, hd) views
        q = torch.randn(Tq, nh, hd, generator=g).transpose(0, 1).unsqueeze(0)     # (1, nh, Tq, hd), strided
        for sinks in (torch.randn(nh, generator=g), 8 + torch.randn(nh, generator=g), None):
            out = sink_attention(q, k, v, sinks, window, block)
            close(out, attention_sinks(q, k, v, sinks, window))
            kept = cache_k.clone(), cache_v.clone()
            skipped = max(0, Tk - Tq - window + 1) // block * block if window else 0
            for c in (cache_k, cache_v):
                c[1, :, :skipped] = c[1, :, Tk:] = float("nan")
            assert torch.equal(sink_attention(q, k, v, sinks, window, block), out)
            cache_k.copy_(kept[0])
            cache_v.copy_(kept[1])


def model_prompt():
    """synth:tiny-gptoss's prompt through sink_attention (interpreted; CUDA's choice forced): 28 tokens of a second
    sequence in ubatches of 16 (the second after a cached prefix, past the window of 16), against the eager
    attention_sinks."""
    from moestream import LLM
    from moestream.models import attention
    ids, calls, kernel, fits = list(range(3, 31)), [], attention.sink_attention, attention.sink_fits

    def run(kernel_fits: bool):
        attention.sink_fits = lambda q: kernel_fits
        eng = LLM("synth:tiny-gptoss", device="cpu", ctx_size=64, n_seq=2, ubatch_size=16).engine
        return eng.prefill(1, ids, all_logits=True)
    attention.sink_attention = lambda *a, **kw: (calls.append(1), kernel(*a, **kw))[1]
    try:            # the interpreter's process runs later checks: put the module back as it was
        close(run(True), run(False))
    finally:
        attention.sink_attention, attention.sink_fits = kernel, fits
    assert len(calls) == 4 * 2                      # 4 layers, 2 ubatches


def model_decode():
    """synth:tiny-gptoss's decode steps (tests/batched.py's join_and_leave: past its window of 16) with the fused
    qk_rope_kv and decode_attention interpreted (sinks on every layer, the window on the sliding ones), against
    its eager steps; the GEMVs and norms as tests/test_decode_paths.py's torch stand-ins."""
    from batched import join_and_leave
    from test_decode_paths import _stand_in_fused
    from moestream import LLM
    from moestream.kernels import fused

    def run(with_fused: bool):
        eng, calls = LLM("synth:tiny-gptoss", device="cpu", ctx_size=128, n_seq=2).engine, []
        if with_fused:
            stand = _stand_in_fused(calls)
            counted = lambda name: lambda *a, **kw: (calls.append(name), getattr(fused, name)(*a, **kw))[1]
            eng.fused = types.SimpleNamespace(**vars(stand), **{n: counted(n) for n in ("qk_rope_kv",
                                                                                         "decode_attention")})
        return join_and_leave(eng), calls
    (eager, _), (out, calls) = run(False), run(True)
    assert calls.count("qk_rope_kv") == calls.count("decode_attention") == 4 * 8      # 4 layers, 8 steps
    assert torch.equal(out[0], eager[0]) and torch.equal(out[4], eager[4])            # the prompts
    for a, b in zip(out, eager):
        close(a, b)


def check(name):
    {"decode": decode, "decode_batch": decode_batch, "prompt": prompt, "model_prompt": model_prompt,
     "model_decode": model_decode}[name]()


# --- on the CPU, no interpreter: the fused path's wiring with torch stand-ins -------------------------------------

def _stand_in_attention(fused, calls: list):
    """kernels/fused.py's qk_rope_kv (per-head QK-norm or none, rotary on whole heads or their first cos.shape[-1]
    dims) and decode_attention (with sinks and a window) as plain torch with the eager ops' math, added to
    test_decode_paths' _stand_in_fused; each call, with its options, in `calls`."""
    from moestream.models.gated_attention import partial_rope
    from moestream.models.layers import decode_attention as attend, rms_norm

    def qk_rope_kv(qkv, qk_norm, eps, cos, sin, k_cache, v_cache, seq_ids, positions, nh, nkv, ring=False):
        calls.append("qk_rope_kv")
        at = positions % k_cache.shape[2] if ring else positions
        T, hd = qkv.shape[0], k_cache.shape[-1]
        q, k, v = qkv.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q, k = q.view(T, nh, hd), k.view(T, nkv, hd)
        if qk_norm is not None:
            q, k = rms_norm(q, qk_norm[:hd], eps), rms_norm(k, qk_norm[hd:], eps)
        k_cache[seq_ids, :, at] = partial_rope(k, cos, sin)
        v_cache[seq_ids, :, at] = v.view(T, nkv, hd)
        return partial_rope(q, cos, sin)

    def decode_attention(q, k_cache, v_cache, seq_ids, positions, n, gate=None, sinks=None, window=0, ring=False):
        calls.append(("decode_attention", sinks is not None, window))
        at = torch.arange(n) % k_cache.shape[2] if ring else torch.arange(n)    # key j's row
        return attend(q, k_cache[seq_ids][:, :, at], v_cache[seq_ids][:, :, at], _window_mask(n, positions, window),
                      sinks)
    fused.qk_rope_kv, fused.decode_attention = qk_rope_kv, decode_attention
    return fused


def test_gpt_oss_decodes_through_the_fused_attention():
    """tiny-gptoss takes the fused decode attention (sinks on every layer, the window of 16 on the even ones) and
    gives the eager steps' tokens past its window (and their logits bit for bit: the stand-ins are the eager math),
    alone and two sequences together; a prompt runs none of it."""
    from batched import join_and_leave
    from test_decode_paths import _stand_in_fused
    from moestream import LLM

    def run(with_fused: bool):
        llm = LLM("synth:tiny-gptoss", ctx_size=128, device="cpu", n_seq=2)
        calls = []
        if with_fused:
            llm.engine.fused = _stand_in_attention(_stand_in_fused(calls), calls)
            assert llm.engine.model.attention.fuses(llm.engine.fused)
        llm.engine.prefill(0, list(range(3, 40)))
        assert not calls                                # a prompt runs no fused kernel
        out = llm.generate(list(range(3, 30)), max_tokens=24, ignore_eos=True).token_ids
        return out, join_and_leave(llm.engine), calls
    (tokens, eager, _), (fused_tokens, out, calls) = run(False), run(True)
    assert fused_tokens == tokens
    assert all(torch.equal(a, b) for a, b in zip(out, eager))
    attn = [c for c in calls if isinstance(c, tuple)]
    assert len(attn) == calls.count("qk_rope_kv") == 4 * (23 + 8)      # 4 layers; 23 + 8 decode steps
    assert all(c == ("decode_attention", True, 16 if i % 2 == 0 else 0) for i, c in enumerate(attn))


if __name__ == "__main__":
    check(sys.argv[1])
