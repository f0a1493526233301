"""A bounded soak of `moestream serve`: concurrent clients of every kind for a few minutes, then the checks that a
long-running server needs (nothing stuck in a slot, nothing pinned in the expert pool, no memory growing).

    python bench/soak.py                                     # starts `moestream serve -m synth:tiny` on a free port
    python bench/soak.py --minutes 10 --clients 16 --server-args "--cpu-moe --moe-cache-mib 0"
    python bench/soak.py --url http://127.0.0.1:8080 --minutes 5      # a running server (the GPU reference)

Each of --clients streams loops until the time is up over /v1/completions requests of random token ids (any model
takes them): mixed prompt lengths (some reusing the client's last prompt as a prefix, for cache_prompt), mixed
answer lengths, streamed or not, greedy or sampled. Some requests are cancelled: a stream closed after a few
chunks, a whole answer given up on by a client timeout. Some connections are dropped abruptly (a TCP reset in the
middle of a stream). Every --sample-s the server's resident memory (`process_resident_memory_bytes` on /metrics,
else /proc of the server this script started) and GPU memory (`moestream_gpu_memory_bytes`, when on CUDA) are read.

It passes when, once the clients have stopped: every slot of /slots is idle and /metrics says no request is
running or waiting; the expert pool has no pinned slot (`moestream_pool_pinned_slots`, where there is a cache); no
request failed (any answer but 200 and a 503 queue_full is an error); and resident and GPU memory grew by at most
--max-growth (5%) from the first window to the last (window: a minute, or a third of a shorter soak; the largest
sample of each, so that allocator warm-up in the first window is the baseline). It prints a markdown summary and
exits 1 on failure. Needs httpx (a dependency of openai), as bench/serve_load.py does.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

PROMPT_LENGTHS = (4, 16, 64, 200)         # tokens, chosen at random per request
ANSWER_LENGTHS = (1, 8, 32, 96)
HEADERS: dict[str, str] = {}              # Authorization, with --api-key
# What a client's request does, and how often: read to the end, closed after a few chunks, answered whole, given up
# on after 50 ms (a client timeout), or a TCP reset in the middle of a stream.
KINDS = {"stream": 0.40, "stream, cancelled": 0.10, "whole": 0.40, "whole, given up": 0.05, "reset": 0.05}


@dataclass
class Tally:
    done: int = 0                 # answered in full
    cancelled: int = 0            # closed by the client mid-answer (stream closed, timeout)
    dropped: int = 0              # connection reset by the client mid-stream
    rejected: int = 0             # 503 queue_full: load shedding, not a failure
    errors: list[str] = field(default_factory=list)
    tokens: int = 0               # completion tokens of the requests answered in full (the server's usage)


# --- the server ------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(a, log) -> tuple[subprocess.Popen, str]:
    """`moestream serve` as a subprocess on a free loopback port; waits for /health."""
    port = free_port()
    cmd = [sys.executable, "-m", "moestream", "serve", "-m", a.model, "-np", str(a.np), "-c", str(a.ctx),
           "--port", str(port), "--no-access-log", *a.server_args.split()]
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    end = time.time() + a.start_timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise SystemExit(f"soak: the server exited ({proc.returncode}) before it was ready: {' '.join(cmd)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        time.sleep(0.2)
    stop_server(proc)
    raise SystemExit(f"soak: the server was not ready after {a.start_timeout} s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)            # uvicorn's graceful shutdown
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def metrics(url: str) -> dict[str, float]:
    """/metrics as {name (labels included): value}."""
    out = {}
    for line in httpx.get(url + "/metrics", headers=HEADERS, timeout=30).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


def proc_rss(pid: int) -> float | None:
    with contextlib.suppress(OSError):
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return float(line.split()[1]) * 1024
    return None


# --- the clients -----------------------------------------------------------------------------------------------
def body(rng: random.Random, vocab: int, last: list[int], ctx: int, max_answer: int) -> dict:
    n = rng.choice(PROMPT_LENGTHS)
    prompt = [rng.randrange(vocab) for _ in range(n)]
    if last and rng.random() < 0.3:              # the same prefix again: the slot's KV is reused
        prompt = last[:rng.randrange(1, len(last) + 1)] + prompt
    max_tokens = min(rng.choice(ANSWER_LENGTHS), max_answer, ctx - len(prompt) - 1)
    greedy = rng.random() < 0.5
    return {"prompt": prompt[:ctx // 2], "max_tokens": max(1, max_tokens), "ignore_eos": rng.random() < 0.7,
            "temperature": 0 if greedy else 0.8, "seed": rng.randrange(1 << 30), "top_p": 0.95}


async def streamed(http: httpx.AsyncClient, req: dict, cancel_after: int | None, t: Tally) -> None:
    req = {**req, "stream": True, "stream_options": {"include_usage": True}}
    async with http.stream("POST", "/v1/completions", json=req) as r:
        if r.status_code != 200:
            return await refused(r, t)
        chunks, usage, finished = 0, None, False
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                finished = True
                break
            if not line.startswith("data: "):
                continue
            data = json.loads(line[6:])
            if "error" in data:
                t.errors.append(f"stream error: {data['error'].get('message')}")
                return
            usage = data.get("usage") or usage
            chunks += 1
            if cancel_after is not None and chunks >= cancel_after:
                t.cancelled += 1                 # leaving the block closes the connection mid-stream
                return
        if not finished:
            t.errors.append("stream ended without [DONE]")
            return
        t.done += 1
        t.tokens += usage["completion_tokens"] if usage else 0


async def whole(http: httpx.AsyncClient, req: dict, give_up_s: float | None, t: Tally) -> None:
    try:
        r = await http.post("/v1/completions", json=req, timeout=give_up_s or 300)
    except httpx.TimeoutException:
        if give_up_s is None:
            raise
        t.cancelled += 1                         # the client gave up: its connection closes, the server cancels
        return
    if r.status_code != 200:
        return await refused(r, t)
    t.done += 1
    t.tokens += r.json()["usage"]["completion_tokens"]


async def refused(r: httpx.Response, t: Tally) -> None:
    text = (await r.aread()).decode(errors="replace")
    if r.status_code == 503 and "queue_full" in text:
        t.rejected += 1
    else:
        t.errors.append(f"HTTP {r.status_code}: {text[:200]}")


async def reset_mid_stream(url: str, req: dict, t: Tally) -> None:
    """A raw connection that asks for a stream, reads its first bytes and resets (SO_LINGER 0): no FIN, no goodbye."""
    host, port = urlsplit(url).hostname, urlsplit(url).port or 80
    reader, writer = await asyncio.open_connection(host, port)
    data = json.dumps({**req, "stream": True, "max_tokens": max(req["max_tokens"], 32)}).encode()
    auth = "".join(f"{k}: {v}\r\n" for k, v in HEADERS.items())
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{auth}"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    await writer.drain()
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(reader.read(256), 30)
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
    t.dropped += 1


async def client(i: int, a, url: str, vocab: int, ctx: int, deadline: float, t: Tally) -> None:
    """Requests one after another until the deadline; the first is of kind i (so that even a short soak has every
    kind), the others drawn with KINDS' weights."""
    rng = random.Random(a.seed * 1000 + i)
    last: list[int] = []
    async with httpx.AsyncClient(base_url=url, headers=HEADERS, timeout=300) as http:
        j = 0
        while time.monotonic() < deadline:
            req = body(rng, vocab, last, ctx, a.max_answer)
            last = req["prompt"]
            kind = list(KINDS)[i % len(KINDS)] if j == 0 else rng.choices(list(KINDS), list(KINDS.values()))[0]
            j += 1
            try:
                if kind == "reset":
                    await reset_mid_stream(url, req, t)
                elif kind.startswith("stream"):
                    await streamed(http, req, rng.randrange(1, 4) if kind == "stream, cancelled" else None, t)
                else:
                    await whole(http, req, 0.05 if kind == "whole, given up" else None, t)
            except (httpx.HTTPError, OSError, json.JSONDecodeError, KeyError) as e:
                t.errors.append(f"{kind}: {type(e).__name__}: {e}")


