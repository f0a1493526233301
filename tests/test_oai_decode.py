"""gpt-oss's clamped SwiGLU with biases in the zero-copy decode kernels (kernels/decode_act.py; issue 53): the float
kernels (kernels/decode.py for one token, kernels/decode_grouped.py for several), the quantized ones
(kernels/decode_quant.py's "values" and "runs") on MXFP4 rows, gpt-oss's, and FP8 rows (kernels/fp8.py), through
Triton's interpreter on the CPU as tests/test_triton_kernels.py and tests/test_quant_kernels.py run them: against
the plain-torch oracle (experts_by_address_reference with an OaiSwiglu) in float32, on cases that reach every
clamp, and the same bits when the experts' rows lie in another buffer in another order (a slot is never an expert
id: the biases go by id). The oracle against the prompt kernels' reference (experts_reference, the same OaiSwiglu)
on the CPU; and, compiled on the GPU (`cuda`), the kernels at gpt-oss-120b's expert shape (H = I = 2880, k = 4)
and synth:tiny-gptoss decoding by address on every placement.

Bound: relative error 1e-5 of the float32 oracle in the interpreter (float32 sums in another order), 1e-2 in
bfloat16 on the GPU, as the other decode kernels' tests.
"""
from __future__ import annotations

import sys

import pytest
import torch

from interpreted import close, run_check

# float:T,k (T = 1: decode.py; T >= 2: decode_grouped.py, experts shared between tokens, and decode.py's per-choice
# kernel); MXFP4 rows through "values" and "runs", one token and several (the other types' runs share the launch
# code the option adds to: tests/test_quant_kernels.py); FP8 block-scaled rows (kernels/fp8.py, whatever the variant).
CHECKS = ["float:1,3", "float:3,2", "values:MXFP4", "runs:MXFP4", "fp8:FP8"]
LIMIT = 7.0


@pytest.mark.parametrize("check", CHECKS)
def test_oai_decode_kernel_in_the_interpreter(check):
    pytest.importorskip("triton")
    run_check(__file__, check, timeout=600)


def _act(ids, E: int, I: int, H: int, g):
    """An OaiSwiglu over ids (T, k) with biases of O(1) (E experts)."""
    from moestream.kernels.reference import OaiSwiglu
    return OaiSwiglu(ids, torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g), LIMIT)


def _elsewhere(rows: torch.Tensor, g) -> tuple[torch.Tensor, torch.Tensor]:
    """The same experts in another buffer, expert e at row perm[e] (so its slot there is not its id): (buffer,
    perm)."""
    perm = torch.randperm(rows.shape[0], generator=g)
    other = torch.empty_like(rows)
    other[perm] = rows
    return other, perm


def _bites(w13: torch.Tensor, x: torch.Tensor, act, I: int) -> None:
    """The case reaches every clamp where it shows (gate above 7; up above 7 and below -7 where the gate is above
    0, so that gate sigmoid(1.702 gate) does not hide it), so the checks check them."""
    e = act.ids.reshape(-1)
    xs = x.float().repeat_interleave(act.ids.shape[1], dim=0)
    gu = torch.einsum("nih,nh->ni", w13[e].float(), xs) + act.b13[e]
    gate, up = gu[:, :I], gu[:, I:]
    assert (gate > LIMIT).any() and ((up > LIMIT) & (gate > 0)).any() and ((up < -LIMIT) & (gate > 0)).any()


