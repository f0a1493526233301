"""Files users hand us and files we write for them (issue 49).

Writing: nothing that is at OUT is replaced (the KL base given the input text or the model), a directory at OUT is
refused before the work, and a failed or interrupted write leaves nothing behind. Reading: a damaged GGUF,
safetensors directory, routing trace or KL base is refused in one line (UserError), never with a traceback: a fuzz
pass (hypothesis, a few seconds each) of byte changes and truncations of small valid files the project's own
writers made.
"""
from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moestream.arch.names import dense_names
from moestream.errors import UserError
from moestream.loading.gguf import GGUFSource
from moestream.loading.gguf_write import write_gguf
from moestream.loading.hf import HFSource, write_hf
from moestream.loading.synth import SynthSource

from cli_run import one_error, run


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def small_source(preset: str = "tiny", tokenizer: bool = False) -> SynthSource:
    """A model of a few hundred KB: its header and tensor table are most of a small GGUF."""
    base = SynthSource.from_spec(preset + ":layers=2")
    cfg = base.config.replace(n_experts=4, n_experts_used=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=32 if base.config.shared_expert_intermediate_size else 0)
    if not tokenizer:
        cfg = cfg.replace(vocab_size=64, bos_token_id=None, eos_token_ids=())
    return SynthSource(cfg, tokenizer=base.tokenizer if tokenizer else None)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    """A small GGUF with a tokenizer, for the commands."""
    path = tmp_path_factory.mktemp("model") / "m.gguf"
    write_gguf(small_source(tokenizer=True), path)
    return path


# --- writing -----------------------------------------------------------------------------------------------------
def test_the_kl_base_never_replaces_a_file(capsys, tmp_path, small_model):
    """Issue 49's data loss: --kl-divergence-base given the input text (or the model) replaced it with the base, rc 0.
    Now it is refused before the model loads, and the file is as it was; a new path is written, once."""
    text = tmp_path / "input.txt"
    text.write_text("the river runs past the old mill " * 40)
    model = tmp_path / "m.gguf"
    shutil.copy(small_model, model)
    kept = {p: p.read_bytes() for p in (text, model)}
    for target in (text, model):
        code, out, err = run(capsys, "perplexity", "-m", model, "-f", text, "-c", "16", "--chunks", "1",
                             "--kl-divergence-base", target)
        assert code == 1 and f"'{target}' already exists; remove it or choose another" in one_error(err)
        assert "perplexity: calculating" not in err and out == ""              # before the work
    assert {p: p.read_bytes() for p in kept} == kept and listing(tmp_path) == ["input.txt", "m.gguf"]
    base = tmp_path / "base.kld"
    argv = ["perplexity", "-m", model, "-f", text, "-c", "16", "--chunks", "1", "--kl-divergence-base", base]
    assert run(capsys, *argv)[0] == 0
    saved = base.read_bytes()
    code, _, err = run(capsys, *argv)
    assert code == 1 and "already exists" in one_error(err) and base.read_bytes() == saved


@pytest.mark.parametrize("argv,target", [
    (["make-model", "tiny", "{tmp}/out.gguf"], "out.gguf"),
    (["make-model", "tiny", "{tmp}/out", "--format", "gguf"], "out"),
    (["quantize", "synth:tiny", "{tmp}/out.gguf", "Q8_0", "--device", "cpu"], "out.gguf"),
    (["generate", "-m", "synth:tiny", "-p", "hi", "-n", "2", "--trace", "{tmp}/run"], "run.npz"),
    (["perplexity", "-m", "synth:tiny", "-f", "{tmp}/t.txt", "-c", "16", "--kl-divergence-base", "{tmp}/out.gguf"],
     "out.gguf"),
], ids=["make-model", "make-model --format gguf", "quantize", "generate --trace", "perplexity base"])
def test_a_directory_at_out_is_refused_before_the_work(capsys, tmp_path, argv, target):
    """Issue 49: make-model onto an (empty) directory wrote the whole model to OUT.partial, failed at the rename and
    left it there; --trace run with run.npz a directory failed only after the generation."""
    (tmp_path / target).mkdir()
    (tmp_path / "t.txt").write_text("word " * 100)
    code, out, err = run(capsys, *(a.format(tmp=tmp_path) for a in argv))
    assert code == 1 and f"{target}' is a directory; give a file name" in one_error(err)
    assert out == "" and "writing" not in err                                 # nothing generated, nothing written
    assert listing(tmp_path) == sorted([target, "t.txt"])                    # no partial file


