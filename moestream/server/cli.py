"""`moestream serve`: the OpenAI-compatible server.

    moestream serve -m synth:tiny -np 4 --port 8080
    moestream serve -m model.gguf --cpu-moe -c 8192 -np 8 --api-key "$KEY" --host 0.0.0.0

The server listens at once (/health says 503 until the model is loaded) and binds to loopback unless told otherwise.
Each of the -np slots has a KV cache of the full -c positions (unlike llama-server, which splits -c among slots).
SIGTERM or Ctrl-C stops it (guard.GracefulServer): every request in flight ends at once with what it has generated,
finish_reason "abort" (streams with [DONE]), within a grace period of SHUTDOWN_GRACE_S; the process exits 0.
"""
from __future__ import annotations

import argparse
import errno
import logging
import os
import socket
import sys

from .. import compat, flags
from ..errors import UserError

log = logging.getLogger("moestream.server")
# The prompt tokens a prompt batch takes with host experts (-b), where the user gives none: llama-server's 2048 cuts
# a round of 8 clients' 512-token prompts into two batches, each a sweep of the pool, the second read while the
# first generate. 8192 is vLLM's online-serving budget; on an H100 it gave +25% tok/s at 8 clients and +30% at 16,
# with TTFT p50 a quarter (bench/RESULTS.md, stop 34). All on the GPU a batch is one ubatch's worth either way.
SERVE_BATCH = 8192
# How long a shutdown waits for the answers in flight to go out: they end after the forward running then (a decode
# step, or a prompt batch's layers); one still running after it is cut off (one line on stderr).
SHUTDOWN_GRACE_S = 5


def add_arguments(p: argparse.ArgumentParser) -> None:
    flags.add_engine_arguments(p, batch_size=dict(
        default=SERVE_BATCH, help=f"the prompt tokens one prompt batch reads with host experts (default "
                                  f"{SERVE_BATCH}; all on the GPU one ubatch's worth)"))
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("-np", "--parallel", type=int, default=1, help="slots: requests served at once (default 1)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $MOESTREAM_API_KEY, else no key)")
    p.add_argument("-a", "--alias", default=None, help="the model name the API reports (default: from -m)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the names requests may ask for (vLLM's flag; the first is the one reported); another "
                        "name is answered 404 model_not_found")
    p.add_argument("--no-access-log", action="store_true", help="no line on stderr per request")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 503s (default 64)")
    p.add_argument("--no-cache-prompt", action="store_true",
                   help="do not reuse a slot's KV cache for the prefix a new prompt shares with the previous one")
    p.add_argument("--prefill-interval", type=int, default=1, metavar="N",
                   help="while requests are generating, read a prompt batch (-b tokens) only after every N decode "
                        "steps, so that prompts delay at most 1 in N of their tokens (default 1: one each step)")
    p.add_argument("--scheduler-delay-factor", type=float, default=0.0, metavar="F",
                   help="while requests are generating, hold a prompt batch until its oldest prompt has waited F "
                        "times the last batch's time, or a whole batch waits (vLLM's flag): prompts arriving a few "
                        "steps apart share one batch, with host experts one pass of the pool (default 0: no wait)")
    p.add_argument("--prefill-layers", type=int, default=None, metavar="N",
                   help="while requests are generating, read a prompt batch N layers at a time, one decode step of "
                        "theirs between (so a long prompt delays their next token by N layers' work, not by the "
                        "whole batch's; their prompts' first tokens come later); only with an expert cache or all "
                        "on the GPU; 0: whole batches (default: 1 with host experts and a cache, else 0)")
    p.add_argument("--max-body-mib", type=float, default=8.0, help="largest request body in MiB (default 8)")
    compat.add_arguments(p, "serve")
    p.set_defaults(func=main)


def model_names(a: argparse.Namespace) -> list[str]:
    """The names requests may ask for: --served-model-name's, else --alias, else -m's (its last part for a path,
    and the path as given, as vLLM takes it)."""
    if a.served_model_name:
        return list(dict.fromkeys(a.served_model_name))
    if a.alias:
        return [a.alias]
    base = a.model if a.model.startswith("synth:") else os.path.basename(a.model.rstrip("/"))
    return list(dict.fromkeys([base, a.model]))


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port, or a one-line UserError (the port is taken, the address is not this machine's)."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise UserError(f"--host {host!r}: cannot resolve it ({e.strerror})") from None
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(info[4])
    except OSError as e:
        sock.close()
        why = "another process is listening there; choose another --port" if e.errno == errno.EADDRINUSE else e.strerror
        raise UserError(f"cannot listen on {host}:{port}: {why}") from None
    return sock


def main(a: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError:
        raise UserError("the server needs fastapi, uvicorn and prometheus-client: "
                        "pip install fastapi uvicorn prometheus-client") from None
    from .app import create_app
    from ..runtime.requests import SchedulerConfig
    from .guard import GracefulServer

    if a.parallel < 1:
        raise UserError(f"-np must be at least 1, got {a.parallel}")
    if a.max_queue < 0:
        raise UserError(f"--max-queue must be >= 0, got {a.max_queue}")
    if a.prefill_interval < 1:
        raise UserError(f"--prefill-interval must be at least 1, got {a.prefill_interval}")
    if a.prefill_layers is not None and a.prefill_layers < 0:
        raise UserError(f"--prefill-layers must be at least 0, got {a.prefill_layers}")
    if not 0 <= a.scheduler_delay_factor < float("inf"):
        raise UserError(f"--scheduler-delay-factor must be a number >= 0, got {a.scheduler_delay_factor}")
    if not 0 < a.max_body_mib < float("inf"):
        raise UserError(f"--max-body-mib must be a positive number of MiB (default 8), got {a.max_body_mib}")
    if not 0 < a.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {a.port}")
    key = a.api_key or os.environ.get("MOESTREAM_API_KEY") or None
    names = model_names(a)
    name = names[0]
    if a.host not in ("127.0.0.1", "localhost", "::1") and key is None:
        log.warning("listening on %s without --api-key: anyone who can reach this port can use the model", a.host)
    failed: list[BaseException] = []
    server: GracefulServer | None = None

    def on_load_error(e):
        failed.append(e)
        if server is not None:
            server.should_exit = True

    ecfg = flags.to_config(a)                 # bad engine flags fail here, before the server listens
    if a.chat_template:
        compat.read_chat_template(a.chat_template)     # a bad file fails now, not after the load
    sock = listen(a.host, a.port)             # a port in use fails now, not after the load
    if not a.no_access_log:
        logging.getLogger("moestream.access").setLevel(logging.INFO)
    from ..cli import load_model
    app = create_app(loader=lambda: load_model(a, ecfg, progress=False, n_seq=a.parallel),
                     sched=SchedulerConfig(a.parallel, a.max_queue, not a.no_cache_prompt, not a.no_warmup,
                                           a.prefill_interval, a.scheduler_delay_factor, a.prefill_layers),
                     api_key=key, model_name=names, max_body=int(a.max_body_mib * (1 << 20)),
                     on_load_error=on_load_error, access_log=not a.no_access_log)
    config = uvicorn.Config(app, log_level="info" if a.verbose else "warning", access_log=False,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    server = GracefulServer(config)
    print(f"moestream: serving {name} on http://{a.host}:{a.port}/v1 with {a.parallel} slot(s)", file=sys.stderr)
    server.run(sockets=[sock])
    if failed:
        e = failed[0]
        if isinstance(e, UserError):
            raise e
        raise UserError(f"loading the model failed: {type(e).__name__}: {e}")
    return 0
