"""A DeltaNet decode step on the cache's states in place (kernels/delta.py step_in_place_triton) against its
plain-torch oracle (models/deltanet.py step_in_place), through Triton's interpreter on the CPU (float32, in a
subprocess: tests/interpreted.py), in both families' projection layouts; and the oracle itself against
gated_deltanet's decode step. tests/test_cuda_delta.py checks the compiled kernel in bfloat16 on the GPU."""
from __future__ import annotations

import sys

import pytest
import torch

from interpreted import close, run_check


def case(layout: str, g: torch.Generator, nk=2, r=2, dk=12, dv=10, KW=4, n_seq=5, B=3):
    """Random projections of B tokens as _projections makes them (views with the layout's strides), one layer's
    weights and cache states of n_seq sequences, and the rows the tokens' sequences have (not in order)."""
    from moestream.config import ModelConfig
    from moestream.models.deltanet import _projections
    nv, H = nk * r, 16
    cfg = ModelConfig(family="qwen3_next", vocab_size=8, hidden_size=H, n_layers=1, n_heads=2, n_kv_heads=1,
                      head_dim=8, n_experts=4, n_experts_used=2, moe_intermediate_size=8,
                      linear_num_key_heads=nk, linear_num_value_heads=nv,
                      linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel=KW)
    C = 2 * nk * dk + nv * dv
    lw = {"ssm_conv1d.weight": torch.randn(C, 1, KW, generator=g) * 0.5,
          "ssm_a": -torch.rand(nv, generator=g) - 0.1, "ssm_dt.bias": torch.randn(nv, generator=g) * 0.3,
          "ssm_norm.weight": 1 + 0.1 * torch.randn(dv, generator=g)}
    if layout == "qwen3_next":
        lw["ssm_in.weight"] = torch.randn(2 * nk * dk + 2 * nv * dv, H, generator=g) * 0.3
        lw["ssm_ba.weight"] = torch.randn(2 * nv, H, generator=g) * 0.5
    else:
        lw["attn_qkv.weight"] = torch.randn(C, H, generator=g) * 0.3
        lw["attn_gate.weight"] = torch.randn(nv * dv, H, generator=g) * 0.3
        lw["ssm_beta.weight"] = torch.randn(nv, H, generator=g) * 0.5
        lw["ssm_alpha.weight"] = torch.randn(nv, H, generator=g) * 0.5
    x = torch.randn(B, 1, H, generator=g)
    proj = [t[:, 0] for t in _projections(x, lw, cfg)]
    conv = torch.randn(n_seq, C, KW - 1, generator=g)
    ssm = torch.randn(n_seq, nv, dk, dv, generator=g) * 0.2
    rows = torch.tensor([3, 0, 4])[:B]
    return cfg, lw, x, proj, conv, ssm, rows


@pytest.mark.parametrize("layout", ["qwen3_next", "qwen3_5_moe"])
def test_the_oracle_is_gated_deltanets_decode_step(layout):
    """step_in_place (the rows of the cache, in place) gives what gathering the rows, gated_deltanet at T = 1 and
    writing them back gives, and leaves the other rows alone."""
    from moestream.models.deltanet import DeltaState, deltanet_step, gated_deltanet
    cfg, lw, x, _, conv, ssm, rows = case(layout, torch.Generator().manual_seed(1))
    lw["ssm_out.weight"] = torch.randn(cfg.hidden_size, cfg.linear_num_value_heads * cfg.linear_value_head_dim)
    want, st = gated_deltanet(x, lw, cfg, DeltaState(conv[rows], ssm[rows]))
    conv_want, ssm_want = conv.clone(), ssm.clone()
    conv_want[rows], ssm_want[rows] = st.conv, st.ssm
    got = deltanet_step(x[:, 0], lw, cfg, conv, ssm, rows)
    assert torch.equal(got, want[:, 0])
    assert torch.equal(conv, conv_want) and torch.equal(ssm, ssm_want)


@pytest.mark.parametrize("ba", [True, False])
def test_fused_projections_give_the_split_layouts_views(ba):
    """fuse_projections' one weight (the split layout: attn_qkv, attn_gate, then ssm_ba grouped by key head, or
    ssm_beta and ssm_alpha) gives the views the separate weights give."""
    from moestream.models.deltanet import _projections, fuse_projections
    cfg, lw, x, want, *_ = case("qwen3_5_moe", torch.Generator().manual_seed(3))
    if ba:                              # ssm_ba: [b_h.. a_h..] per key head, as llama.cpp's qwen3next writes it
        nk, r = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads
        b, a = lw.pop("ssm_beta.weight").view(nk, r, -1), lw.pop("ssm_alpha.weight").view(nk, r, -1)
        lw["ssm_ba.weight"] = torch.cat([b, a], dim=1).reshape(2 * nk * r, -1)
        want = [t[:, 0] for t in _projections(x, lw, cfg)]
    fuse_projections(lw, cfg)
    assert set(lw) & {"attn_qkv.weight", "attn_gate.weight", "ssm_ba.weight", "ssm_beta.weight"} == set()
    for got, w in zip((t[:, 0] for t in _projections(x, lw, cfg)), want):
        assert got.shape == w.shape and torch.allclose(got, w, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("layout", ["qwen3_next", "qwen3_5_moe"])
def test_step_in_place_kernel_in_the_interpreter(layout):
    """The two launches (_step_in_place's blocks of dv, _norm_and_shift's rows) give the oracle's output, states
    and conv windows, at one and several blocks of dv, a partial last block, and 1 to 4 value heads a key head."""
    pytest.importorskip("triton")
    run_check(__file__, layout, timeout=600)


def check(layout: str) -> None:
    from moestream.kernels.delta import step_in_place_triton
    from moestream.models.deltanet import step_in_place
    # one block of dv (BLOCK_V = 32 columns, or fewer: next_power_of_2(dv)), then two (the last one partial, and
    # r = 1: one program shifts both q and k's conv state), then two full ones at r = 4 and the shortest conv
    for shape in (dict(), dict(nk=1, r=3, dk=16, dv=16, KW=3, B=1), dict(nk=2, r=1, dk=8, dv=40),
                  dict(nk=1, r=4, dk=20, dv=64, KW=2, B=2)):
        cfg, lw, x, proj, conv, ssm, rows = case(layout, torch.Generator().manual_seed(2), **shape)
        conv2, ssm2 = conv.clone(), ssm.clone()
        want = step_in_place(*proj, conv, ssm, rows, lw, 1e-6)
        got = step_in_place_triton(*proj, conv2, ssm2, rows, lw, 1e-6)
        close(got, want)
        assert torch.equal(conv2, conv)                     # the conv window: inputs shifted, no arithmetic
        close(ssm2, ssm)
        others = [s for s in range(conv.shape[0]) if s not in rows.tolist()]
        assert torch.equal(conv2[others], conv[others]) and torch.equal(ssm2[others], ssm[others])


if __name__ == "__main__":
    check(sys.argv[1])
