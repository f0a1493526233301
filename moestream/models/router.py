"""The MoE router block: the gating function over every expert's logit, top-k (within the best expert groups, by a
correction bias, where the checkpoint says), the weights renormalised and scaled where it says. A family's entry
gives the defaults (arch/blocks.py's Router); the checkpoint's values are ModelConfig's (`router_of`).

    weights, ids = route(x, lw["ffn_gate_inp.weight"], k, norm_topk)                 # x (T, H) -> (T, k) each
    weights, ids = route(x, w, k, norm_topk, router_of(cfg), lw["exp_probs_b.bias"])   # DeepSeek-V3, GLM-4.5
    weights, ids = route(x, w, k, norm_topk, router_of(cfg), linear_bias=lw["ffn_gate_inp.bias"])   # gpt-oss

Softmax, top-k, renormalise is every Qwen family's, Mixtral's and OLMoE's, in the model's dtype as before.
DeepSeek-V3's (and GLM-4.5's, one group) is transformers' DeepseekV3TopkRouter and llama.cpp's build_moe_ffn:
logits and sigmoid scores in float32; the correction bias added to the scores for the choice only; the experts in
n_group groups, a group scored by the sum of its two best biased scores, the best topk_group groups kept; top-k of
their experts; the weights their unbiased scores, renormalised (norm_topk), times routed_scaling_factor.
gpt-oss's softmax_weight (transformers' GptOssTopKRouter, llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT):
the router linear with its bias, top-k over the logits, a float32 softmax over those k. A fused decode step routes
in kernels/fused.py's norm_route, which computes each of these (`fuses`, `fused_options`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..arch.blocks import Router
from ..arch.families import FAMILIES
from ..config import ModelConfig

SOFTMAX = Router()


def router_of(cfg: ModelConfig) -> Router:
    """The router block's options as the checkpoint sets them."""
    return Router(cfg.gating, cfg.router_bias, cfg.n_group, cfg.routed_scaling_factor, cfg.topk_group,
                  FAMILIES[cfg.family].blocks.router.linear_bias)


def fuses(spec: Router) -> bool:
    """Whether kernels/fused.py's norm_route computes this router: plain softmax top-k, route's float32 form
    (sigmoid or softmax, a correction bias, groups, a scale) without a bias on the router's linear, and
    softmax_weight (gpt-oss's, with or without that bias) in one group."""
    if spec.gating == "softmax_weight":
        return spec.groups == 1
    return spec == SOFTMAX or (spec.gating in ("sigmoid", "softmax") and not spec.linear_bias)


def fused_options(spec: Router, lw: dict) -> dict:
    """norm_route's keywords for this router (one that `fuses`) and the layer's weights: none for plain softmax."""
    if spec == SOFTMAX:
        return {}
    return dict(gating=spec.gating, bias=lw["exp_probs_b.bias"] if spec.bias else None, groups=spec.groups,
                topk_group=spec.topk_group, scale=spec.scale,
                linear_bias=lw["ffn_gate_inp.bias"] if spec.linear_bias else None)


def route(x: torch.Tensor, router: torch.Tensor, k: int, norm_topk: bool, spec: Router = SOFTMAX,
          bias: torch.Tensor | None = None, linear_bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """spec's gating over all experts, top-k, optionally renormalised and scaled: (T, k) weights (x's dtype), ids.
    bias (E,): the correction bias of spec.bias; linear_bias (E,): the router linear's (spec.linear_bias).

    Mixtral's softmax-over-the-top-k-logits is the same function as softmax, top-k, renormalise. softmax_weight
    (gpt-oss, as transformers and llama.cpp compute it): top-k over the logits, a float32 softmax over those k.
    """
    if spec == SOFTMAX:
        logits = F.linear(x, router)                                    # (T, E)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, k, dim=-1)                     # (T, k)
        if norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids
    if spec.gating == "softmax_weight":
        top, ids = torch.topk(F.linear(x, router, linear_bias), k, dim=-1)       # (T, k)
        return torch.softmax(top.float(), dim=-1).to(x.dtype), ids
    logits = F.linear(x.float(), router.float())                        # (T, E) float32, as transformers' router
    scores = torch.sigmoid(logits) if spec.gating == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores + bias.float() if spec.bias else scores
    if spec.groups > 1:
        T, E = choice.shape
        grouped = choice.view(T, spec.groups, E // spec.groups)         # (T, G, E/G)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)       # (T, G)
        best = torch.topk(group_scores, spec.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)     # (T, G)
        choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(T, E)
    ids = torch.topk(choice, k, dim=-1).indices                         # (T, k)
    weights = scores.gather(1, ids)
    if norm_topk:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return (weights * spec.scale).to(x.dtype), ids
