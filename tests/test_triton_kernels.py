"""The Triton kernels (kernels/decode.py, kernels/fused.py, kernels/shared_expert.py) on the CPU, through Triton's interpreter
(TRITON_INTERPRET=1, in a subprocess: the flag is read when the kernels are defined), against their plain-torch
oracles in float32. The interpreter runs the kernels' own indexing, masks, pointer arithmetic and reductions, so a
wrong index or mask fails here; the cuda tests check the same kernels compiled, in bfloat16, on the GPU."""
from __future__ import annotations

import sys

import pytest
import torch

from interpreted import close, run_check

CHECKS = ["experts_one_token", "experts_several_tokens", "experts_read_through", "experts_grouped_shared",
          "experts_grouped_unshared", "experts_grouped_read_through", "qk_rope_kv", "add_rms_norm",
          "decode_attention", "gated_attention", "hybrid_decode", "shared_expert"]


@pytest.mark.parametrize("check", CHECKS)
def test_triton_kernel_in_the_interpreter(check):
    pytest.importorskip("triton")
    run_check(__file__, check, timeout=600)


def experts(T, k):
    from moestream.kernels.decode import experts_by_address
    from moestream.kernels.reference import AddressBook, experts_by_address_reference
    E, H, I = 12, 64, 40                        # I not a power of two: the masks
    g = torch.Generator().manual_seed(T)
    rows, other = torch.randn(E, 3 * I * H, generator=g), torch.randn(E, 3 * I * H, generator=g)
    book = AddressBook()
    book.add(rows)
    book.add(other)
    other.copy_(rows)                           # the same experts at other addresses (a slot and a host row)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    step = rows.stride(0) * rows.element_size()
    addrs = rows.data_ptr() + ids * step
    x, w = torch.randn(T, H, generator=g), torch.softmax(torch.randn(T, k, generator=g), -1)
    out = experts_by_address(x, addrs, w, I)
    close(out, experts_by_address_reference(x, addrs, w, I, book=book))
    elsewhere = torch.where((ids % 2 == 0), other.data_ptr() + ids * step, addrs)     # as a cache places them
    assert torch.equal(experts_by_address(x, elsewhere, w, I), out)


def _landing_rows(E: int, H: int, I: int, n_pool: int, seed: int):
    """A read-through check's memory: E experts' rows ("device" copies), the same bytes again (host rows), n_pool
    empty landing slots, an AddressBook of the three for the oracle, and a row's bytes: (generator, rows, host,
    pool, book, step)."""
    from moestream.kernels.reference import AddressBook
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(E, 3 * I * H, generator=g)
    host, pool = rows.clone(), torch.zeros(n_pool, 3 * I * H)
    book = AddressBook()
    for t in (rows, host, pool):
        book.add(t)
    return g, rows, host, pool, book, rows.stride(0) * rows.element_size()


def read_through():
    """A one-token step with landing slots: the choices read from host (address == the expert's host row) write
    their rows into the slots in choice order, the first R of them; the output is unchanged; the oracle agrees."""
    from moestream.kernels.decode import experts_by_address, landing_slots
    from moestream.kernels.reference import experts_by_address_reference
    from moestream.kernels.stage import Landing
    E, H, I, k = 12, 64, 40, 8
    g, rows, host, pool, book, step = _landing_rows(E, H, I, n_pool=3, seed=5)
    ids = torch.randperm(E, generator=g)[:k][None]                                        # (1, k)
    on_host = torch.tensor([True, False, True, True, False, True, False, False])
    addrs = torch.where(on_host, host.data_ptr() + ids * step, rows.data_ptr() + ids * step)
    host_tab = host.data_ptr() + torch.arange(E) * step
    land = pool.data_ptr() + torch.arange(2) * step                                     # R = 2 of the 3 slots
    x, w = torch.randn(1, H, generator=g), torch.softmax(torch.randn(1, k, generator=g), -1)
    plain = experts_by_address(x, addrs, w, I)
    out = experts_by_address(x, addrs, w, I, Landing(ids, host_tab, land))
    assert torch.equal(out, plain)
    assert landing_slots(on_host.tolist(), 2) == [(0, 0), (2, 1)]
    assert torch.equal(pool[0], rows[ids[0, 0]]) and torch.equal(pool[1], rows[ids[0, 2]])
    assert not pool[2].any()                              # the third host choice had no slot
    pool.zero_()
    close(experts_by_address_reference(x, addrs, w, I, Landing(ids, host_tab, land), book=book), out)
    assert torch.equal(pool[0], rows[ids[0, 0]]) and torch.equal(pool[1], rows[ids[0, 2]])


