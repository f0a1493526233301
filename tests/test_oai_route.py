"""gpt-oss's router in a decode step's fused launch (kernels/gemv.py's norm_route with the router linear's bias and
softmax_weight gating; issue 53): through Triton's interpreter (tests/interpreted.py) against models/router.py's
route on the kernel's own normed rows in float32, the same ids and the weights within 1e-5 (as tests/test_gemv.py's
and tests/test_mla_kernels.py's router checks); synth:tiny-gptoss decoding through it (tests/test_decode_paths.py's
torch stand-ins, and the kernel itself in the interpreter) giving the eager steps' tokens; compiled on the GPU
(`cuda`) at gpt-oss-120b's router shape (2880 -> 128 experts, top 4)."""
from __future__ import annotations

import sys

import pytest
import torch

from moestream import LLM

from interpreted import close, run_check

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPT_OSS = dict(gating="softmax_weight", linear_bias=True)


def test_gpt_oss_router_fuses_and_its_options_carry_the_linear_bias():
    """models/router.py: softmax_weight with the linear's bias fuses, its options name the gating and the bias;
    the others' options are as before (no linear bias)."""
    from moestream.arch.blocks import Router
    from moestream.models.router import SOFTMAX, fused_options, fuses
    lw = {"ffn_gate_inp.bias": torch.ones(4), "exp_probs_b.bias": torch.zeros(4)}
    spec = Router(**GPT_OSS)
    assert fuses(spec) and fuses(SOFTMAX) and fuses(Router("sigmoid", True, 8, 2.5, 4))
    assert not fuses(Router("softmax_weight", groups=2)) and not fuses(Router("sigmoid", linear_bias=True))
    opts = fused_options(spec, lw)
    assert opts["gating"] == "softmax_weight" and opts["linear_bias"] is lw["ffn_gate_inp.bias"]
    assert opts["bias"] is None and opts["groups"] == 1
    assert fused_options(Router("sigmoid", True), lw)["linear_bias"] is None and fused_options(SOFTMAX, lw) == {}


@pytest.mark.parametrize("kw", [{}, {"cpu_moe": True, "moe_cache_mib": 1}, {"cpu_moe": True, "zero_copy_decode": True}])
def test_tiny_gptoss_decode_steps_route_in_norm_route(kw):
    """synth:tiny-gptoss's decode steps route in the fused norm_route (its biased softmax_weight router) in each
    MoE layer on every placement, and no prompt ubatch does; the stand-in's torch math gives the eager tokens."""
    from test_decode_paths import _stand_in_fused
    from test_sink_attention import _stand_in_attention

    def run(fused):
        eng, calls = LLM("synth:tiny-gptoss", device="cpu", ctx_size=64, **kw).engine, []
        if fused:
            eng.fused = _stand_in_attention(_stand_in_fused(calls), calls)
        toks = []
        tok = int(eng.prefill(0, list(range(3, 15)))[-1].argmax())
        assert not calls
        for pos in range(12, 16):
            tok = int(eng.decode([(0, tok, pos)])[0].argmax())
            toks.append(tok)
        assert calls.count("norm_route") == (4 * len(eng.cfg.moe_layers) if fused else 0)
        return toks
    assert run(True) == run(False)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, 4, 8])
def test_gpt_oss_route_compiled_matches_route(T):
    """norm_route's softmax_weight router with the linear's bias compiled, bf16 activations, at gpt-oss-120b's
    router (2880 -> 128 experts, top 4): the same choices as route on the kernel's normed rows (float32 copies of
    the weights, as the kernel sums in float32) but where two logits nearly tie, the weights within 1e-2; 100
    launches, the first one's bits."""
    from moestream.arch.blocks import Router
    from moestream.kernels.gemv import _election_counts, norm_route
    from moestream.models.router import route
    H, E, k = 2880, 128, 4
    g = torch.Generator(device="cuda").manual_seed(T)
    h, d = (torch.randn(T, H, device="cuda", generator=g).bfloat16() for _ in range(2))
    nw = torch.rand(H, device="cuda", generator=g).bfloat16()
    router = (torch.randn(E, H, device="cuda", generator=g) * H ** -0.5).bfloat16()
    lb = (torch.randn(E, device="cuda", generator=g) * 0.5).bfloat16()
    opts = dict(gating="softmax_weight", linear_bias=lb)
    h2, x, w, ids, _ = norm_route(h, d, nw, 1e-5, router, k, False, torch.bfloat16, **opts)
    assert torch.equal(h2, h + d) and w.dtype == torch.bfloat16
    rw, rids = route(x.float(), router.float(), k, False, Router(**GPT_OSS), None, lb.float())
    same = (ids.sort(-1).values == rids.sort(-1).values).all(-1)
    assert same.float().mean() >= 0.8
    order, rorder = ids.argsort(-1), rids.argsort(-1)
    assert torch.allclose(w.gather(-1, order)[same].float(), rw.gather(-1, rorder)[same], rtol=1e-2, atol=1e-3)
    for _ in range(100):
        again = norm_route(h, d, nw, 1e-5, router, k, False, torch.bfloat16, **opts)
        assert torch.equal(again[2], w) and torch.equal(again[3], ids)
    assert not _election_counts(h.device).any()


