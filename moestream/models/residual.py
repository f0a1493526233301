"""The residual block: how a layer's block output joins the residual stream and the next block's input is normed.
A family's entry picks it (arch/blocks.py's Blocks.residual).

    h, x = Plain(eps).add_norm(h, delta, lw["ffn_norm.weight"], fused)     # h (T, H) + delta, and its RMSNorm

plain: one stream, h + delta. hyper (Qwen3.8-Flash-Next's hyper-connections, transformers' Qwen4ExpTextGatedResidual):
`hc` streams (T, hc*H); before each block they are mixed into its one input, and its output is added back to each
stream by its own gate:

    hy = Hyper(cfg.rms_norm_eps, cfg.hc_count)
    h = hy.expand(embeddings)                              # (T, hc*H): the embedding in every stream
    h, (x, inject) = hy.add_norm(h, delta, hy.weights(lw, "hc_attn"))      # delta: (the last block's output, its gate)
    out = hy.final(h, delta, w)                           # the output mixer (w: output_hc_*), for the output norm

A mixer (weights `{p}_norm` (hc*H,) holding 1 + w, `{p}_down` (R, hc*H), `{p}_up` (hc*H, R), `{p}_inject` (hc, hc*H)):
n = the streams' RMSNorm, one H-wide group each; m = sigmoid(up(silu(down(n) / hc))); the input is the mean over
the streams of m * n; each stream's gate is 2 sigmoid(inject(n) / hc), and after the block stream s += gate_s *
output. The fused decode kernels (kernels/fused.py's add_rms_norm, norm_linear and norm_route) add and norm a plain
stream only (`fuses`): a hyper family's decode steps take the unfused ops.

The decoder (models/transformer.py) sees both through one interface: expand, add, block_input (the residual add
and the block's input, with what the block's output needs back: Hyper's gates), block_output and final; and for an
MTP head, head_read (what the head reads: Plain's post-norm state, Hyper's streams before the output mixer) and
read_out (the final hidden state from it).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .layers import rms_norm


class Plain:
    fuses = True                        # the fused decode ops add and norm this stream

    def __init__(self, eps: float):
        self.eps = eps

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        """The embeddings (T, H) as the residual stream's start."""
        return x

    def add(self, h, delta):
        """The stream with the last block's output added (delta None: as it is)."""
        return h if delta is None else h + delta

    def block_input(self, h, delta, lw: dict, block: str, fused=None):
        """(the stream with delta added, block `block`'s (attn, ffn) normed input, None)."""
        h, x = self.add_norm(h, delta, lw[f"{block}_norm.weight"], fused)
        return h, x, None

    @staticmethod
    def block_output(out, carry):
        """What the next add takes of a block's output (T, H)."""
        return out

    def final(self, h, delta, w: dict, rows) -> torch.Tensor:
        """The last block's output added, the output norm of the rows wanted: (R, H)."""
        return rms_norm(self.add(h, delta)[rows], w["output_norm.weight"], self.eps)

    def head_read(self, h, delta, w: dict) -> torch.Tensor:
        """What an MTP head reads of every row (models/mtp.py): the post-norm hidden state (T, H)."""
        return self.final(h, delta, w, slice(None))

    @staticmethod
    def read_out(x, w: dict) -> torch.Tensor:
        """The final hidden state of rows of head_read's (here: as they are)."""
        return x

    def add_norm(self, h, delta, w, fused=None):
        """h + delta (the residual stream) and its RMSNorm: one kernel in a fused decode step. delta None: the
        first block's input, h as it is."""
        if delta is None:
            return h, rms_norm(h, w, self.eps)
        if fused is not None:
            return fused.add_rms_norm(h, delta, w, self.eps)
        h = h + delta
        return h, rms_norm(h, w, self.eps)


class Hyper:
    """Hyper-connections: the residual is `hc` streams, (T, hc*H) (see the module's docstring)."""
    fuses = False                       # the fused decode ops add and norm one plain stream

    def __init__(self, eps: float, hc: int):
        self.eps, self.hc = eps, hc

    @staticmethod
    def weights(lw: dict, prefix: str) -> tuple:
        """A mixer's weights (norm, down, up, inject or None) under `prefix` (hc_attn, hc_ffn, output_hc)."""
        return (lw[f"{prefix}_norm.weight"], lw[f"{prefix}_down.weight"], lw[f"{prefix}_up.weight"],
                lw.get(f"{prefix}_inject.weight"))

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        """The embeddings (T, H) as every stream's start (T, hc*H)."""
        return x.repeat(1, self.hc)

    def group_norm(self, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each stream on its own, times w (hc*H,): transformers' grouped Qwen4ExpTextRMSNorm."""
        return group_rms_norm(h, w, self.hc, self.eps)

    def write(self, h: torch.Tensor, delta) -> torch.Tensor:
        """The streams after a block: delta (its output (T, H), the gates (T, hc) taken before it) added to each."""
        out, gate = delta
        return h + (out[:, None, :] * gate[:, :, None]).flatten(1)

    def mix(self, h: torch.Tensor, w: tuple):
        """The streams mixed into one input (T, H), and each stream's gate (T, hc) (None for the output mixer)."""
        norm, down, up, inject = w
        T, hc = h.shape[0], self.hc
        n = self.group_norm(h, norm)
        m = torch.sigmoid(F.linear(F.silu(F.linear(n, down) / hc), up))
        x = (m.view(T, hc, -1) * n.view(T, hc, -1)).mean(dim=-2)
        gate = None if inject is None else 2 * torch.sigmoid(F.linear(n, inject) / hc)
        return x, gate

    def add_norm(self, h, delta, w: tuple, fused=None):
        """Plain.add_norm's counterpart: the streams with delta written back (None: as they are), and the next
        block's (input, gate); `w` the mixer's weights (Hyper.weights)."""
        if delta is not None:
            h = self.write(h, delta)
        return h, self.mix(h, w)

    def add(self, h, delta):
        """The streams with the last block's output written back (delta None: as they are)."""
        return h if delta is None else self.write(h, delta)

    def block_input(self, h, delta, lw: dict, block: str, fused=None):
        """(the streams with delta written back, block `block`'s (attn, ffn) input mixed from them, its gates)."""
        h, (x, gate) = self.add_norm(h, delta, self.weights(lw, f"hc_{block}"))
        return h, x, gate

    @staticmethod
    def block_output(out, gate):
        """What the next add takes of a block's output (T, H): it and the gates taken before the block."""
        return out, gate

    def final(self, h, delta, w: dict, rows=slice(None)) -> torch.Tensor:
        """The last block written back and the output mixer, for the rows wanted: the final hidden state (R, H).
        w: the model's global weights (output_hc_*)."""
        return self.mix(self.add(h, delta)[rows], self.weights(w, "output_hc"))[0]

    def head_read(self, h, delta, w: dict) -> torch.Tensor:
        """What an MTP head reads of every row (models/mtp.py's mtp_streams): the streams before the output mixer."""
        return self.add(h, delta)

    def read_out(self, x, w: dict) -> torch.Tensor:
        """The final hidden state (R, H) of rows of head_read's: the output mixer."""
        return self.mix(x, self.weights(w, "output_hc"))[0]


def group_rms_norm(h: torch.Tensor, w: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """h (T, G*H): each of its G groups RMS-normed on its own (float32 statistics), times w (G*H,) -> h's dtype."""
    T = h.shape[0]
    x = h.float().view(T, groups, -1)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (x.view(T, -1) * w.float()).to(h.dtype)
