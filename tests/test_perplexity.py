"""moestream perplexity: llama-perplexity's statistics on distributions we know, its output lines, the base file and
the KL divergence (0 exactly for the same logits, and for --cpu-moe against every expert on the device)."""
from __future__ import annotations

import math
import re

import pytest
import torch

from moestream.cli import main
from moestream.errors import UserError
from moestream.tools.perplexity import kl_divergence, make_chunks, perplexity
from moestream.tools.ppl_stats import KLStats, Summary, kl_per_token, log_probs, ppl_estimate

# What a llama.cpp user greps for.
CHUNK_RE = re.compile(r"\[(\d+)\](\d+\.\d+),")
FINAL_RE = re.compile(r"Final estimate: PPL = (\d+\.\d+) \+/- (\d+\.\d+)")


def known_logits(p_target: dict[int, float], vocab: int = 8):
    """A fake LLM.logits_many: at position j the next token (j+1 in the chunk) has probability p_target[j % 2],
    the rest of the mass spread evenly over the other tokens."""
    def fn(ids):
        rows = []
        for j in range(len(ids)):
            p = p_target[j % 2]
            row = torch.full((vocab,), (1 - p) / (vocab - 1), dtype=torch.float64)
            row[ids[j + 1] if j + 1 < len(ids) else 0] = p
            rows.append(row.log())
        return torch.stack(rows).float()
    return lambda chunks: [fn(c) for c in chunks]


def test_perplexity_of_a_known_distribution_and_its_uncertainty():
    chunks = [[1, 2, 3, 4, 5, 6, 7, 0], [3, 1, 4, 1, 5, 2, 6, 5]]         # c = 8: positions 4, 5, 6 scored
    res = perplexity(known_logits({0: 0.5, 1: 0.25}), chunks)
    v = [math.log(2), math.log(4), math.log(2)] * 2                          # -log p at positions 4, 5, 6
    assert res.nll.tolist() == pytest.approx(v, abs=1e-6)
    n, mean = len(v), sum(v) / len(v)
    var = sum(x * x for x in v) / n - mean * mean
    ppl, unc = res.estimate
    assert ppl == pytest.approx(math.exp(mean), rel=1e-6)
    assert unc == pytest.approx(math.exp(mean) * math.sqrt(var / (n - 1)), rel=1e-5)
    assert res.chunk_ppl == pytest.approx([math.exp(mean)] * 2, rel=1e-6)    # both chunks alike
    assert ppl_estimate(torch.full((5,), math.log(3.0), dtype=torch.float64)) == (pytest.approx(3.0), None)


