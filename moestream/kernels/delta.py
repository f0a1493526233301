"""Which Gated DeltaNet kernels a forward runs (models/deltanet.py's DeltaKernels), decided once at load.

    k = pick_delta_kernels(device, dtype)       # DeltaKernels: conv, chunk (prompts), step (decode), norm_gate
    y, st = gated_deltanet(x, lw, cfg, st, kernels=k)

On the CPU, and where fla-core is not installed: the plain-torch references (models/deltanet.py, the oracle). On
CUDA with fla-core (flash-linear-attention's Triton kernels, `pip install fla-core`): its chunk_gated_delta_rule
for prompts and fused_recurrent_gated_delta_rule for decode steps, behind adapters with the references'
signatures (tests/test_cuda_delta.py holds them to the references), the q/k L2 norms, beta's sigmoid, the decay
gate and the gated output norm as torch ops around them. The causal conv stays torch's depthwise conv1d on every
device: with 4 taps it is a small part of a layer.

MOESTREAM_DELTA=fla-fused hands a decode step's projections to fla as they come: the norms and gates run inside
its recurrence (fla's use_qk_l2norm_in_kernel, use_beta_sigmoid_in_kernel, use_gate_in_kernel, given A_log =
log(-ssm_a)), and the gated output norm is one Triton kernel here (_norm_gate: float32, one program a row, a
fixed shape, so its bits do not depend on tuning; fla's own autotunes its warps): a dozen and a half launches
fewer a layer. It is not the default until it is measured on the GPU (bench/RESULTS.md). MOESTREAM_DELTA=torch
keeps the references on CUDA too. No kernel here uses atomics, so a forward's bits do not depend on the expert
cache.
"""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


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


def _fla_step(q, k, v, a, b, ssm_a, dt_bias, state=None, scale=None):
    """recurrent_step's signature (models/deltanet.py: q, k not yet normed, a and b before their activations) over
    fla's fused recurrent kernel, which norms and gates inside the recurrence."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    o, S = fused_recurrent_gated_delta_rule(
        q.contiguous(), k.contiguous(), v.contiguous(), g=a.contiguous(), beta=b.contiguous(), scale=scale,
        initial_state=None if state is None else state.float().contiguous(), output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
        A_log=torch.log(-ssm_a.float()), dt_bias=dt_bias.float().contiguous())
    return o.to(v.dtype), S.float()


if triton is not None:
    @triton.jit
    def _norm_gate(x_ptr, z_ptr, w_ptr, y_ptr, eps, D: tl.constexpr, DP: tl.constexpr):
        """Program r: row r of x (its RMS over D in float32) times w, gated by silu of z's row r, rounded once."""
        r = tl.program_id(0)
        i = tl.arange(0, DP)
        m = i < D
        x = tl.load(x_ptr + r * D + i, mask=m, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + r * D + i, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32)
        y = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + eps) * w * (z * tl.sigmoid(z))
        tl.store(y_ptr + r * D + i, y.to(y_ptr.dtype.element_ty), mask=m)


def norm_gate_triton(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """gated_rms_norm's signature (models/deltanet.py): x, z (..., D), w (D,) -> (..., D) in x's dtype."""
    D = x.shape[-1]
    xs, zs = x.reshape(-1, D).contiguous(), z.reshape(-1, D).contiguous()
    y = torch.empty_like(xs)
    _norm_gate[(xs.shape[0],)](xs, zs, w.contiguous(), y, eps, D=D, DP=triton.next_power_of_2(D), num_warps=1)
    return y.view(x.shape)


def pick_delta_kernels(device: torch.device, dtype: torch.dtype, want: str | None = None):
    """The DeltaNet kernels for this device and dtype: fla's on CUDA where it is installed, else the references.
    want: fla (the default), fla-fused or torch; None: MOESTREAM_DELTA's, or fla."""
    from ..models.deltanet import TORCH, DeltaKernels, causal_conv1d
    want = want or os.environ.get("MOESTREAM_DELTA", "fla")
    if torch.device(device).type != "cuda" or want == "torch" or not fla_available() or triton is None:
        return TORCH
    if want == "fla-fused":
        return DeltaKernels("fla-fused", causal_conv1d, _fla_chunk, _fla_recurrent, _fla_step, norm_gate_triton)
    return DeltaKernels("fla", causal_conv1d, _fla_chunk, _fla_recurrent)
