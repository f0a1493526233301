"""bench --parallel --spec-oracle P (tools/bench_parallel.py's oracle_runs): each sequence of the serving loop drafts
its own greedy continuation, right with probability P, instead of the MTP head's drafts; the verify steps, the
rollback and the expert traffic stay the real ones. Tiny synth model with a head (latent attention, sigmoid
router), float32 on the CPU: greedy tokens are compared exactly."""
from __future__ import annotations

import json

import pytest

from moestream import LLM
from moestream.cli import main
from moestream.tools import bench_parallel
from moestream.tools.bench_parallel import ParallelTest, decode_together, oracle_runs, spec_summary

MODEL = "synth:tiny-glm:mtp=1"
TEST = ParallelTest(8, 6, 3, seed=7)           # 3 sequences, 8 prompt tokens, 6 generated


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, spec_type="draft-mtp", spec_draft_n_max=2, n_seq=3, ctx_size=64, device="cpu")


def _run(llm, p: float, plain: dict, log: list | None = None) -> dict:
    """Run 0 of TEST with n-max 2 and oracles at P; log: each sequence's oracle calls (position, drafts)."""
    eng, vocab = llm.engine, llm.model_config.vocab_size
    oracles = oracle_runs(eng, TEST, vocab, [0], 2, p, plain)[0]
    if log is not None:
        log[:] = [[] for _ in oracles]
        oracles = [lambda pos, n, o=o, calls=calls: (calls.append((pos, o(pos, n))), calls[-1][1])[1]
                   for o, calls in zip(oracles, log)]
    return decode_together(eng, TEST.prompts(vocab, 0), TEST.n_pp, TEST.n_tg, 2, oracles)


def test_the_oracle_at_p1_accepts_every_draft_and_at_p0_none_tokens_unchanged(llm):
    """Every sequence's tokens are its tokens with MTP off (the first pass: the serving loop without drafts)."""
    plain: dict = {}
    for p, accepted, steps in ((1.0, 2.0, 2), (0.0, 0.0, 6)):        # 6 tokens after the first: 3 a step, or 1
        r = _run(llm, p, plain)
        s = spec_summary(r["spec"])
        assert (s["steps"], s["drafted_per_step"], s["accepted_per_step"]) == (3 * steps, 2.0, accepted)
        assert r["steps"] == steps
        assert r["tokens"] == plain[(TEST, 0)]
        assert all(len(t) == TEST.n_tg + 1 for t in r["tokens"])
    assert len({tuple(t) for t in plain[(TEST, 0)]}) == 3               # (its own prompt, its own continuation)


def test_an_oracle_rerun_drafts_the_same(llm):
    plain: dict = {}
    first, again = [], []
    a, b = _run(llm, 0.5, plain, first), _run(llm, 0.5, plain, again)
    assert first == again and [c.accepted for c in a["spec"]] == [c.accepted for c in b["spec"]]
    s = spec_summary(a["spec"])
    assert 0 < s["accepted"] < s["drafted"] and a["tokens"] == plain[(TEST, 0)]
    # each sequence its own oracle: its own continuation, its own seed
    assert len({tuple(d for _, ds in calls for d in ds) for calls in first}) == 3


def test_rows_of_n_max_0_and_2_in_one_process(capsys, monkeypatch):
    """--spec-draft-n-max 0,2 --spec-oracle 1: the MTP-off row and the oracle's, the same hash; the oracle's first
    passes are the n-max 0 row's runs (no pass of its own)."""
    calls = []
    inner = bench_parallel.decode_together
    monkeypatch.setattr(bench_parallel, "decode_together", lambda eng, prompts, pp, tg, n_max=None, oracles=None: (
        calls.append((n_max, oracles is not None)), inner(eng, prompts, pp, tg, n_max, oracles))[1])
    assert main(["bench", "-m", MODEL, "--device", "cpu", "-r", "1", "--no-warmup", "-c", "64", "--parallel", "3",
                 "-npp", "8", "-ntg", "6", "--spec-type", "draft-mtp", "--spec-draft-n-max", "0,2",
                 "--spec-oracle", "1", "-o", "json"]) == 0
    off, on = json.loads(capsys.readouterr().out)
    assert calls == [(0, False), (2, True)]
    assert (off["spec_n"], on["spec_n"], on["spec_oracle"]) == (0, 2, 1.0)
    assert off["hash"] == on["hash"] and off["steps"] == 6 and on["steps"] == 2
    assert off["spec"] == {"steps": 0}
    assert (on["spec"]["drafted_per_step"], on["spec"]["accepted_per_step"], on["spec"]["tokens_per_step"]) == (
        2.0, 2.0, 3.0)
    assert on["ms_per_step"] == pytest.approx(on["t_tg"] * 1e3 / 2)


def test_without_an_oracle_the_rows_draft_with_the_head(capsys):
    assert main(["bench", "-m", MODEL, "--device", "cpu", "-r", "1", "--no-warmup", "-c", "64", "--parallel", "2",
                 "-npp", "8", "-ntg", "4", "--spec-type", "draft-mtp", "--spec-draft-n-max", "0,1", "-o", "json"]) == 0
    off, on = json.loads(capsys.readouterr().out)
    assert off["hash"] == on["hash"] and on["spec_oracle"] is None
    assert on["spec"]["drafted_per_step"] == 1.0 and on["spec"]["steps"] == 2 * on["steps"]
