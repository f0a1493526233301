"""Correctness and cost probes on the reference model, for one GPU run (see bench/gpu.sh probe).

    python bench/probe.py MODEL OUT_DIR gpu       all on the GPU: digests of a prompt (per layer), of 4 chunks, of
                                                  a greedy decode (graphs and eager); run it in two processes
    python bench/probe.py MODEL OUT_DIR cache     --cpu-moe: the same digests under several caches and prefetch
                                                  settings, each after three warm prompts; a routing trace; the
                                                  host-time counters; a profile of one prompt at 24000 MiB
    python bench/probe.py MODEL OUT_DIR hashes    --cpu-moe: the greedy hash of one decode under each setting
    python bench/probe.py MODEL OUT_DIR trace     --cpu-moe: a routing trace with lookahead guesses (ref_trace.npz)

Writes OUT_DIR/probe_<part>[_<tag>].json. `compare` prints, for two or more of those files, where digests differ.
"""
import hashlib
import json
import os
import sys
import time

import torch

import moestream.models.transformer as T
from moestream import LLM
from moestream.runtime.generate import token_hash

MODEL, OUT, PART = sys.argv[1], sys.argv[2], sys.argv[3]
TAG = os.environ.get("PROBE_TAG", "")
if os.environ.get("PROBE_CUDNN_SDP") == "0":
    torch.backends.cuda.enable_cudnn_sdp(False)
V = int(os.environ.get("PROBE_VOCAB", 151936))
N = int(os.environ.get("PROBE_N", 4096))              # warm and timed prompt length (smaller for a CPU dry run)
rand = lambda n, s: torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(s)).tolist()  # noqa: E731
PROMPT, CHUNKS, HASH_PROMPT = rand(512, 1), [rand(512, 10 + i) for i in range(4)], rand(64, 5)
WARM = [rand(N, 100 + i) for i in range(3)]


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()[:10]


# Per-layer digests of the attention output and the MoE output (eager forwards only: a graph capture must not sync).
LOG: list | None = None
_attention, _moe_experts = T.MoETransformer.attention, T.moe_experts


def attention(self, x, lw, layer, *a):
    out = _attention(self, x, lw, layer, *a)
    if LOG is not None:
        LOG.append(f"a{layer}:{digest(out)}")
    return out


def moe_experts(x, lw, layer, *a, **kw):
    out = _moe_experts(x, lw, layer, *a, **kw)
    if LOG is not None:
        LOG.append(f"m{layer}:{digest(out)}")
    return out


T.MoETransformer.attention, T.moe_experts = attention, moe_experts


def digests(llm, graphs_too=True) -> dict:
    global LOG
    eng = llm.engine
    eng.set_batching(2048, 512)
    out = {}
    LOG = []
    eng.begin_prompt(0)
    out["prompt"] = digest(eng.prefill(0, PROMPT, 0, all_logits=True))
    out["prompt_layers"] = LOG
    LOG = None
    out["chunks"] = []
    for c in CHUNKS:
        eng.begin_prompt(0)
        out["chunks"].append(digest(eng.prefill(0, c, 0, all_logits=True)))

    def decode(record: bool):
        global LOG
        eng.begin_prompt(0)
        tok = int(eng.prefill(0, HASH_PROMPT, 0)[0].argmax())
        toks, logs = [], []
        for pos in range(64, 96):
            toks.append(tok)
            LOG = [] if record else None
            lg = eng.decode([(0, tok, pos)])
            if record:
                logs.append(LOG + [digest(lg)])
            tok = int(lg[0].argmax())
        LOG = None
        return token_hash(toks)[:16], logs

    saved, eng.decoder = eng.decoder, eng.eager
    out["decode_eager"], out["decode_layers"] = decode(record=True)
    eng.decoder = saved
    if graphs_too and eng.decoder.captures:
        out["decode_graphs"] = decode(record=False)[0]
    return out


def greedy(eng, n: int = 64) -> tuple[float, list[int]]:
    """Seconds to decode n tokens greedily after HASH_PROMPT (from position 64), and the tokens."""
    eng.begin_prompt(0)
    tok = int(eng.prefill(0, HASH_PROMPT, 0)[0].argmax())
    eng.synchronize()
    t0, toks = time.perf_counter(), []
    for pos in range(64, 64 + n):
        toks.append(tok)
        tok = int(eng.decode([(0, tok, pos)])[0].argmax())
    return time.perf_counter() - t0, toks


