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
from ..config import GATINGS, ModelConfig
from ..kernels.delta_reference import TORCH, DeltaKernels
from . import attention
from .deltanet import DeltaNet
from .qsa import QSA
from .residual import Hyper, Plain
from .router import router_of


ATTENTION_KINDS = {**attention.KINDS, "qsa": QSA}     # (QSA builds on GatedAttention: its own module)
MIXER_KINDS = {"deltanet": DeltaNet}


@dataclass
class Built:
    attention: attention.GQA             # the attention layers' kind (GQA, GatedAttention, MLA or QSA)
    mixers: list                         # per layer: the attention kind or the mixer
    router: Router                       # the checkpoint's options (models/router.py's router_of)
    residual: Plain | Hyper


def build(cfg: ModelConfig, blocks: Blocks, delta: DeltaKernels | None = None, qsa=None) -> Built:
    """The blocks of a decoder of `cfg` as `blocks` picks them; delta: the DeltaNet's kernels (None: the plain
    torch references); qsa: QSA's (kernels/qsa.py's pick_qsa_kernels; None: models/qsa.py's torch form)."""
    check(blocks)
    a = blocks.attention
    opts = dict(window=a.window, sinks=a.sinks) if a.kind == "gqa" else {}     # check: gqa's options only
    if a.kind == "qsa":
        opts = dict(kernels=qsa)
    attn = ATTENTION_KINDS[a.kind](cfg, **opts)
    linear = set(cfg.linear_layers)
    mixer = MIXER_KINDS[blocks.mixer](cfg, delta or TORCH) if blocks.mixer else None
    if linear and mixer is None:
        raise ValueError(f"{cfg.family}: linear_attention layers, but its blocks name no mixer")
    mixers = [mixer if i in linear else attn for i in range(cfg.n_stored_layers)]    # an MTP head: attention
    residual = Hyper(cfg.rms_norm_eps, cfg.hc_count) if blocks.residual == "hyper" else Plain(cfg.rms_norm_eps)
    return Built(attn, mixers, router_of(cfg), residual)


def check(blocks: Blocks) -> None:
    """NotImplementedError naming each option that arch/blocks.py has room for and no block computes yet."""
    a, r, e = blocks.attention, blocks.router, blocks.experts
    missing = [what for bad, what in (
        (a.kind not in ATTENTION_KINDS, f"attention kind {a.kind!r}"),
        ((a.window or a.sinks or a.out_bias) and a.kind != "gqa", f"window, sinks or o bias on {a.kind} attention"),
        (blocks.mixer is not None and blocks.mixer not in MIXERS, f"mixer {blocks.mixer!r}"),
        (r.gating not in GATINGS, f"{r.gating} gating"),
        (r.linear_bias and r.gating != "softmax_weight", f"a router linear bias with {r.gating} gating"),
        (e.activation not in ("swiglu", "swiglu_oai"), f"expert activation {e.activation!r}"),
        (e.clamp is not None and e.activation != "swiglu_oai", "clamped SwiGLU"),
        (e.clamp is None and e.activation == "swiglu_oai", "swiglu_oai without its clamp"),
        (e.bias and e.activation != "swiglu_oai", "expert biases on plain SwiGLU"),
        (blocks.residual not in RESIDUALS, f"residual {blocks.residual!r}")) if bad]
    if missing:
        raise NotImplementedError(f"blocks not built yet: {', '.join(missing)}")
