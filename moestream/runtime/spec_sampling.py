"""Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): drafts from a distribution q accepted so that
the tokens committed follow the target's distribution p exactly.

    p = distribution(target_logits, params)        # (N + 1, V): the sampler's filters (sampling.py), as probabilities
    a, last = accept_drafts(p, q, drafts, gen)     # q (N, V) the drafts' own; drafts[:a] + [last] are committed

Draft j is accepted with probability min(1, p_j(d) / q_j(d)); at the first rejection the token comes from the
residual max(0, p_j - q_j) renormalised; when all N are accepted the last comes from p_N. q None (the oracle's
drafts, bench only): a draft is accepted with probability p_j(d), as if q were one-hot on it.
"""
from __future__ import annotations

import torch

from .sampling import SamplingParams, filtered


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(n, V) float64 probabilities the sampler draws each row from (temperature, top-k, top-p, min-p)."""
    probs, keep, order = filtered(logits, [params] * logits.shape[0])
    kept = (probs * keep).double()
    kept = kept / kept.sum(dim=-1, keepdim=True)
    return torch.zeros_like(kept).scatter_(1, order, kept)


def _draw(p: torch.Tensor, gen) -> int:
    return int(torch.multinomial(p.float(), 1, generator=gen))


def accept_drafts(p: torch.Tensor, q: torch.Tensor | None, drafts: list[int], gen) -> tuple[int, int]:
    """(accepted drafts a, the token after them) for drafts (N,) with the target's p (N + 1, V) and the drafts'
    q (N, V). gen: the request's generator (None: torch's global one); p and q go to its device."""
    dev = gen.device if gen is not None else torch.device("cpu")
    p, q = p.to(dev), None if q is None else q.to(dev)
    for j, d in enumerate(drafts):
        qd = 1.0 if q is None else float(q[j, d])
        u = float(torch.rand((), generator=gen, device=dev, dtype=torch.float64))
        if u * qd < float(p[j, d]):                 # u < p/q, without dividing by a q of 0
            continue
        drafted = q[j] if q is not None else torch.zeros_like(p[j]).index_fill_(0, torch.tensor([d], device=dev), 1)
        residual = (p[j] - drafted).clamp(min=0)
        if float(residual.sum()) <= 0:              # p <= q everywhere but d: p itself (never drawn with q exact)
            residual = p[j]
        return j, _draw(residual / residual.sum(), gen)
    return len(drafts), _draw(p[len(drafts)], gen)
