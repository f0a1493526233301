"""The expert cache and the prefetcher on the reference model: warm prompts, as a server sees them.

    python bench/cache_sweep.py MODEL.gguf OUT_DIR [--quick]

Loads MODEL once with every expert in host memory, then for each configuration (cache size, prefetch switches,
via Engine.reconfigure_cache over the same pinned store) and ubatch: one warm-up prompt, then different 4096-token
prompts one after another, each timed; then a 64-token decode. Prints markdown tables and writes JSON.
"""
import json
import sys
import time

import torch

from moestream import LLM

model, out = sys.argv[1], sys.argv[2]
quick = "--quick" in sys.argv
N, TG = (1024, 16) if quick else (4096, 64)
UBS = [512, 2048, 4096] if not quick else [256, 1024]
prompts = [torch.randint(0, 151936, (N,), generator=torch.Generator().manual_seed(100 + i)).tolist() for i in range(6)]
HASH_PROMPT = prompts[5][:64]

llm = LLM(model, cpu_moe=True, ctx_size=N + TG + 8, moe_cache_mib=0, progress=False)
eng = llm.engine
rows = []


def run_prompt(ids):
    eng.begin_prompt(0)
    _, dt = eng.timed(eng.prefill, 0, ids, 0)
    st = llm.stats()
    return dt, st["prompt"], st["per_layer"]


def decode(n):
    eng.begin_prompt(0)
    tok = int(eng.prefill(0, HASH_PROMPT, 0)[0].argmax())
    eng.synchronize()
    t0, ids = time.perf_counter(), []
    for pos in range(len(HASH_PROMPT), len(HASH_PROMPT) + n):
        ids.append(tok)
        tok = int(eng.decode([(0, tok, pos)])[0].argmax())
    eng.synchronize()
    import hashlib
    return n / (time.perf_counter() - t0), hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16], \
        llm.stats()["prompt"]


def sweep(label, changes, timed=3):
    eng.reconfigure_cache(**changes)
    for ub in UBS:
        eng.set_batching(max(UBS), ub)
        run_prompt(prompts[0])                                       # warm: the cache and the routing statistics
        for i in range(1, 1 + timed):
            dt, p, per_layer = run_prompt(prompts[i])
            n_layers = max(1, len(per_layer))
            row = {"config": label, "ubatch": ub, "prompt": i, "tok_s": N / dt, "seconds": dt,
                   "uploaded_gb": p["uploaded_bytes"] / 1e9, "hit_rate": p["hit_rate"],
                   "prefetched_gb": p["prefetched_bytes"] / 1e9, "prefetch_used": p["prefetch_used"],
                   "prefetch_wasted": p["prefetch_wasted"], "wait_s": p["wait_s"],
                   "wait_ms_per_layer": p["wait_s"] / n_layers * 1e3, "link_bound_s": p["uploaded_bytes"] / 55e9}
            rows.append(row)
            print(json.dumps(row), flush=True)
    json.dump(rows, open(f"{out}/cache_sweep.json", "w"), indent=1)
    tg, h, p = decode(TG)
    row = {"config": label, "test": f"tg{TG}", "tok_s": tg, "hash": h, "hit_rate": p["hit_rate"],
           "uploaded_gb": p["uploaded_bytes"] / 1e9, "lookahead_precision": p["lookahead_precision"],
           "lookahead_recall": p["lookahead_recall"]}
    rows.append(row)
    print(json.dumps(row), flush=True)


sizes = [0, 8000, 16000, 24000] if not quick else [0, 2000]
for mib in sizes:                                                    # issue 3: the cache alone
    sweep(f"cache {mib} MiB, no prefetch", {"moe_cache_mib": mib, "prefetch": False, "lookahead": False})
big = 16000 if not quick else 2000
sweep(f"cache {big}, prefetch on, no seeding from the previous prompt",
      {"moe_cache_mib": big, "prefetch": True, "prefetch_seed": False, "lookahead": False})
sweep(f"cache {big}, prefetch fully on", {"moe_cache_mib": big, "prefetch": True, "prefetch_seed": True,
                                          "lookahead": True})
sweep(f"cache {big}, prefetch on, first chunk copies all", {"moe_cache_mib": big, "prefetch": True,
                                                            "prefetch_first_all": True, "lookahead": True})
json.dump(rows, open(f"{out}/cache_sweep.json", "w"), indent=1)

print("\n| config | ubatch | pp tok/s (mean of prompts) | GB uploaded/prompt | hit rate | link bound s | wait ms/layer |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
keys = []
for r in rows:
    if "ubatch" in r and (r["config"], r["ubatch"]) not in keys:
        keys.append((r["config"], r["ubatch"]))
for cfg, ub in keys:
    rs = [r for r in rows if r.get("ubatch") == ub and r["config"] == cfg]
    m = lambda k: sum(r[k] for r in rs) / len(rs)                     # noqa: E731
    print(f"| {cfg} | {ub} | {m('tok_s'):.0f} | {m('uploaded_gb'):.2f} | {m('hit_rate'):.3f} | "
          f"{m('link_bound_s'):.3f} | {m('wait_ms_per_layer'):.2f} |")
print("\n| config | decode tok/s | hash | hit rate | GB uploaded | lookahead precision | recall |")
print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
for r in rows:
    if "test" in r:
        print(f"| {r['config']} | {r['tok_s']:.1f} | {r['hash']} | {r['hit_rate']:.3f} | {r['uploaded_gb']:.2f} | "
              f"{r['lookahead_precision']:.2f} | {r['lookahead_recall']:.2f} |")