@pytest.mark.parametrize("fmt", ["gguf", "hf", "quantize"])
def test_an_interrupted_write_leaves_nothing(tmp_path, monkeypatch, fmt):
    """Ctrl-C (or any exception) midway through a model's experts: no OUT, no temporary file or directory."""
    from moestream.tools.make_model import make_model
    from moestream.tools.quantize import quantize_model
    real = SynthSource.expert

    def expert(self, layer, e):
        if layer == 1:
            raise KeyboardInterrupt
        return real(self, layer, e)
    monkeypatch.setattr(SynthSource, "expert", expert)
    out = tmp_path / "sub" / ("m" if fmt == "hf" else "m.gguf")
    with pytest.raises(KeyboardInterrupt):
        if fmt == "quantize":
            quantize_model("synth:tiny:layers=2", out, "Q8_0", device="cpu", progress=False)
        else:
            make_model("synth:tiny:layers=2", out, fmt, progress=False)
    assert listing(tmp_path) in ([], ["sub"])


def test_atomic_path_new_refuses_a_file_that_appeared_meanwhile(tmp_path):
    from moestream.outputs import atomic_path
    target = tmp_path / "base.kld"
    with pytest.raises(UserError, match="already exists"):
        with atomic_path(target, new=True) as tmp:
            Path(tmp).write_text("ours")
            target.write_text("theirs")                       # another program, while we worked
    assert target.read_text() == "theirs" and listing(tmp_path) == ["base.kld"]


# --- reading: the corruptions issue 49 met -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    """A routing trace of several sequences' prompts in batches, then decoded together (guesses, step sequences,
    begun prompts: every array a trace holds)."""
    from moestream import LLM
    from moestream.experts.trace import TraceRecorder
    from moestream.tools.bench_parallel import decode_together
    llm = LLM("synth:tiny", ubatch_size=8, batch_size=16, ctx_size=64, n_seq=2, device="cpu", cpu_moe=True,
              moe_cache_mib=2, prefetch_min_batch=8, lookahead_layers=1)
    cfg = llm.model_config
    rec = TraceRecorder(cfg.n_layers, cfg.n_experts, llm.engine.host.store.expert_bytes)
    llm.engine.observe(rec)
    g = torch.Generator().manual_seed(5)
    decode_together(llm.engine, [torch.randint(0, cfg.vocab_size, (12,), generator=g).tolist() for _ in range(2)],
                    12, 2)
    path = tmp_path_factory.mktemp("trace") / "run.npz"
    rec.save(str(path))
    return path


def replay_all(path) -> None:
    """What `moestream replay` does with a trace: load it, replay it plainly, with prefetch and zero-copy."""
    from moestream.experts.prefetch import PrefetchConfig
    from moestream.experts.trace import load_trace, replay
    trace = load_trace(str(path))
    replay(trace, 4, "lfru")
    replay(trace, 4, "lfru", PrefetchConfig(min_batch=8))
    replay(trace, 4, "lfru", zero_copy=True, read_through=True)


def test_a_damaged_trace_is_one_line(trace_file, tmp_path):
    """Every third byte of a trace changed in turn (zlib.error, numpy's and zipfile's errors were tracebacks): a
    one-line refusal, or the same trace (a byte zip does not check); the fuzz pass below replays what loads."""
    from moestream.experts.trace import load_trace
    data = trace_file.read_bytes()
    bad = tmp_path / "bad.npz"
    refused = 0
    for i in range(0, len(data), 3):
        bad.write_bytes(data[:i] + bytes([data[i] ^ 0xA5]) + data[i + 1:])
        try:
            load_trace(str(bad))
        except UserError as e:
            assert "\n" not in str(e)
            refused += 1
    assert refused > len(data) // 6


def test_a_trace_whose_arrays_disagree_is_one_line(trace_file, tmp_path):
    """Arrays that pass the zip's checks but index outside the trace (another program's file, an edited one)."""
    z = dict(np.load(trace_file))
    bad = tmp_path / "bad.npz"
    for key, change in (("ids", lambda a: a + 1000), ("layers", lambda a: a + 99), ("rows", lambda a: a * 2),
                        ("meta", lambda a: a[:2]), ("ubatch_of", lambda a: a + 10_000),
                        ("ubatches", lambda a: a[:, :3]), ("guesses", lambda a: -a - 1),
                        ("step_seq_counts", lambda a: a + 1), ("layers", np.float32)):
        np.savez(bad, **(z | {key: change(z[key])}))
        with pytest.raises(UserError, match="is not a whole routing trace"):
            replay_all(bad)


def test_a_trace_with_huge_sequence_ids_replays_as_the_small_ones(trace_file, tmp_path):
    """A trace's sequence ids are names: one with every id moved to 2**40 plus it (a server's request counter, an
    edited file) replays with the same counts, without allocating a sequence for every number below it."""
    from moestream.experts.trace import load_trace, replay
    z = dict(np.load(trace_file))
    big = 1 << 40
    moved = z | {"ubatches": np.concatenate([z["ubatches"][:, :1] + big, z["ubatches"][:, 1:]], axis=1),
                 "step_seqs": z["step_seqs"] + big, "begun": z["begun"] + big}
    np.savez(tmp_path / "big.npz", **moved)
    def counts(path, **kw):           # (the host's timings, measured as the replay runs, are left out)
        out = replay(load_trace(str(path)), 4, "lfru", **kw)
        return [{k: v for k, v in d.items() if not k.endswith("_s")}
                for d in (out["total"], *out["per_layer"].values())]
    for kw in ({}, {"zero_copy": True, "read_through": True}):
        assert counts(tmp_path / "big.npz", **kw) == counts(trace_file, **kw)


def _member_payload(path: Path, suffix: str) -> tuple[int, int]:
    """(offset, size) of a stored zip member's bytes (a torch file's tensor storage)."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(suffix))
    raw = path.read_bytes()
    name_len, extra_len = int.from_bytes(raw[info.header_offset + 26:][:2], "little"), \
        int.from_bytes(raw[info.header_offset + 28:][:2], "little")
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def test_a_damaged_kl_base_is_one_line(capsys, tmp_path, small_model):
    """Issue 49: a byte-corrupted base gave an index error from tools/ppl_stats.py (torch.load reads no checksum);
    a base whose CRCs hold but whose ids leave the vocabulary, the same."""
    text, base = tmp_path / "t.txt", tmp_path / "b.kld"
    text.write_text("the river runs past the old mill " * 40)
    common = ["perplexity", "-m", small_model, "-c", "16", "--chunks", "2"]
    assert run(capsys, *common, "-f", text, "--kl-top-k", "8", "--kl-divergence-base", base)[0] == 0
    raw = base.read_bytes()
    at, size = _member_payload(base, "data/1")             # the base's top-k token ids (int32)
    flipped = tmp_path / "flipped.kld"
    flipped.write_bytes(raw[:at] + b"\x7f" * size + raw[at + size:])
    d = torch.load(base, weights_only=True)
    edited = tmp_path / "edited.kld"
    torch.save(d | {"idx": d["idx"] + 5000}, edited)
    for bad, needle in ((flipped, "is damaged (its data fail their CRC check)"),
                        (edited, "is not a whole base file (idx)")):
        code, out, err = run(capsys, *common, "--kl-divergence-base", bad, "--kl-divergence")
        assert code == 1 and needle in one_error(err) and out == ""


