"""`moestream bench --compare A B`: two configurations loaded once and run alternately (A, B, A, B, ...), so that
drift (clocks, heat, other tenants) cancels in each pair's ratio, printed pair by pair and as a mean.

    moestream bench -m ref.gguf -p 2048 -n 32 --compare "--cpu-moe" "--cpu-moe --moe-cache-mib 8000"
"""
from __future__ import annotations

import argparse
import copy
import shlex
import statistics

from .. import flags
from ..argv import Parser
from ..errors import UserError
from . import report
from .bench_common import SWEPT, BenchTest, load, placement, scalar, tests_of
from .report import Col, na


class _Raising(Parser):
    def error(self, message):                # a value of --compare, not a flag of the command: exit 1
        raise UserError(f"--compare: {message}")


def compare_config(a: argparse.Namespace, spec: str) -> argparse.Namespace:
    """The bench's engine flags with `spec` (e.g. "--cpu-moe --moe-cache-mib 8000") on top; -m may change too."""
    p = _Raising(prog="moestream bench --compare", add_help=False)
    flags.add_engine_arguments(p)
    base = scalar(a)
    p.set_defaults(verbose=base.verbose)
    ns = copy.copy(base)
    vars(ns).update(vars(p.parse_args(["-m", a.model, *flags.to_argv(flags.to_config(base)), *shlex.split(spec)])))
    return ns


COMPARE_COLS = [
    Col("test", "test"), Col("pair", "pair"),
    Col("A t/s", "a_tps", lambda r: f"{r['a_tps']:.2f}"), Col("B t/s", "b_tps", lambda r: f"{r['b_tps']:.2f}"),
    Col("B/A", "ratio", lambda r: f"{r['ratio']:.4f}" + (f" ± {r['ratio_std']:.4f}" if r["pair"] == "mean" else "")),
    Col("A up GB", "a_uploaded_gb", lambda r: na(r["a_uploaded_gb"], "{:.3f}")),
    Col("B up GB", "b_uploaded_gb", lambda r: na(r["b_uploaded_gb"], "{:.3f}")),
    Col("A hit %", "a_hit_rate", lambda r: na(None if r["a_hit_rate"] is None else 100 * r["a_hit_rate"], "{:.1f}")),
    Col("B hit %", "b_hit_rate", lambda r: na(None if r["b_hit_rate"] is None else 100 * r["b_hit_rate"], "{:.1f}")),
]


def _pair_row(test: BenchTest, pair, ra: dict, rb: dict) -> dict:
    a_tps, b_tps = test.n_tokens / ra["seconds"], test.n_tokens / rb["seconds"]
    up = lambda r: None if r["total"]["uploaded_bytes"] is None else r["total"]["uploaded_bytes"] / 1e9
    return {"test": test.name, "pair": pair, "a_tps": a_tps, "b_tps": b_tps, "ratio": b_tps / a_tps,
            "ratio_std": None, "a_uploaded_gb": up(ra), "b_uploaded_gb": up(rb),
            "a_hit_rate": ra["total"]["hit_rate"], "b_hit_rate": rb["total"]["hit_rate"]}


def compare(a: argparse.Namespace) -> int:
    """`a`: the bench's flags, those after A B parsed too (bench.py)."""
    if a.parallel is not None:                   # given after A B: main could not see it
        raise UserError("--parallel takes -npp and -ntg (tokens per sequence), not --compare")
    flag = {"batch_size": "-b", "ubatch_size": "-ub", "n_cpu_moe": "-ncmoe", "moe_cache_mib": "--moe-cache-mib"}
    swept = [flag[k] for k in SWEPT if len(getattr(a, k, None) or [None]) > 1]
    if swept:
        raise UserError(f"--compare runs one configuration per side: give {', '.join(swept)} inside A or B, "
                        "not as comma lists")
    tests = tests_of(a)
    ctx = max(t.n_tokens for t in tests)
    specs = [compare_config(a, s) for s in a.compare]
    llms = [load(ns, ctx) for ns in specs]                 # both loaded once, held together
    rows, stream_md = [], a.output == "md"
    if stream_md:
        print(f"A: {a.compare[0]!r}  ({placement(specs[0])})\nB: {a.compare[1]!r}  ({placement(specs[1])})\n")
        print(report.md_header(COMPARE_COLS), flush=True)
    for t in tests:
        for llm in llms if not a.no_warmup else ():
            t.run(llm, -1)
        pairs = []
        for i in range(a.repetitions):
            ra, rb = t.run(llms[0], i), t.run(llms[1], i)   # A, B, A, B, ...: drift cancels in each pair
            pairs.append(_pair_row(t, i + 1, ra, rb))
            if stream_md:
                print(report.md_row(COMPARE_COLS, pairs[-1]), flush=True)
        ratios = [r["ratio"] for r in pairs]
        mean = lambda k: None if any(r[k] is None for r in pairs) else statistics.mean(r[k] for r in pairs)
        summary = {"test": t.name, "pair": "mean", "a_tps": mean("a_tps"), "b_tps": mean("b_tps"),
                   "ratio": statistics.mean(ratios), "ratio_std": statistics.stdev(ratios) if len(ratios) > 1 else 0.0,
                   **{k: mean(k) for k in ("a_uploaded_gb", "b_uploaded_gb", "a_hit_rate", "b_hit_rate")}}
        if stream_md:
            print(report.md_row(COMPARE_COLS, summary), flush=True)
        rows += pairs + [summary]
    if not stream_md:
        print(report.render(rows, a.output, COMPARE_COLS))
    return 0
