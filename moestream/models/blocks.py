"""A decoder's blocks, built from the choices a family's entry makes (arch/blocks.py's Blocks): the attention kind,
the mixer of linear_attention layers, the router's options, the expert MLP and the residual.

    built = build(cfg, FAMILIES[cfg.family].blocks, delta=pick_delta_kernels(device, dtype))
    built.mixers[i]           # layer i's token mixer: the attention kind, or the mixer (DeltaNet) by layer_types

An option that arch/blocks.py keeps room for and no block here computes yet is refused with its name, so that a
new family's entry cannot run with math it does not have.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..arch.blocks import ATTENTION_KINDS, MIXERS, RESIDUALS, Blocks, Router
from ..config import ModelConfig
from ..kernels.delta_reference import TORCH, DeltaKernels
from . import attention
from .deltanet import DeltaNet
from .residual import Plain
from .router import router_of


MIXER_KINDS = {"deltanet": DeltaNet}


@dataclass
class Built:
    attention: attention.GQA             # the attention layers' kind (GQA or GatedAttention)
    mixers: list                         # per layer: the attention kind or the mixer
    router: Router                       # the checkpoint's options (models/router.py's router_of)
    residual: Plain


def build(cfg: ModelConfig, blocks: Blocks, delta: DeltaKernels | None = None) -> Built:
    """The blocks of a decoder of `cfg` as `blocks` picks them; delta: the DeltaNet's kernels (None: the plain
    torch references)."""
    check(blocks)
    attn = attention.KINDS[blocks.attention.kind](cfg)
    linear = set(cfg.linear_layers)
    mixer = MIXER_KINDS[blocks.mixer](cfg, delta or TORCH) if blocks.mixer else None
    if linear and mixer is None:
        raise ValueError(f"{cfg.family}: linear_attention layers, but its blocks name no mixer")
    mixers = [mixer if i in linear else attn for i in range(cfg.n_stored_layers)]    # an MTP head: attention
    return Built(attn, mixers, router_of(cfg), Plain(cfg.rms_norm_eps))


def check(blocks: Blocks) -> None:
    """NotImplementedError naming each option that arch/blocks.py has room for and no block computes yet."""
    a, r, e = blocks.attention, blocks.router, blocks.experts
    missing = [what for bad, what in (
        (a.kind not in ATTENTION_KINDS, f"attention kind {a.kind!r}"),
        (a.window is not None, "sliding-window attention"), (a.sinks, "attention sinks"),
        (blocks.mixer is not None and blocks.mixer not in MIXERS, f"mixer {blocks.mixer!r}"),
        (r.gating not in ("softmax", "sigmoid"), f"{r.gating} gating"),
        (e.activation != "swiglu", f"expert activation {e.activation!r}"), (e.clamp is not None, "clamped SwiGLU"),
        (e.bias, "expert biases"),
        (blocks.residual not in RESIDUALS, f"residual {blocks.residual!r}")) if bad]
    if missing:
        raise NotImplementedError(f"blocks not built yet: {', '.join(missing)}")
