"""Decode steps of DeepSeek-V3 (latent attention, the group-limited sigmoid router, an ungated shared expert) and
GLM-4.5 (the sigmoid router, one group) on the CPU: captured the way CUDA graphs capture them, with no host read
inside a step; the fused kernels they take (kernels/gemv.py's norm_route with the sigmoid router,
kernels/shared_expert.py without a gate, kernels/mla.py's absorbed attention) as torch stand-ins
(tests/mla_stand_ins.py, tests/test_decode_paths.py's); on CUDA (`-m cuda`) real graphs. The kernels themselves,
interpreted and compiled: tests/test_mla_kernels.py."""
from __future__ import annotations

import contextlib

import pytest
import torch

from moestream import LLM

from batched import join_and_leave
from mla_stand_ins import stand_in_mla

FAMILIES = ["synth:tiny-deepseek", "synth:tiny-glm"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


_reads_allowed = [0]


@contextlib.contextmanager
def reads_allowed():
    """Within it, no_host_reads lets reads through (the CPU's stand-ins of CUDA kernels: their own business)."""
    _reads_allowed[0] += 1
    try:
        yield
    finally:
        _reads_allowed[0] -= 1


@contextlib.contextmanager
def no_host_reads():
    """Within it, a tensor read back to the host (item, tolist, bool, int, float, nonzero: what a CUDA graph cannot
    capture, or captures with a shape fixed at capture time) raises."""
    names = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero")
    saved = {n: getattr(torch.Tensor, n) for n in names}
    saved_nonzero = torch.nonzero

    def refuse(name, f):
        def read(*a, **kw):
            if not _reads_allowed[0]:
                raise AssertionError(f"a decode step reads a tensor back ({name}): a CUDA graph cannot capture it")
            return f(*a, **kw)
        return read
    try:
        for n, f in saved.items():
            setattr(torch.Tensor, n, refuse(n, f))
        torch.nonzero = refuse("torch.nonzero", saved_nonzero)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
        torch.nonzero = saved_nonzero


def _forward_checked(eng):
    """eng's model forward refusing host reads in decode steps (prompts may read: they are never captured), but in
    the zero-copy expert kernel, whose CPU form (kernels/reference.py) reads its addresses back: on CUDA it is
    Triton's (tests/test_cuda.py captures it)."""
    forward, kernel = eng.model.forward_parts, eng.decode_kernel

    def checked(parts, *a):
        with no_host_reads() if all(p.is_decode for p in parts) else contextlib.nullcontext():
            return forward(parts, *a)

    def expert_kernel(*a):
        with reads_allowed():
            return kernel(*a)
    eng.model.forward_parts = checked
    if kernel is not None:
        eng.decode_kernel = expert_kernel


@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.parametrize("kw", [{}, {"cpu_moe": True, "moe_cache_mib": 1}])
def test_steps_replay_one_graph_a_size_with_the_eager_bits(monkeypatch, model, kw):
    """Latent attention and the sigmoid router hold no host read in a step, so the step captures (here the CPU
    stand-in of runtime/graphs.py's record); join_and_leave's steps, replayed, give the eager bits, and each size
    is captured once at its span (KVCache.span: the absorbed form's keys are the span's, masked)."""
    from test_decode_paths import _replaying_on_the_cpu

    def script(replayed: bool):
        eng = LLM(model, device="cpu", ctx_size=128, n_seq=2, zero_copy_decode=True, **kw).engine
        _forward_checked(eng)
        if replayed:
            _replaying_on_the_cpu(monkeypatch, eng)
        return join_and_leave(eng), eng
    (eager, _), (replayed, eng) = script(False), script(True)
    assert all(torch.equal(x, y) for x, y in zip(eager, replayed))
    assert set(eng.decoder.graphs.graphs) == {(1, 128), (2, 128)}



def test_the_host_read_check_catches_a_read():
    """no_host_reads itself: a read raises inside, not in reads_allowed, nor outside."""
    t = torch.ones(2)
    with no_host_reads():
        for read in (t.tolist, lambda: bool(t[0]), lambda: int(t[0]), lambda: t[0].item(), t.nonzero):
            with pytest.raises(AssertionError, match="reads a tensor back"):
                read()
        with reads_allowed():
            assert t.tolist() == [1.0, 1.0]
    assert t.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("model", FAMILIES)
def test_their_steps_are_planned_as_graphs_on_cuda(model):
    """On CUDA with graphs on, these families' decode steps replay graphs (the plan of runtime/plan.py, as the
    engine makes it): every step all on the GPU, zero-copy steps with host experts."""
    from moestream.arch.families import FAMILIES as TABLE
    from moestream import flags
    from moestream.engine_config import EngineConfig
    from moestream.kernels import by_address_kernels
    from moestream.runtime.plan import decode_plan
    eng = LLM(model, device="cpu", ctx_size=64).engine
    ecfg = flags.apply(EngineConfig(kernel="grouped"), zero_copy_decode=True, cuda_graphs=True)
    for host in (False, True):
        plan = decode_plan(ecfg, True, False, host, eng.model.capturable,
                           by_address_kernels(TABLE[eng.cfg.family].blocks))
        assert plan.graphs and plan.zero_copy and plan.graph_all == (not host)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.parametrize("kw", [{}, {"cpu_moe": True, "moe_cache_mib": 12}])
def test_captured_steps_give_the_eager_bits_on_cuda(model, kw):
    """Real CUDA graphs (bf16, the fused kernels in): positions 250..261 cross the 256-key span; the captured steps
    give the eager steps' bits, one graph a (size, span), and the engine runs the fused kernels."""
    def run(graphs):
        eng = LLM(f"{model}:dtype=bfloat16", ctx_size=600, device="cuda", cuda_graphs=graphs, **kw).engine
        assert eng.fused is not None and eng.model.attention.fuses(eng.fused)      # GLM-4.5: its partial rotary
        ids = torch.randint(0, 1000, (250,), generator=torch.Generator().manual_seed(1)).tolist()
        tok, outs = int(eng.prefill(0, ids, 0)[-1].argmax()), []
        for pos in range(250, 262):
            lg = eng.decode([(0, tok, pos)])
            outs.append(lg.clone())
            tok = int(lg[0].argmax())
        if graphs:
            assert set(eng.decoder.graphs.graphs) == {(1, 256), (1, 512)}
        return outs
    eager, graphs = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(eager, graphs))


