"""moestream bench --parallel (tools/bench_parallel.py): its rows, and what batched decode must keep: each sequence
gets the greedy tokens it gets decoded alone, on every placement, cache size and policy, and a step of B tokens
copies (or reads from host) each missed expert once, not once per token that routes it."""
from __future__ import annotations

import json
import re

import pytest
import torch

from moestream import LLM
from moestream.cli import main
from moestream.tools.bench_parallel import ParallelTest, decode_together

TINY = ["bench", "-m", "synth:tiny", "--device", "cpu", "-r", "1"]
SEQS, PP, TG = 5, 10, 8


def _md_rows(text: str) -> list[dict]:
    lines = [l for l in text.splitlines() if l.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in l.strip("|").split("|")))) for l in lines[2:]]


def test_a_row_per_parallel_value_with_llama_batched_bench_columns(capsys):
    assert main(TINY + ["--parallel", "1,2,4", "-npp", "8", "-ntg", "4", "--cpu-moe", "--moe-cache-mib", "0,1",
                        "-o", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["moe_cache_mib"], r["n_pl"]) for r in rows] == [(m, b) for m in (0, 1) for b in (1, 2, 4)]
    for r in rows:
        B = r["n_pl"]
        assert (r["n_pp"], r["n_tg"], r["n_kv"], r["experts"]) == (8, 4, B * 12, "host")
        assert r["t_pp"] > 0 and r["t_tg"] > 0 and r["t"] == pytest.approx(r["t_pp"] + r["t_tg"])
        assert r["s_pp"] == pytest.approx(B * 8 / r["t_pp"]) and r["s_tg"] == pytest.approx(B * 4 / r["t_tg"])
        assert r["s"] == pytest.approx(B * 12 / r["t"])
        assert r["ms_per_step"] == pytest.approx(r["t_tg"] * 1e3 / 4)
        assert r["pp_uploaded_gb"] > 0 and r["tg_uploaded_gb"] >= 0 and 0 <= r["tg_hit_rate"] <= 1
        assert r["uploaded_gb_per_step"] == pytest.approx(r["tg_uploaded_gb"] / 4)
        assert r["tg_host_read_gb"] == 0                               # the CPU decode fetches its experts
        assert re.fullmatch(r"[0-9a-f]{16}", r["hash"])
    by_size = {m: [r["hash"] for r in rows if r["moe_cache_mib"] == m] for m in (0, 1)}
    assert by_size[0] == by_size[1] and len(set(by_size[0])) == 3       # the cache changes no token; B does

    assert main(TINY + ["-p", "0", "-n", "0", "-pg", "8,4", "-o", "json"]) == 0     # sequence 0's prompt is -pg's
    assert json.loads(capsys.readouterr().out)[0]["hash"] == rows[0]["hash"]

    assert main(TINY + ["-npl", "1,3", "-npp", "8", "-ntg", "0,2"]) == 0            # every expert on the device
    md = _md_rows(capsys.readouterr().out)
    assert [(r["TG"], r["B"], r["N_KV"]) for r in md] == [("0", "1", "8"), ("0", "3", "24"), ("2", "1", "10"),
                                                          ("2", "3", "30")]
    assert md[0]["S_TG t/s"] == md[0]["ms/step"] == "n/a" and md[0]["hash"] == "-"
    assert re.fullmatch(r"\d+\.\d\d ± \d+\.\d\d", md[3]["S_TG t/s"]) and md[3]["tg hit %"] == "n/a"


CONFIGS = {
    "device": dict(),
    "host, no cache": dict(cpu_moe=True),
    "cache 0 (one layer)": dict(cpu_moe=True, moe_cache_mib=0),
    "cache 1 MiB (waves)": dict(cpu_moe=True, moe_cache_mib=1),
    "cache 32 MiB (all)": dict(cpu_moe=True, moe_cache_mib=32),
    "cache 0, lru": dict(cpu_moe=True, moe_cache_mib=0, cache_policy="lru"),
    "cache 1 MiB, lru": dict(cpu_moe=True, moe_cache_mib=1, cache_policy="lru"),
    "zero-copy, no cache": dict(cpu_moe=True, zero_copy_decode=True),
    "zero-copy, cache 0": dict(cpu_moe=True, moe_cache_mib=0, zero_copy_decode=True),
    "zero-copy, cache 1 MiB": dict(cpu_moe=True, moe_cache_mib=1, zero_copy_decode=True),
}


def _llm(kw: dict, n_seq: int = SEQS) -> LLM:
    return LLM("synth:tiny", device="cpu", ctx_size=64, n_seq=n_seq, **kw)


