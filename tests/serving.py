"""A shared test driver: the OpenAI-compatible server on a loopback port (uvicorn in a thread), its helpers, and
what the server's test modules make their fixtures of (alone, served)."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import uvicorn

from moestream import LLM
from moestream.server.app import create_app
from moestream.server.guard import GracefulServer

CTX = 256
PROMPTS = ["Once upon a time", "The river runs past the old mill", "Numbers, dates and prices",
           "She opened the window", "Winter came early that year", "A mixture of experts is"]


class Server:
    """uvicorn in a background thread, on a socket bound here (so the port is known and never raced for)."""

    def __init__(self, app):
        self.app = app
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = "http://127.0.0.1:%d" % sock.getsockname()[1]
        self.server = GracefulServer(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


def tiny_server() -> Server:
    """synth:tiny served with 4 slots, a queue of 8, two names, a 1 MiB body limit and the access log on."""
    return Server(create_app(llm=LLM("synth:tiny", ctx_size=CTX, n_seq=4), n_slots=4, max_queue=8,
                             model_name=["tiny", "tiny-alias"], max_body=1 << 20, access_log=True))


def post(srv, path, body, **kw):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(srv.url + path, content=data, headers={"Content-Type": "application/json"}, timeout=30, **kw)


def wait_idle(srv, timeout=10.0) -> list[dict]:
    end = time.time() + timeout
    while True:
        slots = httpx.get(srv.url + "/slots").json()
        if all(s["state"] == "idle" for s in slots) or time.time() > end:
            return slots
        time.sleep(0.02)


def metric(srv, name: str, *labels: str) -> float:
    """The value of metric `name` on the line holding every one of `labels` (e.g. 'kind="model_not_found"')."""
    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        if (line.startswith(name + " ") or line.startswith(name + "{")) and all(l in line for l in labels):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def alone() -> LLM:
    """synth:tiny run alone: what every served greedy output must equal (a module's `ref` fixture)."""
    return LLM("synth:tiny", ctx_size=CTX)


def served():
    """tiny_server() for the length of a module (its `srv` fixture)."""
    s = tiny_server()
    yield s
    s.stop()
