"""The decode paths (runtime/decode.py): which one a placement gets, what each step's batch carries (the fused
kernels, the zero-copy expert kernel), and what they report to the route observers."""
from __future__ import annotations

import contextlib
import gc
import types

import pytest
import torch

from moestream import LLM, flags

from batched import join_and_leave

KW = dict(ctx_size=128, device="cpu", zero_copy_decode=True)
PROMPTS = ["Once upon a time", "The capital of France is"]


def test_which_families_take_the_fused_decode_attention(checkpoint):
    """Per-head QK-norm or none, no clipping, rotary on whole heads or part of them: every family but OLMoE
    (whole-projection norm, clip_qkv); DeepSeek-V3's latent attention where its widths fit kernels/mla.py (the
    test checkpoint's rotary key of 8 does not)."""
    from moestream.kernels.mla import mla_fits
    family, path, _ = checkpoint
    model = LLM(path, ctx_size=64, device="cpu").engine.model
    cfg = model.cfg
    mla = family.startswith("deepseek")
    assert model.attention.fuses(object()) == (mla_fits(cfg.kv_lora_rank, cfg.qk_rope_head_dim) if mla
                                                else family != "olmoe")
    assert not model.attention.fuses(None)


def _stand_in_fused(calls: list):
    """The fused kernels OLMoE and Qwen3-Next use (add + RMSNorm, the GEMVs with and without it, the router's add,
    norm, softmax and top-k, the shared expert) as plain torch with the eager ops' math: the Triton ones run only on
    CUDA. Each call is counted in `calls`."""
    import types
    from moestream.arch.blocks import Router
    from moestream.models.layers import rms_norm, swiglu
    from moestream.models.router import route

    def add_rms_norm(h, delta, w, eps):
        calls.append("add_rms_norm")
        h = h + delta
        return h, rms_norm(h, w, eps)

    def linear(x, w, bias=None):
        calls.append("linear")
        return torch.nn.functional.linear(x, w, bias)

    def norm_linear(h, delta, nw, eps, w, bias=None):
        calls.append("norm_linear")
        h = h + delta
        x = rms_norm(h, nw, eps)
        return h, x, torch.nn.functional.linear(x, w, bias)

    def norm_route(h, delta, nw, eps, router, k, renorm, dtype, table=None, **opts):
        calls.append("norm_route")
        h = h + delta
        x = rms_norm(h, nw, eps)
        if opts:        # models/router.py's fused_options: the router's form past plain softmax
            lb = opts.get("linear_bias")
            spec = Router(opts["gating"], opts["bias"] is not None, opts["groups"], opts["scale"], opts["topk_group"],
                          lb is not None)
            w, ids = route(x, router, k, renorm, spec, opts["bias"], lb)
        else:
            w, ids = route(x, router, k, renorm)
        if table is None:
            return h, x, w, ids, None
        tab, routed = table
        if routed is not None:
            routed[:ids.numel()] = ids.reshape(-1)
        return h, x, w, ids, tab[ids]

    def shared_expert(x, gate, up, down, gate_inp, out):
        calls.append("shared_expert")
        if gate_inp is None:
            return out + swiglu(x, gate, up, down)
        return out + torch.sigmoid(torch.nn.functional.linear(x, gate_inp)) * swiglu(x, gate, up, down)
    return types.SimpleNamespace(add_rms_norm=add_rms_norm, linear=linear, norm_linear=norm_linear,
                                 norm_route=norm_route, shared_expert=shared_expert)


