"""A GGUF's quantized PLE n-gram table read in place (Qwen3.8-Flash-Next): its blocks, as the file holds them, in
host memory (models/ple.py's BlockTable; runtime/load.py pins them on a GPU), a decode step's rows gathered and
dequantized on the device (kernels/ple_gather.py's gather_block_rows), so GGUF files get CUDA graphs too. Through
Triton's interpreter on the CPU: the kernel's rows equal the host path's dequantized rows bit for bit (float32),
Q8_0 and Q4_0 (the types moestream's quantize and the published files give the table) and Q2_K (IQ1/IQ2 mixes).
The engine on a tiny-flash-next GGUF with a Q4_0 / Q8_0 table: the device path (the kernel's CPU stand-in,
BlockTable.take) gives the host path's tokens and logits bit for bit; the copy's bytes and its fallback where host
memory lacks room. On CUDA (`-m cuda`): the kernel on pinned memory, and the family's steps captured."""
from __future__ import annotations

import logging
import sys

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from moestream import LLM
from moestream.models.ple import BlockTable, PLETable
from moestream.models.transformer import MoETransformer

from conftest import greedy_steps
from interpreted import run_check

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _table(qtype: Q, rows: int, d: int, seed: int = 0) -> BlockTable:
    from moestream.quant.quantize import quantize
    x = torch.randn(rows, d, generator=torch.Generator().manual_seed(seed))
    return BlockTable(quantize(x, qtype), qtype, d)


def check_block_gather(device: str = "cpu") -> None:
    """gather_block_rows' rows (repeats, the first and last row, several programs a row) equal BlockTable.take's
    (the host's dequantizer) bit for bit."""
    from moestream.kernels import ple_gather
    if device == "cpu":
        ple_gather.VALUES = 32                    # several programs a row, in the interpreter
    for qtype, d in ((Q.Q8_0, 96), (Q.Q4_0, 64), (Q.Q2_K, 256)):
        table = _table(qtype, 41, d)
        if device != "cpu":
            table.blocks = table.blocks.pin_memory()
        rows = torch.tensor([0, 40, 5, 5, 17, 1], device=device)
        out = torch.full((6, d), 7.0, device=device)
        ple_gather.gather_block_rows(table.blocks.data_ptr(), table.blocks.shape[1], qtype, rows, out)
        assert torch.equal(out.cpu(), table.take(rows.cpu())), qtype


def check(name: str, device: str = "cpu") -> None:
    {"block_gather": check_block_gather}[name](device)


def test_the_quantized_in_place_gather_in_the_interpreter():
    pytest.importorskip("triton")
    run_check(__file__, "block_gather", timeout=300)


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    """tiny-flash-next as Q8_0 GGUFs whose n-gram table is Q4_0 and Q8_0: {table type: path}."""
    from moestream.loading.gguf_write import write_gguf
    from moestream.loading.synth import SynthSource
    from moestream.quant.mix import Mix
    src = SynthSource.from_spec("tiny-flash-next")
    mix = Mix.for_config(src.config, "Q8_0")
    out = {}
    for qtype in (Q.Q4_0, Q.Q8_0):
        path = tmp_path_factory.mktemp("pleq") / f"{qtype.name}.gguf"
        write_gguf(src, path, types=lambda n, shape, q=qtype: q if n == "per_layer_token_embd.weight"
                   else mix.type(n, shape), file_type=mix.file_type)
        out[qtype] = path
    return out


def test_the_copy_holds_the_files_blocks_and_falls_back_where_host_memory_lacks_room(gguf_files, caplog):
    """pinned_blocks copies the table's blocks as the file holds them (a Q4_0 row: 18 bytes a 32 values), whose
    rows dequantize as the map's; with too little room it keeps the map, saying so in one line."""
    from moestream.device import Device
    from moestream.loading.gguf import GGUFSource
    from moestream.runtime.load import pinned_blocks
    src = GGUFSource(gguf_files[Q.Q4_0])
    mapped = src.rows("per_layer_token_embd.weight")
    d = mapped.shape[1]
    assert mapped.qtype == Q.Q4_0 and mapped.row_bytes == d // 32 * 18
    table = pinned_blocks(mapped, "per_layer_token_embd.weight", Device.resolve("cpu"), room=None)
    assert isinstance(table, BlockTable) and table.nbytes == mapped.nbytes == mapped.shape[0] * d // 32 * 18
    idx = torch.tensor([0, mapped.shape[0] - 1, 9, 9, 300])
    assert torch.equal(table.take(idx), mapped.take(idx))
    assert not PLETable(table).in_place                           # not pinned (no GPU here)
    with caplog.at_level(logging.WARNING, logger="moestream"):
        assert pinned_blocks(mapped, "per_layer_token_embd.weight", Device.resolve("cpu"),
                             room=mapped.nbytes - 1) is mapped
    assert "do not fit" in caplog.text and len(caplog.records) == 1 and "\n" not in caplog.text.strip()


