"""The HTTP side: FastAPI routes of the OpenAI-compatible API, llama-server's /tokenize, /detokenize and /slots,
Prometheus /metrics and /health.

    app = create_app(loader=lambda: LLM("synth:tiny", n_seq=4), n_slots=4)    # loads in the background
    uvicorn.run(app, host="127.0.0.1", port=8080)

Requests are tokenized (prompts.py) and handed to the scheduler thread (runtime/scheduler.py), which owns the engine; its events
come back through the event loop (call_soon_threadsafe) into one asyncio.Queue per HTTP request. A client that goes
away cancels its requests: the scheduler frees their slots before its next forward.

Shutdown (SIGTERM, Ctrl-C: guard.GracefulServer) begins with State.begin_shutdown: new requests are refused (503),
and the scheduler ends every request in flight after its current forward, with what it has and finish_reason
"abort", so that each stream gets its last chunk and [DONE] and each whole response is sent, before uvicorn closes.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from ..errors import UserError
from ..runtime.scheduler import QueueFull, Request, Scheduler, SchedulerConfig
from . import openai_format as fmt
from .guard import Guard
from .harmony import is_harmony
from .metrics import CONTENT_TYPE, ServerMetrics, engine_snapshot
from .prompts import chat_prompt, check_ids, encode, params, tokenizer
from .schemas import (ApiError, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, error_body,
                      validation_message)

log = logging.getLogger("moestream.server")


def _shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", "unavailable_error", code="shutting_down")


class State:
    """What the routes share: the model once loaded, its scheduler, the metrics."""

    def __init__(self, sched: SchedulerConfig, model_names: list[str]):
        self.sched, self.n_slots, self.max_queue = sched, sched.n_slots, sched.max_queue
        self.model_names = model_names
        self.llm = self.scheduler = None
        self.load_error: str | None = None
        self.stopping = False
        self.metrics = ServerMetrics()
        self.created = int(time.time())

    def start(self, llm) -> None:
        if self.stopping:                    # loaded after the server began to stop: nothing to serve
            return
        self.scheduler = Scheduler(llm, self.sched, self.metrics)
        self.metrics.set_queue_sizes(self.n_slots, lambda: (self.scheduler.n_running, self.scheduler.n_waiting))
        self.scheduler.start()
        self.llm = llm                       # last: /health says ready only once the scheduler runs

    def begin_shutdown(self) -> None:
        """The server begins to stop: every request in flight ends after the scheduler's current forward (finish_reason
        "abort"); lifespan's end then waits for its thread."""
        self.stopping = True
        if self.scheduler is not None:
            self.scheduler.stop(timeout=0)   # (asks; does not wait here, on the event loop)

    def ready(self):
        if self.llm is None:
            raise ApiError(503, self.load_error or "Loading model", "unavailable_error", code="model_loading",
                           headers={"Retry-After": "5"})
        return self.llm, self.scheduler

    def model_for(self, body) -> str:
        """The name to answer with: the one the request asked for, which must be one of ours (vLLM's 404)."""
        if body.model is None:
            return self.model_names[0]
        if body.model not in self.model_names:
            raise ApiError(404, f"The model `{body.model}` does not exist; this server serves "
                                f"{', '.join(repr(n) for n in self.model_names)}", "not_found_error", param="model",
                           code="model_not_found")
        return body.model


