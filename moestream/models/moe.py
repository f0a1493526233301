"""The MoE block: router, top-k, the routed experts through a provider and a kernel, the shared expert.

    y = moe_block(x, lw, layer, cfg, provider, kernel)    # x (T, H) -> (T, H)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..experts.provider import ExpertWeights
from ..experts.routing import report_route
from .layers import swiglu


def route(x: torch.Tensor, router: torch.Tensor, k: int, norm_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in float32, top-k, optionally renormalised: (T, k) weights (x's dtype), ids.

    Mixtral's softmax-over-the-top-k-logits is the same function as softmax, top-k, renormalise.
    """
    logits = F.linear(x, router)                                        # (T, E)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)                         # (T, k)
    if norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), ids


def combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Sum of the k expert outputs (T, k, H) weighted (T, k): one reduction over k, whose order depends only on
    the shapes, never on where the experts were computed."""
    return (y * weights.unsqueeze(-1)).sum(dim=1)


def moe_route(x: torch.Tensor, lw: dict, layer: int, cfg: ModelConfig, provider, observer=None,
              next_routers: tuple = (), routed=None):
    """The router half of the MoE block: (T, k) weights and ids, and the lookahead guesses (or None).

    `observer` (a RouteObserver, experts/routing.py), if given, sees each ubatch's routing (for traces and stats),
    and the next layer's guess too if it has `wants_guess`.
    `routed`: the (T, k) weights and ids where the step computed them already (a fused decode step: kernels.fused's
    norm_route, the norm, router, softmax, top-k and renormalisation in one launch).
    Lookahead: `next_routers` are the routers of the MoE layers after this one. Where the provider asks
    (`lookahead_layers`: how many layers ahead), each applied to this layer's input guesses that layer's experts,
    so their copies start before its own routing is known. The guesses: a tuple of (T, k) ids, nearest layer first.
    """
    if routed is not None:
        weights, ids = routed
    else:
        weights, ids = route(x, lw["ffn_gate_inp.weight"], cfg.n_experts_used, cfg.norm_topk_prob)
    ahead = min(provider.lookahead_layers(layer, x.shape[0]), len(next_routers)) if next_routers else 0
    traced = bool(next_routers) and observer is not None and observer.wants_guess
    guesses = tuple(torch.topk(F.linear(x, r), cfg.n_experts_used, dim=-1).indices
                    for r in next_routers[:max(ahead, int(traced))])
    report_route(observer, layer, ids, guesses[0] if guesses else None)
    return weights, ids, guesses[:ahead] or None       # a guess made only for the trace is not the provider's


def moe_experts(x: torch.Tensor, lw: dict, layer: int, cfg: ModelConfig, provider, kernel, weights, ids,
                guess=None, by_address=None, fused=None, addrs=None) -> torch.Tensor:
    """The expert half: the routed experts' weights from the provider, the kernel, the combine, the shared expert.
    `by_address` (a zero-copy decode step): that kernel reads each expert where the provider says it lies (addrs
    (T, k), where the router's launch looked them up already). `fused` (kernels.fused, decode steps on CUDA): the
    shared expert in two launches, on every path alike."""
    if by_address is not None:
        land = provider.landing(layer, ids)
        if addrs is None:
            addrs = provider.addresses(layer, ids)
        out = by_address(x, addrs, weights, provider.layout(layer), land)
        return _shared(x, lw, cfg, out, fused)
    w = provider.fetch(layer, ids, guess)
    if isinstance(w, ExpertWeights):
        y = w.run(kernel, x)                                             # (T, k, H)
    else:
        # Waves (a pool smaller than this ubatch's routed set): each wave computes its experts' rows, in the
        # same token order as one launch would, so every expert's result is the same.
        y = torch.zeros(*ids.shape, x.shape[1], dtype=x.dtype, device=x.device)
        for wave, member in w:
            tok, j = member.nonzero(as_tuple=True)
            y[tok, j] = wave.run(kernel, x[tok], wave.slots[tok, j].unsqueeze(1))[:, 0]
    provider.experts_launched(layer)               # the cache copies the next layer's experts ahead from here
    return _shared(x, lw, cfg, combine(y, weights), fused)


def _shared(x: torch.Tensor, lw: dict, cfg: ModelConfig, out: torch.Tensor, fused=None) -> torch.Tensor:
    """Add the sigmoid-gated shared expert, where the family has one. The torch form is the fused kernel's
    oracle (kernels/shared_expert.py: float32 sums rounded once, so not these bits)."""
    if cfg.shared_expert_intermediate_size:
        gate, up, down = lw["ffn_gate_shexp.weight"], lw["ffn_up_shexp.weight"], lw["ffn_down_shexp.weight"]
        if fused is not None:               # a decode step on CUDA: two launches instead of nine
            return fused.shared_expert(x, gate, up, down, lw["ffn_gate_inp_shexp.weight"], out)
        out = out + torch.sigmoid(F.linear(x, lw["ffn_gate_inp_shexp.weight"])) * swiglu(x, gate, up, down)
    return out


def moe_block(x: torch.Tensor, lw: dict, layer: int, cfg: ModelConfig, provider, kernel,
              observer=None, next_routers: tuple = ()) -> torch.Tensor:
    """x (T, H) -> (T, H): router, then experts."""
    weights, ids, guess = moe_route(x, lw, layer, cfg, provider, observer, next_routers)
    return moe_experts(x, lw, layer, cfg, provider, kernel, weights, ids, guess)