@pytest.mark.parametrize("kw", CONFIGS.values(), ids=CONFIGS.keys())
def test_each_sequence_decoded_together_gets_its_tokens_decoded_alone(kw):
    """The bench's B sequences, decoded in steps of B tokens, against each prompt decoded alone (B = 1), on one
    engine: the cache has other contents each time, which must change no token either."""
    eng = _llm(kw).engine
    prompts = ParallelTest(PP, TG, SEQS, seed=7).prompts(1024, 0)
    together = decode_together(eng, prompts, PP, TG)["generated"]
    alone = [decode_together(eng, [p], PP, TG)["generated"][0] for p in prompts]
    assert together == alone
    assert len({tuple(g) for g in alone}) == SEQS          # (different prompts, different answers)


class Routed:
    """Each MoE layer's routed ids of the engine's forwards, as the MoE block hands them to the providers (fetch, or
    addresses in a zero-copy step), whoever reports routing to the observers."""

    def __init__(self, monkeypatch, eng):
        self.ids: dict[int, torch.Tensor] = {}
        router = eng.experts
        for name in ("fetch", "addresses"):
            inner = getattr(router, name)

            def wrapped(layer, ids, *rest, _inner=inner):
                self.ids[layer] = ids.clone()
                return _inner(layer, ids, *rest)
            monkeypatch.setattr(router, name, wrapped)

    def distinct(self) -> dict[int, int]:
        return {l: len(torch.unique(ids)) for l, ids in self.ids.items()}


def _steps(monkeypatch, kw: dict, n_steps: int = 4, B: int = 8):
    """(step, layer, distinct routed experts, that step's counters of the layer) for n_steps decode steps of B
    sequences after their prompts. Reading the counters flushes a zero-copy step, so each step's learning (its
    uploads, its host reads) is counted in its own step."""
    eng = _llm(kw, n_seq=B).engine
    prompts = ParallelTest(PP, 0, B, seed=3).prompts(1024, 0)
    tokens = []
    for s, p in enumerate(prompts):
        eng.begin_prompt(s)
        tokens.append(int(eng.prefill(s, p, 0)[-1].argmax()))
    routed = Routed(monkeypatch, eng)
    out = []
    for j in range(n_steps):
        before = eng.stats()["per_layer"]
        routed.ids.clear()
        tokens = eng.decode([(s, tokens[s], PP + j) for s in range(B)]).argmax(-1).tolist()
        after = eng.stats()["per_layer"]
        assert set(routed.ids) == set(eng.cfg.moe_layers)
        for l, n in routed.distinct().items():
            out.append((j, l, n, {k: after[l][k] - before.get(l, {}).get(k, 0) for k in after[l]}))
    return out


FETCHING = {k: v for k, v in CONFIGS.items() if v.get("cpu_moe") and not v.get("zero_copy_decode")}


@pytest.mark.parametrize("kw", FETCHING.values(), ids=FETCHING.keys())
def test_a_step_of_b_tokens_copies_each_missed_expert_once(monkeypatch, kw):
    """A decode step that fetches its experts (the CPU's path, and CUDA's past 16 tokens or without zero-copy
    decode) looks each distinct routed expert up once per layer and copies each miss once, however many of the
    step's tokens route it. Copies beyond the misses are the lookahead's guesses (`prefetched`)."""
    for step, layer, n, c in _steps(monkeypatch, kw):
        where = f"step {step}, layer {layer}: {n} distinct experts, counters {c}"
        assert c["hits"] + c["misses"] == n, where
        assert c["copies"] - c["prefetched"] <= c["misses"] <= n, where
        assert c["host_reads"] == 0, where
        if "moe_cache_mib" not in kw:                    # no cache: every routed expert is uploaded, once
            assert c["copies"] == c["misses"] == n, where


ZERO_COPY = {k: v for k, v in CONFIGS.items() if v.get("zero_copy_decode")}


@pytest.mark.parametrize("kw", ZERO_COPY.values(), ids=ZERO_COPY.keys())
def test_a_zero_copy_step_reads_each_host_expert_once(monkeypatch, kw):
    """A zero-copy step of B tokens (experts read in place, kernels/decode.py) should read each routed expert that
    is not in a slot over the link once, however many of its tokens route it."""
    for step, layer, n, c in _steps(monkeypatch, kw, n_steps=2):
        assert c["host_reads"] <= n, f"step {step}, layer {layer}: {n} distinct experts, counters {c}"


def test_a_zero_copy_step_looks_up_every_routed_expert(monkeypatch):
    for step, layer, n, c in _steps(monkeypatch, CONFIGS["zero-copy, cache 1 MiB"], n_steps=2):
        assert c["hits"] + c["misses"] == n, f"step {step}, layer {layer}: {n} distinct experts, counters {c}"


def test_zero_copy_decode_without_a_cache_reports_its_routing():
    from moestream.experts.routing import RouteCallback
    eng = _llm(CONFIGS["zero-copy, no cache"]).engine
    tok = int(eng.prefill(0, list(range(1, 9)))[-1].argmax())
    seen = []
    eng.observe(RouteCallback(lambda layer, ids: seen.append(layer)))
    eng.decode([(0, tok, 8), (1, tok, 8)])
    assert sorted(seen) == eng.cfg.moe_layers