def test_latent_attention_takes_the_fused_kernels_whatever_its_head_size(monkeypatch):
    """DeepSeek-V3's q/k heads are 192 wide, which GQA's fused attention kernels do not take; its decode steps
    still take the fused norms, router and shared expert (the engine's `fused` where Triton runs on CUDA), as a
    GQA model's do where its heads fit (a power of two >= 32) and not otherwise."""
    import dataclasses
    from moestream.kernels import fused
    from moestream.models.attention import GQA
    monkeypatch.setattr(fused, "fused_available", lambda device, dtype: True)      # as on CUDA
    for model in FAMILIES:
        eng = LLM(model, device="cpu", ctx_size=64).engine
        assert eng.fused is fused
    cfg = LLM("synth:tiny-glm", device="cpu", ctx_size=64).model_config
    assert GQA(cfg).takes_fused() and not GQA(dataclasses.replace(cfg, head_dim=48)).takes_fused()


@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.parametrize("kw", [{}, {"cpu_moe": True, "moe_cache_mib": 1}])
def test_decode_steps_route_and_run_the_shared_expert_fused(model, kw):
    """A decode step of these families routes in the fused norm_route (the sigmoid router with its bias, groups and
    scale) and runs the ungated shared expert fused, in each MoE layer and on every placement, and in no prompt
    ubatch (tests/test_decode_paths.py's torch stand-ins: the eager bits, the same greedy tokens)."""
    from test_decode_paths import _stand_in_fused
    from test_sink_attention import _stand_in_attention

    def run(fused):
        eng, calls = LLM(model, device="cpu", ctx_size=64, **kw).engine, []
        if fused:
            eng.fused = stand_in_mla(_stand_in_attention(_stand_in_fused(calls), calls), calls)
        n_moe, toks = len(eng.cfg.moe_layers), []
        tok = int(eng.prefill(0, list(range(3, 15)))[-1].argmax())
        assert not calls
        for pos in range(12, 16):
            tok = int(eng.decode([(0, tok, pos)])[0].argmax())
            toks.append(tok)
        assert calls.count("norm_route") == calls.count("shared_expert") == (4 * n_moe if fused else 0)
        mla = fused and model.endswith("deepseek")
        assert calls.count("mla_decode_attention") == calls.count("mla_rope_kv") == (4 * eng.cfg.n_layers if mla else 0)
        assert calls.count("qk_rope_kv") == (4 * eng.cfg.n_layers if fused and not mla else 0)    # GLM-4.5's
        return toks
    assert run(True) == run(False)

