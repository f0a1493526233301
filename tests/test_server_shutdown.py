"""`moestream serve` stopped while it serves (SIGTERM, as a service manager stops it; Ctrl-C's SIGINT takes the same
handler): every request in flight ends at once with finish_reason "abort", a stream with its last chunk and [DONE],
a whole response whole; the process exits 0, with no traceback. A real process: the signal handling is uvicorn's and
ours, in the main thread."""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from moestream.server.cli import SHUTDOWN_GRACE_S  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# Past the server's grace period, the interpreter's own teardown (torch's modules, the model's objects): under a
# second on an idle machine, 4.6 s measured on 2 cores at a load of 11.
TEARDOWN_S = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def events(lines) -> list:
    """The data of an SSE stream's events: JSON objects, and "[DONE]"."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_sigterm_during_a_stream_ends_it_with_a_last_chunk_and_done_and_exits_0():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "moestream", "serve", "-m", "synth:tiny", "--port", str(port),
                             "-c", "4096", "-np", "2", "--no-warmup"], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE, text=True)
    try:
        end = time.time() + 120
        while time.time() < end and proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail(f"the server did not come up: rc {proc.poll()}")
        # Two requests of thousands of tokens: a stream and a whole one, both generating when the signal comes.
        body = {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            whole = pool.submit(httpx.post, url + "/v1/completions", json={**body, "return_token_ids": True},
                                timeout=60)
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                lines = r.iter_lines()
                first = events([next(lines)])
                until = time.time() + 60
                while time.time() < until:
                    slots = httpx.get(url + "/slots", timeout=30).json()
                    if [s["state"] for s in slots] == ["generating"] * 2:
                        break
                    time.sleep(0.05)
                else:
                    pytest.fail(f"both requests should be generating: {slots}")
                t0 = time.time()
                proc.send_signal(signal.SIGTERM)
                rest = events(lines)
                ended = time.time() - t0
            answer = whole.result(timeout=60)
        rc = proc.wait(SHUTDOWN_GRACE_S + TEARDOWN_S)
        exited = time.time() - t0
        stderr = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert first[0]["choices"][0]["finish_reason"] is None
    assert rest[-1] == "[DONE]" and rest[-2]["choices"][0]["finish_reason"] == "abort", rest[-3:]
    assert all(e["choices"][0]["finish_reason"] is None for e in rest[:-2])
    assert ended < SHUTDOWN_GRACE_S, f"the stream ended {ended:.1f} s after the signal"
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < 3000
    assert answer.json()["usage"]["completion_tokens"] == len(choice["token_ids"])
    assert rc == 0, stderr
    assert exited < SHUTDOWN_GRACE_S + TEARDOWN_S
    assert "Traceback" not in stderr and "CancelledError" not in stderr, stderr
    assert "graceful shutdown exceeded" not in stderr, stderr


def test_guard_once_shutdown_begins_refuses_new_requests_and_a_cut_off_answer_is_one_line(caplog):
    """What GracefulServer relies on, without a server: begin_shutdown calls the app's hook and answers 503 from then
    on; a response uvicorn cancels after the grace period ends quietly, while any other cancellation goes through."""
    import asyncio

    from moestream.server.guard import Guard

    async def forever(scope, receive, send):            # a stream whose forward outlasts the grace period
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await asyncio.Event().wait()

    told = []
    guard = Guard(forever, on_shutdown=lambda: told.append(True))
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def run():
        sent = []

        async def send(msg):
            sent.append(msg)

        before = asyncio.create_task(guard(scope, receive, send))
        running = asyncio.create_task(guard(scope, receive, send))
        await asyncio.sleep(0.05)
        before.cancel()                                  # not shutting down: a cancellation stays one
        with pytest.raises(asyncio.CancelledError):
            await before
        guard.begin_shutdown()
        late = []

        async def send_late(msg):
            late.append(msg)

        await guard(scope, receive, send_late)
        running.cancel()
        await running                                    # quiet: no CancelledError
        return late

    late = asyncio.run(run())
    assert told == [True]
    assert late[0]["status"] == 503 and json.loads(late[1]["body"])["error"]["code"] == "shutting_down"
    assert [r.getMessage() for r in caplog.records if r.name == "moestream.server"] == \
        ["shutdown: POST /v1/completions cut off after the grace period"]


def test_an_openai_client_reads_the_aborted_stream_to_its_end():
    """In-process (serving.Server: GracefulServer in a thread, stopped with should_exit): the official client takes
    the "abort" chunk and [DONE] as the end of its stream, without an error."""
    openai = pytest.importorskip("openai")
    from moestream import LLM
    from moestream.server.app import create_app
    from serving import Server

    srv = Server(create_app(llm=LLM("synth:tiny", ctx_size=4096), n_slots=1, model_name="tiny"))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=3000, stream=True, extra_body={"ignore_eos": True})
        chunks = [next(stream), next(stream)]
        srv.server.should_exit = True
        chunks += list(stream)
    finally:
        srv.stop()
    assert not srv.thread.is_alive()
    assert [c.choices[0].finish_reason for c in chunks][-1] == "abort" and len(chunks) < 3000
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