def float_check(T: int, k: int):
    """Float rows: against the oracle; the same bits from the other buffer and from a mix of both; several tokens:
    a token's bits whatever other tokens share its step, and close to the per-choice kernel."""
    from moestream.kernels.decode import experts_by_address
    from moestream.kernels.reference import AddressBook, experts_by_address_reference
    E, H, I = 7, 12, 6              # not powers of two: the masks (tiles as tests/test_triton_kernels.py's grouped)
    g = torch.Generator().manual_seed(100 * T + k)
    rows = torch.randn(E, 3 * I * H, generator=g) * 1.5
    other, perm = _elsewhere(rows, g)
    book = AddressBook()
    book.add(rows)
    book.add(other)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    act = _act(ids, E, I, H, g)
    step = rows.stride(0) * rows.element_size()
    addrs = rows.data_ptr() + ids * step
    x, w = torch.randn(T, H, generator=g) * 2, torch.softmax(torch.randn(T, k, generator=g), -1)
    _bites(rows[:, :2 * I * H].view(E, 2 * I, H), x, act, I)                # gate and up sums of std 10
    out = experts_by_address(x, addrs, w, I, act=act)
    close(out, experts_by_address_reference(x, addrs, w, I, book=book, act=act))
    assert not torch.allclose(out, experts_by_address(x, addrs, w, I), atol=1e-2)      # the option does something
    moved = other.data_ptr() + perm[ids] * step
    assert torch.equal(experts_by_address(x, moved, w, I, act=act), out)
    mixed = torch.where(ids % 2 == 0, moved, addrs)
    assert torch.equal(experts_by_address(x, mixed, w, I, act=act), out)
    if T > 1:
        assert ids.unique().numel() < T * k                # experts shared: a run of several members
        sub = act.rows(ids[1:])
        assert torch.equal(experts_by_address(x[1:], addrs[1:], w[1:], I, act=sub), out[1:])
        close(experts_by_address(x, addrs, w, I, grouped=False, act=act), out)


def quant_check(spec: str, variant: str):
    """Quantized rows (tests/test_quant_kernels.py's random valid blocks; I = 96: a down row of 3 blocks, masked;
    FP8: tests/test_fp8_kernels.py's rows, a partial 128 block): one token with k = 3 and two tokens with k = 2,
    against the oracle; the same bits from the other buffer, and ("runs") from an odd-aligned copy of it (its
    shifted words instead of its vector loads)."""
    from test_quant_kernels import layout_of, moved_copy, random_rows

    from moestream.kernels.decode_quant import experts_by_address_quant
    from moestream.kernels.decode_runs import runs_layout
    from moestream.kernels.reference import AddressBook, experts_by_address_reference
    E = 6
    g = torch.Generator().manual_seed(len(spec))
    if spec == "FP8":
        from test_fp8_kernels import fp8_rows, layout
        lay = layout(40, 64)
        rows = fp8_rows(E, lay.inter, lay.hidden, g)
    else:
        lay = layout_of(spec, 96, 64)
        rows = random_rows(lay, E, g)
    assert variant != "runs" or runs_layout(lay), spec
    other, perm = _elsewhere(rows, g)
    copies = [other] + ([moved_copy(other, 1)] if variant == "runs" else [])
    book = AddressBook()
    for c in [rows] + copies:
        book.add(c)
    w13 = lay.dequantize(rows)[0]
    scale = w13[0].std().item() * lay.hidden ** 0.5
    step = rows.stride(0)
    for T, k in ((1, 3), (2, 2)):
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        act = _act(ids, E, lay.inter, lay.hidden, g)
        x = torch.randn(T, lay.hidden, generator=g) * 6 / scale             # gate x of order 6: the clamps bite
        _bites(w13, x, act, lay.inter)
        w = torch.softmax(torch.randn(T, k, generator=g), -1)
        addrs = rows.data_ptr() + ids * step
        out = experts_by_address_quant(x, addrs, w, lay, variant=variant, act=act)
        close(out, experts_by_address_reference(x, addrs, w, lay, book=book, act=act))
        for c in copies:
            assert torch.equal(experts_by_address_quant(x, c.data_ptr() + perm[ids] * step, w, lay, variant=variant,
                                                        act=act), out), (T, k)


def check(name: str):
    kind, spec = name.split(":")
    if kind == "float":
        float_check(*map(int, spec.split(",")))
    else:
        quant_check(spec, kind)


