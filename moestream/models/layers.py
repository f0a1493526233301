"""The math every family shares: RMSNorm, rotary embeddings, grouped-query attention over a KV cache.

Plain functions over tensors: no file I/O, no device choice, no flags.

    cos, sin = rope_tables(cfg, max_pos, device)     # (P, hd) float32 each
    q = apply_rope(q, cos[pos], sin[pos])            # q: (T, nh, hd)
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from ..config import ModelConfig


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim. torch's fused kernel (one launch on CUDA; float32 statistics) instead of
    transformers' five elementwise steps: a decode step runs four of these per layer."""
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def _inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (rd/2,) and the attention factor for the config's rope type, over the rotary width rd
    (head_dim, or its leading head_dim * partial_rotary_factor dims: transformers' dim for every rope type)."""
    dim = cfg.rotary_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    r, kind = cfg.rope, cfg.rope_type
    if kind == "default":
        return inv, 1.0
    factor = float(r.get("factor", 1.0))
    if kind == "linear":
        return inv / factor, 1.0
    orig = r.get("original_max_position_embeddings") or cfg.max_position_embeddings
    if kind == "llama3":
        lo, hi = r.get("low_freq_factor", 1.0), r.get("high_freq_factor", 4.0)
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > orig / lo, inv / factor, inv)
        smooth = (orig / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= orig / hi) & (wavelen <= orig / lo)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn: blend interpolated and extrapolated frequencies over a ramp of dimensions
    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    att = r.get("attention_factor")
    if att is None:
        m, m_all = r.get("mscale"), r.get("mscale_all_dim")
        att = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = r.get("beta_fast") or 32, r.get("beta_slow") or 1

    def corr_dim(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))
    lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
    if r.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    extra = 1 - ramp
    return (inv / factor) * (1 - extra) + inv * extra, float(att)


def rope_tables(cfg: ModelConfig, n_pos: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions 0..n_pos-1: (n_pos, rd) float32, halves repeated (NEOX layout); rd = cfg.rotary_dim."""
    inv, att = _inv_freq(cfg)
    freqs = torch.arange(n_pos, dtype=torch.float32)[:, None] * inv[None, :]    # (P, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)                                     # (P, rd)
    return (emb.cos() * att).to(device), (emb.sin() * att).to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, hd); cos/sin: (T, hd) in x's dtype (cast once per forward, as transformers casts them)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


# cuDNN's attention is left out: on the H200 its decode-shaped calls (one query against a masked context) gave
# different bits from run to run (bench/probe.py, since deleted, in git history at a5d4676: two greedy hashes
# alternating over identical runs, none with it off), and PyTorch leaves it out of its deterministic algorithms.
# Flash, memory-efficient and math are.
DETERMINISTIC_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Causal attention of a prompt chunk: q (1, nh, Tq, hd) are the last Tq of the Tk positions in k, v
    (1, nkv, Tk, hdv) (the earlier ones are the KV cache) -> (1, nh, Tq, hdv); scale: the softmax's (None:
    hd ** -0.5).

    Grouped-query attention: the KV heads are shared by nh / nkv query heads each, without copying them. The
    causal mask is aligned to the last key (lower right), which flash attention applies without materialising it.
    """
    Tq, Tk = q.shape[2], k.shape[2]
    mask = None if Tq == Tk else causal_lower_right(Tq, Tk)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    if not q.is_cuda:
        return sdpa()
    with sdpa_kernel(DETERMINISTIC_SDPA):
        return sdpa()


def attention_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None,
                    window: int = 0, rows: int = 512, start: int | None = None) -> torch.Tensor:
    """attention() with gpt-oss's options: each head's sink logit `sinks` (nh,) joins the softmax (it takes mass
    and adds no value), and with `window` each query attends only its last `window` positions (itself included,
    as transformers' and llama.cpp's sliding window). q (1, nh, Tq, hd), the last Tq of the Tk positions of k, v
    (1, nkv, Tk, hd) -> (1, nh, Tq, hd). start: the queries' first position where k, v are a sliding layer's ring
    (position p at index p % Tk, holding the window before the queries and the queries' own; runtime/sliding_kv.py):
    each chunk gathers the same keys, in the same order, as from a linear cache.

    Plain torch in float32 (scores, softmax, sums), `rows` queries at a time, each against only the keys it may
    attend: the CPU path and the oracle of kernels/sink_attention.py, the flash-style kernel CUDA prompts run.
    """
    _, nh, Tq, hd = q.shape
    nkv, Tk = k.shape[1], k.shape[2]
    g = nh // nkv
    at = Tk - Tq if start is None else start                                # the first query's position
    out = torch.empty_like(q)
    for a in range(0, Tq, rows):
        b = min(a + rows, Tq)
        first, last = at + a, at + b - 1                                     # the chunk's positions
        lo = max(0, first - window + 1) if window else 0
        if start is None:
            kk, vv = k[0, :, lo:last + 1].float(), v[0, :, lo:last + 1].float()     # (nkv, n, hd)
        else:
            idx = torch.arange(lo, last + 1, device=k.device) % Tk
            kk, vv = k[0].index_select(1, idx).float(), v[0].index_select(1, idx).float()
        qg = q[0, :, a:b].float().reshape(nkv, g * (b - a), hd)
        scores = torch.matmul(qg, kk.transpose(-1, -2)).view(nkv, g, b - a, -1) * hd ** -0.5   # (nkv, g, r, n)
        pos = torch.arange(first, last + 1, device=q.device)[:, None]
        key = torch.arange(lo, last + 1, device=q.device)[None, :]
        allowed = (key <= pos) & ((key > pos - window) if window else True)     # (r, n)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[0, :, a:b] = _softmax_sinks(scores, sinks).matmul(vv[:, None]).reshape(nh, b - a, hd).to(q.dtype)
    return out


