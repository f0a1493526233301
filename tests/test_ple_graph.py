"""The PLE layer's decode step on the device (models/ple.py's on_device path, Qwen3.8-Flash-Next): the n-gram hash
as integer torch ops (NGramHash.rows_decode) bit for bit the host's (NGramHash.rows: EOS rules, a sequence's
start), the table's rows read in place by a kernel (kernels/ple_gather.py, through Triton's interpreter on the CPU)
equal to the lookup, and tiny-flash-next's decode steps on that path: the host path's tokens (one sequence: its
bits), no host read in the PLE's part of a step, and the CPU stand-in of a CUDA graph giving the eager bits. On
CUDA (`-m cuda`): the kernel against pinned host memory, and real graphs of the family's steps."""
from __future__ import annotations

import contextlib
import sys

import pytest
import torch

from moestream import LLM
from moestream.models.ple import NGramHash, PLETable
from moestream.models.transformer import MoETransformer

from batched import join_and_leave
from conftest import greedy_steps
from interpreted import run_check

KW = dict(device="cpu", ctx_size=64)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def cfg():
    return LLM("synth:tiny-flash-next", **KW).engine.cfg


def test_the_device_hash_is_the_host_hash(cfg):
    """rows_decode of a batch of (context, token) equals rows() of each alone, over contexts and tokens with EOS
    anywhere (EOS dense: the n-grams restart), at a sequence's start (EOS context) and with large token ids; and a
    sequence hashed a token a step from its start equals it hashed in one call."""
    h = NGramHash.of(cfg)
    eos, c = h.eos, h.context_len
    g = torch.Generator().manual_seed(0)
    vocab = cfg.vocab_size
    for _ in range(20):
        B = 7
        ctx = torch.randint(0, vocab, (B, c), generator=g)
        tok = torch.randint(0, vocab, (B,), generator=g)
        ctx[torch.rand(B, c, generator=g) < 0.3] = eos
        tok[torch.rand(B, generator=g) < 0.2] = eos
        ctx[0], ctx[1, -1], tok[2] = eos, vocab - 1, vocab - 1            # a start; the largest id
        got = h.rows_decode(ctx, tok)
        want = torch.cat([h.rows(ctx[b], tok[b:b + 1]) for b in range(B)])
        assert got.dtype == torch.long and torch.equal(got, want)
    seq = torch.randint(0, vocab, (40,), generator=g)
    seq[[5, 6, 20]] = eos
    ctx, steps = torch.tensor(h.start_context()), []
    for t in seq:
        steps.append(h.rows_decode(ctx[None], t[None]))
        ctx = torch.cat([ctx[1:], t[None]])
    assert torch.equal(torch.cat(steps), h.rows(h.start_context(), seq))


def check_gather(device: str = "cpu") -> None:
    """kernels/ple_gather.py's rows (repeats, the first and last row, several programs a row) read from the
    host table by address equal its index_select."""
    from moestream.kernels import ple_gather
    if device == "cpu":
        ple_gather.BLOCK = 8                      # several programs a row, in the interpreter
    g = torch.Generator().manual_seed(0)
    for dtype, d in ((torch.float32, 20), (torch.bfloat16, 32)):
        table = torch.randn(97, d, generator=g).to(dtype)
        if device != "cpu":
            table = table.pin_memory()
        rows = torch.tensor([0, 96, 5, 5, 40, 1], device=device)
        out = torch.full((6, d), 7, dtype=dtype, device=device)
        ple_gather.gather_rows(table.data_ptr(), d * table.element_size() // 4, rows, out)
        assert torch.equal(out.cpu(), table.index_select(0, rows.cpu())), dtype


def check(name: str, device: str = "cpu") -> None:
    {"gather": check_gather}[name](device)


def test_the_in_place_gather_in_the_interpreter():
    pytest.importorskip("triton")
    run_check(__file__, "gather", timeout=300)


def test_capturable_where_the_table_is_read_in_place_and_qsa_has_kernels(cfg):
    assert not MoETransformer.capturable_for(cfg)
    assert not MoETransformer.capturable_for(cfg, ple_in_place=True)          # QSA's torch form
    assert not MoETransformer.capturable_for(cfg, qsa_kernels=True)           # a mapped (GGUF) table
    assert MoETransformer.capturable_for(cfg, ple_in_place=True, qsa_kernels=True)
    assert not PLETable(torch.zeros(4, 8)).in_place                           # not pinned (no GPU here)


def _as_tensor(table):
    """A synth table (loading/synth.py's SynthRows: rows made when taken) as a tensor of the same rows."""
    return table if isinstance(table, torch.Tensor) else table.take(torch.arange(table.shape[0]))


def _device_path(eng) -> list:
    """eng's PLE on the device path (as with a pinned table on CUDA; here the gather's oracle) over its table's
    rows as a tensor; the decode steps that took it (one entry a step)."""
    ple, took = eng.model.ple, []
    ple.table.table, ple.table.mapped, ple.table.in_place = _as_tensor(ple.table.table), False, True
    on_device = ple.on_device
    ple.on_device = lambda batch: took.append(1) or on_device(batch) if batch.is_decode else on_device(batch)
    return took


def _no_reads_but_qsa(eng) -> None:
    """eng's decode steps refuse host reads (test_mla_decode's check), but QSA's torch form's, which slices by
    host-known sequences and positions: here it stands in for its CUDA kernels (which read none: tests/
    test_qsa_kernels.py checks them so) reading them from the step's device tensors, as the kernels do (a captured
    step's segments are its capture's)."""
    from test_mla_decode import _forward_checked, reads_allowed
    from moestream.models.transformer import Segment
    _forward_checked(eng)
    attn = eng.model.attention
    attend = attn.attend

    def allowed(q, x, lw, slot, batch, *a):
        if not batch.is_decode:
            return attend(q, x, lw, slot, batch, *a)
        with reads_allowed():
            segments = batch.segments
            batch.segments = [Segment(int(s), int(p), 1) for s, p in zip(batch.seq_ids, batch.positions)]
            try:
                return attend(q, x, lw, slot, batch, *a)
            finally:
                batch.segments = segments
    attn.attend = allowed


def test_decode_on_the_device_path_gives_the_host_paths_tokens_and_bits():
    """Greedy generation on the device path: the host path's tokens, every step's logits bit for bit (one
    sequence: the same ops); the steps took the device path and read nothing back in the PLE's part."""
    prompt = [int(x) for x in torch.randint(3, 400, (20,), generator=torch.Generator().manual_seed(3))]

    def run(device: bool):
        llm = LLM("synth:tiny-flash-next", zero_copy_decode=True, **KW)
        eng, logits = llm.engine, []
        took = _device_path(eng) if device else None
        if device:
            _no_reads_but_qsa(eng)
        tok, pos = int(eng.prefill(0, prompt)[-1].argmax()), len(prompt)
        for _ in range(6):
            lg = eng.decode([(0, tok, pos)]).clone()
            logits.append(lg)
            tok, pos = int(lg[0].argmax()), pos + 1
        assert not device or len(took) >= 6
        return logits, eng.kv.ngram.clone(), eng.kv.ple_conv[eng.cfg.ple_layers[0]].clone()
    (host, hctx, hconv), (dev, dctx, dconv) = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(host, dev))
    assert torch.equal(hctx, dctx) and torch.equal(hconv, dconv)


