"""The ASGI layer in front of the routes: the API key and the body size limit, both checked before any parsing; what
every answer is seen for: an error counted by kind, an access-log line; and the server's shutdown.

    app = Guard(fastapi_app, api_key="sk-...", max_body=8 << 20, public={"/health"},
                on_error=metrics.on_http_error, access_log=True, on_shutdown=state.begin_shutdown)
    GracefulServer(uvicorn.Config(app, timeout_graceful_shutdown=5)).run()

A request body is read whole, up to max_body bytes, before the app sees it (413 past it, whether the client sent a
Content-Length or chunks), then replayed to the app; after the body, `receive` is the server's own again, so that
the routes still hear a client's disconnect.

uvicorn alone stops badly for a server of long streams: it waits for every open response up to its grace period,
then cancels them (a traceback each, and streams cut without a finish_reason or [DONE]), and only then tells the app
(lifespan). GracefulServer tells the Guard first (begin_shutdown: new requests 503, and on_shutdown ends the open
ones), then runs uvicorn's shutdown, which now has only to let those last answers go out.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import threading
import time

import uvicorn

from .schemas import error_body

access = logging.getLogger("moestream.access")
log = logging.getLogger("moestream.server")


class Guard:
    def __init__(self, app, api_key: str | None = None, max_body: int = 8 << 20, public=frozenset({"/health"}),
                 on_error=None, access_log: bool = False, on_shutdown=None):
        self.app, self.max_body, self.public = app, max_body, frozenset(public)
        self.key = api_key.encode() if api_key else None
        self.on_error, self.access_log, self.on_shutdown = on_error, access_log, on_shutdown
        self.closing = False

    def begin_shutdown(self) -> None:
        """From now on every request is answered 503; on_shutdown() ends the ones in flight."""
        self.closing = True
        if self.on_shutdown is not None:
            self.on_shutdown()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, seen = time.perf_counter(), {"status": 0, "kind": None}

        async def watch(msg):
            if msg["type"] == "http.response.start":
                seen["status"] = msg["status"]
            elif msg["type"] == "http.response.body" and seen["status"] >= 400 and seen["kind"] is None:
                seen["kind"] = _kind(msg.get("body", b""))
            await send(msg)
        try:
            await self._guarded(scope, receive, watch)
        except asyncio.CancelledError:
            if not self.closing:
                raise
            # uvicorn cancels what still runs when its grace period ends (a forward longer than that): one line
            log.warning("shutdown: %s %s cut off after the grace period", scope.get("method"), scope["path"])
        finally:
            status = seen["status"]
            if status >= 400 and status != 499 and self.on_error is not None:     # 499: nobody is listening
                self.on_error(status, seen["kind"] or str(status))
            if self.access_log:
                client = scope.get("client") or ("-", 0)
                access.info('%s "%s %s" %s %.1f ms', client[0], scope.get("method"), scope["path"], status or "-",
                            (time.perf_counter() - t0) * 1e3)

    async def _guarded(self, scope, receive, send):
        if self.closing:
            return await _reply(send, 503, error_body("the server is shutting down", "unavailable_error",
                                                      code="shutting_down"))
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        if self.key is not None and scope["path"] not in self.public and not self._authorized(headers):
            return await _reply(send, 401, error_body("invalid or missing API key (Authorization: Bearer KEY)",
                                                      "authentication_error", code="invalid_api_key"))
        length = headers.get("content-length", b"")
        try:
            declared = int(length) if length else 0
        except ValueError:
            return await _reply(send, 400, error_body("malformed Content-Length header"))
        if declared > self.max_body:
            return await _reply(send, 413, self._too_large())
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            size += len(body)
            if size > self.max_body:
                return await _reply(send, 413, self._too_large())
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    def _authorized(self, headers: dict) -> bool:
        auth = headers.get("authorization", b"")
        token = auth[7:].strip() if auth[:7].lower() == b"bearer " else headers.get("x-api-key", b"")
        # compare_digest: the time taken does not tell how much of a guessed key was right.
        return hmac.compare_digest(token, self.key)

    def _too_large(self) -> dict:
        return error_body(f"request body too large (limit {self.max_body} bytes)", "invalid_request_error",
                          code="request_too_large")


def _kind(body: bytes) -> str | None:
    """An error answer's kind: its code, else its type (OpenAI's shape); None for a body of another shape."""
    try:
        err = json.loads(body)["error"]
        return str(err.get("code") or err.get("type"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


async def _reply(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})


class GracefulServer(uvicorn.Server):
    """uvicorn's server in front of a Guard (config.app), stopping as the module's docstring says: on SIGTERM, Ctrl-C
    or should_exit, Guard.begin_shutdown first, then uvicorn's shutdown (its sockets closed, up to
    timeout_graceful_shutdown for the last answers). A second Ctrl-C quits at once, as in uvicorn."""

    async def shutdown(self, sockets=None) -> None:
        self.config.app.begin_shutdown()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's handlers, without raising the signal again once the server has stopped (uvicorn does, so that a
        process stopped with SIGTERM dies of it, rc 143): a server that stopped as asked exits 0."""
        if threading.current_thread() is not threading.main_thread():     # (only the main thread gets signals)
            yield
            return
        before = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)
