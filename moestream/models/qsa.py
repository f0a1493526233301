"""QSA, Qwen3.8-Flash-Next's sparse attention (transformers' Qwen4ExpTextQSAIndexer and Qwen4ExpTextAttention):
gated attention (models/gated_attention.py's math) where each query attends only the key blocks a learnt indexer
picks, plus the recent tail. Plain torch: the CPU path and the oracle; on CUDA the same ops for now (no kernel).

    iq, ik = index_qk(x, lw, cfg, cos, sin)       # indexer queries (T, ih, d), normed and turned; raw keys (T, d)
    keys = block_keys(raw_keys[:end], lw, cfg, cos_all, sin_all)              # (nb, d): the complete blocks' keys
    keep = select(iq, keys, positions, cfg)       # (T, end) bool: the keys each query attends
    attn = QSA(cfg)                               # the decoder's kind (models/attention.py's interface)

The indexer: a query at position p sees tokens 0..p, in nb = (p+1) // B complete blocks of B consecutive tokens and
a tail of the rest. A block's key is the mean of its raw index keys (float32), RMS-normed (k_norm) and turned by
rotary at the block's first position; its score is sum over the indexer heads of relu(q_h . k) / sqrt(d). The
query attends the top min(budget / B, nb) blocks' tokens and the tail (every block while nb <= budget / B: dense).
The cache keeps each token's raw index key beside its K and V (a prefix of them is valid like K and V are).

Ties. Scores are sums of ReLUs, so blocks tie at exactly 0. The rule is transformers': `torch.topk` over the
query's nb scores (a 1-D vector of exactly nb entries), whose order among equal scores is torch's CPU topk
(implementation-defined, deterministic for the same vector: neither the lower nor the higher index always wins).
select() calls topk on exactly those nb scores (a 2-D call over the queries sharing nb, row by row the same
picks), so it picks what transformers picks on the CPU. A CUDA kernel that breaks ties by index will differ from it
where a tie straddles the cut.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from .attention import GatedAttention
from .gated_attention import gated_attention, partial_rope
from .layers import masked_attention, rms_norm, rope_tables


def index_qk(x: torch.Tensor, lw: dict, cfg: ModelConfig, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, H) normed -> the indexer's queries (T, ih, d) (q_norm, rotary at the tokens' positions: cos, sin
    (T, rotary_dim)) and raw keys (T, d) (what the cache keeps)."""
    T, ih, d = x.shape[0], cfg.indexer_heads, cfg.indexer_head_dim
    q = F.linear(x, lw["indexer.q_proj.weight"]).view(T, ih, d)
    k = F.linear(x, lw["indexer.k_proj.weight"])
    q = partial_rope(rms_norm(q, lw["indexer.q_norm.weight"], cfg.rms_norm_eps), cos, sin)
    return q, k


def block_keys(raw: torch.Tensor, lw: dict, cfg: ModelConfig, cos_all: torch.Tensor,
               sin_all: torch.Tensor) -> torch.Tensor:
    """raw (n, d): a sequence's raw index keys from position 0 -> the keys of its n // B complete blocks (nb, d);
    cos_all, sin_all: rotary tables by position (in raw's dtype)."""
    B = cfg.indexer_block
    nb = raw.shape[0] // B
    pooled = raw[:nb * B].view(nb, B, raw.shape[-1]).float().mean(dim=1).to(raw.dtype)
    pooled = rms_norm(pooled, lw["indexer.k_norm.weight"], cfg.rms_norm_eps)
    starts = torch.arange(nb, device=raw.device) * B
    return partial_rope(pooled[:, None], cos_all[starts], sin_all[starts])[:, 0]