def _stand_in_gated_attention(fused, calls: list):
    """kernels/fused.py's gated attention (gated_qk_rope_kv, decode_attention with a gate) as plain torch with
    _gated_attention's eager math, added to _stand_in_fused's; each call counted in `calls`."""
    from moestream.models.gated_attention import partial_rope
    from moestream.models.layers import decode_attention as attend, rms_norm

    def gated_qk_rope_kv(qkv, qk_norm, eps, cos, sin, k_cache, v_cache, seq_ids, positions, nh, nkv):
        calls.append("gated_qk_rope_kv")
        T, hd = qkv.shape[0], k_cache.shape[-1]
        qg, k, v = qkv.split([2 * nh * hd, nkv * hd, nkv * hd], dim=-1)
        q, gate = qg.view(T, nh, 2 * hd).chunk(2, dim=-1)                    # (T, nh, hd) each
        k_cache[seq_ids, :, positions] = partial_rope(rms_norm(k.view(T, nkv, hd), qk_norm[hd:], eps), cos, sin)
        v_cache[seq_ids, :, positions] = v.view(T, nkv, hd)
        return partial_rope(rms_norm(q, qk_norm[:hd], eps), cos, sin), gate

    def decode_attention(q, k_cache, v_cache, seq_ids, positions, n, gate=None):
        calls.append("decode_attention")
        mask = torch.arange(n)[None, :] <= positions[:, None]                # (B, n)
        o = attend(q, k_cache[seq_ids, :, :n], v_cache[seq_ids, :, :n], mask)
        return o * torch.sigmoid(gate)
    fused.gated_qk_rope_kv, fused.decode_attention = gated_qk_rope_kv, decode_attention
    return fused


def test_a_family_the_fused_attention_does_not_take_still_decodes(tmp_path):
    """OLMoE keeps eager attention in a fused decode step, and gets its mask. The fused kernels are Triton (CUDA):
    here stand-ins with the eager ops' math take the place of the ones OLMoE uses."""
    from conftest import write_checkpoint
    write_checkpoint("olmoe", str(tmp_path))

    def run(fused):
        llm = LLM(str(tmp_path), ctx_size=64, device="cpu", zero_copy_decode=True)
        if fused:
            llm.engine.fused = _stand_in_fused([])
        return llm.generate(list(range(3, 15)), max_tokens=8, ignore_eos=True).token_ids
    assert run(True) == run(False)


def test_every_decode_path_takes_the_fused_kernels(tmp_path):
    """Decode steps of up to MAX_TOKENS tokens run the fused kernels on every path: the eager step that fetches its
    experts (through the cache, or all on the device) and the zero-copy step (eager here, a graph on CUDA), so the
    placements give the same bits (on CUDA the fused ones differ from the unfused ones in the last bits). Prompt
    ubatches and longer steps run none."""
    from conftest import write_checkpoint
    from moestream.kernels.decode import MAX_TOKENS
    write_checkpoint("olmoe", str(tmp_path))

    def run(**kw):
        llm = LLM(str(tmp_path), ctx_size=64, device="cpu", n_seq=MAX_TOKENS + 1, **kw)
        eng, calls = llm.engine, []
        eng.fused = _stand_in_fused(calls)
        tok, outs = int(eng.prefill(0, list(range(3, 15)))[-1].argmax()), []
        assert not calls                            # a prompt ubatch runs no fused kernel
        for pos in range(12, 18):
            lg = eng.decode([(0, tok, pos)])
            outs.append(lg.clone())
            tok = int(lg[0].argmax())
        n = len(calls)
        eng.decode([(s, tok, 18) for s in range(MAX_TOKENS + 1)])
        assert len(calls) == n                      # a step longer than MAX_TOKENS tokens runs none either
        return outs, n
    (cached, n_cached), (dev, n_dev) = run(cpu_moe=True, moe_cache_mib=1, zero_copy_decode=False), run()
    _, n_zero_copy = run(cpu_moe=True, moe_cache_mib=1, zero_copy_decode=True)
    assert n_cached == n_dev == n_zero_copy > 0
    assert all(torch.equal(a, b) for a, b in zip(cached, dev))


@pytest.mark.parametrize("kw", [{}, {"cpu_moe": True, "moe_cache_mib": 1, "zero_copy_decode": False},
                                {"cpu_moe": True, "moe_cache_mib": 1}])