async def sampler(a, url: str, pid: int | None, deadline: float, samples: list, t: Tally) -> None:
    """(seconds, resident bytes, GPU bytes) into samples every --sample-s, until the deadline."""
    t0 = time.monotonic()
    while True:
        try:
            m = await asyncio.to_thread(metrics, url)
        except httpx.HTTPError as e:
            t.errors.append(f"/metrics: {type(e).__name__}: {e}")
            m = {}
        rss = m.get("process_resident_memory_bytes") or (proc_rss(pid) if pid else None)
        samples.append((time.monotonic() - t0, rss, m.get("moestream_gpu_memory_bytes")))
        if time.monotonic() >= deadline:
            return
        await asyncio.sleep(min(a.sample_s, max(0.0, deadline - time.monotonic())))


async def soak(a, url: str, pid: int | None) -> tuple[Tally, list, float]:
    meta = httpx.get(url + "/v1/models", headers=HEADERS, timeout=30).json()["data"][0].get("meta") or {}
    vocab, ctx = meta.get("n_vocab", 1000), meta.get("n_ctx", a.ctx)
    t, samples = Tally(), []
    t0 = time.monotonic()
    deadline = t0 + a.minutes * 60
    await asyncio.gather(sampler(a, url, pid, deadline, samples, t),
                         *(client(i, a, url, vocab, ctx, deadline, t) for i in range(a.clients)))
    return t, samples, time.monotonic() - t0


# --- the checks ------------------------------------------------------------------------------------------------
def settle(url: str, timeout: float) -> tuple[list[dict], dict]:
    """/slots and /metrics once every slot is idle and nothing runs or waits (or the timeout has passed)."""
    end = time.time() + timeout
    while True:
        slots, m = httpx.get(url + "/slots", headers=HEADERS, timeout=30).json(), metrics(url)
        quiet = m.get("moestream_requests_running", 0) == 0 and m.get("moestream_requests_waiting", 0) == 0
        if (quiet and all(s["state"] == "idle" for s in slots)) or time.time() > end:
            return slots, m
        time.sleep(0.2)