def warm(llm, ub=2048):
    eng = llm.engine
    eng.set_batching(4096, ub)
    for ids in WARM:
        eng.begin_prompt(0)
        eng.prefill(0, ids, 0)


def save(name, obj):
    with open(f"{OUT}/probe_{name}{TAG}.json", "w") as f:
        json.dump(obj, f, indent=1)


def part_gpu():
    llm = LLM(MODEL, ctx_size=4200)
    res = {"all-gpu": digests(llm)}
    warm(llm)
    res["all-gpu after warm prompts"] = digests(llm)
    save("gpu", res)
    print(f"all-gpu tg64 (graphs, no cuDNN attention): {64 / greedy(llm.engine)[0]:.1f} tok/s", flush=True)
    if not TAG:
        profile_prompt(llm, f"{OUT}/profile_prompt_gpu.txt")
    print(json.dumps({k: {kk: v[kk] for kk in ("prompt", "chunks", "decode_eager", "decode_graphs") if kk in v}
                      for k, v in res.items()}, indent=1), flush=True)


CONFIGS = [
    ("no cache (upload per ubatch)", {"moe_cache_mib": None}),
    ("cache 0", {"moe_cache_mib": 0, "prefetch": False}),
    ("cache 16000 no prefetch", {"moe_cache_mib": 16000, "prefetch": False, "lookahead": False}),
    ("cache 16000 prefetch, no seeding", {"moe_cache_mib": 16000, "prefetch_seed": False, "lookahead": False}),
    ("cache 16000 prefetch fully on", {"moe_cache_mib": 16000}),
    ("cache 16000 first chunk copies all", {"moe_cache_mib": 16000, "prefetch_first_all": True}),
    ("cache 16000 host decode graphs", {"moe_cache_mib": 16000, "host_decode_graphs": True}),
]


def part_cache():
    llm = LLM(MODEL, cpu_moe=True, ctx_size=4200, moe_cache_mib=0)
    eng = llm.engine
    res = {}
    for name, kw in CONFIGS:
        eng.reconfigure_cache(**{"prefetch": True, "lookahead": True, "prefetch_seed": True,
                                 "prefetch_first_all": False, "host_decode_graphs": False, **kw})
        warm(llm)
        res[name] = digests(llm)
        print(name, {kk: res[name][kk] for kk in ("prompt", "chunks", "decode_eager", "decode_graphs")
                     if kk in res[name]}, flush=True)
        save("cache", res)

    # Host-time counters and prompt speed, prompt lookahead on and off, at 16000 and 24000 MiB.
    speed = []
    for mib in (16000, 24000):
        for name, kw in (("no prefetch", {"prefetch": False}), ("prefetch, no prompt lookahead",
                                                                 {"prompt_lookahead": False}),
                         ("prefetch + prompt lookahead", {})):
            eng.reconfigure_cache(**{"moe_cache_mib": mib, "prefetch": True, "lookahead": True,
                                     "prompt_lookahead": True, "prefetch_first_all": False,
                                     "host_decode_graphs": False, **kw})
            for ub in (2048, 4096):
                warm(llm, ub)
                for i in range(2):
                    ids = rand(N, 200 + i)
                    eng.begin_prompt(0)
                    _, dt = eng.timed(eng.prefill, 0, ids, 0)
                    p = llm.stats()["prompt"]
                    row = {"mib": mib, "config": name, "ubatch": ub, "tok_s": N / dt,
                           **{k: p[k] for k in ("hit_rate", "uploaded_bytes", "prefetched", "prefetch_used",
                                                "prefetch_wasted", "lookahead_precision", "lookahead_recall")},
                           **{f"{k}_ms_layer": p[k] * 1e3 / 24 for k in ("wait_s", "sync_s", "host_s")}}
                    speed.append(row)
                    print(json.dumps(row), flush=True)
        for graphs in (False, True):
            eng.reconfigure_cache(moe_cache_mib=mib, prefetch=True, lookahead=True, prompt_lookahead=True,
                                  host_decode_graphs=graphs)
            warm(llm)
            for rep in range(2):
                dt = greedy(eng)[0]
                p = llm.stats()["prompt"]
                row = {"mib": mib, "test": "tg64", "host_decode_graphs": graphs, "tok_s": 64 / dt,
                       "hit_rate": p["hit_rate"], "lookahead_precision": p["lookahead_precision"],
                       **{f"{k}_ms_layer_token": p[k] * 1e3 / 24 / 64 for k in ("wait_s", "sync_s", "host_s")}}
                speed.append(row)
                print(json.dumps(row), flush=True)
    save("speed", speed)

    record_trace(llm, f"{OUT}/ref_trace.npz")

    # Where a prompt's time goes when every expert hits (24000 MiB, ubatch 4096).
    eng.reconfigure_cache(moe_cache_mib=24000, prefetch=True, lookahead=True)
    profile_prompt(llm, f"{OUT}/profile_prompt24000.txt")


