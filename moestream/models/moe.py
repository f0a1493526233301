"""The MoE block: router, top-k, the routed experts through a provider and a kernel, the shared expert.

    y = moe_block(x, lw, layer, cfg, provider, kernel)    # x (T, H) -> (T, H)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..arch.blocks import ExpertMLP
from ..config import ModelConfig
from ..experts.provider import ExpertWeights
from ..experts.routing import report_route
from ..kernels.reference import OaiSwiglu
from .layers import swiglu
from .router import SOFTMAX, route

SWIGLU = ExpertMLP()


def combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Sum of the k expert outputs (T, k, H) weighted (T, k): one reduction over k, whose order depends only on
    the shapes, never on where the experts were computed."""
    return (y * weights.unsqueeze(-1)).sum(dim=1)


def moe_route(xs: list[torch.Tensor], lw: dict, layer: int, cfg: ModelConfig, provider, observer=None,
              next_routers: tuple = (), routed=None, router=SOFTMAX):
    """The router half of the MoE block over the parts of a forward (models/transformer.py: one ubatch, or
    consecutive ubatches of a prompt's batch run layer by layer): (T, k) weights of each part, the (T, k) ids of
    all parts one after the other, and the lookahead guesses (or None).

    Each part is routed on its own: the router's GEMM has the shape of a forward of that part alone, so it gives
    the same bits. The provider and `observer` see the parts as one ubatch of all their tokens.
    `observer` (a RouteObserver, experts/routing.py), if given, sees each ubatch's routing (for traces and stats),
    and the next layer's guess too if it has `wants_guess`.
    `routed`: the (T, k) weights and ids where the step computed them already (a fused decode step, one part:
    kernels.fused's norm_route, the norm, router, gating, top-k and renormalisation in one launch).
    `router`: the router block's options (arch/blocks.py's Router, models/router.py).
    Lookahead: `next_routers` are the routers of the MoE layers after this one. Where the provider asks
    (`lookahead_layers`: how many layers ahead), each applied to this layer's input guesses that layer's experts,
    so their copies start before its own routing is known. The guesses: a tuple of (T, k) ids, nearest layer first.
    """
    if routed is not None:
        weights, ids = [routed[0]], routed[1]
    else:
        pairs = [route(x, lw["ffn_gate_inp.weight"], cfg.n_experts_used, cfg.norm_topk_prob, router,
                       lw.get("exp_probs_b.bias"), lw.get("ffn_gate_inp.bias")) for x in xs]
        weights, ids = [w for w, _ in pairs], _cat([i for _, i in pairs])
    n = sum(x.shape[0] for x in xs)
    ahead = min(provider.lookahead_layers(layer, n), len(next_routers)) if next_routers else 0
    traced = bool(next_routers) and observer is not None and observer.wants_guess
    guesses = tuple(_cat([guess(x, r, cfg.n_experts_used) for x in xs]) for r in next_routers[:max(ahead, int(traced))])
    report_route(observer, layer, ids, guesses[0] if guesses else None)
    return weights, ids, guesses[:ahead] or None       # a guess made only for the trace is not the provider's


def guess(x: torch.Tensor, router: torch.Tensor, k: int) -> torch.Tensor:
    """The (T, k) experts another MoE layer's router (E, H) would pick for x (T, H): a lookahead guess of that layer's
    routing from this one's input (its bias and gating left out: the ranking is what a copy-ahead needs)."""
    return torch.topk(F.linear(x, router), k, dim=-1).indices


