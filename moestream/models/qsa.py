"""QSA, Qwen3.8-Flash-Next's sparse attention (transformers' Qwen4ExpTextQSAIndexer and Qwen4ExpTextAttention):
gated attention (models/gated_attention.py's math) where each query attends only the key blocks a learnt indexer
picks, plus the recent tail. Plain torch here: the CPU path and the oracle of kernels/qsa.py (CUDA).

    iq, ik = index_qk(x, lw, cfg, cos, sin)       # indexer queries (T, ih, d), normed and turned; raw keys (T, d)
    keys = block_keys(raw_keys[b0 * B:b1 * B], lw, cfg, cos_all, sin_all, b0)     # (b1 - b0, d): blocks b0..b1-1
    keep = select(iq, keys, positions, cfg, n)    # (T, n) bool: the keys each query attends
    attn = QSA(cfg, kernels)                      # the decoder's kind (models/attention.py's interface)

The indexer: a query at position p sees tokens 0..p, in nb = (p+1) // B complete blocks of B consecutive tokens and
a tail of the rest. A block's key is the mean of its raw index keys (float32), RMS-normed (k_norm) and turned by
rotary at the block's first position; its score is sum over the indexer heads of relu(q_h . k) / sqrt(d). The
query attends the top min(budget / B, nb) blocks' tokens and the tail (every block while nb <= budget / B: dense).
The cache keeps each token's raw index key beside its K and V, and each complete block's key (Qwen4Cache's
block_keys), made once when the block's last token lands: the same bits as pooling every block again (a block's
mean, norm and rotary are its own rows' ops), without the O(ctx d) pass a step.

Ties. Scores are sums of ReLUs, so blocks tie at exactly 0. The rule here and in kernels/qsa.py: higher score
first, equal scores by lower block index (a stable descending sort). Transformers calls torch.topk over the
query's nb scores, whose order among equal scores is implementation-defined (on the CPU neither the lower nor the
higher index always wins): the picks are transformers' wherever no tie straddles the cut (tests/test_qwen4exp.py),
and where one does, this rule is the deterministic one every path here shares.
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
               sin_all: torch.Tensor, first: int = 0) -> torch.Tensor:
    """raw (n, d): a sequence's raw index keys from block `first`'s first position -> the keys of the n // B
    complete blocks there (nb, d); cos_all, sin_all: rotary tables by position (in raw's dtype)."""
    B = cfg.indexer_block
    nb = raw.shape[0] // B
    pooled = raw[:nb * B].view(nb, B, raw.shape[-1]).float().mean(dim=1).to(raw.dtype)
    pooled = rms_norm(pooled, lw["indexer.k_norm.weight"], cfg.rms_norm_eps)
    starts = (first + torch.arange(nb, device=raw.device)) * B
    return partial_rope(pooled[:, None], cos_all[starts], sin_all[starts])[:, 0]


def select(q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, cfg: ModelConfig, n: int) -> torch.Tensor:
    """q (T, ih, d): queries of one sequence at `positions` (T,), each below n; keys (nb, d): the keys of its first
    nb blocks, nb covering every complete block any of the queries sees -> (T, n) bool, the keys each query
    attends: its top min(budget / B, seen) blocks (higher score first, equal scores by lower index) and its tail."""
    B, top = cfg.indexer_block, cfg.indexer_budget // cfg.indexer_block
    keep = torch.arange(n, device=q.device)[None, :] <= positions[:, None]            # causal: dense
    nb = keys.shape[0]
    if nb <= top:                       # every query sees at most top blocks: dense
        return keep
    seen = (positions + 1) // B                                                        # complete blocks per query
    scores = torch.matmul(q.float(), keys.float().t()).transpose(-1, -2)              # (T, nb, ih)
    scores = torch.relu(scores).sum(dim=-1) / math.sqrt(cfg.indexer_head_dim)          # (T, nb), >= 0
    visible = torch.arange(nb, device=q.device)[None, :] < seen[:, None]
    order = scores.masked_fill(~visible, -1.0).sort(dim=-1, descending=True, stable=True).indices[:, :top]
    blocks = torch.zeros_like(visible).scatter_(1, order, True) | ~visible  # (T, nb): past seen, the causal mask's
    keep[:, :nb * B] &= blocks.repeat_interleave(B, dim=1)
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
    keep = select(iq, keys, torch.arange(start, start + T, device=x.device), cfg, start + T)
    return gated_attention(x, lw, cfg, cos, sin, kv, slot, seq, start, keep)


class QSA(GatedAttention):
    """QSA as the decoder's attention kind: GatedAttention's projections, norms, rotary, cache writes and gate, each
    token attending the keys its indexer keeps in its own sequence's cache (runtime/kv_cache.py's Qwen4Cache: each
    token's raw index key, kv.index_keys[slot] (n_seq, ctx, d), and each complete block's key, kv.block_keys[slot]
    (n_seq, ctx // B, d), valid up to a sequence's position like K and V). kernels: kernels/qsa.py (CUDA), which
    runs every token of a prompt or decode step in one launch each with no host read; None: the torch form here,
    one segment at a time with a (n, end) mask. The fused decode kernels attend every key: `fuses` is False."""

    def __init__(self, cfg: ModelConfig, kernels=None):
        super().__init__(cfg)
        self.kernels = kernels
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
        cfg, B = self.cfg, self.cfg.indexer_block
        iq, ik = index_qk(x, lw, cfg, cos, sin)                                # (T, ih, d), (T, d)
        raw, pooled = kv.index_keys[slot], kv.block_keys[slot]                 # (n_seq, ctx, d), (n_seq, ctx//B, d)
        raw[batch.seq_ids, batch.positions] = ik
        tables = self.rope_all(kv.ctx, x)
        if self.kernels is not None:
            K = self.kernels
            K.block_keys(raw, lw["indexer.k_norm.weight"], cfg.rms_norm_eps, *tables, pooled, batch.seq_ids,
                         batch.positions)
            # a decode step's keys reach at most its span (fixed for a captured step); a prompt's its last token
            n = (batch.kv_len or kv.ctx) if batch.is_decode else max(s.start + s.n for s in batch.segments)
            picks = K.select(iq, pooled, batch.seq_ids, batch.positions, B, cfg.indexer_budget // B, n)
            return K.attend(q, kv.k[slot], kv.v[slot], picks, batch.seq_ids, batch.positions, B,
                            cfg.indexer_budget // B)
        outs, r = [], 0
        for s in batch.segments:
            end = s.start + s.n
            b0, b1 = s.start // B, end // B                 # the blocks this segment's tokens complete
            if b1 > b0:
                pooled[s.seq, b0:b1] = block_keys(raw[s.seq, b0 * B:b1 * B], lw, cfg, *tables, b0)
            keep = select(iq[r:r + s.n], pooled[s.seq, :b1], batch.positions[r:r + s.n], cfg, end)   # (n, end)
            outs.append(masked_attention(q[r:r + s.n], kv.k[slot][s.seq, :, :end], kv.v[slot][s.seq, :, :end],
                                         keep))                                # (n, nh, hd)
            r += s.n
        return torch.cat(outs) if len(outs) > 1 else outs[0]