def create_app(llm=None, *, loader=None, sched: SchedulerConfig | None = None, api_key: str | None = None,
               model_name: str | list[str] = "moestream", max_body: int = 8 << 20, on_load_error=None,
               access_log: bool = False, **sched_fields):
    """An ASGI app. Give a loaded `llm` (built with n_seq >= n_slots), or a `loader()` run in a thread at startup.
    sched: the scheduler's SchedulerConfig, or its fields as keywords (n_slots=4, max_queue=8, ...).
    model_name: the name requests must ask for, or several (aliases; the first is the one /v1/models lists first).
    access_log: one line per request on the "moestream.access" logger."""
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    st = State(sched if sched is not None else SchedulerConfig(**sched_fields), names)

    def load():
        try:
            st.start(loader())
        except Exception as e:               # the server stays up to say why (/health), and the CLI exits
            st.load_error = f"loading the model failed: {e}"
            if on_load_error is not None:
                on_load_error(e)             # the CLI prints it and exits
            else:
                log.error("%s", st.load_error, exc_info=not isinstance(e, UserError))

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        if llm is not None:
            st.start(llm)
        else:
            threading.Thread(target=load, name="moestream-loader", daemon=True).start()
        yield
        if st.scheduler is not None:
            await run_in_threadpool(st.scheduler.stop)

    app = FastAPI(title="moestream", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server for Mixture-of-Experts models with experts in host memory")
    app.state.moestream = st
    _add_error_handlers(app)

    @app.get("/health")
    async def health():
        if st.llm is None:
            raise ApiError(500 if st.load_error else 503, st.load_error or "Loading model", "unavailable_error",
                           headers=None if st.load_error else {"Retry-After": "5"})
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        meta = {}
        if st.llm is not None:
            c = st.llm.model_config
            meta = {"n_ctx": st.llm.engine.kv.ctx, "n_vocab": c.vocab_size, "n_layers": c.n_layers,
                    "n_experts": c.n_experts, "n_experts_used": c.n_experts_used, "family": c.family}
        return {"object": "list", "data": [{"id": name, "object": "model", "created": st.created,
                                            "owned_by": "moestream", "meta": meta} for name in st.model_names]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: HttpRequest):
        llm, _ = st.ready()
        st.model_for(body)
        texts = body.prompts()
        prompts = [await run_in_threadpool(encode, llm, p) for p in texts]
        echo = [p if isinstance(p, str) else fmt.detok(llm.tokenizer, ids) for p, ids in zip(texts, prompts)] \
            if body.echo else None
        return await _serve(st, request, body, prompts, "text", echo=echo, default_max=16)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: HttpRequest):
        llm, _ = st.ready()
        st.model_for(body)
        if llm.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer, so no chat template: use /v1/completions with "
                                "token ids (prompt: [1, 2, 3])", param="messages")
        prompt = await run_in_threadpool(chat_prompt, llm, body)
        return await _serve(st, request, body, [prompt], "chat", default_max=None)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        llm, _ = st.ready()
        tok = tokenizer(llm)
        ids = await run_in_threadpool(tok.encode, body.content, body.add_special)
        if body.with_pieces:
            return {"tokens": [{"id": i, "piece": tok.token_to_piece(i)} for i in ids]}
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        llm, _ = st.ready()
        tok = tokenizer(llm)
        check_ids(llm, body.tokens, "tokens")
        return {"content": await run_in_threadpool(tok.decode, body.tokens)}

    @app.get("/slots")
    async def slots():
        _, sched = st.ready()
        try:
            return await asyncio.wait_for(asyncio.wrap_future(sched.call(sched.slots_info)), 60)
        except RuntimeError:
            if st.stopping:                  # the scheduler stopped before it ran the call
                raise _shutting_down() from None
            raise

    @app.get("/metrics")
    async def metrics():
        if st.llm is not None:
            try:                             # the engine's counters, read on the thread that owns the engine
                stats = await asyncio.wait_for(asyncio.wrap_future(st.scheduler.call(
                    lambda: engine_snapshot(st.llm))), 2)
                st.metrics.set_engine_stats(stats)
            except Exception as e:           # a busy or failing engine: serve the last counters read
                log.warning("metrics: engine stats unavailable (%s)", type(e).__name__)
        return Response(st.metrics.render(), media_type=CONTENT_TYPE)

    return Guard(app, api_key=api_key, max_body=max_body, on_error=st.metrics.on_http_error, access_log=access_log,
                 on_shutdown=st.begin_shutdown)


