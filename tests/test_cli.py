"""The command line: a user's mistake is one line on stderr and exit status 1, never a traceback."""
from __future__ import annotations

import pytest

from moestream.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv,needle", [
    (["generate", "-m", "/no/such/model", "-p", "hi"], "model not found"),
    (["generate", "-m", "synth:nope", "-p", "hi"], "synth"),
    (["generate", "-m", "synth:tiny", "-c", "8", "-p", "a prompt that is much longer than eight tokens, surely"],
     "context"),
    (["generate", "-m", "synth:tiny", "--n-cpu-moe", "99", "-p", "hi"], "--n-cpu-moe 99"),
    (["generate", "-m", "synth:tiny", "--moe-cache-mib", "-1", "-p", "hi"], "--moe-cache-mib"),
    (["generate", "-m", "synth:tiny", "-p", "hi", "--top-p", "1.5"], "top_p"),
    (["generate", "-m", "synth:tiny"], "no prompt"),
    (["generate", "-m", "synth:qwen3-30b-a3b:layers=1", "--dtype", "float32", "-p", "hello"], "token ids"),
    (["generate", "-m", "synth:tiny", "-p", "hi", "--device", "cuda:3"] , "cuda"),
    (["replay", "/no/such/trace.npz", "--slots", "4"], "routing trace"),
])
def test_user_mistakes_are_one_line(capsys, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 1
    lines = [l for l in err.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0], err
    assert "Traceback" not in err


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
    code, _, err = run(capsys, "replay", str(trace), "--slots", "16", "--read-through")
    assert code != 0 and "add --zero-copy" in err


def test_same_hash_for_every_placement(capsys):
    hashes = set()
    for flags in ([], ["--cpu-moe"], ["--n-cpu-moe", "2", "--moe-cache-mib", "1"]):
        code, out, _ = run(capsys, "generate", "-m", "synth:tiny", "-p", "The cat", "-n", "12", "--ignore-eos",
                           "--hash-only", *flags)
        assert code == 0
        hashes.add(out.strip())
    assert len(hashes) == 1