def _blocks_on_device_path(eng) -> list:
    """eng's PLE over its GGUF's table as pinned_blocks makes it, on the device path (as on CUDA; here the kernel's
    CPU stand-in, BlockTable.take); the decode steps that took it."""
    from moestream.device import Device
    from moestream.runtime.load import pinned_blocks
    ple, took = eng.model.ple, []
    ple.table.table = pinned_blocks(ple.table.table, "per_layer_token_embd.weight", Device.resolve("cpu"), None)
    assert isinstance(ple.table.table, BlockTable)
    ple.table.in_place = True
    on_device = ple.on_device
    ple.on_device = lambda batch: took.append(1) or on_device(batch) if batch.is_decode else on_device(batch)
    return took


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0], ids=["Q4_0", "Q8_0"])
def test_a_gguf_table_on_the_device_path_gives_the_host_paths_tokens_and_logits(gguf_files, qtype):
    """Greedy decode of a tiny-flash-next GGUF whose table is quantized: the device path (blocks in host memory,
    rows dequantized by the kernel's stand-in, no host read in the PLE's part) gives the host path's (the map's
    rows dequantized on the host) tokens and every step's logits bit for bit; its steps count a row's blocks."""
    from test_ple_graph import _no_reads_but_qsa
    prompt = [int(x) for x in torch.randint(3, 400, (12,), generator=torch.Generator().manual_seed(5))]

    def run(device: bool):
        eng = LLM(str(gguf_files[qtype]), device="cpu", ctx_size=64, zero_copy_decode=True).engine
        assert eng.model.ple.table.mapped and not eng.model.ple.table.in_place
        took = _blocks_on_device_path(eng) if device else None
        if device:
            _no_reads_but_qsa(eng)
        tok, pos, logits = int(eng.prefill(0, prompt)[-1].argmax()), len(prompt), []
        before = eng.model.ple.table.bytes_read
        for _ in range(5):
            lg = eng.decode([(0, tok, pos)]).clone()
            logits.append(lg)
            tok, pos = int(lg[0].argmax()), pos + 1
        if device:
            t = eng.model.ple.table.table
            heads = eng.model.ple.hash.rows_decode(torch.zeros(1, 2, dtype=torch.long),
                                                   torch.zeros(1, dtype=torch.long)).shape[1]
            assert len(took) >= 5 and eng.model.ple.table.bytes_read - before == 5 * heads * t.blocks.shape[1]
        return logits, eng.kv.ngram.clone()
    (host, hctx), (dev, dctx) = run(False), run(True)
    assert [int(x.argmax()) for x in host] == [int(x.argmax()) for x in dev]
    assert all(torch.equal(a, b) for a, b in zip(host, dev)) and torch.equal(hctx, dctx)


@pytest.mark.cuda
@needs_cuda
def test_the_quantized_in_place_gather_reads_pinned_host_blocks_on_cuda():
    check_block_gather("cuda")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0], ids=["Q4_0", "Q8_0"])
def test_a_gguf_table_is_pinned_and_its_steps_captured_on_cuda(gguf_files, qtype):
    """tiny-flash-next's GGUF on CUDA: its quantized table pinned by runtime/load.py (BlockTable, read in place),
    its decode steps captured; the captured steps' bits the eager steps', the host path's tokens."""
    prompt = list(range(10, 50))

    def run(graphs: bool, in_place: bool = True):
        eng = LLM(str(gguf_files[qtype]), device="cuda", ctx_size=128, cuda_graphs=graphs).engine
        table = eng.model.ple.table
        assert isinstance(table.table, BlockTable) and table.table.blocks.is_pinned() and table.in_place
        assert eng.model.capturable and MoETransformer.capturable_for(eng.cfg, True, True)
        table.in_place = in_place
        outs = greedy_steps(eng, prompt, 8)
        if graphs:
            assert eng.decoder.graphs.graphs
        return outs
    eager, graphs = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(eager, graphs))
    host = run(False, in_place=False)
    assert [int(x.argmax()) for x in host] == [int(x.argmax()) for x in eager]


if __name__ == "__main__":
    check(*sys.argv[1:])