def grouped(T, k, E, shared):
    """A step of T >= 2 tokens takes the grouped kernel (kernels/decode_grouped.py: each expert read once for the
    tokens that chose it): against the oracle; the same bits with the experts at other addresses (the same bytes
    in a slot and in a host row), whichever order the sort puts them in, and for a token whatever other tokens
    share its step; close to the per-choice kernel."""
    from moestream.kernels.decode import experts_by_address
    from moestream.kernels.reference import AddressBook, experts_by_address_reference
    # Not powers of two: the masks (H in a gate/up and combine tile of 16, I in a down tile of 8, and I = 6 in
    # gate/up tiles of 2 rows). Small, since the interpreter runs T k (I / 2 + H / 4) programs a call: the loops
    # over H and I take one step at any H and I (the tiles are fit to them, kernels/decode_tiles.py).
    H, I = 12, 6
    g = torch.Generator().manual_seed(T * 100 + E)
    rows = torch.randn(E, 3 * I * H, generator=g)
    perm = torch.randperm(E, generator=g)
    other = torch.empty_like(rows)
    other[perm] = rows                          # expert e at row perm[e] of another buffer: another sort order
    book = AddressBook()
    book.add(rows)
    book.add(other)
    if shared:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        assert ids.unique().numel() < T * k
    else:
        ids = torch.randperm(E, generator=g)[:T * k].view(T, k)
    step = rows.stride(0) * rows.element_size()
    addrs = rows.data_ptr() + ids * step
    x, w = torch.randn(T, H, generator=g), torch.softmax(torch.randn(T, k, generator=g), -1)
    out = experts_by_address(x, addrs, w, I)
    close(out, experts_by_address_reference(x, addrs, w, I, book=book))
    moved = other.data_ptr() + perm[ids] * step
    assert torch.equal(experts_by_address(x, moved, w, I), out)
    mixed = torch.where(ids % 2 == 0, moved, addrs)               # as a cache places them: each expert in one place
    assert torch.equal(experts_by_address(x, mixed, w, I), out)
    assert torch.equal(experts_by_address(x[1:3], addrs[1:3], w[1:3], I), out[1:3])
    close(experts_by_address(x, addrs, w, I, grouped=False), out)


def grouped_read_through():
    """A several-token step with landing slots: the leaders of the experts read from host memory write their rows,
    the distinct ones in ascending id, into the slots (landing_slots_grouped), each once; a slot address of 0 is
    nowhere; the output is unchanged; the oracle lands the same."""
    from moestream.kernels.decode import experts_by_address, landing_slots_grouped
    from moestream.kernels.reference import experts_by_address_reference
    from moestream.kernels.stage import Landing
    E, H, I, T, k = 10, 64, 40, 4, 3
    g, rows, host, pool, book, step = _landing_rows(E, H, I, n_pool=5, seed=7)
    ids = torch.tensor([[7, 2, 5], [2, 9, 7], [0, 7, 3], [5, 2, 8]])
    on_host = torch.tensor([e in (2, 3, 5, 7, 8) for e in range(E)])             # as a cache has it, per expert
    addrs = torch.where(on_host[ids], host.data_ptr() + ids * step, rows.data_ptr() + ids * step)
    host_tab = host.data_ptr() + torch.arange(E) * step
    land = pool.data_ptr() + torch.arange(4) * step
    land[2] = 0                                           # no slot there
    want = landing_slots_grouped(ids.reshape(-1).tolist(), on_host[ids].reshape(-1).tolist(), 4)
    assert want == [(2, 0), (3, 1), (5, 2), (7, 3)]
    x, w = torch.randn(T, H, generator=g), torch.softmax(torch.randn(T, k, generator=g), -1)
    plain = experts_by_address(x, addrs, w, I)
    for run in (lambda lt: experts_by_address(x, addrs, w, I, lt),
                lambda lt: experts_by_address_reference(x, addrs, w, I, lt, book=book)):
        pool.zero_()
        out = run(Landing(ids, host_tab, land))
        close(out, plain)
        assert torch.equal(pool[0], rows[2]) and torch.equal(pool[1], rows[3]) and torch.equal(pool[3], rows[7])
        assert not pool[2].any() and not pool[4].any()    # slot 2 was nowhere; slot 4 not a landing slot
    assert torch.equal(experts_by_address(x, addrs, w, I, Landing(ids, host_tab, land)), plain)


