"""fla-core's Gated DeltaNet kernels (kernels/delta.py) against the plain-torch references, and a hybrid model on
CUDA: its bits do not depend on where the experts are."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moestream import LLM
from moestream.kernels.delta import fla_available, pick_delta_kernels
from moestream.models.deltanet import TORCH, l2norm

from batched import join_and_leave

pytestmark = pytest.mark.cuda
TINY_BF16 = "synth:tiny-next:dtype=bfloat16"        # (float32 decodes eagerly: the decode kernels take 16-bit)
needs_fla = pytest.mark.skipif(not (torch.cuda.is_available() and fla_available()), reason="needs CUDA and fla-core")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _inputs(B, T, nk, nv, dk, dv, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")
    q, k = l2norm(r(B, T, nk, dk)), l2norm(r(B, T, nk, dk))
    v = r(B, T, nv, dv).bfloat16()
    gate = -F.softplus(r(B, T, nv)) * 0.5                       # log-decays, <= 0
    beta = torch.sigmoid(r(B, T, nv)).bfloat16()
    state = r(B, nv, dk, dv) * 0.1
    # the references see what the fla kernels see: q, k and beta rounded to bf16
    return q.bfloat16().float(), k.bfloat16().float(), v, gate, beta, state


@needs_fla
@pytest.mark.parametrize("T", [1, 37, 130])
def test_fla_chunk_matches_the_reference(T):
    fla = pick_delta_kernels(torch.device("cuda"), torch.bfloat16)
    assert fla.name == "fla"
    q, k, v, g, beta, state = _inputs(2, T, 2, 4, 64, 64)
    for s0 in (None, state):
        o, S = fla.chunk(q, k, v, g, beta, s0, 64)
        o_ref, S_ref = TORCH.chunk(q, k, v, g, beta.float(), s0, 64)
        assert o.dtype == v.dtype and S.dtype == torch.float32
        assert torch.allclose(o.float(), o_ref.float(), atol=3e-2, rtol=3e-2), (o.float() - o_ref.float()).abs().max()
        assert torch.allclose(S, S_ref, atol=3e-2, rtol=3e-2), (S - S_ref).abs().max()


@needs_fla
def test_fla_recurrent_matches_the_reference():
    fla = pick_delta_kernels(torch.device("cuda"), torch.bfloat16)
    q, k, v, g, beta, state = _inputs(3, 1, 2, 4, 64, 64, seed=1)
    o, S = fla.recurrent(q, k, v, g, beta, state)
    o_ref, S_ref = TORCH.recurrent(q, k, v, g, beta.float(), state)
    assert torch.allclose(o.float(), o_ref.float(), atol=2e-2, rtol=2e-2)
    assert torch.allclose(S, S_ref, atol=1e-3, rtol=1e-3)


@needs_fla
@pytest.mark.parametrize("layout", ["qwen3_next", "qwen3_5_moe"])
def test_the_in_place_step_kernel_matches_the_reference(layout):
    """kernels/delta.py's in-place decode step, compiled, bf16, at Qwen3-Next's head shapes (16 key heads, 2 value
    heads each, 128 x 128 states), against step_in_place on the same inputs; twice the same bits."""
    from moestream.kernels.delta import step_in_place_triton
    from moestream.models.deltanet import step_in_place
    from test_delta_step import case
    cfg, lw, x, proj, conv, ssm, rows = case(layout, torch.Generator().manual_seed(5), nk=16, r=2, dk=128, dv=128,
                                             n_seq=6, B=3)
    lw = {n: (t.cuda() if n == "ssm_a" else t.cuda().bfloat16()) for n, t in lw.items()}
    proj = [t.cuda().bfloat16() for t in proj]
    conv, ssm, rows = conv.cuda().bfloat16(), ssm.cuda(), rows.cuda()
    outs = []
    for _ in range(2):
        c, S = conv.clone(), ssm.clone()
        outs.append((step_in_place_triton(*proj, c, S, rows, lw, 1e-6), c, S))
    c_ref, S_ref = conv.clone(), ssm.clone()
    want = step_in_place(*proj, c_ref, S_ref, rows, lw, 1e-6)
    got, c, S = outs[0]
    assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[1]))
    assert torch.equal(c, c_ref)                             # the conv window: inputs shifted, no arithmetic
    assert torch.allclose(got.float(), want.float(), atol=3e-2, rtol=3e-2), (got.float() - want.float()).abs().max()
    assert torch.allclose(S, S_ref, atol=1e-3, rtol=1e-3), (S - S_ref).abs().max()


@needs_fla
def test_hybrid_model_on_cuda_bit_identical_across_placements():
    """synth:tiny-next in bf16 on CUDA (fla's kernels): the same logits bits and greedy tokens all on the GPU and
    with its experts in host memory behind caches of two sizes (fla's prompts, the in-place decode step)."""
    prompt = list(range(3, 40))
    outs = []
    for kw in ({}, {"cpu_moe": True, "moe_cache_mib": 1}, {"cpu_moe": True, "moe_cache_mib": 64}):
        llm = LLM(TINY_BF16, ctx_size=128, device="cuda", **kw)
        assert llm.engine.model.mixers[0].kernels.name == "fla"      # layer 0: a DeltaNet
        eng = llm.engine
        logits = eng.prefill(0, prompt, 0, all_logits=True).float().cpu()
        outs.append((logits, llm.generate(prompt, max_tokens=12).token_ids))
    for logits, ids in outs[1:]:
        assert torch.equal(logits, outs[0][0]) and ids == outs[0][1]


@needs_cuda
def test_hybrid_fused_decode_as_close_to_float32_as_the_eager_decode(monkeypatch):
    """synth:tiny-next's bf16 weights, two sequences decoding together: steps with the fused kernels (the gated
    attention's among them: one gated_qk_rope_kv per attention layer and step) are as close to the same weights run
    in float32 as the same steps with torch's bf16 ops are (within 1.5x their error: both round in other places, so
    neither is the other's bits); the prompts, which run no fused kernel, equal bit for bit."""
    from moestream.kernels import fused
    calls = []
    gated = fused.gated_qk_rope_kv
    monkeypatch.setattr(fused, "gated_qk_rope_kv", lambda *a: (calls.append(1), gated(*a))[1])

    def run(with_fused: bool, dtype: str = "bfloat16") -> list[torch.Tensor]:
        # the torch ops' steps run eagerly: on CUDA in bf16 an engine always has the fused kernels, and no path
        # captures a graph of steps without them
        eng = LLM(TINY_BF16, ctx_size=128, n_seq=2, device="cuda", cuda_graphs=with_fused, dtype=dtype).engine
        if not with_fused:
            eng.fused = None
        out = [eng.prefill(0, list(range(3, 30))).float().cpu(), eng.prefill(1, list(range(40, 51))).float().cpu()]
        return out + [eng.decode([(0, 7 + i, 27 + i), (1, 30 + i, 11 + i)]).float().cpu() for i in range(4)]
    truth = run(False, "float32")
    eager = run(False)
    assert not calls
    out = run(True)
    assert len(calls) >= 2                  # each attention layer's (at least once: a captured step replays it)
    assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])
    for a, b, t in zip(out[2:], eager[2:], truth[2:]):
        assert (a - t).norm() <= 1.5 * (b - t).norm() + 1e-3 * t.norm()
        assert (a - t).abs().max() < 0.1 * t.abs().max()