def moe_experts(xs: list[torch.Tensor], lw: dict, layer: int, cfg: ModelConfig, provider, kernel, weights, ids,
                guess=None, by_address=None, fused=None, addrs=None, mlp: ExpertMLP = SWIGLU) -> list[torch.Tensor]:
    """The expert half over the parts of a forward (moe_route's): the routed experts' weights from the provider,
    once for all parts, then each part's kernel, combine and shared expert as in a forward of that part alone.
    `by_address` (a zero-copy decode step, one part): that kernel reads each expert where the provider says it
    lies (addrs (T, k), where the router's launch looked them up already). `fused` (kernels.fused, decode steps
    on CUDA): the shared expert in two launches, on every path alike. `mlp`: the expert MLP's options (arch/blocks.py;
    gpt-oss's swiglu_oai goes to the kernel, fetched or by address, as an OaiSwiglu with each choice's expert id)."""
    act = None
    if mlp.activation == "swiglu_oai":     # the layer's (E, 2I) gate | up and (E, H) down biases
        act = OaiSwiglu(ids, lw["ffn_gate_up_exps.bias"], lw["ffn_down_exps.bias"], mlp.clamp)
    if by_address is not None:
        x, = xs
        land = provider.landing(layer, ids)
        if addrs is None:
            addrs = provider.addresses(layer, ids)
        out = (by_address(x, addrs, weights[0], provider.layout(layer), land) if act is None else
               by_address(x, addrs, weights[0], provider.layout(layer), land, act))
        return [_shared(x, lw, cfg, out, fused)]
    w = provider.fetch(layer, ids, guess)
    rows = _bounds(xs)
    if isinstance(w, ExpertWeights):
        d = w.dense(xs[0].dtype)                   # quantized rows dequantized once for every part
        ys = [kernel(x, d.slots[a:b], d.w13, d.w2) if act is None else
              kernel(x, d.slots[a:b], d.w13, d.w2, act.rows(ids[a:b])) for x, (a, b) in zip(xs, rows)]   # (T, k, H)
    else:
        # Waves (a pool smaller than the routed set): each wave computes its experts' rows of each part, in the
        # same token order as one launch would, so every expert's result is the same.
        ys = [torch.zeros(b - a, ids.shape[1], x.shape[1], dtype=x.dtype, device=x.device)
              for x, (a, b) in zip(xs, rows)]
        for wave, member in w:
            for x, y, (a, b) in zip(xs, ys, rows):
                tok, j = member[a:b].nonzero(as_tuple=True)
                if len(tok):
                    sub = act.rows(ids[a:b][tok, j].unsqueeze(1)) if act is not None else None
                    y[tok, j] = wave.run(kernel, x[tok], wave.slots[a:b][tok, j].unsqueeze(1), sub)[:, 0]
    provider.experts_launched(layer)               # the cache copies the next layer's experts ahead from here
    return [_shared(x, lw, cfg, combine(y, wt), fused) for x, y, wt in zip(xs, ys, weights)]


def _cat(ts: list[torch.Tensor]) -> torch.Tensor:
    return ts[0] if len(ts) == 1 else torch.cat(ts)


def _bounds(xs: list[torch.Tensor]) -> list[tuple[int, int]]:
    """Each part's rows [a, b) among all parts' rows."""
    out, a = [], 0
    for x in xs:
        out.append((a, a + x.shape[0]))
        a += x.shape[0]
    return out


def _shared(x: torch.Tensor, lw: dict, cfg: ModelConfig, out: torch.Tensor, fused=None) -> torch.Tensor:
    """Add the shared expert, where the family has one: sigmoid-gated where the layer has its gate
    (ffn_gate_inp_shexp: Qwen2-MoE, the hybrids), else always on (DeepSeek-V3's n_shared_experts, GLM-4.5's). The
    torch form is the fused kernel's oracle (kernels/shared_expert.py: float32 sums rounded once, so not these
    bits), which decode steps on CUDA take, gated or not."""
    if cfg.shared_expert_intermediate_size:
        gate, up, down = lw["ffn_gate_shexp.weight"], lw["ffn_up_shexp.weight"], lw["ffn_down_shexp.weight"]
        gate_inp = lw.get("ffn_gate_inp_shexp.weight")
        if fused is not None:               # a decode step on CUDA: two launches instead of nine (six ungated)
            return fused.shared_expert(x, gate, up, down, gate_inp, out)
        if gate_inp is None:
            return out + swiglu(x, gate, up, down)
        out = out + torch.sigmoid(F.linear(x, gate_inp)) * swiglu(x, gate, up, down)
    return out


def moe_block(x: torch.Tensor, lw: dict, layer: int, cfg: ModelConfig, provider, kernel,
              observer=None, next_routers: tuple = ()) -> torch.Tensor:
    """x (T, H) -> (T, H): router, then experts."""
    weights, ids, guess = moe_route([x], lw, layer, cfg, provider, observer, next_routers)
    return moe_experts([x], lw, layer, cfg, provider, kernel, weights, ids, guess)[0]