def gated_attention(nh, nkv, hd, rd, n=256):
    """A hybrid model's gated-attention layer in a decode step of three sequences (models/attention.py's
    GatedAttention), through the fused kernels against its eager path: the kernels' q (normed, rotated on the
    first rd dims, the rest passed through), the keys and values written to the cache, and nothing else written;
    decode_attention's gated output; the layer's output."""
    from moestream.config import ModelConfig
    from moestream.kernels import fused
    from moestream.models.gated_attention import partial_rope
    from moestream.arch.families import FAMILIES
    from moestream.models.layers import decode_attention, rms_norm, rope_tables
    from moestream.models.transformer import Batch, MoETransformer, Segment
    from moestream.runtime.kv_cache import KVCache
    H, n_seq, eps = 64, 4, 1e-6
    cfg = ModelConfig(family="qwen3_next", vocab_size=8, hidden_size=H, n_layers=1, n_heads=nh, n_kv_heads=nkv,
                      head_dim=hd, n_experts=2, n_experts_used=1, moe_intermediate_size=8, qk_norm="head",
                      rms_norm_eps=eps, layer_types=("full_attention",), partial_rotary_factor=rd / hd,
                      attn_output_gate=True, zero_centred_norm=True)
    assert cfg.rotary_dim == rd
    g = torch.Generator().manual_seed(hd + rd)
    r = lambda *s: torch.randn(*s, generator=g)
    w = {"token_embd.weight": r(8, H), "blk.0.attn_q.weight": r(2 * nh * hd, H) * H ** -0.5,
         "blk.0.attn_k.weight": r(nkv * hd, H) * H ** -0.5, "blk.0.attn_v.weight": r(nkv * hd, H) * H ** -0.5,
         "blk.0.attn_output.weight": r(H, nh * hd) * (nh * hd) ** -0.5,
         "blk.0.attn_q_norm.weight": 1 + 0.3 * r(hd), "blk.0.attn_k_norm.weight": 1 + 0.3 * r(hd)}
    model = MoETransformer(cfg, w, rope_tables(cfg, n, "cpu"), FAMILIES["qwen3_next"].blocks)
    lw = model.layers[0]
    seq, pos = [2, 0, 3], [5, n - 1, 63]           # early, at the span's end, at a chunk's edge
    batch = Batch.make([Segment(s, p, 1) for s, p in zip(seq, pos)], [1, 2, 3], "cpu", kv_len=n)
    x, cos, sin = r(3, H), model.cos[batch.positions], model.sin[batch.positions]         # (3, H), (3, rd)
    caches = []
    for _ in range(2):
        kv = KVCache(1, n_seq, n, nkv, hd, torch.float32, "cpu")
        kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=torch.Generator().manual_seed(0)))
        kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=torch.Generator().manual_seed(1)))
        caches.append(kv)
    eager_kv, fused_kv = caches
    k0, v0 = fused_kv.k[0].clone(), fused_kv.v[0].clone()

    qkv = torch.nn.functional.linear(x, lw["attn_qkv.weight"])
    q, gate = fused.gated_qk_rope_kv(qkv, lw["attn_qk_norm.weight"], eps, cos, sin, fused_kv.k[0], fused_kv.v[0],
                                     batch.seq_ids, batch.positions, nh, nkv)
    rq, rg = qkv[:, :2 * nh * hd].view(3, nh, 2 * hd).chunk(2, -1)
    rk, rv = qkv[:, 2 * nh * hd:].view(3, 2, nkv, hd).unbind(1)
    rq = partial_rope(rms_norm(rq, lw["attn_q_norm.weight"], eps), cos, sin)
    close(q, rq)
    close(q[..., rd:], rms_norm(qkv[:, :2 * nh * hd].view(3, nh, 2 * hd)[..., :hd], lw["attn_q_norm.weight"],
                                eps)[..., rd:])                        # the unrotated dims: the norm alone
    assert torch.equal(gate, rg)
    s_, p_ = batch.seq_ids, batch.positions
    close(fused_kv.k[0][s_, :, p_], partial_rope(rms_norm(rk, lw["attn_k_norm.weight"], eps), cos, sin))
    assert torch.equal(fused_kv.v[0][s_, :, p_], rv)
    written_k, written_v = fused_kv.k[0][s_, :, p_].clone(), fused_kv.v[0][s_, :, p_].clone()
    fused_kv.k[0][s_, :, p_], fused_kv.v[0][s_, :, p_] = k0[s_, :, p_], v0[s_, :, p_]
    assert torch.equal(fused_kv.k[0], k0) and torch.equal(fused_kv.v[0], v0)            # nothing else written
    fused_kv.k[0][s_, :, p_], fused_kv.v[0][s_, :, p_] = written_k, written_v

    mask = torch.arange(n)[None, :] <= p_[:, None]                                        # (3, n)
    o = fused.decode_attention(q, fused_kv.k[0], fused_kv.v[0], s_, p_, n, gate)
    plain = decode_attention(q, fused_kv.k[0][s_], fused_kv.v[0][s_], mask)
    close(o, plain * torch.sigmoid(rg))
    close(fused.decode_attention(q, fused_kv.k[0], fused_kv.v[0], s_, p_, n), plain)      # no gate: as before

    fused_kv.k[0].copy_(k0)
    fused_kv.v[0].copy_(v0)
    out = model.mix(x, lw, 0, Batch.make(batch.segments, [1, 2, 3], "cpu", kv_len=n, fused=fused),
                                 fused_kv, cos, sin, None, fused)
    want = model.mix(x, lw, 0, batch, eager_kv, cos, sin, mask)
    close(out, want)
    close(fused_kv.k[0], eager_kv.k[0])
    assert torch.equal(fused_kv.v[0], eager_kv.v[0])


