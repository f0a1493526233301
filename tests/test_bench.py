"""moestream bench: the statistics accessor (old and new llm.stats()), the roofline, the three output formats read
back, sweeps, -pg, --compare and --plot on synth:tiny with tiny sizes."""
from __future__ import annotations

import csv
import io
import json
import re
import sys

import pytest

from moestream.cli import main
from moestream.errors import UserError
from moestream.tools import report
from moestream.tools.bench import summarise
from moestream.tools.bench_common import BenchTest, diff_counters, mean_counters, read_stats

TINY = ["bench", "-m", "synth:tiny", "--device", "cpu", "-r", "2"]


class FakeLLM:
    def __init__(self, st):
        self.st = st

    def stats(self):
        return self.st


def test_stats_accessor_reads_both_versions_of_llm_stats():
    old = FakeLLM({"uploaded_bytes": 300, "uploaded_experts": 3, "uploaded_bytes_per_layer": {0: 100, 2: 200}})
    total, per_layer = read_stats(old)
    assert total["uploaded_bytes"] == 300 and total["copies"] == 3 and total["hits"] is None
    assert per_layer[2]["uploaded_bytes"] == 200
    d = diff_counters(total, None)
    assert d["hit_rate"] is None and d["wait_s"] is None and d["uploaded_bytes"] == 300

    def new(h, m, up, w):
        c = {"hits": h, "misses": m, "evictions": 0, "uploaded_bytes": up, "copies": m, "hit_rate": 0.0, "wait_s": w}
        return FakeLLM({"total": c, "per_layer": {"1": c}, "uploaded_bytes": up})
    before, after = read_stats(new(10, 10, 1000, 0.5)), read_stats(new(16, 12, 1400, 0.75))
    d = diff_counters(after[0], before[0])
    assert (d["hits"], d["misses"], d["uploaded_bytes"], d["wait_s"]) == (6, 2, 400, 0.25)
    assert d["hit_rate"] == pytest.approx(0.75)
    assert diff_counters(after[1][1], before[1][1])["hit_rate"] == pytest.approx(0.75)
    m = mean_counters([d, diff_counters(before[0], {"hits": 0, "misses": 0})])     # 6 of 8 and 10 of 20
    assert m["hit_rate"] == pytest.approx(16 / 28) and m["uploaded_bytes"] == 700


def test_summary_roofline_is_link_bound_over_measured():
    t = BenchTest(512, 0, seed=1)
    runs = [{"seconds": s, "total": diff_counters({"uploaded_bytes": 1e9, "wait_s": 0.048}, None),
             "per_layer": {}} for s in (0.04, 0.06)]
    row = summarise(t, runs, n_layers=48, link_bps=50e9, compute_s_per_token=None)
    assert row["test"] == "pp512" and row["uploaded_gb"] == pytest.approx(1.0)
    assert row["bound_s"] == pytest.approx(0.02) and row["roofline_frac"] == pytest.approx(0.02 / 0.05)
    assert row["tps_mean"] == pytest.approx((512 / 0.04 + 512 / 0.06) / 2)
    assert row["samples_ts"] == pytest.approx([512 / 0.04, 512 / 0.06])        # each repetition, in order
    assert row["wait_ms_per_layer"] == pytest.approx(1.0)                       # 48 ms over 48 layers
    row = summarise(t, runs, 48, link_bps=None, compute_s_per_token=1e-4)      # the CPU: compute bound only
    assert row["bound_s"] == pytest.approx(0.0512) and row["link_gbps"] is None
    assert summarise(t, runs, 48, None, None)["roofline_frac"] is None
    assert BenchTest(16, 4, 1).name == "pp16+tg4" and BenchTest(0, 4, 1).name == "tg4"


