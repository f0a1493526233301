"""The command line: a user's mistake is one line on stderr and exit status 1, never a traceback."""
from __future__ import annotations

import pytest

from cli_run import one_error, run


@pytest.mark.parametrize("argv,needle", [
    (["generate", "-m", "/no/such/model", "-p", "hi"], "model not found"),
    (["generate", "-m", "synth:nope", "-p", "hi"], "synth"),
    (["generate", "-m", "synth:tiny", "-c", "8", "-p", "a prompt that is much longer than eight tokens, surely"],
     "context"),
    (["generate", "-m", "synth:tiny", "--n-cpu-moe", "99", "-p", "hi"], "--n-cpu-moe 99"),
    (["generate", "-m", "synth:tiny", "--moe-cache-mib", "-1", "-p", "hi"], "--moe-cache-mib"),
    (["generate", "-m", "synth:tiny", "-p", "hi", "--top-p", "1.5"], "top_p"),
    (["generate", "-m", "synth:tiny", "-p", "hi", "--temp", "inf"], "temperature must be a finite number"),
    (["generate", "-m", "synth:tiny", "-p", "hi", "-s", str(10 ** 23)], "seed must be a whole number from"),
    (["generate", "-m", "synth:tiny", "-p", "hi", "-n", "-5"], "-n must be a number of tokens, or -1"),
    (["generate", "-m", "synth:tiny"], "no prompt"),
    (["generate", "-m", "synth:tiny", "-p", "hi", "--device", "cuda:3"] , "cuda"),
    (["replay", "/no/such/trace.npz", "--slots", "4"], "routing trace"),
])
def test_user_mistakes_are_one_line(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 1
    lines = [l for l in err.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in err


def test_a_model_without_a_tokenizer_takes_token_ids(capsys, monkeypatch):
    """The 30B preset has no tokenizer; tiny made as one (no 30B-shaped weights to build) refuses text, takes ids."""
    from moestream.loading import synth
    assert synth.SynthSource.from_spec("qwen3-30b-a3b:layers=1").tokenizer is None
    monkeypatch.setattr(synth, "HAS_TOKENIZER", set())
    code, out, err = run(capsys, "generate", "-m", "synth:tiny", "-p", "hello")
    assert code == 1 and "token ids" in one_error(err) and out == ""
    code, out, _ = run(capsys, "generate", "-m", "synth:tiny", "-p", "1,2,3", "-n", "2", "--hash-only")
    assert code == 0 and "(2 tokens)" in out


def test_generate_hash_and_trace_then_replay(capsys, tmp_path):
    trace = tmp_path / "run.npz"
    code, out, err = run(capsys, "generate", "-m", "synth:tiny", "-p", "Once upon a time", "-n", "6", "--cpu-moe",
                         "--moe-cache-mib", "4", "--ignore-eos", "--hash", "--trace", str(trace))
    assert code == 0
    sha = [l for l in out.splitlines() if l.startswith("sha256 ")]
    assert len(sha) == 1 and "(6 tokens)" in sha[0]
    code, out, _ = run(capsys, "replay", str(trace), "--slots", "8,64", "--policy", "lru")
    assert code == 0 and "| lru | 8 |" in out and "| lru | 64 |" in out
    code, out, _ = run(capsys, "replay", str(trace), "--slots", "16", "--policy", "lfru", "--zero-copy",
                       "--read-through")
    assert code == 0 and "read in place GB" in out and "| lfru | 16 |" in out
    code, out, _ = run(capsys, "replay", str(trace), "--slots", "16", "--zero-copy", "--stage-host-reads")
    assert code == 0 and "| lfru | 16 |" in out
    for mode in ("--read-through", "--stage-host-reads"):
        code, _, err = run(capsys, "replay", str(trace), "--slots", "16", mode)
        assert code != 0 and f"{mode} is a mode of zero-copy decode: add --zero-copy" in err


def test_same_hash_for_every_placement(capsys):
    hashes = set()
    for flags in ([], ["--cpu-moe"], ["--n-cpu-moe", "2", "--moe-cache-mib", "1"]):
        code, out, _ = run(capsys, "generate", "-m", "synth:tiny", "-p", "The cat", "-n", "12", "--ignore-eos",
                           "--hash-only", *flags)
        assert code == 0
        hashes.add(out.strip())
    assert len(hashes) == 1


# --- every input and output as a user gives them ---------------------------------------------------------------------
def test_prompt_file_not_utf8_and_missing(capsys, tmp_path):
    f = tmp_path / "p.txt"
    f.write_bytes(b"caf\xe9 au lait")
    code, out, err = run(capsys, "generate", "-m", "synth:tiny", "-f", str(f))
    assert code == 1 and "not UTF-8" in one_error(err) and out == ""
    code, _, err = run(capsys, "generate", "-m", "synth:tiny", "-f", str(tmp_path))
    assert code == 1 and "cannot read prompt file" in one_error(err)


def test_kv_cache_too_big_for_host_memory_is_refused_before_allocating(capsys):
    from moestream.engine_config import EngineConfig
    from moestream.errors import UserError
    from moestream.loading.source import open_source
    from moestream import flags
    from moestream.runtime.memory import check_host_fits, host_bytes
    from moestream.runtime.plan import resolve
    cfg = open_source("synth:tiny").config
    ecfg = resolve(flags.apply(EngineConfig(), ctx_size=1 << 20), __import__("torch").float32)
    weights, kv = host_bytes(cfg, ecfg)
    assert kv > 0 and weights > 0
    with pytest.raises(UserError, match=r"-c 1048576: the KV cache needs \d+ MiB and the model's weights \d+ MiB, "
                                        r"but 100 MiB of host memory are available; use -c \d+ or less"):
        check_host_fits(cfg, ecfg, available=100 << 20)
    check_host_fits(cfg, ecfg, available=weights + kv)           # exactly enough: fine
    code, out, err = run(capsys, "generate", "-m", "synth:tiny", "-p", "hi", "-c", str(1 << 40))
    assert code == 1 and "of host memory are available" in one_error(err) and out == ""


@pytest.mark.parametrize("argv", [
    ["generate", "-m", "synth:tiny", "-p", "hi", "-n", "2", "--trace", "{tmp}/no/dir/t.npz"],
    ["generate", "-m", "synth:tiny", "-p", "hi", "-n", "2", "--trace", "{tmp}"],
    ["perplexity", "-m", "synth:tiny", "-f", "{text}", "-c", "16", "--kl-divergence-base", "{tmp}/no/dir/base.kld"],
    ["perplexity", "-m", "synth:tiny", "-f", "{text}", "-c", "16", "--plot", "{tmp}/no/x.png"],
    ["bench", "-m", "synth:tiny", "-p", "8", "-n", "0", "-r", "1", "--plot", "{tmp}/no/x.png"],
    ["bench", "-m", "synth:tiny", "-p", "8", "-n", "0", "-r", "1", "--plot", "{tmp}/x.txt"],      # matplotlib's
    ["make-model", "tiny", "{tmp}/file.txt/out"],
])
def test_unwritable_outputs_are_refused_before_the_work(capsys, tmp_path, argv):
    text = tmp_path / "text.txt"
    text.write_text("word " * 200)
    (tmp_path / "file.txt").write_text("x")
    argv = [a.format(tmp=tmp_path, text=text) for a in argv]
    code, out, err = run(capsys, *argv)
    assert code == 1 and one_error(err)
    assert "loaded" not in err and "perplexity: calculating" not in err and "|" not in out   # before the work
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt", "text.txt"]          # nothing left behind


def test_a_failed_write_leaves_no_partial_file(tmp_path):
    from moestream.errors import UserError
    from moestream.outputs import atomic_path
    target = tmp_path / "out.bin"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_path(str(target)) as tmp:
            open(tmp, "w").write("half")
            raise RuntimeError("interrupted")
    with pytest.raises(UserError, match="cannot write"):
        with atomic_path(str(target)) as tmp:
            raise OSError(28, "No space left on device")
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"] and target.read_text() == "old"


def test_a_written_file_gets_the_mode_open_would_give_it(tmp_path):
    from moestream.outputs import atomic_path
    with atomic_path(str(tmp_path / "out.bin")) as tmp:
        open(tmp, "w").write("x")
    (tmp_path / "plain.bin").write_text("x")
    assert (tmp_path / "out.bin").stat().st_mode == (tmp_path / "plain.bin").stat().st_mode


def test_trace_without_npz_suffix_and_perplexity_base_are_written_whole(capsys, tmp_path):
    code, _, _ = run(capsys, "generate", "-m", "synth:tiny", "-p", "hi", "-n", "3", "--cpu-moe", "--trace",
                     str(tmp_path / "run"))
    assert code == 0 and [p.name for p in tmp_path.iterdir()] == ["run.npz"]
    text = tmp_path / "t.txt"
    text.write_text("the river runs past the old mill " * 20)
    code, _, err = run(capsys, "perplexity", "-m", "synth:tiny", "-f", str(text), "-c", "16", "--chunks", "2",
                       "--kl-divergence-base", str(tmp_path / "b.kld"))
    assert code == 0 and sorted(p.name for p in tmp_path.iterdir()) == ["b.kld", "run.npz", "t.txt"]


def test_bench_output_is_a_format_not_a_file(capsys):
    code, out, err = run(capsys, "bench", "-m", "synth:tiny", "-p", "8", "-o", "results.json")
    assert code == 2 and "-o json > results.json" in one_error(err) and out == ""


def test_bench_sweeps_threads_and_takes_llama_bench_lists(capsys):
    import torch
    before = torch.get_num_threads()
    try:
        code, out, err = run(capsys, "bench", "-m", "synth:tiny", "-p", "8", "-n", "0", "-r", "1", "-t", "1,2",
                             "-ngl", "99", "-fa", "1", "--no-warmup", "-o", "json")
    finally:
        torch.set_num_threads(before)
    import json
    rows = json.loads(out)
    assert code == 0 and [r["threads"] for r in rows] == [1, 2]
    code, _, err = run(capsys, "bench", "-m", "synth:tiny", "-p", "8", "-fa", "0,1")
    assert code == 1 and "-fa 0" in one_error(err)


def test_serve_refuses_a_port_in_use_before_loading(capsys):
    import socket
    pytest.importorskip("uvicorn")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    try:
        code, _, err = run(capsys, "serve", "-m", "synth:tiny", "--port", str(s.getsockname()[1]))
    finally:
        s.close()
    assert code == 1 and "cannot listen on 127.0.0.1" in one_error(err)
    code, _, err = run(capsys, "serve", "-m", "synth:tiny", "--max-body-mib", "0")       # it refused every request
    assert code == 1 and "--max-body-mib must be a positive number" in one_error(err)
    code, _, err = run(capsys, "serve", "-m", "synth:tiny", "--scheduler-delay-factor", "-1")
    assert code == 1 and "--scheduler-delay-factor must be a number >= 0" in one_error(err)
    code, _, err = run(capsys, "serve", "-m", "synth:tiny", "--prefill-layers", "-2")
    assert code == 1 and "--prefill-layers must be at least 0" in one_error(err)


def test_replay_inputs(capsys, tmp_path):
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a trace")
    code, _, err = run(capsys, "replay", str(junk), "--slots", "4")
    assert code == 1 and "routing trace" in one_error(err)
    (tmp_path / "empty.npz").write_bytes(b"")                     # numpy's EOFError
    code, _, err = run(capsys, "replay", str(tmp_path / "empty.npz"), "--slots", "4")
    assert code == 1 and "is not a routing trace; record one with generate --trace" in one_error(err)
    trace = tmp_path / "t.npz"
    assert run(capsys, "generate", "-m", "synth:tiny", "-p", "hi", "-n", "3", "--cpu-moe", "--trace", str(trace))[0] == 0
    code, _, err = run(capsys, "replay", str(trace), "--slots", "4", "--policy", "fifo")
    assert code == 1 and "--policy" in one_error(err)
    code, _, err = run(capsys, "replay", str(trace), "--moe-cache-mib", "x")
    assert code == 2 and "comma-separated integers" in one_error(err)


def test_make_model_refuses_and_leaves_nothing(capsys, tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep").write_text("x")
    code, _, err = run(capsys, "make-model", "tiny", str(out))
    assert code == 1 and "already exists" in one_error(err)
    code, _, err = run(capsys, "make-model", "nope:preset", str(tmp_path / "n"))
    assert code == 1 and one_error(err) and sorted(p.name for p in tmp_path.iterdir()) == ["m"]


# --- say what happened -----------------------------------------------------------------------------------------------
def test_cache_without_host_experts_warns_and_no_cache_statistics(capsys):
    code, _, err = run(capsys, "generate", "-m", "synth:tiny", "-p", "hi", "-n", "3", "--moe-cache-mib", "16",
                       "--timings")
    assert code == 0 and "--moe-cache-mib 16 does nothing: no expert is in host memory" in err
    assert "experts: all on the device" in err and "hit rate" not in err and "moe cache:" not in err
    code, _, err = run(capsys, "generate", "-m", "synth:tiny", "-p", "hi", "-n", "3", "--cpu-moe", "--timings")
    assert code == 0 and "uploaded" in err and "hit rate" not in err                # uploads, but no cache


def test_n_clipped_by_the_context_is_said(capsys):
    code, out, err = run(capsys, "generate", "-m", "synth:tiny", "-p", "Once upon a time", "-c", "12", "-n", "64",
                         "--ignore-eos", "--hash-only")
    assert code == 0 and "-n 64 is clipped to" in err
    n = int(err.split("clipped to ")[1].split(":")[0])
    assert f"({n} tokens)" in out


def test_timings_count_decode_steps_and_prefetch_words_add_up(capsys):
    code, _, err = run(capsys, "generate", "-m", "synth:tiny", "-p", "Once upon a time", "-n", "8", "--ignore-eos",
                       "--cpu-moe", "--moe-cache-mib", "16", "--timings")
    assert code == 0 and "generated: 8 tokens, 7 decode steps in" in err
    from moestream.cli import prefetch_words
    assert prefetch_words({"prefetched": 59, "prefetch_used": 14, "prefetch_wasted": 42}) == \
        "prefetched 59: 14 used, 42 evicted unused, 3 in the cache not used yet"
    assert "some copied earlier" in prefetch_words({"prefetched": 2, "prefetch_used": 5, "prefetch_wasted": 0})


def test_an_error_during_a_load_starts_on_its_own_line(capsys, monkeypatch):
    import re
    from moestream.errors import UserError
    from moestream.runtime import load

    def broken(*a, **k):
        raise UserError("the file ended early")
    monkeypatch.setattr(load, "fill_layer", broken)
    code, _, err = run(capsys, "generate", "-m", "synth:tiny", "-p", "hi")
    assert code == 1 and "loading:" in err                           # a bar was drawn
    assert re.search(r"(^|[\r\n])error: the file ended early", err) and not re.search(r"[^\r\n]error:", err), err


def test_replay_cache_of_0_mib_is_the_smallest_pool(capsys, tmp_path):
    trace = tmp_path / "t.npz"
    assert run(capsys, "generate", "-m", "synth:tiny", "-p", "Once upon", "-n", "4", "--cpu-moe",
               "--trace", str(trace))[0] == 0
    code, out, err = run(capsys, "replay", str(trace), "--moe-cache-mib", "0", "--policy", "lru")
    assert code == 0 and "| lru | 16 |" in out, err                 # tiny: 16 experts a layer