def hybrid_decode():
    """synth:tiny-next's decode steps (tests/batched.py's join_and_leave) with every fused kernel, the gated
    attention's and the shared expert's among them, against its eager steps; prompts run none. The plain GEMVs
    (linear, norm_linear: the projections and the vocabulary's head, 2/3 of this check's interpreted time) are
    tests/test_gemv.py's interpreter checks, and tests/test_decode_paths.py's torch stand-ins here: this check
    interprets the rest (the gated attention's, the shared expert's, add_rms_norm and norm_route) in the model."""
    import types
    from batched import join_and_leave
    from test_decode_paths import _stand_in_fused
    from moestream import LLM
    from moestream.kernels import fused

    def run(with_fused: bool):
        eng, calls = LLM("synth:tiny-next", device="cpu", ctx_size=128, n_seq=2).engine, []
        assert eng.fused is None                    # no CUDA: the engine leaves them out; here they are put in
        if with_fused:
            gemvs = _stand_in_fused(calls)
            counted = lambda name: lambda *a: (calls.append(name), getattr(fused, name)(*a))[1]
            eng.fused = types.SimpleNamespace(linear=gemvs.linear, norm_linear=gemvs.norm_linear,
                                              **{n: counted(n) for n in ("gated_qk_rope_kv", "decode_attention",
                                                                         "add_rms_norm", "norm_route",
                                                                         "shared_expert")})
        return join_and_leave(eng), calls
    (eager, _), (out, calls) = run(False), run(True)
    steps = 8                                       # join_and_leave's decode steps
    assert calls.count("gated_qk_rope_kv") == calls.count("decode_attention") == 2 * steps   # 2 attention layers
    assert calls.count("shared_expert") == 4 * steps                                       # every layer's MoE
    assert torch.equal(out[0], eager[0]) and torch.equal(out[4], eager[4])                  # the prompts
    for a, b in zip(out, eager):
        close(a, b)


def check(name):
    from moestream.kernels import fused
    from moestream.models.layers import decode_attention, rms_norm
    g = torch.Generator().manual_seed(1)
    if name == "experts_one_token":
        experts(1, 8)
    elif name == "experts_read_through":
        read_through()
    elif name == "experts_grouped_shared":
        for T, k, E in ((2, 4, 6), (3, 6, 8), (8, 3, 6), (16, 2, 5)):
            grouped(T, k, E, shared=True)
    elif name == "experts_grouped_unshared":
        for T, k in ((2, 4), (3, 3), (8, 2), (16, 2)):
            grouped(T, k, T * k + 2, shared=False)
    elif name == "experts_grouped_read_through":
        grouped_read_through()
    elif name == "experts_several_tokens":      # several tokens, some choosing the same experts
        experts(5, 4)
        experts(3, 6)
    elif name == "qk_rope_kv":     # rotary on whole heads; on their first half (GLM-4.5), on 12 of 32 (the masks)
        for rd in (32, 16, 12):
            qk_rope_kv(g, rd)
    elif name == "add_rms_norm":
        h, d, w = torch.randn(3, 48, generator=g), torch.randn(3, 48, generator=g), torch.rand(48, generator=g)
        new_h, normed = fused.add_rms_norm(h, d, w, 1e-6)
        assert torch.equal(new_h, h + d)
        close(normed, rms_norm(h + d, w, 1e-6))
    elif name == "decode_attention":
        for nh, nkv, hd, n in ((8, 2, 32, 128), (4, 4, 32, 256)):
            kc = torch.randn(3, nkv, 512, hd, generator=g)
            vc = torch.randn_like(kc)
            seq, pos = torch.tensor([1, 0, 2, 1]), torch.tensor([0, 63, n - 1, 100])
            q = torch.randn(4, nh, hd, generator=g)
            mask = torch.arange(n)[None, :] <= pos[:, None]
            close(fused.decode_attention(q, kc, vc, seq, pos, n), decode_attention(q, kc[seq, :, :n], vc[seq, :, :n], mask))
    elif name == "gated_attention":    # Qwen3-Next's heads (256 wide, rotary on 64); a rotary width not a power of two
        gated_attention(16, 2, 256, 64)
        gated_attention(6, 2, 32, 12)
    elif name == "hybrid_decode":
        hybrid_decode()
    elif name == "shared_expert":      # kernels/shared_expert.py against models/moe.py's torch form
        shared()