def _softmax_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of float32 scores (nkv, g, ..., n), with each head's sink logit (nh,) as one more
    column that is dropped after (transformers' eager_attention_forward's order)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    nkv, g = scores.shape[:2]
    sink = sinks.float().view(nkv, g, *([1] * (scores.dim() - 2))).expand(*scores.shape[:-1], 1)
    both = torch.cat([scores, sink], dim=-1)
    both = both - both.max(dim=-1, keepdim=True).values
    return torch.softmax(both, dim=-1)[..., :-1]


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """q (T, nh, hd) against k, v (nkv, n, hd) where keep (T, n) says -> (T, nh, hd)."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=keep[None, None],
                                       enable_gqa=q.shape[1] != k.shape[0])
    return o[0].transpose(0, 1)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence against its whole cache: q (B, nh, hd); k, v (B, nkv, n, hd); mask (B, n) bool
    (True: attend) -> (B, nh, hd).

    Two batched matmuls and a float32 softmax, grouped by KV head (no copy of the cache per query head): torch's
    fused kernels either do not take a mask with grouped heads (they fall back to a slow path that copies the
    cache) or are not deterministic (cuDNN, see above). Scores and softmax in float32, as flash attention keeps them.
    sinks (nh,): each head's sink logit joins the softmax (gpt-oss; a sliding window is the caller's mask).
    """
    B, nh, hd = q.shape
    nkv = k.shape[1]
    qg = q.reshape(B, nkv, nh // nkv, hd).float()                           # (B, nkv, g, hd)
    scores = torch.matmul(qg, k.float().transpose(-1, -2)) * hd ** -0.5     # (B, nkv, g, n)
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        probs = _softmax_sinks(scores.transpose(0, 1).transpose(1, 2), sinks).transpose(1, 2).transpose(0, 1)
    out = torch.matmul(probs, v.float())                                    # (B, nkv, g, hd)
    return out.reshape(B, nh, hd).to(q.dtype)


def interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on adjacent pairs (x0, x1), (x2, x3), ... (DeepSeek's rope_interleave, llama.cpp's NORM rope), the
    rotated pairs written as [evens | odds], as transformers' apply_rotary_pos_emb_interleave writes them (q and k
    alike, so their dot products are the pairs'). x (T, heads, rd); cos, sin (T, rd), halves repeated."""
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """A dense gated MLP: down(silu(gate x) * up x). x: (T, H)."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