# --- serving one completion request ------------------------------------------------------------------------------
async def _serve(st: State, http: HttpRequest, body, prompts: list[list[int]], kind: str, echo=None,
                 default_max: int | None = 16):
    llm, sched = st.ready()
    if body.stop_token_ids:
        check_ids(llm, body.stop_token_ids, "stop_token_ids")
    n_logprobs = fmt.logprobs_wanted(body, kind)
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()

    def emit(event):                         # on the scheduler thread
        loop.call_soon_threadsafe(queue.put_nowait, event)

    reqs = []
    for ids in prompts:                      # choice i is prompt i // n, sample i % n (OpenAI's order)
        for _ in range(body.n):
            i = len(reqs)
            reqs.append(Request(ids, params(llm, body, len(ids), default_max, i), emit, index=i,
                                logprobs=n_logprobs, cache_prompt=body.cache_prompt, stream=body.stream,
                                speculative=body.speculative))
    if len(reqs) > st.max_queue + st.n_slots:     # could never be queued whole: the request's fault, not load
        raise ApiError(400, f"{len(reqs)} choices (prompts x n) in one request, but this server takes at most "
                            f"{st.max_queue + st.n_slots} at once (-np + --max-queue)", param="n")
    try:
        sched.submit(reqs)
    except QueueFull as e:
        if st.stopping:
            raise _shutting_down() from None
        st.metrics.on_rejected()
        raise ApiError(503, f"server busy: {e}; retry later", "server_error", code="queue_full",
                       headers={"Retry-After": "1"}) from None
    out = fmt.Formatter(kind, st.model_for(body), llm.tokenizer, body, prompts, echo, is_harmony(llm.tokenizer))
    if body.stream:
        return StreamingResponse(_stream(sched, reqs, queue, out), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _collect(sched, http, reqs, queue, out)


async def _stream(sched, reqs, queue, out):
    left = {r.index: r for r in reqs}
    try:
        for chunk in out.start():
            yield fmt.sse(chunk)
        while left:
            ev = await queue.get()
            if ev[0] == "error":
                yield fmt.sse(error_body(ev[3], "server_error" if ev[2] >= 500 else "invalid_request_error"))
                return
            if ev[0] == "done":
                left.pop(ev[1], None)
            for chunk in out.event(ev):
                yield fmt.sse(chunk)
        if out.include_usage:
            yield fmt.sse(out.usage_chunk())
        yield "data: [DONE]\n\n"
    finally:                                 # the client went away, or an error: free the other slots too
        for r in left.values():
            sched.cancel(r)


async def _collect(sched, http: HttpRequest, reqs, queue, out):
    left = {r.index: r for r in reqs}
    gone = asyncio.create_task(_disconnected(http))
    try:
        while left:
            get = asyncio.create_task(queue.get())
            done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                return Response(status_code=499)         # nobody reads this: the client has gone
            ev = get.result()
            if ev[0] == "error":
                raise ApiError(ev[2], ev[3], "server_error" if ev[2] >= 500 else "invalid_request_error")
            if ev[0] == "done":
                left.pop(ev[1], None)
                out.event(ev)
        return out.response()
    finally:
        gone.cancel()
        for r in left.values():
            sched.cancel(r)


async def _disconnected(http: HttpRequest) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


# --- errors in OpenAI's shape --------------------------------------------------------------------------------------
def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_req, e: ApiError):
        return JSONResponse(e.body, status_code=e.status, headers=e.headers)

    @app.exception_handler(UserError)
    async def user_error(_req, e: UserError):
        return JSONResponse(error_body(str(e)), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def invalid(_req, e: RequestValidationError):
        errs = e.errors()
        message, param, code = validation_message(errs[0] if errs else {"loc": (), "msg": "invalid request"})
        return JSONResponse(error_body(message, param=param, code=code), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_req, e: HTTPException):
        kind = {401: "authentication_error", 404: "not_found_error"}.get(e.status_code, "invalid_request_error")
        return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def crash(_req, e: Exception):
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"), status_code=500)