def qk_rope_kv(g, rd: int):
    """kernels/fused.py's qk_rope_kv with rotary on each head's first rd of 32 dims, with and without QK-norm,
    against rms_norm and models/gated_attention.py's partial_rope (apply_rope where rd is the head), the caches
    written at (seq, pos) and nowhere else."""
    from moestream.kernels import fused
    from moestream.models.gated_attention import partial_rope
    from moestream.models.layers import rms_norm
    T, nh, nkv, hd, ctx, eps = 3, 8, 2, 32, 64, 1e-6
    qkv = torch.randn(T, (nh + 2 * nkv) * hd, generator=g)
    qw, kw = torch.rand(hd, generator=g) + 0.5, torch.rand(hd, generator=g) + 0.5
    ang = torch.rand(T, rd // 2, generator=g) * 6
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    seq, pos = torch.tensor([2, 0, 3]), torch.tensor([5, 63, 0])
    for norm in (True, False):
        kc = torch.randn(4, nkv, ctx, hd, generator=g)
        vc, kc0 = torch.randn_like(kc), kc.clone()
        vc0 = vc.clone()
        q = fused.qk_rope_kv(qkv, torch.cat([qw, kw]) if norm else None, eps, cos, sin, kc, vc, seq, pos, nh, nkv)
        rq, rk, rv = qkv.split([nh * hd, nkv * hd, nkv * hd], -1)
        rq, rk, rv = rq.view(T, nh, hd), rk.view(T, nkv, hd), rv.view(T, nkv, hd)
        if norm:
            rq, rk = rms_norm(rq, qw, eps), rms_norm(rk, kw, eps)
        close(q, partial_rope(rq, cos, sin))
        close(kc[seq, :, pos], partial_rope(rk, cos, sin))
        assert torch.equal(vc[seq, :, pos], rv)
        kc[seq, :, pos], vc[seq, :, pos] = kc0[seq, :, pos], vc0[seq, :, pos]
        assert torch.equal(kc, kc0) and torch.equal(vc, vc0)


def shared():
    """The shared expert of a decode step of 1, 3 and 8 tokens, H and I not powers of two (the masks), with the
    default blocks (one tile a row) and small ones (the loops over H and I run three times, the last part-full),
    against `_shared`'s torch form; `out` is read, not written."""
    import types
    from moestream.kernels.shared_expert import shared_expert
    from moestream.models.moe import _shared
    H, I = 76, 42
    g = torch.Generator().manual_seed(3)
    lw = {"ffn_gate_shexp.weight": torch.randn(I, H, generator=g) * H ** -0.5,
          "ffn_up_shexp.weight": torch.randn(I, H, generator=g) * H ** -0.5,
          "ffn_down_shexp.weight": torch.randn(H, I, generator=g) * I ** -0.5,
          "ffn_gate_inp_shexp.weight": torch.randn(1, H, generator=g) * H ** -0.5}
    cfg = types.SimpleNamespace(shared_expert_intermediate_size=I)
    small = ((4, 32, 1), (8, 16, 1))
    for T in (1, 3, 8):
        x, out = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
        kept = out.clone()
        want = _shared(x, lw, cfg, out)
        for config in (None, small):
            y = shared_expert(x, *(lw[n] for n in ("ffn_gate_shexp.weight", "ffn_up_shexp.weight",
                                                    "ffn_down_shexp.weight", "ffn_gate_inp_shexp.weight")), out,
                              *(() if config is None else (config,)))
            assert y.shape == out.shape and y.dtype == out.dtype
            close(y, want)
        assert torch.equal(out, kept)


if __name__ == "__main__":
    check(sys.argv[1])