def test_decode_steps_take_the_fused_shared_expert(kw):
    """A family with a shared expert (Qwen3-Next) runs it fused in each MoE layer of a decode step, on every path
    (experts on the device, fetched through a cache, read in place), and in no prompt ubatch; the stand-in's
    torch math gives the unfused tokens."""
    def run(fused):
        llm = LLM("synth:tiny-next", ctx_size=64, device="cpu", **kw)
        calls = []
        if fused:
            llm.engine.fused = _stand_in_gated_attention(_stand_in_fused(calls), calls)
        eng, n_moe = llm.engine, len(llm.model_config.moe_layers)
        tok, toks = int(eng.prefill(0, list(range(3, 15)))[-1].argmax()), []
        assert "shared_expert" not in calls
        for pos in range(12, 16):
            tok = int(eng.decode([(0, tok, pos)])[0].argmax())
            toks.append(tok)
        assert calls.count("shared_expert") == (4 * n_moe if fused else 0)
        return toks
    assert run(True) == run(False)


def test_the_decode_path_is_chosen_once_from_the_placement():
    """The decode plan (runtime/plan.py), decided once at setup: graphs where a step holds no host step (every
    expert on the GPU, or zero-copy decode), on CUDA with graphs on and a kernel with no host sync; eager steps
    otherwise. With host experts the graphs take zero-copy steps only (the engine's eager path runs longer ones)
    and report their routing through the provider."""
    import types
    from moestream.engine_config import EngineConfig
    from moestream.kernels.decode import MAX_TOKENS
    from moestream.runtime.decode import EagerDecode, GraphDecode, decode_path
    from moestream.runtime.plan import decode_plan

    def path(host=False, zero_copy=True, cuda=True, graphs=True, kernel="grouped", quantized=False,
             capturable=True):
        ecfg = flags.apply(EngineConfig(kernel=kernel), zero_copy_decode=zero_copy, cuda_graphs=graphs)
        plan = decode_plan(ecfg, cuda, quantized, host, capturable)
        return decode_path(types.SimpleNamespace(plan=plan, host=object() if host else None))
    for p in (path(), path(zero_copy=False)):                  # every expert on the GPU: every step is a graph
        assert isinstance(p, GraphDecode) and p.captures and p.takes(MAX_TOKENS + 1) and not p.reports_routing
    # Quantized experts fetched (no zero-copy kernel for their types, or a step longer than MAX_TOKENS) are
    # dequantized per ubatch: a host sync, so the eager path runs those steps.
    assert isinstance(path(zero_copy=False, quantized=True), EagerDecode)
    q = path(quantized=True)
    assert isinstance(q, GraphDecode) and q.takes(MAX_TOKENS) and not q.takes(MAX_TOKENS + 1)
    p = path(host=True)
    assert isinstance(p, GraphDecode) and p.takes(MAX_TOKENS) and not p.takes(MAX_TOKENS + 1) and p.reports_routing
    for p in (path(host=True, zero_copy=False), path(cuda=False), path(graphs=False),
              path(kernel="reference"), path(capturable=False), path(host=True, capturable=False)):
        assert isinstance(p, EagerDecode) and not p.captures and p.takes(MAX_TOKENS + 1) and p.reports_routing
    llm = LLM("synth:tiny", **KW, cpu_moe=True, moe_cache_mib=2)
    llm.generate(PROMPTS[0], max_tokens=4, ignore_eos=True)
    assert isinstance(llm.engine.decoder, EagerDecode) and llm.engine.reports_decode_routing
    kept = set(vars(llm.engine.model))                        # decoding changes nothing on the model
    llm.generate(PROMPTS[1], max_tokens=4, ignore_eos=True)
    assert set(vars(llm.engine.model)) == kept and not kept & {"on_route", "decode_kernel", "fused"}


def test_a_zero_copy_step_is_one_ubatch_of_the_trace():
    """The route observers hear of each zero-copy decode step once (begin_ubatch), then its routing once queued."""
    from moestream.experts.trace import TraceRecorder
    llm = LLM("synth:tiny", **KW, cpu_moe=True, moe_cache_mib=3)
    cfg, eng = llm.model_config, llm.engine
    rec = TraceRecorder(cfg.n_layers, cfg.n_experts, eng.host.store.expert_bytes)
    eng.observe(rec)
    eng.prefill(0, list(range(5, 15)))
    for pos in range(10, 13):
        eng.decode([(0, 3, pos)])
    assert [u[:3] for u in rec.ubatches] == [[0, 10, 1]] + [[0, 1, 0]] * 3
    assert rec.ubatch_of[-len(cfg.moe_layers):] == [3] * len(cfg.moe_layers)