def test_the_by_address_oracle_is_the_prompt_kernels_math():
    """experts_by_address_reference with an OaiSwiglu (what the decode kernels are held to) against the prompt path's
    experts_reference with the same OaiSwiglu (tests/test_gptoss.py checks it against transformers' formula), the
    experts in slots that are not their ids, combined: the same result in float32 up to the order of the sums."""
    from moestream.kernels.reference import AddressBook, experts_by_address_reference, experts_reference
    from moestream.models.moe import combine
    E, H, I, T, k = 6, 16, 8, 5, 3
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(E, 3 * I * H, generator=g) * 1.5
    other, perm = _elsewhere(rows, g)
    book = AddressBook()
    book.add(other)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    act = _act(ids, E, I, H, g)
    x, w = torch.randn(T, H, generator=g) * 1.5, torch.softmax(torch.randn(T, k, generator=g), -1)
    w13, w2 = other[:, :2 * I * H].view(E, 2 * I, H), other[:, 2 * I * H:].view(E, H, I)
    _bites(rows[:, :2 * I * H].view(E, 2 * I, H), x, act, I)
    want = combine(experts_reference(x, perm[ids], w13, w2, act), w)                  # slots perm[ids]
    step = other.stride(0) * other.element_size()
    got = experts_by_address_reference(x, other.data_ptr() + perm[ids] * step, w, I, book=book, act=act)
    assert (got - want).abs().max() < 1e-4 * want.abs().max(), (got - want).abs().max()


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gpu_case(lay, rows: torch.Tensor, T: int, k: int, g, x_scale: float):
    """rows (E, row) of `lay` (an ExpertLayout, or I for float rows of I x H) on the GPU, and the same bytes in
    pinned host memory in another order; k of E experts for T tokens, bf16 biases, x and weights; the addresses of
    both copies and the float32 oracle's output (on the CPU, through an AddressBook); last, the host copy itself,
    which the caller holds while kernels read its addresses (freed, its pinned block goes back to the allocator)."""
    from moestream.kernels.reference import AddressBook, OaiSwiglu, experts_by_address_reference
    from moestream.quant.layout import ExpertLayout
    E = rows.shape[0]
    inter, hidden = (lay.inter, lay.hidden) if isinstance(lay, ExpertLayout) else (lay, rows.shape[1] // (3 * lay))
    host, perm = _elsewhere(rows, g)
    host = host.pin_memory()
    dev = rows.cuda()
    book = AddressBook()
    book.add(dev)
    book.add(host)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    b13 = torch.randn(E, 2 * inter, generator=g).to(torch.bfloat16)
    b2 = torch.randn(E, hidden, generator=g).to(torch.bfloat16)
    x = (torch.randn(T, hidden, generator=g) * x_scale).to(torch.bfloat16)
    w = torch.softmax(torch.randn(T, k, generator=g), -1).to(torch.bfloat16)
    step = dev.stride(0) * dev.element_size()
    dev_addr, host_addr = dev.data_ptr() + ids * step, host.data_ptr() + perm[ids] * step
    ref = experts_by_address_reference(x, dev_addr, w, lay, book=book, act=OaiSwiglu(ids, b13, b2, LIMIT))
    act = OaiSwiglu(ids.cuda(), b13.cuda(), b2.cuda(), LIMIT)
    return dev, ids.cuda(), dev_addr.cuda(), host_addr.cuda(), x.cuda(), w.cuda(), act, ref.cuda(), host


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("T", [1, 8])
def test_mxfp4_oai_decode_compiled_at_gpt_oss_120b_shape(T):
    """MXFP4 rows of gpt-oss-120b's experts (H = I = 2880, 90 blocks of 17 bytes a row), k = 4, both variants:
    bfloat16 against the float32 oracle; the same bits from pinned host memory (another order: slots are not ids),
    from a mix of both, and from 4- and 2-aligned copies (the runs' shifted words)."""
    from test_quant_kernels import layout_of, moved_copy, random_rows

    from moestream.kernels.decode_quant import experts_by_address_quant
    from moestream.kernels.decode_runs import runs_layout
    lay = layout_of("MXFP4", 2880, 2880)
    assert runs_layout(lay)
    g = torch.Generator().manual_seed(T)
    rows = random_rows(lay, 12, g)
    scale = lay.dequantize(rows[:1])[0].std().item() * lay.hidden ** 0.5
    dev, ids, dev_addr, host_addr, x, w, act, ref, _host = _gpu_case(lay, rows, T, 4, g, 6 / scale)
    step = dev.stride(0)
    on_host = torch.arange(dev.shape[0], device="cuda") % 3 == 0            # each expert in one place
    copies = [moved_copy(dev, s) for s in (4, 2)]          # held: the kernels read them by address
    moved = [c.data_ptr() + ids * step for c in copies]
    for variant in ("values", "runs"):
        out = experts_by_address_quant(x, dev_addr, w, lay, variant=variant, act=act)
        assert torch.isfinite(out).all()
        close(out, ref, tol=1e-2)
        for addrs in [host_addr, torch.where(on_host[ids], host_addr, dev_addr)] + moved:
            assert torch.equal(experts_by_address_quant(x, addrs, w, lay, variant=variant, act=act), out), variant


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("T", [1, 8])
def test_float_oai_decode_compiled_at_gpt_oss_120b_shape(T):
    """bf16 rows at H = I = 2880, k = 4 (T = 1: decode.py; T = 8: decode_grouped.py, experts shared): against the
    float32 oracle, and the same bits from pinned host memory in another order and from a mix."""
    from moestream.kernels.decode import experts_by_address
    H = I = 2880
    g = torch.Generator().manual_seed(T)
    rows = (torch.randn(10, 3 * I * H, generator=g) * H ** -0.5).to(torch.bfloat16)
    dev, ids, dev_addr, host_addr, x, w, act, ref, _host = _gpu_case(I, rows, T, 4, g, 6.0)
    out = experts_by_address(x, dev_addr, w, I, act=act)
    assert torch.isfinite(out).all()
    close(out, ref, tol=1e-2)
    on_host = torch.arange(dev.shape[0], device="cuda") % 3 == 0
    for addrs in (host_addr, torch.where(on_host[ids], host_addr, dev_addr)):
        assert torch.equal(experts_by_address(x, addrs, w, I, act=act), out)



@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("experts", ["float", "mxfp4"])
def test_gpt_oss_zero_copy_decode_hash_same_on_every_placement_and_cache(experts):
    """synth:tiny-gptoss in bf16, its experts float or MXFP4: the decode plan reads them by address (the OaiSwiglu
    in the decode kernels) all on the GPU, with no cache, with caches small and whole, eager and captured, staged
    or not: the same greedy tokens (tests/test_cuda.py's contract for the other families); with no cache the steps
    read host memory."""
    from moestream import LLM
    spec = f"synth:tiny-gptoss:dtype=bfloat16:experts={experts}"
    prompt = list(range(3, 60, 2))
    hashes = set()
    for kw in ({}, {"cuda_graphs": False}, {"cpu_moe": True}, {"cpu_moe": True, "moe_cache_mib": 0},
               {"cpu_moe": True, "moe_cache_mib": 1}, {"cpu_moe": True, "moe_cache_mib": 100, "cuda_graphs": False},
               {"n_cpu_moe": 2, "moe_cache_mib": 1}, {"cpu_moe": True, "stage_host_reads": experts == "float"}):
        llm = LLM(spec, ctx_size=256, device="cuda", **kw)
        assert llm.engine.plan.zero_copy and llm.engine.decode_kernel is not None, kw
        hashes.add(llm.generate(prompt, max_tokens=32, ignore_eos=True).sha256)
        if kw.get("moe_cache_mib") == 0:
            assert llm.stats()["total"]["host_reads"] > 0, kw
    assert len(hashes) == 1, hashes


if __name__ == "__main__":
    check(sys.argv[1])
