"""The command line: flags users type from habit (compat.py), and how flags are read (argv.py)."""
from __future__ import annotations

import contextlib
import io

import pytest

from cli_run import one_error, run
from moestream.cli import main


G = ["generate", "-m", "synth:tiny", "-p", "Once upon a time", "-n", "4", "--hash-only"]


@pytest.fixture(scope="module")
def plain_g():
    """G's output without any other flag, run once for the tests that compare a flag's run against it."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert main(list(G)) == 0
    assert out.getvalue().startswith("sha256 ")
    return out.getvalue()


@pytest.mark.parametrize("argv,needle", [
    (["-ngl", "99", "-x"], "unknown flag -x"),                   # -x: one letter, no such flag (argparse's own)
    (["-co"], "-co is llama.cpp's"),                             # not -c o
    (["-ngx", "3"], "unknown flag -ngx"),                        # not -n gx
    (["--ctx", "64"], "did you mean --ctx-size?"),               # no prefix abbreviations
    (["--n-pred", "4"], "unknown flag --n-pred"),
    (["-fa", "off"], "-fa off"),
    (["-fa", "maybe"], "-fa takes on, off or auto"),
    (["-ngl", "0"], "--cpu-moe"),
    (["-ngl", "2"], "--n-cpu-moe 2"),                            # tiny has 4 layers
    (["-ngl", "many"], "-ngl takes"),
    (["-ot", "attn_q=CUDA0"], "only experts to CPU"),
    (["-ot", "blk\\.1\\.ffn_.*_exps=CPU"], "whole MoE layers"),   # layer 1 alone: no flag spells it
    (["-ot", "exps"], "PATTERN=BUFFER"),
    (["-t", "0"], "-t must be at least 1"),
    (["--repeat-penalty", "0"], "repeat_penalty"),
    (["--chat-template", "/no/such.jinja"], "no such file"),
    (["extra"], "unexpected argument 'extra'"),
    (["--temperature", "0.5"], "unknown flag --temperature; moestream spells it --temp"),      # not --chat-template
    (["--max_new_tokens", "5"], "moestream spells it -n/--n-predict"),
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size is vLLM's; moestream has no such flag"),
    (["--dry-multiplier", "0.5"], "--dry-multiplier is llama.cpp's; moestream has no such flag: moestream samples"),
    (["--kv-unified"], "--kv-unified is llama.cpp's"),                                      # not "did you mean --file?"
])
def test_habit_flags_and_misreadings_are_one_line(capsys, argv, needle):
    code, out, err = run(capsys, *G, *argv)
    assert code != 0 and needle in one_error(err), err
    assert out == ""                                              # nothing ran


def test_a_bare_fa_is_not_a_file_named_a(capsys, tmp_path, monkeypatch, plain_g):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").write_text("a prompt from a file named a")
    code, out, _ = run(capsys, *G, "-fa")
    assert code == 0 and out == plain_g                          # -p's prompt, as without -fa


@pytest.mark.parametrize("extra", [["-ngl", "99"], ["-ngl", "all"], ["-fa", "on"], ["-fa", "auto"], ["--no-mmap"],
                                   ["--mlock"], ["--jinja"], ["-no-cnv"], ["--no-escape"],
                                   ["--n-gpu-layers", "999"]])
def test_habit_flags_with_a_meaning_here_change_nothing_else(capsys, extra, plain_g):
    code, out, _ = run(capsys, *G, *extra)
    assert code == 0 and out == plain_g


def test_override_tensor_is_cpu_moe_or_n_cpu_moe(capsys):
    from moestream.cli import build_parser
    from moestream import compat
    for spec, cpu_moe, n in (("exps=CPU", True, 0), (r"\.ffn_.*_exps\.=CPU", True, 0),
                             (r"blk\.[01]\.ffn_(up|down|gate)_exps=CPU", False, 2)):
        a = build_parser("generate").parse_args([*G, "-ot", spec])
        compat.apply(a)
        assert (a.cpu_moe, a.n_cpu_moe) == (cpu_moe, n), spec
    code, out, err = run(capsys, *G, "-ot", "exps=CPU", "-v")
    assert code == 0 and "experts of 4 of 4 MoE layers in host memory" in err


def test_threads_flags_set_torch_threads(capsys):
    import torch
    from moestream.runtime import threads
    before = torch.get_num_threads()
    try:
        code, _, _ = run(capsys, *G, "-t", "1", "-tb", "2")
        assert code == 0 and threads._counts == {"decode": 1, "prompt": 2}
        assert torch.get_num_threads() == 1                        # the last phase run was decode
    finally:
        threads.configure(None, None)
        torch.set_num_threads(before)


def test_version_and_subcommand_version(capsys):
    from moestream import __version__
    for argv in (["--version"], ["generate", "--version"], ["bench", "--version"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0 and capsys.readouterr().out.strip() == f"moestream {__version__}"


def test_chat_flags_system_prompt_escape_and_template_file(capsys, tmp_path):
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]")
    from moestream import LLM
    llm = LLM("synth:tiny")
    want = llm.generate(llm.encode("[system] be brief\n[user] Hi\tthere\n[assistant]"), max_tokens=4).sha256
    code, out, _ = run(capsys, "generate", "-m", "synth:tiny", "-p", "Hi\\tthere", "-e", "-sys", "be brief",
                       "--chat-template", str(tpl), "-n", "4", "--hash-only")
    assert code == 0 and out.split()[1] == want                  # the file's template, the escape, the system turn
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    code, _, err = run(capsys, *G, "--chat-template", str(bad))
    assert code == 1 and "is not a Jinja template" in one_error(err)
    cnv = run(capsys, *G, "-cnv")
    chat = run(capsys, *G, "--chat")
    assert cnv[0] == 0 and cnv[1] == chat[1]


def test_unescape():
    from moestream.cli import unescape
    assert unescape(r"a\nb\tc\\d\x41\q") == "a\nb\tc\\dA\\q"
    assert unescape(r"\xZZ\x4") == r"\xZZ\x4"                        # not two hex digits: kept (was a traceback)


def test_other_programs_habits_say_what_to_type_instead(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "synth:tiny", "-p", "hi")                     # vllm serve MODEL
    assert code == 2 and "the model is given with -m: -m synth:tiny" in one_error(err)
    code, _, err = run(capsys, "perplexity", "-m", "synth:tiny", "-n", "5")              # not "ambiguous option"
    assert code == 2 and "unknown flag -n (" in one_error(err)
    code, _, err = run(capsys, "quantize", "--imatrix", "i.dat", "synth:tiny", str(tmp_path / "q.gguf"), "Q8_0")
    assert code == 1 and "cannot read importance matrix 'i.dat'" in one_error(err)       # not "NTHREADS: 'Q8_0'"
    (tmp_path / "config.json").write_text("{}")
    code, _, err = run(capsys, "generate", "-m", str(tmp_path / "config.json"), "-p", "hi")
    assert code == 1 and f"one file of a Hugging Face model; give its directory: -m '{tmp_path}'" in one_error(err)


def test_repeat_penalty_changes_generate_as_the_sampler_says(capsys):
    from moestream import LLM
    llm = LLM("synth:tiny")
    plain = llm.generate("The cat", max_tokens=24)
    pen = llm.generate("The cat", max_tokens=24, repeat_penalty=3.0)
    assert plain.token_ids != pen.token_ids
    code, out, _ = run(capsys, "generate", "-m", "synth:tiny", "-p", "The cat", "-n", "24", "--repeat-penalty", "3",
                       "--hash-only")
    assert code == 0 and out.split()[1] == pen.sha256
