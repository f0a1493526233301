"""`moestream bench`: prompt and generation speed, shaped like llama-bench.

    moestream bench -m ref.gguf -p 4096 -n 64 -ub 512,2048,4096 -b 4096 --cpu-moe -r 3 -o md

pp N: one N-token prompt of random ids from position 0, in ubatches. tg N: N tokens decoded one at a time from
position 0, each waiting for the previous one's argmax (as a real decode does). A warm-up run precedes the timed
repetitions; results are mean ± std of tokens per second. Comma lists sweep; the model loads once, since -b and
-ub change how prompts are cut, not where weights live.
"""
from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import statistics

import torch


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x != ""]


def add_parser(sub) -> None:
    from ..cli import add_engine_flags
    p = sub.add_parser("bench", help="measure prompt (pp) and generation (tg) speed, like llama-bench")
    add_engine_flags(p)
    for a in p._actions:                         # sweepable: -b and -ub take comma lists here
        if a.dest in ("batch_size", "ubatch_size"):
            a.type = _ints
            a.default = [a.default]
    p.add_argument("-p", "--n-prompt", type=_ints, default=[512], help="prompt lengths, comma list (0 skips)")
    p.add_argument("-n", "--n-gen", type=_ints, default=[128], help="generation lengths, comma list (0 skips)")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="timed repetitions (default 5)")
    p.add_argument("-o", "--output", choices=["md", "json", "csv"], default="md", help="output format")
    p.add_argument("--seed", type=int, default=1234, help="seed of the random prompt tokens")
    p.set_defaults(func=main)


def run_test(llm, kind: str, n: int, reps: int, seed: int) -> dict:
    eng = llm.engine
    vocab = llm.model_config.vocab_size
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (max(n, 1),), generator=g).tolist()

    def once():
        if kind == "pp":
            eng.prefill(0, ids, 0)
        else:
            tok = ids[0]
            for pos in range(n):
                tok = int(eng.decode([(0, tok, pos)])[0].argmax())

    once()                                              # warm-up: allocations, kernels, caches
    times, up0 = [], llm.stats()["uploaded_bytes"]
    for _ in range(reps):
        times.append(eng.timed(once)[1])
    uploaded = (llm.stats()["uploaded_bytes"] - up0) / reps
    tps = [n / t for t in times]
    return {"test": f"{kind}{n}", "n": n, "tps_mean": statistics.mean(tps),
            "tps_std": statistics.stdev(tps) if len(tps) > 1 else 0.0,
            "seconds_mean": statistics.mean(times), "uploaded_gb": uploaded / 1e9}


def main(a: argparse.Namespace) -> int:
    from ..api import LLM
    from ..cli import engine_kwargs
    rows = []
    kw = engine_kwargs(a) | {"batch_size": a.batch_size[0], "ubatch_size": a.ubatch_size[0]}
    kw["ctx_size"] = max(a.ctx_size, max(a.n_prompt + a.n_gen))
    llm = LLM(a.model, progress=a.verbose, **kw)           # one load: -b and -ub change no placement
    placement = "host" if a.cpu_moe else (f"host x{a.n_cpu_moe}" if a.n_cpu_moe else "gpu")
    for b, ub in itertools.product(a.batch_size, a.ubatch_size):
        llm.engine.set_batching(b, ub)
        for kind, ns in (("pp", a.n_prompt), ("tg", a.n_gen)):
            for n in ns:
                if n > 0:
                    r = run_test(llm, kind, n, a.repetitions, a.seed)
                    rows.append({"model": a.model, "experts": placement, "n_batch": b, "n_ubatch": ub,
                                 "device": llm.engine.device.name, **r})
    print(render(rows, a.output))
    return 0


def render(rows: list[dict], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(rows, indent=2)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else [])
        w.writeheader()
        w.writerows(rows)
        return buf.getvalue()
    head = "| model | experts | n_batch | n_ubatch | test | t/s | uploaded GB |"
    lines = [head, "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['experts']} | {r['n_batch']} | {r['n_ubatch']} | {r['test']} | "
                     f"{r['tps_mean']:.2f} ± {r['tps_std']:.2f} | {r['uploaded_gb']:.2f} |")
    return "\n".join(lines)

