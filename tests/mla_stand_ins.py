"""kernels/mla.py's decode kernels as models/mla.py's torch forms: the stand-ins tests/test_mla_decode.py puts in a
decode step, and the oracle tests/test_mla_kernels.py checks mla_rope_kv against.

    eng.fused = stand_in_mla(fused, calls)      # fused (a namespace of stand-ins) with the two MLA kernels added
    q_rot = rope_kv_ops(q, kv, norm, eps, cos, sin, latents, rot_keys, seq_ids, positions, interleaved)
"""
from __future__ import annotations

import torch


def stand_in_mla(fused, calls: list):
    """kernels/mla.py's mla_decode_attention as models/mla.py's torch form (latent_attention, its mask made from
    the positions), added to tests/test_decode_paths.py's stand-ins; each call counted in `calls`."""
    from moestream.models.mla import latent_attention

    def mla_decode_attention(q_lat, q_rot, latents, rot_keys, seq_ids, positions, n, scale):
        calls.append("mla_decode_attention")
        mask = torch.arange(n)[None, :] <= positions[:, None]                # (B, n)
        return latent_attention(q_lat, q_rot, latents, rot_keys, seq_ids, mask, scale)

    def mla_rope_kv(*args):
        calls.append("mla_rope_kv")
        return rope_kv_ops(*args)
    fused.mla_decode_attention, fused.mla_rope_kv = mla_decode_attention, mla_rope_kv
    return fused


def rope_kv_ops(q, kv, norm, eps, cos, sin, latents, rot_keys, seq_ids, positions, interleaved):
    """kernels/mla.py's mla_rope_kv as models/mla.py's torch ops: c normed and k_rot rotated into the cache, q's
    rotary dims rotated."""
    from moestream.models.layers import apply_rope, interleaved_rope, rms_norm
    rope = interleaved_rope if interleaved else apply_rope
    T, r, dr = q.shape[0], latents.shape[-1], rot_keys.shape[-1]
    c, k_rot = kv.split([r, dr], dim=-1)
    latents[seq_ids, :, positions] = rms_norm(c, norm, eps).view(T, 1, r)
    rot_keys[seq_ids, :, positions] = rope(k_rot.reshape(T, 1, dr), cos, sin)
    return rope(q[..., q.shape[-1] - dr:], cos, sin)