def test_a_step_longer_than_a_zero_copy_step_runs_as_several():
    """A decode step of more tokens than a zero-copy step takes (-np above MAX_TOKENS) runs as steps of at most
    MAX_TOKENS through the fast path, not as one eager step; its logits are those of the pieces run alone."""
    from moestream.kernels.decode import MAX_TOKENS
    n = MAX_TOKENS + 4
    llm = LLM("synth:tiny", ctx_size=32, device="cpu", n_seq=n, cpu_moe=True, moe_cache_mib=12, zero_copy_decode=True)
    eng = llm.engine
    for s in range(n):
        eng.prefill(s, [s + 1, s + 2], 0)
    steps = [(s, 3 + s, 2) for s in range(n)]
    sizes = []
    run = eng.decoder.run
    eng.decoder.takes = lambda t: t <= MAX_TOKENS             # as GraphDecode with host experts
    eng.decoder.run = lambda st, span, tokens=None: (sizes.append(len(st)), run(st, span, tokens))[1]
    eng.eager.run = None                                     # the eager path must not run
    logits = eng.decode(steps)
    assert sizes == [MAX_TOKENS, 4] and logits.shape[0] == n
    pieces = torch.cat([run(steps[:MAX_TOKENS], eng.kv.span(3)), run(steps[MAX_TOKENS:], eng.kv.span(3))])
    assert torch.equal(logits.argmax(-1), pieces.argmax(-1))
    assert torch.allclose(logits, pieces, atol=1e-5)


class _Replayed:
    """A CUDA graph's stand-in on the CPU (runtime/graphs.py's record): each replay runs the recorded step again
    over the same static inputs, which the decode path rewrites before it, and overwrites the same buffer (a list
    of them, None where it has none: a split's share's crossing). A real graph holds no Python reference to what it
    reads, so `outside` (the tensors the step read that it did not make) is checked at each replay to be held by
    the engine or the decode path's graph entries, not only by this stand-in's step."""

    def __init__(self, fn, out, outside: list, eng):
        self.fn, self.out, self.outside, self.eng = fn, out, outside, eng

    def replay(self):
        held = {_storage(t) for t in _reachable([self.eng], skip=(_Replayed,)) if isinstance(t, torch.Tensor)}
        loose = [t for t in self.outside if _storage(t) not in held]
        assert not loose, f"a captured step reads {len(loose)} tensors that only its step function holds"
        got = self.fn()
        for dst, src in zip(_listed(self.out), _listed(got)):
            if dst is not None:
                dst.copy_(src)