def record_trace(llm, path):
    """The routing, and each layer's lookahead guess, of 4 prompts at ubatch 2048, 4 at 4096 and a 64-token decode
    (eager, so every guess is made), for `moestream replay`."""
    from moestream.experts.trace import TraceRecorder
    eng = llm.engine
    eng.reconfigure_cache(moe_cache_mib=16000, prefetch=False, lookahead=False, host_decode_graphs=False)
    cfg = llm.model_config
    rec = TraceRecorder(cfg.n_layers, cfg.n_experts, eng.host.store.expert_bytes)
    eng.observe(rec)
    for ub in (2048, 4096):
        eng.set_batching(4096, ub)
        for i in range(4):
            eng.begin_prompt(0)
            eng.prefill(0, rand(N, 300 + i), 0)
    greedy(eng, 64)
    eng.unobserve(rec)
    rec.save(path)


def part_trace():
    record_trace(LLM(MODEL, cpu_moe=True, ctx_size=4200, moe_cache_mib=16000), f"{OUT}/ref_trace.npz")


def profile_prompt(llm, path):
    from torch.profiler import ProfilerActivity, profile
    eng = llm.engine
    warm(llm, 4096)
    eng.begin_prompt(0)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _, dt = eng.timed(eng.prefill, 0, rand(N, 400), 0)
    with open(path, "w") as f:
        f.write(f"prompt of {N} tokens at ubatch 4096: {dt * 1e3:.1f} ms under the profiler\n")
        f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30))
        f.write("\n\n")
        f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30))


def part_hashes():
    """The greedy hash of one fixed decode under each cache and prefetch setting, after warm prompts (issue 4)."""
    llm = LLM(MODEL, cpu_moe=True, ctx_size=4200, moe_cache_mib=0)
    eng = llm.engine
    configs = CONFIGS + [("cache 16000 (defaults: prefetch, lookahead, host decode graphs)", {"moe_cache_mib": 16000}),
                         ("cache 24000", {"moe_cache_mib": 24000})]
    res = {}
    for name, kw in configs:
        eng.reconfigure_cache(**{"prefetch": True, "lookahead": True, "prefetch_seed": True,
                                 "prefetch_first_all": False, "host_decode_graphs": "defaults" in name, **kw})
        warm(llm)
        toks = greedy(eng, 32)[1]
        res[name] = token_hash(toks)[:16]
        print(f"{name}: {res[name]}", flush=True)
    save("hashes", res)


def compare():
    runs = {}
    for path in sys.argv[4:]:
        for name, d in json.load(open(path)).items():
            runs[f"{os.path.basename(path)}:{name}"] = d
    base_name, base = next(iter(runs.items()))
    print(f"base: {base_name}")
    for name, d in runs.items():
        diffs = [k for k in ("prompt", "chunks", "decode_eager", "decode_graphs") if k in d and k in base
                 and d[k] != base[k]]
        first = next((f"{a} != {b}" for a, b in zip(d["prompt_layers"], base["prompt_layers"]) if a != b), "-")
        step = next((f"step {i}: {next(x for x, y in zip(a, b) if x != y)}" for i, (a, b) in
                     enumerate(zip(d["decode_layers"], base["decode_layers"])) if a != b), "-")
        print(f"{name}: differs in {diffs or 'nothing'}; first prompt layer {first}; first decode {step}")


{"gpu": part_gpu, "cache": part_cache, "hashes": part_hashes, "trace": part_trace, "compare": compare}[PART]()
