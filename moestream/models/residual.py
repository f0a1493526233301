"""The residual block: how a layer's block output joins the residual stream and the next block's input is normed.
A family's entry picks it (arch/blocks.py's Blocks.residual).

    h, x = Plain(eps).add_norm(h, delta, lw["ffn_norm.weight"], fused)     # h (T, H) + delta, and its RMSNorm

plain: one stream, h + delta. Room for hyper-connections (several streams, mixed by learnt weights around each
block): a block with this interface holding its streams. The fused decode kernels (kernels/fused.py's
add_rms_norm, norm_linear and norm_route) add and norm a plain stream; models/blocks.py refuses another residual.
"""
from __future__ import annotations

from .layers import rms_norm


class Plain:
    def __init__(self, eps: float):
        self.eps = eps

    def add_norm(self, h, delta, w, fused=None):
        """h + delta (the residual stream) and its RMSNorm: one kernel in a fused decode step. delta None: the
        first block's input, h as it is."""
        if delta is None:
            return h, rms_norm(h, w, self.eps)
        if fused is not None:
            return fused.add_rms_norm(h, delta, w, self.eps)
        h = h + delta
        return h, rms_norm(h, w, self.eps)