@pytest.mark.parametrize("args, message", [
    (["--parallel", "0"], "--parallel takes numbers of sequences of at least 1, got 0"),
    (["-npl", ""], "--parallel takes numbers of sequences"),
    (["-npl", "1,1000000"], r"1000000 sequences.*use -c \d+ or less, or at most \d+ sequences"),
    (["-npl", "2", "-p", "16"], "--parallel takes -npp and -ntg (tokens per sequence), not -p"),
    (["-npl", "2", "-npp", "-1"], "-npp takes token counts of at least 0, got -1"),
    (["-npl", "2", "-npp", "0", "-ntg", "0"], "nothing to run"),
    (["-npl", "2", "-r", "0"], "-r must be at least 1, got 0"),
    (["-npl", "2", "--spec-oracle", "0.8"], "--spec-oracle takes a probability in [0, 1] with --spec-type "
                                            "draft-mtp, got 0.8 without it"),
    (["-npl", "2", "--spec-type", "draft-mtp", "--spec-oracle", "1.5"],
     r"--spec-oracle takes a probability in \[0, 1\] with --spec-type draft-mtp, got 1.5$"),
    (["-npl", "2", "--spec-draft-n-max", "0,-1"], "--spec-draft-n-max takes drafts a step from 0 (MTP off) up"),
    (["-npl", "2", "--spec-draft-n-max", ""], "--spec-draft-n-max takes drafts a step from 0 (MTP off) up, e.g. "
                                              "0,2; got none"),
    (["-npl", "2", "--spec-type", "draft-mtp", "-npp", "0,8"], "-npp 0 has none: give -npp N > 0"),
    (["-npl", "2", "--trace", "/nonexistent-dir/t.npz"], "--trace '/nonexistent-dir/t.npz': the directory"),
    (["-p", "8", "--trace", "t.npz", "--compare", "--cpu-moe"], "--trace records one configuration's runs"),
    (["-p", "8", "--trace", "/nonexistent-dir/t.npz"], "--trace '/nonexistent-dir/t.npz': the directory"),
])
def test_bad_parallel_input_is_one_line(capsys, args, message):
    assert main(TINY + args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert message in err[0] or re.search(message, err[0]), err


def test_trace_records_the_first_rows_routing_with_each_steps_sequences(capsys, tmp_path):
    from moestream.experts.trace import load_trace
    path = tmp_path / "p3"
    assert main(TINY + ["--parallel", "3,2", "-npp", "6", "-ntg", "4", "--cpu-moe", "--moe-cache-mib", "1",
                        "--trace", str(path)]) == 0
    assert "trace: " in capsys.readouterr().err
    tr = load_trace(str(path) + ".npz")
    decode = [u for u, (_, n, is_prompt, _) in enumerate(tr.ubatches.tolist()) if not is_prompt]
    assert len(decode) == 2 * 4                       # the warm-up's 4 steps and the timed run's, of B = 3 only
    assert all(tr.step_seqs[u].tolist() == [0, 1, 2] for u in decode)
    # each run's three prompts begin before its prompt batch (one forward of all three: its first sequence is 0)
    assert [tr.begun[u].tolist() for u in range(len(tr.ubatches)) if len(tr.begun[u])] == [[0, 1, 2]] * 2
    assert [tr.ubatches[u, 0] for u in range(len(tr.ubatches)) if tr.ubatches[u, 3]] == [0] * 2
    assert len(tr.ids) == len(tr.layers) and all(len(tr.ids[i]) == 3 for i, u in enumerate(tr.ubatch_of)
                                                  if u in decode)


def test_trace_of_plain_rows_records_the_first_configurations_tests(capsys, tmp_path):
    """bench --trace without --parallel: every run (warm-up and timed) of the first cache size's pp and tg tests,
    in order: pp's prompt ubatches, then tg's one-token steps of sequence 0; the second cache size is not in it."""
    from moestream.experts.trace import load_trace
    path = tmp_path / "rows.npz"
    assert main(TINY + ["-p", "8", "-n", "3", "-ub", "4", "--cpu-moe", "--moe-cache-mib", "1,2",
                        "--trace", str(path)]) == 0
    assert capsys.readouterr().err.count("trace: ") == 1
    tr = load_trace(str(path))
    kinds = [(n, bool(is_prompt)) for _, n, is_prompt, _ in tr.ubatches.tolist()]
    assert kinds == [(8, True)] * 2 + [(1, False)] * 3 * 2     # -r 1 and a warm-up each; a batch's ubatches as one
    assert all(tr.step_seqs[u].tolist() == [0] for u, (_, p) in enumerate(kinds) if not p)