class _Reads(torch.overrides.TorchFunctionMode):
    """The tensors the torch calls under it read that none of them made (a captured step's static inputs)."""

    def __init__(self):
        super().__init__()
        self.made, self.read = set(), {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        for t in _tensors((args, kwargs or {})):
            if id(t) not in self.made:
                self.read[id(t)] = t
        out = func(*args, **(kwargs or {}))
        self.made.update(id(t) for t in _tensors(out))
        return out


def _tensors(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def _storage(t: torch.Tensor) -> int:
    """Where a tensor's memory lies: a view held anywhere keeps its base's storage, which is what a graph reads."""
    return t.untyped_storage().data_ptr()


def _reachable(roots: list, skip: tuple) -> list:
    """The objects reachable from roots (tensors as leaves; a function through its closure and defaults only, not
    its module's globals), not through an instance of `skip`."""
    seen, out, stack = set(), [], list(roots)
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, skip) or isinstance(o, (type, types.ModuleType)):
            continue
        seen.add(id(o))
        out.append(o)
        if isinstance(o, torch.Tensor):
            continue
        if isinstance(o, types.FunctionType):
            stack.extend(c.cell_contents for c in o.__closure__ or () if c.cell_contents is not None)
            stack.extend(o.__defaults__ or ())
        elif isinstance(o, types.MethodType):
            stack.append(o.__self__)
        else:
            stack.extend(gc.get_referents(o))
    return out


def _listed(out) -> list:
    return out if isinstance(out, list) else [out]


def _replaying_on_the_cpu(monkeypatch, eng) -> None:
    """Make eng's decode path GraphDecode with CUDA graphs stood in for: what the captured path does around its
    graphs (static inputs, warm-ups under kv.kept, the positions of recurrent states, what the graphs read kept
    alive) runs on the CPU."""
    from moestream.runtime import graphs
    from moestream.runtime.decode import GraphDecode

    def record(fn, pool):
        ops = eng.host.decode_step_ops() if eng.host is not None else None
        kept = ops[2]() if ops is not None else contextlib.nullcontext()
        with eng.kv.kept(), kept:       # a capture runs nothing: this dry run only makes the buffer, then is undone
            with _Reads() as reads:
                out = fn()
            out = [None if t is None else t.clone() for t in out] if isinstance(out, list) else out.clone()
        return _Replayed(fn, out, list(reads.read.values()), eng), out, pool
    step_inputs = graphs.step_inputs
    monkeypatch.setattr(graphs, "record", record)
    monkeypatch.setattr(graphs, "warm_up", lambda dev, fn, times=1: [fn() for _ in range(times)])
    monkeypatch.setattr(graphs, "step_inputs", lambda steps, pinned: step_inputs(steps, False))
    eng.decoder = GraphDecode(eng)


@pytest.mark.parametrize("model", ["synth:tiny", "synth:tiny-next"])
@pytest.mark.parametrize("kw", [{}, {"cpu_moe": True, "moe_cache_mib": 1}, {"cpu_moe": True, "moe_cache_mib": 16}])
def test_captured_steps_replayed_give_the_eager_bits(monkeypatch, model, kw):
    """Two sequences, one decoding alone, then both (the step of two is captured in the middle of their decode: a
    hybrid model's warm-up runs on their recurrent states), then the first alone again; and the same after the
    server's captures of every size (warm_up_decode): the captured path's bits are the eager path's."""
    def script(replayed: bool, warm: bool = False) -> list[torch.Tensor]:
        eng = LLM(model, device="cpu", ctx_size=128, n_seq=2, zero_copy_decode=True, **kw).engine
        if replayed:
            _replaying_on_the_cpu(monkeypatch, eng)
            if warm:
                eng.warm_up_decode(2)
        return join_and_leave(eng)
    eager = script(False)
    for warm in (False, True):
        assert all(torch.equal(x, y) for x, y in zip(eager, script(True, warm))), warm


@pytest.mark.parametrize("model", ["synth:tiny", "synth:tiny-next"])
@pytest.mark.parametrize("replayed", [False, True])
def test_a_steps_tokens_on_the_device_give_the_bits_of_its_tokens_read_back(monkeypatch, model, replayed):
    """Greedy steps each queued on the last one's argmax on the device (Engine.decode's tokens: generate and bench
    decode so) give the logits of steps fed the same tokens as ints, eager and captured, over a cache that lands."""
    def steps(on_device: bool) -> list[torch.Tensor]:
        eng = LLM(model, device="cpu", ctx_size=64, zero_copy_decode=True, cpu_moe=True, moe_cache_mib=16).engine
        if replayed:
            _replaying_on_the_cpu(monkeypatch, eng)
        logits, out = eng.prefill(0, [5, 6, 7], 0)[-1:], []
        for pos in range(3, 12):
            tok = logits.argmax(-1)
            logits = (eng.decode([(0, -1, pos)], tokens=tok) if on_device
                      else eng.decode([(0, int(tok), pos)])).clone()
            out.append(logits)
        return out
    assert all(torch.equal(x, y) for x, y in zip(steps(False), steps(True)))
