"""Mistakes caught before the model loads, in one line, and flags that say what they do (issue 49).

Each check runs in-process through cli.main; a check that must come before the weights load runs with
load_engine replaced by a failure, so that a check made after loading fails the test.
"""
from __future__ import annotations

import logging
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from moestream import compat
from moestream.cli import build_parser, main

NO_TOKENIZER = "synth:qwen3-30b-a3b:layers=1"         # Qwen3-30B-A3B's shapes: no tokenizer, 151936 ids
G = ["generate", "-m", "synth:tiny", "-n", "4", "--hash-only"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error(err: str) -> str:
    lines = [l for l in err.splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def no_load(monkeypatch):
    """The engine's load fails the test: what is checked here must be checked before any weight is read."""
    from moestream import api

    def load(*a, **kw):
        raise AssertionError("the weights were loaded before the check")
    monkeypatch.setattr(api, "load_engine", load)


@pytest.mark.parametrize("argv,needle", [
    (["generate", "-m", NO_TOKENIZER, "-p", "hello"], "this model has no tokenizer"),
    (["generate", "-m", NO_TOKENIZER, "-p", "1,2,151936"], "token id 151936 is outside the vocabulary"),
    (["generate", "-m", NO_TOKENIZER, "-p", "1,2", "--chat"], "--chat (and -cnv, -sys) need a model with a tokenizer"),
    (["generate", "-m", "synth:tiny", "-p", ""], "empty prompt"),
    (["generate", "-m", "synth:tiny", "-p", "hi", "-ngl", "2"], "--n-cpu-moe 2"),
])
def test_prompt_mistakes_are_one_line_before_the_weights_load(capsys, no_load, argv, needle):
    code, out, err = run(capsys, *argv)
    assert code == 1 and needle in one_error(err), err
    assert "loaded" not in err


def test_p_and_f_together_are_refused(capsys, tmp_path):
    """llama.cpp takes the later of the two without a word; here it is one line, and nothing runs."""
    f = tmp_path / "prompt.txt"
    f.write_text("from the file")
    code, out, err = run(capsys, *G, "-p", "from the flag", "-f", str(f))
    assert code == 1 and "-p and -f both give the prompt" in one_error(err) and out == ""


def test_cpu_moe_with_n_cpu_moe_says_which_wins(caplog):
    """As in llama.cpp, where -cmoe's tensor override covers -ncmoe's: every MoE layer's experts in host memory."""
    for argv, said in (([], False), (["-ncmoe", "0"], False), (["-ncmoe", "2"], True)):
        a = build_parser("generate").parse_args([*G, "-p", "hi", "--cpu-moe", *argv])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="moestream"):
            compat.apply(a)
        lines = [r.getMessage() for r in caplog.records]
        assert (lines == ["--cpu-moe keeps every MoE layer's experts in host memory; -ncmoe 2 adds nothing"]) == said
        assert not said or len(lines) == 1


def test_ngl_0_with_device_cpu_runs_as_asked(capsys):
    """-ngl 0 --device cpu asks for everything on the CPU, which is what --device cpu does; -ngl 0 alone is still
    refused, and that refusal is the one that suggests --device cpu."""
    base = run(capsys, *G, "-p", "Once upon a time", "--device", "cpu")
    assert base[0] == 0
    code, out, err = run(capsys, *G, "-p", "Once upon a time", "--device", "cpu", "-ngl", "0")
    assert code == 0 and out == base[1] and "error" not in err
    code, out, err = run(capsys, *G, "-p", "Once upon a time", "-ngl", "0")
    assert code == 1 and "--device cpu" in one_error(err)


@pytest.mark.parametrize("argv,code,needle", [
    (["generate", "-m", "synth:tiny", "-p", "hi", "--reverse-prompt", "User:"], 2, "moestream spells it --stop"),
    (["generate", "-m", "synth:tiny", "-p", "hi", "-r", "User:"], 2, "moestream spells it --stop"),
    (["bench", "-m", "synth:tiny", "-p", "-5", "-n", "4"], 2, "expected token counts >= 0"),
    (["bench", "-m", "synth:tiny", "-p", "16", "-n", "-1"], 2, "expected token counts >= 0"),
    (["bench", "-m", "synth:tiny", "-pg", "16,-4"], 2, "expected token counts >= 0"),
    (["quantize", "synth:tiny", "OUT", "IQ2_XXS"], 1, "IQ2_XXS needs an importance matrix"),
    (["quantize", "synth:tiny", "OUT", "iq1_m"], 1, "IQ1_M needs an importance matrix"),
    (["quantize", "synth:tiny", "OUT", "IQ3_S"], 1, "does not write llama-quantize's file type IQ3_S"),
    (["quantize", "synth:tiny", "OUT", "Q9_K"], 1, "unknown file type 'Q9_K'"),
])
def test_flag_mistakes_are_one_line(capsys, no_load, tmp_path, argv, code, needle):
    argv = [str(tmp_path / "out.gguf") if x == "OUT" else x for x in argv]
    got, out, err = run(capsys, *argv)
    assert got == code and needle in one_error(err), err
    assert out == "" and not list(tmp_path.iterdir())          # nothing ran, nothing was written


def test_the_readmes_tiny_next_example_prints_what_it_says(capsys):
    """The README's synth:tiny-next command, run as written, prints the text the README shows (with seed 0 its
    first greedy token was end-of-sequence, and the demo printed the prompt alone)."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    m = re.search(r"\n    moestream (generate -m synth:tiny-next [^\n]*)\n    ([^\n]*)\n", readme)
    assert m, "the README lost its synth:tiny-next example"
    shown = m.group(2)
    code, out, _ = run(capsys, *shlex.split(m.group(1)))
    assert code == 0 and out.splitlines()[0] == shown
    assert len(shown) > len("Once upon a time") + 20


def test_help_of_bench_make_model_and_quantize_imports_no_torch():
    """--help answers at once: no torch (seconds to import) while a command's flags are parsed."""
    code = ("import sys\nfrom moestream.cli import build_parser\n"
            "for c in ('bench', 'make-model', 'quantize'):\n    build_parser(c).format_help()\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False"], out