def select(q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """q (T, ih, d): queries of one sequence at `positions` (T,); keys (nb, d): block_keys of its first nb blocks,
    nb covering every complete block any of the queries sees -> (T, n) bool, the keys each query attends, n =
    positions.max() + 1."""
    B, top = cfg.indexer_block, cfg.indexer_budget // cfg.indexer_block
    n = int(positions.max()) + 1
    keep = torch.arange(n, device=q.device)[None, :] <= positions[:, None]            # causal: dense
    seen = (positions + 1) // B                                                        # complete blocks per query
    scores = torch.matmul(q.float(), keys.float().t()).transpose(-1, -2)              # (T, nb, ih)
    scores = torch.relu(scores).sum(dim=-1) / math.sqrt(cfg.indexer_head_dim)          # (T, nb)
    for nb in torch.unique(seen).tolist():
        if nb <= top:                   # every block: dense
            continue
        rows = (seen == nb).nonzero()[:, 0]
        picked = scores[rows, :nb].topk(top, dim=-1).indices                          # (r, top)
        blocks = torch.zeros(len(rows), nb, dtype=torch.bool, device=q.device)
        blocks.scatter_(1, picked, True)
        keep[rows, :nb * B] &= blocks.repeat_interleave(B, dim=1)
    return keep


def qsa_attention(x: torch.Tensor, lw: dict, cfg: ModelConfig, cos: torch.Tensor, sin: torch.Tensor,
                  rope_all: tuple[torch.Tensor, torch.Tensor], kv, index_keys: torch.Tensor, slot: int, seq: int,
                  start: int) -> torch.Tensor:
    """gated_attention of tokens start..start+T-1 of sequence `seq` over the keys its indexer keeps. index_keys
    (n_seq, ctx, d): this layer's raw index keys, the tokens' written at their positions; rope_all: the rotary
    tables by position (in x's dtype)."""
    T = x.shape[0]
    iq, ik = index_qk(x, lw, cfg, cos, sin)
    index_keys[seq, start:start + T] = ik
    keys = block_keys(index_keys[seq, :start + T], lw, cfg, *rope_all)
    keep = select(iq, keys, torch.arange(start, start + T, device=x.device), cfg)
    return gated_attention(x, lw, cfg, cos, sin, kv, slot, seq, start, keep)


class QSA(GatedAttention):
    """QSA as the decoder's attention kind: GatedAttention's projections, norms, rotary, cache writes and gate, each
    token attending the keys its indexer keeps in its own sequence's cache, which holds each token's raw index key
    beside its K and V (kv.index_keys[slot] (n_seq, ctx, d), a prefix valid like theirs: runtime/kv_cache.py's
    Qwen4Cache). Prompts and decode steps alike run one segment at a time, as qsa_attention does. The fused decode
    kernels attend every key: a QSA step runs these ops (`fuses` False) and decides on the host (the picks per
    number of blocks seen), so it is not captured."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self._tables = None             # rotary tables by position for the block keys: the decoder's (rope_tables)

    def fuses(self, fused) -> bool:
        return False

    def rope_all(self, ctx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (ctx, rotary_dim) by position in like's dtype and device (made once)."""
        t = self._tables
        if t is None or t[0].shape[0] < ctx or t[0].dtype != like.dtype or t[0].device != like.device:
            cos, sin = rope_tables(self.cfg, ctx, like.device)
            self._tables = t = (cos.to(like.dtype), sin.to(like.dtype))
        return t

    def attend(self, q, x, lw, slot: int, batch, kv, cos, sin, mask=None) -> torch.Tensor:
        cfg = self.cfg
        iq, ik = index_qk(x, lw, cfg, cos, sin)                                # (T, ih, d), (T, d)
        raw = kv.index_keys[slot]                                              # (n_seq, ctx, d)
        raw[batch.seq_ids, batch.positions] = ik
        tables = self.rope_all(kv.ctx, x)
        outs, r = [], 0
        for s in batch.segments:
            end = s.start + s.n
            keys = block_keys(raw[s.seq, :end], lw, cfg, *tables)             # (nb, d)
            keep = select(iq[r:r + s.n], keys, batch.positions[r:r + s.n], cfg)     # (n, end)
            outs.append(masked_attention(q[r:r + s.n], kv.k[slot][s.seq, :, :end], kv.v[slot][s.seq, :, :end],
                                         keep))                                # (n, nh, hd)
            r += s.n
        return torch.cat(outs) if len(outs) > 1 else outs[0]
