"""The Gated DeltaNet's kernels in plain torch: the CPU path and the oracle of kernels/delta.py's (fla's chunked
and recurrent delta rules, the one-launch decode step). models/deltanet.py is the layer around them.

    o, S = chunk_gated_delta_rule(q, k, v, g, beta, S0)        # a prompt: q, k (B, T, nk, dk), v (B, T, nv, dv)
    o, S = TORCH.recurrent(q, k, v, g, beta, S)                 # one token a sequence, the same recurrence
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None = None,
                  activation: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over time, then SiLU: x (B, T, C), weight (C, K), state (B, C, K-1) the inputs before
    x (None: zeros, a sequence's start) -> y (B, T, C), the new state (the last K-1 inputs). T = 1 is a decode step."""
    B, T, C = x.shape
    weight = weight.reshape(C, -1)
    K = weight.shape[1]
    if state is None:
        state = x.new_zeros(B, C, K - 1)
    window = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)           # (B, C, K-1+T)
    y = F.conv1d(window, weight.unsqueeze(1), groups=C)                           # (B, C, T)
    if activation:
        y = F.silu(y)
    return y.transpose(1, 2), window[:, :, window.shape[-1] - (K - 1):]


def _heads_first(q, k, v, g, beta, scale):
    """(B, T, h, d) inputs -> float32 (B, nv, T, d), key heads repeated for their value heads, q scaled."""
    r = v.shape[2] // k.shape[2]
    q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
    q, k, v, g, beta = (t.transpose(1, 2).float() for t in (q, k, v, g, beta))
    return q * (scale if scale is not None else q.shape[-1] ** -0.5), k, v, g, beta


def recurrent_gated_delta_rule(q, k, v, g, beta, state=None, scale=None):
    """The delta rule token by token: q, k (B, T, nk, dk) L2-normed, v (B, T, nv, dv), g and beta (B, T, nv),
    state (B, nv, dk, dv) or None -> out (B, T, nv, dv) in v's dtype, final state (B, nv, dk, dv) float32."""
    B, T, nv, dv = v.shape
    dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, scale)
    S = q.new_zeros(B, nv, q.shape[-1], dv) if state is None else state.float().clone()
    out = torch.empty(B, nv, T, dv, dtype=torch.float32, device=v.device)
    for t in range(T):
        S = S * g[:, :, t].exp()[..., None, None]
        kt = k[:, :, t]                                                            # (B, nv, dk)
        delta = (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", S, kt)) * beta[:, :, t, None]
        S = S + kt[..., :, None] * delta[..., None, :]
        out[:, :, t] = torch.einsum("bhkv,bhk->bhv", S, q[:, :, t])
    return out.transpose(1, 2).to(dtype), S


def chunk_gated_delta_rule(q, k, v, g, beta, state=None, chunk_size: int = 64, scale=None):
    """The delta rule a chunk of tokens at a time; arguments and results as recurrent_gated_delta_rule's.

    Inside a chunk, with G_i the cumulative log-decay from its start to token i, the state before it S0 and
    A_ij = beta_i k_i.k_j exp(G_i - G_j) for j < i, the corrections written to the state are
        u = (I + A)^-1 (beta v) - (I + A)^-1 (beta k exp(G)) S0      (a unit lower-triangular solve, the WY form)
    and then o_i = exp(G_i) q_i S0 + sum_{j<=i} exp(G_i - G_j) (q_i.k_j) u_j,
    S = exp(G_last) S0 + sum_j exp(G_last - G_j) k_j u_j^T. The chunks then run in sequence.
    """
    B, T, nv, dv = v.shape
    dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, scale)
    dk = q.shape[-1]
    pad = -T % chunk_size               # zero-padded tokens: beta = 0 and g = 0 leave the state as it was
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    N, L = (T + pad) // chunk_size, chunk_size
    q, k, v = (t.reshape(B, nv, N, L, -1) for t in (q, k, v))                     # (B, nv, N, L, d)
    g, beta = g.reshape(B, nv, N, L), beta.reshape(B, nv, N, L)
    G = g.cumsum(-1)                                                               # (B, nv, N, L)
    causal = torch.ones(L, L, dtype=torch.bool, device=v.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()   # (.., L, L): i, j
    kk = k @ k.transpose(-1, -2)                                                   # (B, nv, N, L, L)
    A = (beta[..., None] * kk * decay).tril(-1)
    eye = torch.eye(L, dtype=A.dtype, device=A.device)
    u0 = torch.linalg.solve_triangular(A + eye, beta[..., None] * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(A + eye, beta[..., None] * k * G.exp()[..., None], upper=False,
                                      unitriangular=True)                          # (B, nv, N, L, dk)
    qk = (q @ k.transpose(-1, -2)) * decay                                         # (B, nv, N, L, L)
    q_in = q * G.exp()[..., None]                       # reads the state the chunk starts from
    k_out = k * (G[..., -1:] - G).exp()[..., None]      # writes the state the chunk ends with
    S = q.new_zeros(B, nv, dk, dv) if state is None else state.float().clone()
    out = torch.empty(B, nv, N, L, dv, dtype=torch.float32, device=v.device)
    for n in range(N):
        u = u0[:, :, n] - w[:, :, n] @ S                                           # (B, nv, L, dv)
        out[:, :, n] = q_in[:, :, n] @ S + qk[:, :, n] @ u
        S = S * G[:, :, n, -1].exp()[..., None, None] + k_out[:, :, n].transpose(-1, -2) @ u
    out = out.reshape(B, nv, N * L, dv)[:, :, :T]
    return out.transpose(1, 2).to(dtype), S


@dataclass(frozen=True)
class DeltaKernels:
    """The seam where a DeltaNet layer's kernels are chosen (kernels/delta.py: pick_delta_kernels), each with the
    signature of its plain-torch reference here (step_in_place's: models/deltanet.py): the causal conv (causal_conv1d), the delta rule over a prompt
    (chunk_gated_delta_rule), over one token per sequence (recurrent_gated_delta_rule), and optionally a whole
    decode step on the cache's states in place (step_in_place's: the engine's decode steps; None: step_in_place
    itself around this conv and recurrence, which gathers the states and writes them back)."""
    name: str
    conv: Callable
    chunk: Callable
    recurrent: Callable
    in_place: Callable | None = None


TORCH = DeltaKernels("torch", causal_conv1d, chunk_gated_delta_rule, recurrent_gated_delta_rule)
