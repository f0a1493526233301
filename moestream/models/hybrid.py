"""Qwen3-Next and Qwen3.5-MoE in the engine: MoETransformer's decoder with each layer's token mixer chosen by its
layer type, a Gated DeltaNet (models/deltanet.py) or gated attention (models/gated_attention.py's math: q's second
half gates the output through a sigmoid, per-head QK-norm, rotary on the first rotary_dim dims). Norms, routers,
the routed experts and the shared expert are MoETransformer's, through the same providers and kernels.

    model = HybridTransformer(cfg, weights, rope=(cos, sin), delta=pick_delta_kernels(device, dtype))
    logits = model.forward(batch, cache, experts, kernel)        # cache: runtime/kv_cache.py's HybridCache

`cache` holds the KV of the attention layers only (k[j], v[j] for the j-th attention layer) and, per DeltaNet layer
i, conv[i] (n_seq, C, kernel-1) and ssm[i] (n_seq, nv, dk, dv) float32: row s is sequence s's state, read at each
segment's sequence and written back. The cache checks positions and resets restarted sequences before the forward
(HybridCache.begin); the model only computes. A prompt runs the chunked delta rule, one segment at a time; a
decode step (every segment one token) runs the recurrent form over all its sequences at once, and its gated
attention, where the step carries the fused kernels (CUDA), as kernels/fused.py's gated_qk_rope_kv and
decode_attention with the gates.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from .deltanet import TORCH, DeltaKernels, DeltaState, deltanet_step, fuse_projections, gated_deltanet, step_in_place
from .gated_attention import partial_rope
from .layers import rms_norm
from .transformer import Batch, MoETransformer


class HybridTransformer(MoETransformer):
    # Decode steps are captured in CUDA graphs like MoETransformer's: the states are gathered and written back by
    # the step's device tensor of sequences (no host sync); the engine checks and advances each sequence's position
    # around every replay (runtime/decode.py's GraphDecode), and a graph's warm-up leaves the states as they were
    # (HybridCache.kept).
    capturable = True

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], rope: tuple[torch.Tensor, torch.Tensor],
                 delta: DeltaKernels = TORCH):
        super().__init__(cfg, weights, rope)        # attention layers: q (with its gate), k, v as one attn_qkv
        self.delta = delta
        # a decode step on the cache's states: the kernels' own, or the reference's gather and write-back around them
        self.in_place = delta.in_place or functools.partial(step_in_place, kernels=delta)
        self.linear = set(cfg.linear_layers)
        self.kv_slot = {i: j for j, i in enumerate(cfg.attention_layers)}     # layer -> its KV cache layer
        for i in self.linear:
            fuse_projections(self.layers[i], cfg)

    def _fuses_attention(self, fused) -> bool:
        """A decode step's gated attention runs as the fused kernels (kernels/fused.py's gated_qk_rope_kv and
        decode_attention with its gate): they take the interleaved gates, the partial rotary and the per-head
        norms every hybrid family has."""
        return fused is not None

    def in_proj(self, lw, layer) -> str | None:
        if layer in self.linear:        # the split layout's projections, one weight since fuse_projections
            return "ssm_proj" if "ssm_proj.weight" in lw else None
        return "attn_qkv"

    def mix(self, x, lw, layer, batch: Batch, kv, cos, sin, mask=None, fused=None, proj=None) -> torch.Tensor:
        if layer in self.linear:
            return self._deltanet(x, lw, layer, batch, kv, fused, proj)
        return self._gated_attention(x, lw, self.kv_slot[layer], batch, kv, cos, sin, mask, fused, proj)

    def _gated_attention(self, x, lw, slot: int, batch: Batch, kv, cos, sin, mask, fused=None,
                         proj=None) -> torch.Tensor:
        """x (T, H) -> (T, H); cos, sin (T, rotary_dim). Keys and values go to KV layer `slot`. A fused decode step
        (fused: kernels.fused) runs norms, rotary, cache writes, attention and gate in three launches."""
        cfg = self.cfg
        T, nh, nkv, hd = x.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qkv = proj if proj is not None else F.linear(x, lw["attn_qkv.weight"])    # (T, nh 2hd + 2 nkv hd)
        if self._fuses_attention(fused):
            q, gate = fused.gated_qk_rope_kv(qkv, lw["attn_qk_norm.weight"], cfg.rms_norm_eps, cos, sin,
                                             kv.k[slot], kv.v[slot], batch.seq_ids, batch.positions, nh, nkv)
            o = fused.decode_attention(q, kv.k[slot], kv.v[slot], batch.seq_ids, batch.positions,
                                       batch.kv_len or kv.ctx, gate)        # (T, nh, hd), gated
            return fused.linear(o.reshape(T, nh * hd), lw["attn_output.weight"])
        qg, k, v = qkv.split([2 * nh * hd, nkv * hd, nkv * hd], dim=-1)
        q, gate = qg.view(T, nh, 2 * hd).chunk(2, dim=-1)                    # (T, nh, hd) each: [q_h | gate_h]
        q = rms_norm(q, lw["attn_q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(k.view(T, nkv, hd), lw["attn_k_norm.weight"], cfg.rms_norm_eps)
        q, k = partial_rope(q, cos, sin), partial_rope(k, cos, sin)
        kv.write(slot, batch.seq_ids, batch.positions, k, v.view(T, nkv, hd))
        o = self._attend(q, slot, batch, kv, mask)                           # (T, nh, hd)
        o = o.reshape(T, nh * hd) * torch.sigmoid(gate.reshape(T, nh * hd))
        return F.linear(o, lw["attn_output.weight"])

    def _deltanet(self, x, lw, layer: int, batch: Batch, kv, fused=None, proj=None) -> torch.Tensor:
        """x (T, H) -> (T, H), each segment's sequence's state read from its row of the cache and written back."""
        conv, ssm = kv.conv[layer], kv.ssm[layer]                  # (n_seq, C, kernel-1), (n_seq, nv, dk, dv)
        if batch.is_decode:             # one token of each of B distinct sequences: one recurrent step, batched
            return deltanet_step(x, lw, self.cfg, conv, ssm, batch.seq_ids, self.in_place, proj,
                                 F.linear if fused is None else fused.linear)
        outs, r = [], 0
        for s in batch.segments:        # a prompt chunk: the chunked rule, from where the sequence's state is
            rows = slice(s.seq, s.seq + 1)
            y, st = gated_deltanet(x[None, r:r + s.n], lw, self.cfg, DeltaState(conv[rows], ssm[rows]),
                                   kernels=self.delta)                       # (1, n, H)
            conv[rows], ssm[rows] = st.conv, st.ssm
            outs.append(y[0])
            r += s.n
        return torch.cat(outs) if len(outs) > 1 else outs[0]