def test_a_gguf_array_longer_than_the_file_is_one_line(capsys, small_model, tmp_path):
    """The fuzz pass found it: gguf's reader loops once per item an array claims, reading past the end of the file
    as empty arrays (without end, gigabytes allocated) or the tensors' bytes as items (20 s for this 3 MB file before
    a numpy error). Now an array that cannot fit is refused at once, by generate and by quantize."""
    import gguf
    field = gguf.GGUFReader(small_model).fields["tokenizer.ggml.token_type"]
    at = field.offset + sum(int(p.nbytes) for p in field.parts[:4])        # key length, key, type, item type
    raw = bytearray(small_model.read_bytes())
    raw[at:at + 8] = (1 << 40).to_bytes(8, "little")                        # the item count
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(raw))
    for argv in (["generate", "-m", bad, "-p", "hi"], ["quantize", bad, tmp_path / "q.gguf", "Q8_0"]):
        code, _, err = run(capsys, *argv)
        assert code == 1 and "runs past the end of the file" in one_error(err)


# --- reading: the fuzz pass ------------------------------------------------------------------------------------------
# The same 60 examples each run in CI; MOESTREAM_FUZZ_EXAMPLES=5000 searches further, at random.
EXAMPLES = int(os.environ.get("MOESTREAM_FUZZ_EXAMPLES", 0))
FUZZ = settings(max_examples=EXAMPLES or 60, deadline=None, derandomize=not EXAMPLES, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])


def damaged(data: bytes, region: int | None = None):
    """A strategy of `data` truncated anywhere, or with 1 to 4 of its first `region` bytes (all: None) replaced."""
    region = region or len(data)

    def replace(changes):
        out = bytearray(data)
        for i, b in changes:
            out[i] = b
        return bytes(out)
    cut = st.integers(0, len(data) - 1).map(lambda n: data[:n])
    changed = st.lists(st.tuples(st.integers(0, region - 1), st.integers(0, 255)), min_size=1, max_size=4)
    return st.one_of(cut, changed.map(replace))


