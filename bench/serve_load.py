"""Load a running `moestream serve` with 1, 4 and 8 concurrent clients; print a markdown table of throughput and
latency per concurrency.

    moestream serve -m ref.gguf --cpu-moe -np 8 -c 4096 &
    python bench/serve_load.py --url http://127.0.0.1:8080 --clients 1,4,8 -p 512 -n 64 -r 4

Each client sends -r streamed completions one after another. Prompts are random token ids (any model takes them,
with or without a tokenizer), different for every request so that no prompt prefix is reused; ignore_eos keeps
every answer exactly -n tokens long. Per concurrency level: TTFT (request sent -> first token), the gap between two
tokens of one stream, decode tok/s per stream (after its first token), and tok/s in aggregate (every generated token
over the wall time of the level), and the ITL p90 of the gaps that overlap another request's prompt being read
(its submission to its first token). --stagger S spreads the clients' starts over S seconds, so that prompts arrive
while other streams generate. A warm-up request runs first. Needs httpx (a dependency of openai).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time

import httpx


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def one(client: httpx.AsyncClient, a, prompt: list[int]) -> dict:
    body = {"model": a.model, "prompt": prompt, "max_tokens": a.n_gen, "temperature": 0, "stream": True,
            "ignore_eos": True, "cache_prompt": False, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps, usage = [], None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any(c.get("text") for c in chunk.get("choices", [])):
                stamps.append(time.perf_counter())
    n = usage["completion_tokens"] if usage else len(stamps)
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    decode_s = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
    return {"ttft": stamps[0] - t0 if stamps else float("nan"), "gaps": gaps, "tokens": n,
            "decode_tps": (n - 1) / decode_s if decode_s > 0 else float("nan"),
            "reading": (t0, stamps[0] if stamps else t0), "stamps": stamps}


def gaps_during_prompts(results: list[dict]) -> list[float]:
    """The token gaps of each stream that overlap another request's prompt being read (its submission to its first
    token): what a new request's prompt costs the streams already generating."""
    out = []
    for i, r in enumerate(results):
        others = [o["reading"] for j, o in enumerate(results) if j != i]
        for a, b in zip(r["stamps"], r["stamps"][1:]):
            if any(s < b and a < e for s, e in others):
                out.append(b - a)
    return out


async def level(a, n_clients: int, vocab: int, rng: random.Random) -> dict:
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    limits = httpx.Limits(max_connections=n_clients + 1)
    async with httpx.AsyncClient(base_url=a.url, headers=headers, timeout=a.timeout, limits=limits) as client:
        prompts = [[[rng.randrange(vocab) for _ in range(a.n_prompt)] for _ in range(a.requests)]
                   for _ in range(n_clients)]

        async def worker(i, ps):
            await asyncio.sleep(a.stagger * i / n_clients)       # --stagger: clients start spread over S seconds
            return [await one(client, a, p) for p in ps]

        t0 = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(worker(i, ps) for i, ps in enumerate(prompts))) for r in rs]
        wall = time.perf_counter() - t0
    ttft = [r["ttft"] for r in results]
    gaps = [g for r in results for g in r["gaps"]]
    return {"clients": n_clients, "requests": len(results), "ttft_p50": pct(ttft, .5), "ttft_p90": pct(ttft, .9),
            "itl_p50": pct(gaps, .5), "itl_p90": pct(gaps, .9), "itl_prompt_p90": pct(gaps_during_prompts(results), .9),
            "stream_tps": statistics.mean(r["decode_tps"] for r in results),
            "total_tps": sum(r["tokens"] for r in results) / wall, "wall": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080", help="the server (default http://127.0.0.1:8080)")
    ap.add_argument("--clients", default="1,4,8", help="concurrency levels, comma list (default 1,4,8)")
    ap.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens per request (default 512)")
    ap.add_argument("-n", "--n-gen", type=int, default=64, help="tokens generated per request (default 64)")
    ap.add_argument("-r", "--requests", type=int, default=4, help="requests per client (default 4)")
    ap.add_argument("--stagger", type=float, default=0.0, metavar="S",
                    help="clients start spread over S seconds, so that prompts arrive while others generate (default 0)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default 600)")
    a = ap.parse_args()
    a.url = a.url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    try:
        models = httpx.get(a.url + "/v1/models", headers=headers, timeout=30).json()
    except httpx.HTTPError as e:
        print(f"error: cannot reach {a.url}: {e}", file=sys.stderr)
        return 1
    a.model = models["data"][0]["id"]              # the server answers 404 to a name it does not serve
    meta = models["data"][0].get("meta") or {}
    vocab = min(meta.get("n_vocab", 1000), 100_000)
    rng = random.Random(a.seed)
    asyncio.run(one(httpx.AsyncClient(base_url=a.url, headers=headers, timeout=a.timeout), a,
                    [rng.randrange(vocab) for _ in range(a.n_prompt)]))          # warm-up
    print(f"server {a.url} model {models['data'][0]['id']}: prompt {a.n_prompt} tokens, {a.n_gen} generated, "
          f"{a.requests} requests per client\n")
    print("| clients | requests | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | ITL p90 ms | ITL p90 ms, prompts read "
          "| tok/s per stream | tok/s total | wall s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for c in [int(x) for x in a.clients.split(",") if x.strip()]:
        r = asyncio.run(level(a, c, vocab, rng))
        print(f"| {r['clients']} | {r['requests']} | {r['ttft_p50'] * 1e3:.1f} | {r['ttft_p90'] * 1e3:.1f} "
              f"| {r['itl_p50'] * 1e3:.2f} | {r['itl_p90'] * 1e3:.2f} | {r['itl_prompt_p90'] * 1e3:.2f} "
              f"| {r['stream_tps']:.2f} "
              f"| {r['total_tps']:.2f} | {r['wall']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