def test_captured_steps_replayed_give_the_eager_bits(monkeypatch):
    """The family's decode steps on the device path, captured (runtime/graphs.py's CPU stand-in) with no host read
    but QSA's torch form's: join_and_leave's steps give the eager steps' bits, and those are within float32 of
    the host path's (two sequences at once: one GEMM over both rows)."""
    from test_decode_paths import _replaying_on_the_cpu

    def script(device: bool, replayed: bool):
        eng = LLM("synth:tiny-flash-next", device="cpu", ctx_size=128, n_seq=2, zero_copy_decode=True).engine
        if device:
            _device_path(eng)
            _no_reads_but_qsa(eng)
        if replayed:
            _replaying_on_the_cpu(monkeypatch, eng)
        out = join_and_leave(eng)
        assert not replayed or set(eng.decoder.graphs.graphs) == {(1, 128), (2, 128)}
        return out
    host, eager, replayed = script(False, False), script(True, False), script(True, True)
    assert all(torch.equal(x, y) for x, y in zip(eager, replayed))
    assert all(torch.allclose(x, y, atol=5e-5, rtol=0) for x, y in zip(host, eager))


@pytest.mark.cuda
@needs_cuda
def test_the_in_place_gather_reads_pinned_host_rows_on_cuda():
    check_gather("cuda")


@pytest.mark.cuda
@needs_cuda
def test_the_family_captures_its_decode_steps_on_cuda_with_the_eager_bits(monkeypatch):
    """tiny-flash-next on CUDA in bfloat16 (in float32 the reference expert kernel's host sync keeps decode eager:
    runtime/plan.py decode_plan): its table (the synth's made a tensor) pinned by runtime/load.py's host_tables and
    read in place, its steps captured (QSA's kernels), the captured steps' tokens and bits the eager steps'; the
    host path's tokens."""
    from moestream.runtime import load
    host_tables = load.host_tables
    monkeypatch.setattr(load, "host_tables", lambda source, cfg, dev, *room: host_tables(
        type("S", (), {"rows": lambda self, n: _as_tensor(source.rows(n))})(), cfg, dev, *room))
    prompt = list(range(10, 50))

    def run(graphs: bool, in_place: bool = True):
        eng = LLM("synth:tiny-flash-next:dtype=bfloat16", device="cuda", ctx_size=128, cuda_graphs=graphs).engine
        assert eng.model.ple.table.in_place and eng.model.capturable
        eng.model.ple.table.in_place = in_place
        outs = greedy_steps(eng, prompt, 8)
        assert eng.plan.graphs == graphs
        if graphs:
            assert eng.decoder.graphs.graphs
        return outs
    eager, graphs = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(eager, graphs))
    host = run(False, in_place=False)
    assert [int(x.argmax()) for x in host] == [int(x.argmax()) for x in eager]


if __name__ == "__main__":
    check(*sys.argv[1:])
