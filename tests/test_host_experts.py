"""kernels/host_experts.py: the numba kernel against its plain-torch reference, per type and mixed layouts, and the
reference against gguf.quants' numpy dequantizer.

The bound: ||out - ref|| / ||ref|| < 1e-5. Both sum in float32 (the kernel a sub-block's integer-valued quants
times x, then the scales; the reference dequantized weights in matmuls), in other orders, over rows of at most
512 values: each output is off by a few float32 roundings (~1e-7 relative, measured 1.5-4e-7).
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from moestream.kernels.host_experts import fast_path, host_experts, host_experts_reference
from moestream.quant.dequant import random_blocks
from moestream.quant.layout import ExpertLayout
from moestream.quant.types import type_size

I, H, E = 256, 512, 6
BOUND = 1e-5
LAYOUTS = {"Q4_K": (Q.Q4_K,) * 3, "Q5_K": (Q.Q5_K,) * 3, "Q6_K": (Q.Q6_K,) * 3, "Q8_0": (Q.Q8_0,) * 3,
           "Q4_K_M": (Q.Q4_K, Q.Q4_K, Q.Q6_K), "Q5_K/Q6_K/Q8_0": (Q.Q5_K, Q.Q6_K, Q.Q8_0),
           "BF16/F16/F32": (Q.BF16, Q.F16, Q.F32)}
# (T, k) choices: skipped ones (-1), an expert chosen by several tokens, a token with no choice left.
IDS = {1: [[4, -1, 1]], 3: [[0, 2, -1, 5], [2, 5, 1, 3], [-1, -1, -1, -1]]}


def quantized_rows(types, seed: int) -> torch.Tensor:
    """(E, nbytes) uint8: random valid blocks of each matrix's type, laid out as ExpertLayout says."""
    g = torch.Generator().manual_seed(seed)
    lay = ExpertLayout(I, H, types)
    return torch.cat([random_blocks(t, E * s // type_size(t), g).view(E, s) for t, s in zip(types, lay.sizes)], 1)


def inputs(T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor(IDS[T])
    return torch.randn(T, H, generator=g), ids, torch.rand(ids.shape, generator=g)


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_quantized_layouts_match_the_reference(name, T):
    lay = ExpertLayout(I, H, LAYOUTS[name])
    assert fast_path(lay)
    rows = quantized_rows(lay.types, seed=T)
    x, ids, w = inputs(T, seed=T)
    out, ref = host_experts(x, rows, ids, w, lay), host_experts_reference(x, rows, ids, w, lay)
    assert out.shape == (T, H) and out.dtype == torch.float32
    assert rel(out, ref) < BOUND, rel(out, ref)
    if T == 3:
        assert torch.equal(out[2], torch.zeros(H))                      # no choice left: zeros


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_float_layouts_match_the_reference(dtype):
    lay = ExpertLayout(I, H)
    rows = (torch.randn(E, lay.numel, generator=torch.Generator().manual_seed(1)) * H ** -0.5).to(dtype)
    x, ids, w = inputs(3, seed=2)
    out, ref = host_experts(x, rows, ids, w, lay), host_experts_reference(x, rows, ids, w, lay)
    assert rel(out, ref) < BOUND, rel(out, ref)


def test_rows_with_padding_and_the_thread_count():
    """Rows wider than the layout (a pool's padded rows) read the same; the thread count changes no bit (each
    output is one thread's sum, in the same order)."""
    lay = ExpertLayout(I, H, LAYOUTS["Q4_K_M"])
    rows = quantized_rows(lay.types, seed=5)
    wide = torch.cat([rows, torch.full((E, 64), 255, dtype=torch.uint8)], 1)
    x, ids, w = inputs(3, seed=5)
    one = host_experts(x, rows, ids, w, lay, threads=1)
    assert torch.equal(host_experts(x, wide, ids, w, lay, threads=2), one)


def test_other_types_fall_back_to_the_reference():
    lay = ExpertLayout(I, H, (Q.Q4_0, Q.Q4_0, Q.Q6_K))
    assert not fast_path(lay)
    rows = quantized_rows(lay.types, seed=3)
    x, ids, w = inputs(3, seed=3)
    assert torch.equal(host_experts(x, rows, ids, w, lay), host_experts_reference(x, rows, ids, w, lay))


def test_an_expert_id_past_the_layer_is_an_error():
    lay = ExpertLayout(I, H, LAYOUTS["Q4_K"])
    x, _, w = inputs(1, seed=0)
    with pytest.raises(ValueError):
        host_experts(x, quantized_rows(lay.types, seed=0), torch.tensor([[E, 0, 1]]), w, lay)


def test_the_reference_is_the_experts_math_on_gguf_dequantized_weights():
    """host_experts_reference against numpy: gguf.quants.dequantize's weights, the SwiGLU expert, the weighted
    sum, in float64."""
    types = LAYOUTS["Q4_K_M"]
    lay = ExpertLayout(I, H, types)
    rows = quantized_rows(types, seed=7)
    x, ids, w = inputs(3, seed=7)
    want = np.zeros((3, H))
    for t in range(3):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            gate, up, down = (gguf.quants.dequantize(rows[e, o:o + s].numpy(), q).astype(np.float64)
                              for q, o, s in zip(types, lay.offsets, lay.sizes))
            gate, up, down = gate.reshape(I, H), up.reshape(I, H), down.reshape(H, I)
            xt = x[t].double().numpy()
            g = gate @ xt
            want[t] += float(w[t, j]) * (down @ (F.silu(torch.from_numpy(g)).numpy() * (up @ xt)))
    ref = host_experts_reference(x, rows, ids, w, lay).double()
    assert rel(ref, torch.from_numpy(want)) < BOUND
