"""`moestream serve`: the OpenAI-compatible server.

    moestream serve -m synth:tiny -np 4 --port 8080
    moestream serve -m model.gguf --cpu-moe -c 8192 -np 8 --api-key "$KEY" --host 0.0.0.0

The server listens at once (/health says 503 until the model is loaded) and binds to loopback unless told otherwise.
Each of the -np slots has a KV cache of the full -c positions (unlike llama-server, which splits -c among slots).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from .. import flags
from ..errors import UserError

log = logging.getLogger("moestream.server")


def add_arguments(p: argparse.ArgumentParser) -> None:
    flags.add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("-np", "--parallel", type=int, default=1, help="slots: requests served at once (default 1)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: $MOESTREAM_API_KEY, else no key)")
    p.add_argument("--alias", default=None, help="the model name the API reports (default: from -m)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 503s (default 64)")
    p.add_argument("--no-cache-prompt", action="store_true",
                   help="do not reuse a slot's KV cache for the prefix a new prompt shares with the previous one")
    p.add_argument("--max-body-mib", type=float, default=8.0, help="largest request body in MiB (default 8)")
    p.set_defaults(func=main)


def main(a: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError:
        raise UserError("the server needs fastapi, uvicorn and prometheus-client: "
                        "pip install fastapi uvicorn prometheus-client") from None
    from ..api import LLM
    from .app import create_app

    if a.parallel < 1:
        raise UserError(f"-np must be at least 1, got {a.parallel}")
    if a.max_queue < 0:
        raise UserError(f"--max-queue must be >= 0, got {a.max_queue}")
    if not 0 < a.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {a.port}")
    key = a.api_key or os.environ.get("MOESTREAM_API_KEY") or None
    name = a.alias or (a.model if a.model.startswith("synth:") else os.path.basename(a.model.rstrip("/")))
    if a.host not in ("127.0.0.1", "localhost", "::1") and key is None:
        log.warning("listening on %s without --api-key: anyone who can reach this port can use the model", a.host)
    failed: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_load_error(e):
        failed.append(e)
        if server is not None:
            server.should_exit = True

    ecfg = flags.to_config(a)                 # bad engine flags fail here, before the server listens
    app = create_app(loader=lambda: LLM(a.model, ecfg, n_seq=a.parallel, progress=False),
                     n_slots=a.parallel, max_queue=a.max_queue, api_key=key, model_name=name,
                     cache_prompt=not a.no_cache_prompt, max_body=int(a.max_body_mib * (1 << 20)),
                     on_load_error=on_load_error)
    config = uvicorn.Config(app, host=a.host, port=a.port, log_level="info" if a.verbose else "warning",
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    print(f"moestream: serving {name} on http://{a.host}:{a.port}/v1 with {a.parallel} slot(s)", file=sys.stderr)
    server.run()
    if failed:
        e = failed[0]
        if isinstance(e, UserError):
            raise e
        raise UserError(f"loading the model failed: {type(e).__name__}: {e}")
    return 0