def _two_streams(**kw) -> list[torch.Tensor]:
    """tests/batched.py's join_and_leave on synth:tiny-next in bf16; after the server's captures of every batch size
    and span (warm_up_decode) where warm is set."""
    warm = kw.pop("warm", False)
    eng = LLM(TINY_BF16, ctx_size=512, n_seq=2, device="cuda", **kw).engine
    if warm:
        eng.warm_up_decode(2)
    return join_and_leave(eng)


@needs_fla
@pytest.mark.parametrize("kw", [{}, {"cpu_moe": True, "moe_cache_mib": 1}, {"cpu_moe": True, "moe_cache_mib": 64}])
def test_hybrid_decode_graphs_give_the_eager_bits(kw):
    """A hybrid model's decode steps replayed as CUDA graphs give the bits of eager steps, also when a graph is
    captured in the middle of two sequences' decode (its warm-up runs on their states, kv.kept puts them back) and
    after the server's captures of every size up front."""
    assert type(LLM(TINY_BF16, ctx_size=64, device="cuda", **kw).engine.decoder).__name__ == "GraphDecode"
    eager = _two_streams(cuda_graphs=False, **kw)
    for warm in (False, True):
        graphs = _two_streams(warm=warm, **kw)
        assert all(torch.equal(x, y) for x, y in zip(eager, graphs)), warm
