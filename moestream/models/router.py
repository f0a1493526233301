"""The MoE router block: the gating function over every expert's logit, top-k, the weights renormalised where the
checkpoint says (ModelConfig.norm_topk_prob). A family's entry picks its options (arch/blocks.py's Router).

    weights, ids = route(x, lw["ffn_gate_inp.weight"], k, norm_topk)       # x (T, H) -> (T, k) each

Softmax is the gating every family run today uses; a sigmoid with a correction bias and expert groups (DeepSeek-V3)
is the room models/blocks.py keeps: it refuses those options until the next family brings their math here. A fused
decode step routes in kernels/fused.py's norm_route, which is softmax's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..arch.blocks import Router

SOFTMAX = Router()


def _softmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits, dim=-1, dtype=torch.float32)


# (T, E) logits -> (T, E) float32 scores; softmax_weight's softmax is over the chosen k (route); room: "sigmoid"
GATING = {"softmax": _softmax, "softmax_weight": None}


def route(x: torch.Tensor, router: torch.Tensor, k: int, norm_topk: bool,
          spec: Router = SOFTMAX, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """spec's gating over all experts in float32 (softmax), top-k, optionally renormalised: (T, k) weights (x's
    dtype), ids. bias: the router linear's (spec.linear_bias).

    Mixtral's softmax-over-the-top-k-logits is the same function as softmax, top-k, renormalise. softmax_weight
    (gpt-oss, as transformers and llama.cpp compute it): top-k over the logits, a float32 softmax over those k.
    """
    logits = F.linear(x, router, bias)                                  # (T, E)
    if spec.gating == "softmax_weight":
        top, ids = torch.topk(logits, k, dim=-1)                        # (T, k)
        return torch.softmax(top.float(), dim=-1).to(x.dtype), ids
    probs = GATING[spec.gating](logits)
    weights, ids = torch.topk(probs, k, dim=-1)                         # (T, k)
    if norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), ids
