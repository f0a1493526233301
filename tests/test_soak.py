"""bench/soak.py: a short soak of a real `moestream serve` on the CPU passes, with every kind of request; its
memory check fails on growth; and the /metrics gauges it reads (pinned pool slots, process memory) exist."""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("httpx")


def _soak_module(monkeypatch):
    spec = importlib.util.spec_from_file_location("soak", ROOT / "bench" / "soak.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "soak", mod)          # (its dataclass looks its module up while it is made)
    spec.loader.exec_module(mod)
    return mod


def test_a_short_soak_of_a_cpu_server_with_an_expert_cache_passes():
    """~15 s of 8 clients against `moestream serve -m synth:tiny --cpu-moe --moe-cache-mib 0` (a cache, so pins
    exist to leak): streams read whole or closed early, whole answers and given-up ones, TCP resets."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, str(ROOT / "bench" / "soak.py"), "--minutes", "0.25", "--sample-s", "2", "--clients", "8",
           "--max-answer", "8", "-c", "512", "--server-args", "--device cpu --cpu-moe --moe-cache-mib 0 -t 1 -tb 1"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [l for l in out.stdout.splitlines() if l.startswith("| ") and not l.startswith("| ---")]
    head, values = rows[0], rows[1]
    counts = dict(zip((c.strip() for c in head.strip("|").split("|")), (c.strip() for c in values.strip("|").split("|"))))
    assert int(counts["requests done"]) > 0 and int(counts["cancelled"]) > 0 and int(counts["reset mid-stream"]) > 0
    assert counts["errors"] == "0" and float(counts["tokens (server)"]) > 0
    assert re.search(r"\| no pinned pool slot \| pass \| 0 pinned \|", out.stdout)      # the cache's gauge was read
    assert re.search(r"\| resident memory grew <= 5% \| pass \|", out.stdout) and "(PASS)" in out.stdout


def test_memory_growth_and_a_stuck_slot_fail_the_soak(capsys, monkeypatch):
    soak = _soak_module(monkeypatch)
    a = argparse.Namespace(minutes=3.0, clients=8, max_growth=0.05, sample_s=5.0)
    mib = 1 << 20
    flat = [(t, 500.0 * mib, None) for t in range(0, 181, 5)]
    growing = [(t, (500.0 + t) * mib, None) for t in range(0, 181, 5)]        # 500 -> 680 MiB
    idle, quiet = [{"id": 0, "state": "idle"}], {"moestream_pool_pinned_slots": 0.0}
    assert soak.growth(growing, 1, 60) == (560.0 * mib, 680.0 * mib)
    assert soak.report(a, soak.Tally(done=3), flat, 180, idle, quiet, 30)
    assert not soak.report(a, soak.Tally(done=3), growing, 180, idle, quiet, 30)
    assert not soak.report(a, soak.Tally(), flat, 180, [{"id": 0, "state": "generating"}], quiet, 30)
    assert not soak.report(a, soak.Tally(), flat, 180, idle, {"moestream_pool_pinned_slots": 2.0}, 30)
    assert "FAIL | 2 pinned" in capsys.readouterr().out


def test_metrics_export_pool_pins_device_and_process_memory():
    from moestream import LLM
    from moestream.server.metrics import ServerMetrics, engine_snapshot
    llm = LLM("synth:tiny", device="cpu", ctx_size=64, cpu_moe=True, moe_cache_mib=0)
    llm.generate([1, 2, 3, 4], max_tokens=4)
    snap = engine_snapshot(llm)
    assert snap["pool_slots"] == 16 and snap["pool_pinned_slots"] == 0 and snap["gpu_memory_bytes"] is None
    m = ServerMetrics()
    m.set_engine_stats(snap)
    text = m.render().decode()
    assert "moestream_pool_slots 16.0" in text and "moestream_pool_pinned_slots 0.0" in text
    assert "moestream_gpu_memory_bytes" not in text                      # the CPU: no device memory to report
    if sys.platform == "linux":
        assert re.search(r"^process_resident_memory_bytes \d", text, re.M)
    assert LLM("synth:tiny", device="cpu", ctx_size=64).engine.pinned_slots() is None      # no cache, no pool