# --- the kernel, through Triton's interpreter (tests/interpreted.py) ---
CHECKS = ["softmax_weight_route", "softmax_weight_ties", "tiny_gptoss_decode"]


@pytest.mark.parametrize("check", CHECKS)
def test_oai_route_in_the_interpreter(check):
    pytest.importorskip("triton")
    run_check(__file__, check, timeout=600)


def softmax_weight_route():
    """norm_route's softmax_weight against route (float32): with the linear's bias and without, one token and
    several, experts not a power of two, renormalise on or off (route does not read it), a zero-copy table; the
    same ids, the weights within 1e-5; groups refused."""
    from moestream.arch.blocks import Router
    from moestream.kernels import gemv
    from moestream.models.router import route
    g = torch.Generator().manual_seed(53)
    for T, E, K, k, renorm, linear_bias in ((1, 32, 64, 4, False, True), (4, 20, 96, 4, True, True),
                                            (3, 16, 40, 2, False, False)):
        h, d = torch.randn(T, K, generator=g), torch.randn(T, K, generator=g)
        nw, router = torch.rand(K, generator=g) + 0.5, torch.randn(E, K, generator=g) * K ** -0.5
        lb = torch.randn(E, generator=g) if linear_bias else None
        h2, normed, w, ids, _ = gemv.norm_route(h, d, nw, 1e-5, router, k, renorm, torch.float32,
                                                gating="softmax_weight", linear_bias=lb)
        assert torch.equal(h2, h + d)
        rw, rids = route(normed, router, k, renorm, Router("softmax_weight", linear_bias=linear_bias), None, lb)
        assert torch.equal(ids, rids), (ids, rids)
        close(w, rw)
        tab, kept = torch.randint(0, 1 << 40, (E,), generator=g), torch.full((T * k,), -1)
        again = gemv.norm_route(h, d, nw, 1e-5, router, k, renorm, torch.float32, (tab, kept),
                                gating="softmax_weight", linear_bias=lb)
        assert torch.equal(again[2], w) and torch.equal(again[3], ids)
        assert torch.equal(again[4], tab[ids]) and torch.equal(kept, ids.reshape(-1))
    assert not gemv._election_counts(h.device).any()
    with pytest.raises(ValueError, match="softmax_weight routing over 16 experts in 2 groups"):
        gemv.norm_route(h, d, nw, 1e-5, router, k, False, torch.float32, gating="softmax_weight", groups=2)


def softmax_weight_ties():
    """Two experts with the same router row and bias tie: the lower id first, equal weights, after the leader."""
    from moestream.kernels import gemv
    g = torch.Generator().manual_seed(54)
    K, E = 64, 16
    router = torch.randn(E, K, generator=g)
    router[11] = router[3]
    lb = torch.zeros(E)
    lb[3], lb[11], lb[7] = 100.0, 100.0, 300.0          # 7 leads, then 3 and 11 tied, well above the rest
    h = torch.randn(1, K, generator=g)
    _, _, w, ids, _ = gemv.norm_route(h, torch.zeros(1, K), torch.ones(K), 1e-5, router, 4, False, torch.float32,
                                      gating="softmax_weight", linear_bias=lb)
    assert ids[0, :3].tolist() == [7, 3, 11] and w[0, 1] == w[0, 2]
    assert abs(w.sum().item() - 1) < 1e-6


def tiny_gptoss_decode():
    """synth:tiny-gptoss's decode steps with the Triton norm_route (its biased softmax_weight router; the other
    fused kernels the torch stand-ins of tests/test_decode_paths.py and tests/test_sink_attention.py) against its
    eager steps: the same greedy tokens, the logits within 1e-4."""
    from moestream.kernels import gemv
    from test_decode_paths import _stand_in_fused
    from test_sink_attention import _stand_in_attention

    def run(with_fused: bool):
        eng, calls = LLM("synth:tiny-gptoss", device="cpu", ctx_size=64).engine, []
        if with_fused:
            eng.fused = _stand_in_attention(_stand_in_fused([]), [])

            def norm_route(*a, **kw):
                calls.append("norm_route")
                return gemv.norm_route(*a, **kw)
            eng.fused.norm_route = norm_route
        tok = int(eng.prefill(0, list(range(3, 15)))[-1].argmax())
        out = []
        for pos in range(12, 15):
            lg = eng.decode([(0, tok, pos)])
            out.append(lg)
            tok = int(lg[0].argmax())
        return out, calls
    (eager, _), (out, calls) = run(False), run(True)
    assert len(calls) == 3 * 4                      # 3 steps, 4 MoE layers
    for a, b in zip(out, eager):
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        close(a, b, 1e-4)


if __name__ == "__main__":
    globals()[sys.argv[1]]()