def _md_rows(text: str) -> list[dict]:
    lines = [l for l in text.splitlines() if l.startswith("|")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert set(lines[1].replace("|", "").split()) <= {"---", "---:"}
    return [dict(zip(head, (c.strip() for c in l.strip("|").split("|")))) for l in lines[2:]]


def test_formats_parse_back_with_sweeps_and_pg(capsys):
    assert main(TINY + ["-p", "16", "-n", "2", "-pg", "8,2", "-ub", "8,16", "--cpu-moe", "-o", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["n_ubatch"], r["test"]) for r in rows] == [(ub, t) for ub in (8, 16) for t in ("pp16", "tg2", "pp8+tg2")]
    for r in rows:
        assert r["experts"] == "host" and r["reps"] == 2 and r["tps_mean"] > 0 and r["link_gbps"] is None
        assert r["uploaded_gb"] > 0 and r["roofline_frac"] is None and set(r["per_layer"]) == {"0", "1", "2", "3"}
    pp = {r["n_ubatch"]: r["uploaded_gb"] for r in rows if r["test"] == "pp16"}
    assert pp[8] >= pp[16]                               # two ubatches upload each routed expert twice

    assert main(TINY + ["-p", "16", "-n", "0", "-o", "csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert len(rows) == 1 and rows[0]["test"] == "pp16" and rows[0]["experts"] == "device"
    assert float(rows[0]["tps_mean"]) > 0 and rows[0]["roofline_frac"] == "" and "per_layer" not in rows[0]

    assert main(TINY + ["-p", "16", "-n", "2", "-ncmoe", "0,2"]) == 0
    rows = _md_rows(capsys.readouterr().out)
    assert [(r["experts"], r["test"]) for r in rows] == [("device", "pp16"), ("device", "tg2"),
                                                       ("host x2", "pp16"), ("host x2", "tg2")]
    assert all(re.fullmatch(r"\d+\.\d\d ± \d+\.\d\d", r["t/s"]) for r in rows)
    assert rows[0]["roofline"] == "n/a" and float(rows[2]["up GB"]) > 0


def test_cache_size_sweep_loads_each_size_and_hashes_the_same_tokens(capsys):
    assert main(TINY + ["-p", "16", "-n", "6", "--cpu-moe", "--moe-cache-mib", "0,8", "-o", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["moe_cache_mib"] for r in rows] == [0, 0, 8, 8]
    assert all(r["hit_rate"] is None or 0 <= r["hit_rate"] <= 1 for r in rows)
    assert main(TINY + ["-p", "16", "-n", "6", "-o", "json"]) == 0                 # every expert on the device
    device = json.loads(capsys.readouterr().out)
    hashes = {r["hash"] for r in rows + device if r["n_gen"]}
    assert len(hashes) == 1 and None not in hashes                 # the cache changes no generated token
    assert all(r["hash"] is None for r in rows if not r["n_gen"])


def test_compare_alternates_and_prints_ratios(capsys):
    assert main(TINY + ["-p", "16", "-n", "0", "--compare", "--cpu-moe", "-ub 8", "-r", "3"]) == 0
    out = capsys.readouterr().out
    assert "A: '--cpu-moe'" in out and "B: '-ub 8'" in out
    rows = _md_rows(out)
    assert [r["pair"] for r in rows] == ["1", "2", "3", "mean"]
    for r in rows[:3]:
        assert float(r["B/A"]) == pytest.approx(float(r["B t/s"]) / float(r["A t/s"]), rel=0.02)
    assert re.fullmatch(r"\d+\.\d{4} ± \d+\.\d{4}", rows[3]["B/A"])
    assert float(rows[0]["A up GB"]) > 0 and float(rows[0]["B up GB"]) == 0      # B: every expert on the device

    assert main(TINY + ["-p", "16", "-n", "0", "-o", "json", "--compare", "", "--cpu-moe"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["pair"] for r in rows] == [1, 2, "mean"] and rows[-1]["ratio_std"] is not None

    assert main(TINY + ["-p", "16", "-ub", "8,16", "--compare", "", "--cpu-moe"]) == 1
    assert "-ub" in capsys.readouterr().err
    assert main(TINY + ["-p", "16", "--compare", "--cpu-moe", "--no-such-flag"]) == 1
    assert "--compare" in capsys.readouterr().err


def test_plot_and_missing_matplotlib(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    png = tmp_path / "bench.png"
    assert main(TINY + ["-p", "16", "-n", "0", "-ub", "8,16", "--cpu-moe", "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    monkeypatch.setitem(sys.modules, "matplotlib", None)                          # import matplotlib fails
    with pytest.raises(UserError, match="needs matplotlib"):
        report.pyplot()


def test_nothing_to_run_is_an_error(capsys):
    assert main(TINY + ["-p", "0", "-n", "0"]) == 1
    assert "nothing to run" in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["--seed", str(10 ** 23)], "--seed must be from 0 to"),                   # was torch's overflow traceback
    (["--compute-s-per-token", "-1"], "--compute-s-per-token must be a positive"),      # was a negative roofline
    (["--link-mib", "-1"], "--link-mib must be >= 0"),
])
def test_numbers_out_of_range_are_one_line(capsys, argv, needle):
    assert main(TINY + ["-p", "8", "-n", "0", *argv]) == 1
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and "loaded" not in err