def read_or_refuse(read) -> None:
    """`read` loads, or refuses in one line: any other exception fails the test."""
    try:
        read()
    except UserError as e:
        assert str(e) and "\n" not in str(e)


def fuzz(path, data: bytes, read, region: int | None = None) -> None:
    """Each damaged copy of `data` (damaged's) written to `path`, then read: it loads or refuses in one line."""
    @FUZZ
    @given(damaged(data, region))
    def check(b):
        path.write_bytes(b)
        read_or_refuse(read)
    check()


def read_model(src) -> None:
    """What loading reads of a source: its config, tokenizer, every dense tensor and one expert a layer."""
    src.tokenizer
    for name in dense_names(src.config):
        src.tensor(name)
    for layer in src.config.moe_layers:
        src.expert(layer, 0)


@pytest.fixture(scope="module", params=["tiny", "tiny+tokenizer", "tiny-next"])
def small_gguf(request, tmp_path_factory):
    """(a small GGUF's bytes, its header's length: metadata and tensor table)."""
    import gguf
    preset, _, tok = request.param.partition("+")
    path = tmp_path_factory.mktemp("gguf") / "m.gguf"
    write_gguf(small_source(preset, bool(tok)), path, dtype="float16")
    return path.read_bytes(), gguf.GGUFReader(path).data_offset


def test_fuzz_gguf(small_gguf, tmp_path_factory):
    data, header = small_gguf
    path = tmp_path_factory.mktemp("fuzz") / "m.gguf"
    fuzz(path, data, lambda: read_model(GGUFSource(path)), header)


@pytest.fixture(scope="module")
def small_hf(tmp_path_factory):
    """A small HF directory in several shards and an index."""
    path = tmp_path_factory.mktemp("hf") / "m"
    write_hf(small_source(), path, max_shard_bytes=60_000)
    return path


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json", "a shard"])
def test_fuzz_hf(small_hf, tmp_path_factory, name):
    work = tmp_path_factory.mktemp("fuzz") / "m"
    shutil.copytree(small_hf, work)
    if name == "a shard":
        name = sorted(p.name for p in small_hf.glob("*.safetensors"))[1]
    data = (small_hf / name).read_bytes()
    region = 8 + int.from_bytes(data[:8], "little") if name.endswith(".safetensors") else None    # its header
    fuzz(work / name, data, lambda: read_model(HFSource(work)), region)


def test_json_that_is_not_an_object_is_one_line(small_hf, tmp_path):
    for name, value in (("config.json", [1, 2]), ("model.safetensors.index.json", "x"),
                        ("model.safetensors.index.json", {"weight_map": [1]}),
                        ("model.safetensors.index.json", {"weight_map": {"a": 7}})):
        shutil.copytree(small_hf, tmp_path / "m", dirs_exist_ok=True)
        (tmp_path / "m" / name).write_text(json.dumps(value))
        with pytest.raises(UserError, match=name.replace(".", r"\.")):
            HFSource(tmp_path / "m")


def test_fuzz_trace(trace_file, tmp_path):
    path = tmp_path / "t.npz"
    fuzz(path, trace_file.read_bytes(), lambda: replay_all(path))


@pytest.fixture(scope="module")
def small_base(tmp_path_factory):
    """A KL base of 2 chunks of 8 tokens over a vocabulary of 32, top 4, as save_base writes it."""
    from moestream.tools.perplexity import save_base_file
    from moestream.tools.ppl_stats import Summary, log_probs
    g = torch.Generator().manual_seed(0)
    chunks = torch.randint(0, 32, (2, 8), generator=g).tolist()
    lp = log_probs(torch.randn(2 * 3, 32, generator=g))
    targets = torch.tensor([t for c in chunks for t in c[5:]])
    path = tmp_path_factory.mktemp("base") / "b.kld"
    save_base_file(str(path), chunks, Summary.of(lp, targets, 4), 32, "synth:x")
    return path


def kl_against(path, vocab: int = 32) -> None:
    """What `perplexity --kl-divergence` does with a base: load it, check its vocabulary, compare a run with it."""
    from moestream.tools.perplexity import kl_divergence, load_base
    from moestream.tools.ppl_stats import Summary
    d = load_base(str(path))
    if d["n_vocab"] != vocab:
        raise UserError("another model's base")
    st = kl_divergence(lambda group: [torch.randn(len(c), vocab) for c in group], d["tokens"].tolist(),
                       Summary.from_dict(d))
    st.report()


def test_fuzz_kl_base(small_base, tmp_path):
    path = tmp_path / "b.kld"
    fuzz(path, small_base.read_bytes(), lambda: kl_against(path))