def test_chunks_replace_the_first_token_with_bos_and_drop_the_rest():
    assert make_chunks(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert make_chunks(list(range(10)), 4, n_chunks=1, bos=99) == [[99, 1, 2, 3]]
    with pytest.raises(UserError, match="fewer than one chunk"):
        make_chunks(list(range(3)), 4)
    with pytest.raises(UserError, match="scores no token"):
        make_chunks(list(range(10)), 2)


def _random_lp(n=300, vocab=50, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * scale


def test_kl_is_zero_against_itself_and_exact_with_the_whole_vocabulary():
    logits = _random_lp()
    targets = torch.randint(0, 50, (300,), generator=torch.Generator().manual_seed(1))
    lp = log_probs(logits)
    for k in (0, 5):
        base = Summary.of(lp, targets, k)
        kl = kl_per_token(base, base.compare(log_probs(logits.clone()), targets))
        assert torch.equal(kl, torch.zeros_like(kl))                         # exactly, not approximately
    noisy = logits + 0.3 * torch.randn(logits.shape, generator=torch.Generator().manual_seed(2))
    lq = log_probs(noisy)
    full = kl_per_token(Summary.of(lp, targets, 0), Summary.of(lp, targets, 0).compare(lq, targets))
    ref = (lp.exp() * (lp - lq)).sum(-1)                                    # KL(p || q) over the vocabulary
    assert torch.allclose(full, ref, rtol=1e-5, atol=1e-7) and (full > 0).all()
    top = Summary.of(lp, targets, 5)
    bound = kl_per_token(top, top.compare(lq, targets))
    assert (bound > 0).all() and (bound <= full + 1e-6).all()                # merging the tail: a lower bound


def test_kl_stats_top1_agreement_and_report_lines():
    logits = _random_lp(n=200)
    targets = torch.randint(0, 50, (200,), generator=torch.Generator().manual_seed(1))
    base = Summary.of(log_probs(logits), targets, 16)
    moved = logits.clone()
    flip = torch.arange(200) % 4 == 0                                       # a quarter of the argmaxes move
    moved[flip, (logits[flip].argmax(-1) + 1) % 50] = logits[flip].max(-1).values + 5
    cur = base.compare(log_probs(moved), targets)
    st = KLStats()
    st.add(-cur.target, -base.target, kl_per_token(base, cur), cur.top1 == base.top1)
    assert st.n_same_top == 150 and st.count == 200
    text = st.report()
    top = float(re.search(r"Same top p:\s+(\d+\.\d+) ±\s+(\d+\.\d+) %", text).group(1))
    assert top == pytest.approx(75.0)
    mean_kld = float(re.search(r"Mean    KLD:\s+(\d+\.\d+) ±\s+(\d+\.\d+)", text).group(1))
    assert mean_kld == pytest.approx(sum(st.kld_values) / 200, abs=1e-6) and mean_kld > 0
    for label in ("====== Perplexity statistics ======", "Mean PPL(Q)                   :", "Mean PPL(base)   ",
                  "Cor(ln(PPL(Q)), ln(PPL(base))):", "Mean ln(PPL(Q)/PPL(base))     :", "Maximum KLD:",
                  "99.9%   KLD:", "99.0%   KLD:", "Median  KLD:", " 0.1%   KLD:", "Minimum KLD:",
                  "====== Token probability statistics ======", "RMS Δp    :", "Same top p:"):
        assert label in text
    assert st.chunk_line(1).startswith("   1    ")


def _text(tmp_path, n_words=600):
    words = "the of and a to in is was that for on as with by he it at from his an".split()
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "text.txt"
    path.write_text(" ".join(words[i] for i in torch.randint(0, len(words), (n_words,), generator=g).tolist()))
    return str(path)


def test_cli_prints_llama_perplexity_lines(tmp_path, capsys):
    f = _text(tmp_path)
    assert main(["perplexity", "-m", "synth:tiny", "--device", "cpu", "-f", f, "-c", "32", "--chunks", "3"]) == 0
    out = capsys.readouterr().out
    chunks = CHUNK_RE.findall(out)
    assert [int(i) for i, _ in chunks] == [1, 2, 3]
    ppl, unc = map(float, FINAL_RE.search(out).groups())
    assert ppl == pytest.approx(float(chunks[-1][1]), abs=1e-4) and unc > 0

    from moestream import LLM
    llm = LLM("synth:tiny", device="cpu", ctx_size=32)
    tokens = llm.tokenizer.encode(open(f).read())
    res = perplexity(llm.logits_many, make_chunks(tokens, 32, 3))
    assert res.estimate[0] == pytest.approx(ppl, abs=1e-4)

    ids = tmp_path / "ids.txt"                                               # token ids: commas and whitespace
    ids.write_text(",".join(map(str, tokens[:40])) + "\n" + " ".join(map(str, tokens[40:100])))
    assert main(["perplexity", "-m", "synth:tiny", "--device", "cpu", "-f", str(ids), "--token-ids", "-c", "32"]) == 0
    out = capsys.readouterr().out
    assert len(CHUNK_RE.findall(out)) == 3 and float(FINAL_RE.search(out).group(1)) == pytest.approx(ppl, abs=1e-4)


def test_cpu_moe_against_every_expert_on_the_device_is_kld_zero(tmp_path, capsys):
    f, base = _text(tmp_path), str(tmp_path / "base.kld")
    common = ["perplexity", "-m", "synth:tiny", "--device", "cpu", "-c", "64"]
    assert main(common + ["-f", f, "--chunks", "4", "--kl-divergence-base", base]) == 0
    base_ppl = float(FINAL_RE.search(capsys.readouterr().out).group(1))
    assert main(common + ["--cpu-moe", "--kl-divergence-base", base, "--kl-divergence"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"Mean    KLD:\s+0\.000000 ±\s+0\.000000", out)
    assert re.search(r"Maximum KLD:\s+0\.000000", out) and "Same top p: 100.000 ± 0.000 %" in out
    assert float(re.search(r"Mean PPL\(base\)\s+:\s+(\d+\.\d+)", out).group(1)) == pytest.approx(base_ppl, abs=1e-4)

    from moestream import LLM
    from moestream.tools.perplexity import load_base
    d = load_base(base)
    llm = LLM("synth:tiny", device="cpu", ctx_size=64, cpu_moe=True)
    st = kl_divergence(llm.logits_many, d["tokens"].tolist(), Summary.from_dict(d))
    assert st.count == 4 * 31 and all(v == 0.0 for v in st.kld_values) and st.n_same_top == st.count
    assert st.nll == st.nll_base                                           # the same nll bits, token by token


def test_errors_are_one_line(tmp_path, capsys):
    f = _text(tmp_path, n_words=10)
    cpu = ["perplexity", "-m", "synth:tiny", "--device", "cpu"]
    assert main(cpu + ["--kl-divergence"]) == 1
    assert "needs --kl-divergence-base" in capsys.readouterr().err
    assert main(cpu + ["-f", f]) == 1                                      # 10 words < one chunk of 512
    assert "fewer than one chunk" in capsys.readouterr().err
    llama = tmp_path / "llama.bin"
    llama.write_bytes(b"_logits_" + bytes(16))
    assert main(cpu + ["--kl-divergence-base", str(llama), "--kl-divergence"]) == 1
    assert "llama.cpp logits file" in capsys.readouterr().err
    assert main(cpu + ["-f", f, "--token-ids"]) == 1
    assert "must hold token ids" in capsys.readouterr().err
    assert main(cpu + ["-f", f, "--chunks", "0"]) == 1                    # was a torch.cat traceback
    assert "--chunks must be at least 1, or -1 for all, got 0" in capsys.readouterr().err
    for name, data in (("text.kld", b"the cat sat\n"), ("empty.kld", b""), ("model.gguf", b"GGUF" + bytes(64))):
        (tmp_path / name).write_bytes(data)                              # tracebacks of torch.load, "()" for empty
        assert main(cpu + ["--kl-divergence-base", str(tmp_path / name), "--kl-divergence"]) == 1
        err = capsys.readouterr().err
        assert f"{name}' is not a moestream base file (write one with" in err and "Traceback" not in err, err


def test_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    f, base, png = _text(tmp_path), str(tmp_path / "b.kld"), tmp_path / "kld.png"
    common = ["perplexity", "-m", "synth:tiny", "--device", "cpu", "-c", "32", "--chunks", "2"]
    assert main(common + ["-f", f, "--kl-divergence-base", base, "--plot", str(tmp_path / "ppl.png")]) == 0
    assert main(common + ["-ub", "8", "--kl-divergence-base", base, "--kl-divergence", "--plot", str(png)]) == 0
    assert (tmp_path / "ppl.png").stat().st_size > 0 and png.read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    for bad in ("ppl.txt", "ppl"):                     # matplotlib's ValueError once the work was done
        assert main(common + ["-f", f, "--plot", str(tmp_path / bad)]) == 1
        err = capsys.readouterr().err
        assert f"--plot '{tmp_path / bad}': " in err and "end it in .png" in err and "perplexity:" not in err
        assert not (tmp_path / bad).exists()


@pytest.mark.parametrize("place", [[], ["--cpu-moe"], ["--cpu-moe", "--moe-cache-mib", "1"]])
def test_several_chunks_a_batch_change_no_figure(tmp_path, capsys, place):
    """-b 4 n_ctx runs four chunks a batch (llama-perplexity's n_seq), with host experts layer by layer: every
    running PPL and the final estimate are the same as one chunk a batch, and the KL divergence between them is 0."""
    f, base = _text(tmp_path), str(tmp_path / "base.kld")
    common = ["perplexity", "-m", "synth:tiny", "--device", "cpu", "-c", "32", "-ub", "16"] + place
    assert main(common + ["-f", f, "--chunks", "6", "-b", "32", "--kl-divergence-base", base]) == 0
    one = capsys.readouterr()
    assert "n_seq=1" in one.err
    assert main(common + ["-f", f, "--chunks", "6", "-b", "128"]) == 0
    four = capsys.readouterr()
    assert "n_seq=4" in four.err
    assert CHUNK_RE.findall(one.out) == CHUNK_RE.findall(four.out) and len(CHUNK_RE.findall(one.out)) == 6
    assert FINAL_RE.search(one.out).groups() == FINAL_RE.search(four.out).groups()
    assert main(common + ["-b", "128", "--kl-divergence-base", base, "--kl-divergence"]) == 0
    assert re.search(r"Maximum KLD:\s+0\.000000", capsys.readouterr().out)


def test_logits_many_gives_each_list_the_bits_logits_gives_it():
    from moestream import LLM
    llm = LLM("synth:tiny", device="cpu", ctx_size=64, n_seq=3, ubatch_size=8, cpu_moe=True, moe_cache_mib=1)
    chunks = [list(range(3, 23)), list(range(40, 49)), list(range(100, 130))]
    together = llm.logits_many(chunks)
    assert [t.shape[0] for t in together] == [20, 9, 30]
    assert all(torch.equal(t, llm.logits(c)) for t, c in zip(together, chunks))
    from moestream.errors import UserError
    with pytest.raises(UserError, match="at most 3 lists"):
        llm.logits_many(chunks + [[1, 2]])
