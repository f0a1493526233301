"""Which Gated DeltaNet kernels a forward runs (models/deltanet.py's DeltaKernels), decided once at load.

    k = pick_delta_kernels(device, dtype)       # DeltaKernels: conv, chunk (prompts), recurrent (decode steps)
    y, st = gated_deltanet(x, lw, cfg, st, kernels=k)

On the CPU, and where fla-core is not installed: the plain-torch references (models/deltanet.py, the oracle). On
CUDA with fla-core (flash-linear-attention's Triton kernels, `pip install fla-core`): its chunk_gated_delta_rule
for prompts and fused_recurrent_gated_delta_rule for decode steps, behind adapters with the references'
signatures (tests/test_cuda.py holds them to the references). The causal conv stays torch's depthwise conv1d on
every device: with a kernel of 4 taps it is a small part of a layer. MOESTREAM_DELTA=torch keeps the references on
CUDA too. Both fla kernels run without atomics, so a forward's bits do not depend on the expert cache.
"""
from __future__ import annotations

import os

import torch


def fla_available() -> bool:
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception:                    # not installed, or no Triton (the CPU build of torch)
        return False
    return True


def _fla_chunk(q, k, v, g, beta, state=None, chunk_size: int = 64, scale=None):
    """chunk_gated_delta_rule's signature (models/deltanet.py) over fla's chunked kernel: q, k (B, T, nk, dk)
    L2-normed, v (B, T, nv, dv), g and beta (B, T, nv), state (B, nv, dk, dv) float32 or None -> out in v's dtype,
    the final state float32. fla runs 64-token chunks (chunk_size is the reference's)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    dt = v.dtype
    o, S = chunk_gated_delta_rule(q.to(dt).contiguous(), k.to(dt).contiguous(), v.contiguous(),
                                  g.float().contiguous(), beta.to(dt).contiguous(), scale=scale,
                                  initial_state=None if state is None else state.float().contiguous(),
                                  output_final_state=True)
    return o.to(dt), S.float()


def _fla_recurrent(q, k, v, g, beta, state=None, scale=None):
    """recurrent_gated_delta_rule's signature over fla's fused recurrent kernel (decode steps, T = 1 each)."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    dt = v.dtype
    o, S = fused_recurrent_gated_delta_rule(q.to(dt).contiguous(), k.to(dt).contiguous(), v.contiguous(),
                                            g=g.float().contiguous(), beta=beta.to(dt).contiguous(), scale=scale,
                                            initial_state=None if state is None else state.float().contiguous(),
                                            output_final_state=True)
    return o.to(dt), S.float()


def pick_delta_kernels(device: torch.device, dtype: torch.dtype):
    """The DeltaNet kernels for this device and dtype: fla's on CUDA where it is installed, else the references."""
    from ..models.deltanet import TORCH, DeltaKernels, causal_conv1d
    if torch.device(device).type != "cuda" or os.environ.get("MOESTREAM_DELTA") == "torch" or not fla_available():
        return TORCH
    return DeltaKernels("fla", causal_conv1d, _fla_chunk, _fla_recurrent)
