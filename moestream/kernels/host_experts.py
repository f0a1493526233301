"""Routed experts on the host's CPU cores, read straight from their host rows (GGUF blocks or float rows).

    out = host_experts(x, rows, experts, weights, layout)   # x (T, H) float32; rows (E, row) one layer's host rows
    set_threads(8)                                          # numba's thread count (default: every core)
    ref = host_experts_reference(x, rows, experts, weights, layout)     # the same in plain torch

out (T, H) float32 = sum over j of weights[t, j] * down(silu(gate x_t) * (up x_t)) of expert experts[t, j]; a
choice whose id is < 0 is skipped (the caller gives the CPU only some of a token's choices; a token with none
gets zeros). rows is what the expert store holds: (E, >= layout.nbytes) uint8 for a quantized layout, each row
gate (I, H) | up (I, H) | down (H, I) in the file's types (ExpertLayout), or (E, 3 I H) of the model's dtype for a
float layout (bf16, f16 or float32), pinned or not.

Why on the host: a decode step's missed experts can be computed where their bytes are instead of crossing the
link; llama.cpp computes Q4_K experts on 16 cores at ~77 GB/s of weights, more than the ~50 GB/s of the link.

The fast path (host_numba.py, numba, parallel over every involved expert's rows) reads each row's blocks once
a call and dots them with every token that chose the expert, never making a dequantized matrix. Its types:
FAST_TYPES (Q4_K, Q5_K, Q6_K, Q8_0 and BF16/F16/F32, the Q4_K_M, Q8_0 and bf16 files' experts). Any other
type, or no numba, or rows that a type's view cannot read aligned: the reference, which is slower (it
dequantizes each expert to float32 first) but gives the same result (`fast_path(layout)` says which runs).
Results: float32 sums in another order than the reference's matmuls: ||out - ref|| / ||ref|| < 1e-5 (the
tests' bound), not bit-identical to it, nor to the GPU kernels.

numba is an optional dependency (`pip install moestream[host]`, also in `[test]`): the engine runs without it,
and this module imports it only on the first fast call. That call compiles the kernels (10-15 s on a slow
2-core machine) and caches them beside host_numba.py (__pycache__), so later processes load them in ~0.5 s.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from ..quant.layout import ExpertLayout

FAST_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.BF16, Q.F16, Q.F32)
_FLOAT_TYPE = {torch.bfloat16: Q.BF16, torch.float16: Q.F16, torch.float32: Q.F32}
_ALIGN = {Q.BF16: 2, Q.F16: 2, Q.F32: 4}       # the bytes of the view a float matrix is read through


def host_experts(x: torch.Tensor, rows: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                 layout: ExpertLayout, threads: int | None = None) -> torch.Tensor:
    """x (T, H), rows (E, row), experts (T, k) int64 (< 0: skipped), weights (T, k) -> (T, H) float32, on the
    host. threads: numba's thread count from now on (set_threads); None leaves it."""
    plan = _plan(rows, layout)
    kernel = _kernel() if plan is not None else None
    if kernel is None:
        return host_experts_reference(x, rows, experts, weights, layout)
    if threads is not None:
        set_threads(threads)
    flat, types, offsets, row = plan
    u8 = flat.numpy()                                                   # (bytes,): every view below shares it
    i8 = u8.view(np.int8)
    u16 = u8[:u8.size // 2 * 2].view(np.uint16) if flat.data_ptr() % 2 == 0 else _EMPTY16
    w32 = u8[:u8.size // 4 * 4].view(np.float32) if flat.data_ptr() % 4 == 0 else _EMPTY32
    out = kernel(_np(x, torch.float32), u8, i8, u16, w32, _np(experts, torch.int64), _np(weights, torch.float32),
                 rows.shape[0], row, types, offsets, layout.inter)
    return torch.from_numpy(out)


def host_experts_reference(x: torch.Tensor, rows: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                           layout: ExpertLayout) -> torch.Tensor:
    """host_experts in plain torch: each chosen expert dequantized to float32 (ExpertLayout.dequantize) or read
    through its float views, then float32 matmuls. The fallback and the test oracle."""
    I = layout.inter
    x = x.float()
    out = torch.zeros(x.shape, dtype=torch.float32)                     # (T, H)
    for e in experts[experts >= 0].unique().tolist():
        if layout.quantized:
            w13, w2 = layout.dequantize(rows[e:e + 1])                  # (1, 2I, H), (1, H, I)
        else:
            w13, w2 = (w.float() for w in layout.views(rows[e:e + 1]))
        tok, j = (experts == e).nonzero(as_tuple=True)                  # (n,), (n,): the choices of expert e
        gu = x[tok] @ w13[0].T                                          # (n, 2I): gate | up
        y = (F.silu(gu[:, :I]) * gu[:, I:]) @ w2[0].T                   # (n, H)
        out.index_add_(0, tok, y * weights[tok, j].float()[:, None])
    return out


def fast_path(layout: ExpertLayout) -> bool:
    """Whether host_experts runs numba's kernels for this layout (else the reference)."""
    return numba_available() and (not layout.quantized or all(t in FAST_TYPES for t in layout.types))


@functools.cache
def numba_available() -> bool:
    import importlib.util
    return importlib.util.find_spec("numba") is not None


def set_threads(n: int) -> None:
    """The host kernel's thread count, at most the cores numba started with (NUMBA_NUM_THREADS)."""
    import numba
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))


def _plan(rows: torch.Tensor, layout: ExpertLayout):
    """(flat uint8 bytes of rows, types (3,), byte offsets (3,), row stride in bytes) for the kernel, or None
    where the reference must run (no numba, a slow type, a float matrix off its view's alignment)."""
    if not fast_path(layout) or rows.device.type != "cpu" or rows.dim() != 2 or rows.stride(1) != 1:
        return None
    size = rows.element_size()
    if layout.quantized:
        types, offsets = layout.types, layout.offsets
        if rows.dtype != torch.uint8 or rows.shape[1] < layout.nbytes:
            raise ValueError(f"quantized rows must be uint8 (E, >= {layout.nbytes}), got {rows.dtype} "
                             f"{tuple(rows.shape)}")
    else:
        if rows.dtype not in _FLOAT_TYPE or rows.shape[1] < layout.numel:
            return None
        types = (_FLOAT_TYPE[rows.dtype],) * 3
        n = layout.inter * layout.hidden * size                         # bytes of gate, of up
        offsets = (0, n, 2 * n)
    row = rows.stride(0) * size
    flat = rows.view(torch.uint8) if size > 1 else rows
    flat = flat.as_strided(((rows.shape[0] - 1) * row + rows.shape[1] * size,), (1,))    # (bytes,)
    for t, o in zip(types, offsets):
        a = _ALIGN.get(t, 1)
        if (flat.data_ptr() + o) % a or row % a or (a > 1 and (layout.inter % 32 or layout.hidden % 32)):
            return None                                                 # float rows: whole 32-value blocks
    return flat, np.array([int(t) for t in types], dtype=np.int64), np.array(offsets, dtype=np.int64), row


def _np(t: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    return t.detach().to(dtype).contiguous().numpy()


@functools.cache
def _kernel():
    if not numba_available():
        return None
    from .host_numba import experts
    return experts


_EMPTY16 = np.empty(0, dtype=np.uint16)
_EMPTY32 = np.empty(0, dtype=np.float32)