def growth(samples: list, col: int, window: float) -> tuple[float, float] | None:
    """(first window's largest, last window's largest) of sample column `col`, None where it was not measured."""
    pts = [(s[0], s[col]) for s in samples if s[col] is not None]         # (seconds, bytes)
    if len(pts) < 2:
        return None
    end = pts[-1][0]
    first = [v for t, v in pts if t <= window] or [pts[0][1]]
    last = [v for t, v in pts if t >= end - window] or [pts[-1][1]]
    return max(first), max(last)


def report(a, t: Tally, samples: list, seconds: float, slots: list[dict], m: dict, gen_tokens: float) -> bool:
    window = min(60.0, a.minutes * 60 / 3)
    checks = []
    busy = [s["id"] for s in slots if s["state"] != "idle"]
    checks.append(("every slot idle", not busy, f"busy: {busy}" if busy else f"{len(slots)} idle"))
    running, waiting = m.get("moestream_requests_running", 0), m.get("moestream_requests_waiting", 0)
    checks.append(("nothing running or waiting", running == waiting == 0, f"{running:.0f} running, {waiting:.0f} waiting"))
    pinned = m.get("moestream_pool_pinned_slots")
    checks.append(("no pinned pool slot", not pinned, "no expert cache" if pinned is None else f"{pinned:.0f} pinned"))
    checks.append(("no failed request", not t.errors, f"{len(t.errors)} errors" + (f", first: {t.errors[0]}"
                                                                                 if t.errors else "")))
    mib = lambda v: f"{v / (1 << 20):.1f} MiB"
    for name, col in (("resident memory", 1), ("GPU memory", 2)):
        g = growth(samples, col, window)
        if g is None:
            if name == "resident memory":
                checks.append((name, False, "not measured"))
            continue
        ok = g[1] <= g[0] * (1 + a.max_growth)
        checks.append((f"{name} grew <= {100 * a.max_growth:.0f}%", ok,
                       f"{mib(g[0])} -> {mib(g[1])} ({100 * (g[1] / g[0] - 1):+.2f}%)"))
    passed = all(ok for _, ok, _ in checks)
    print(f"## soak: {a.clients} clients for {seconds:.0f} s ({'PASS' if passed else 'FAIL'})\n")
    print("| requests done | cancelled | reset mid-stream | rejected (503) | errors | tokens (server) | tok/s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(f"| {t.done} | {t.cancelled} | {t.dropped} | {t.rejected} | {len(t.errors)} | {gen_tokens:.0f} | "
          f"{gen_tokens / seconds:.1f} |\n")
    print("| check | result | value |\n| --- | --- | --- |")
    for name, ok, value in checks:
        print(f"| {name} | {'pass' if ok else 'FAIL'} | {value} |")
    print(f"\n{len(samples)} memory samples, every {a.sample_s:g} s; windows of {window:.0f} s")
    return passed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server to soak (default: start `moestream serve` here)")
    p.add_argument("--minutes", type=float, default=3.0, help="how long the clients run (default 3)")
    p.add_argument("--clients", type=int, default=12, help="concurrent client streams (default 12)")
    p.add_argument("-m", "--model", default="synth:tiny", help="the model of the server started here")
    p.add_argument("-np", type=int, default=8, help="its slots (default 8)")
    p.add_argument("-c", "--ctx", type=int, default=1024, help="its context per slot (default 1024)")
    p.add_argument("--server-args", default="", help="more flags for `moestream serve`, quoted")
    p.add_argument("--max-answer", type=int, default=max(ANSWER_LENGTHS),
                   help=f"longest answer asked for, in tokens (default {max(ANSWER_LENGTHS)}; the clients finish "
                        "their last request after the time is up)")
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between memory samples (default 5)")
    p.add_argument("--max-growth", type=float, default=0.05, help="memory growth allowed, first to last window")
    p.add_argument("--api-key", default=os.environ.get("MOESTREAM_API_KEY"), help="the server's key, if it has one")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds to wait for the server's /health")
    a = p.parse_args(argv)
    if a.minutes <= 0 or a.clients < 1 or a.sample_s <= 0 or a.max_answer < 1:
        p.error("--minutes and --sample-s must be positive, --clients and --max-answer at least 1")
    if a.api_key:
        HEADERS["Authorization"] = f"Bearer {a.api_key}"
    proc = None
    with tempfile.TemporaryFile("w+") as log:
        try:
            if a.url:
                url, pid = a.url.rstrip("/"), None
            else:
                proc, url = start_server(a, log)
                pid = proc.pid
            before = metrics(url).get("moestream_generation_tokens_total", 0.0)
            t, samples, seconds = asyncio.run(soak(a, url, pid))
            slots, m = settle(url, 60)
            passed = report(a, t, samples, seconds, slots, m, m.get("moestream_generation_tokens_total", 0.0) - before)
        finally:
            if proc is not None:
                stop_server(proc)
        if proc is not None and not passed:
            log.seek(0)
            tail = log.read()[-3000:]
            print(f"\nthe server's last output:\n```\n{tail}\n```" if tail.strip() else "")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
