"""What the serving loop (serving.py) sends back: each accepted token of a slot's request, as text and logprobs
streamed through the request's `emit`, the request's end (its `Result`), and the slot's release, with the
metrics of each.

    replies = Replies(metrics)                # metrics: the server's (Prometheus), or None
    replies.accept(slot, token, row)          # row: the token's logits (V,); ends the request where it stops it
    replies.finish(slot, "abort")             # ("done", index, Result) with what it has, and frees the slot
"""
from __future__ import annotations

import time

import torch

from .requests import Request, Result, Run, Slot
from .sampling import token_logprobs


class Replies:
    """A request's events and its slot's release, in the loop's thread; `metrics` sees each token and end."""

    def __init__(self, metrics=None):
        self.metrics = metrics

    def accept(self, slot: Slot, token: int, row: torch.Tensor) -> None:
        """One sampled token of a slot's request: its logprobs, its text, and the request's end if it ends it."""
        run = slot.run
        now = time.perf_counter()
        if not run.t_first:
            run.t_first = now
            if self.metrics is not None:
                self.metrics.on_first_token(now - run.req.t_submit)
        elif self.metrics is not None:
            self.metrics.on_token_gap(now - run.t_last)
        run.t_last = now
        seq = run.seq
        if run.req.logprobs is not None and token not in seq.stop_ids:     # a stop token is not in the output
            run.lps.append(token_logprobs(row, token, run.req.logprobs))
            run.all_lps.append(run.lps[-1])
        piece, done = seq.push(token)
        slot.generated = len(seq.ids)
        self._piece(run, piece)
        if done:
            self.finish(slot)

    def _piece(self, run: Run, piece: str) -> None:
        if piece:
            if run.req.stream:
                self.emit(run.req, ("token", run.req.index, piece, run.lps))
            run.lps = []

    def finish(self, slot: Slot, reason: str = "length") -> None:
        """End a slot's request: its held-back text, then ("done", index, Result); the slot is freed."""
        run, seq = slot.run, slot.run.seq
        self._piece(run, seq.finish(reason))  # the held-back text; the reason: push's, else `reason`
        if run.lps and run.req.stream:       # logprobs of tokens whose text was held back, then cut
            self.emit(run.req, ("token", run.req.index, "", run.lps))
        now = time.perf_counter()
        res = Result(seq.ids, seq.text, seq.finish_reason, seq.stop_reason, len(run.req.prompt), run.n_cached,
                     ttft_s=max(run.t_first - run.req.t_submit, 0.0), duration_s=now - run.req.t_submit,
                     logprobs=run.all_lps)
        self.emit(run.req, ("done", run.req.index, res))
        self.free(slot, outcome=seq.finish_reason, result=res)

    def free(self, slot: Slot, outcome: str, result: Result | None = None, valid: int | None = None) -> None:
        """Release a slot; its cached tokens stay reusable (`valid` cuts them, e.g. 0 after a failed forward)."""
        if valid is not None:
            slot.cached = slot.cached[:valid]
        if self.metrics is not None:
            self.metrics.on_finish(outcome, result)
        slot.run, slot.last_used = None, time.perf_counter()

    def emit(self, req: Request, event: tuple) -> None:
        try:
            req.emit(event)
        except Exception:                    # the HTTP side is gone (loop closed): the request is as good as cancelled
            req.cancelled = True

    def abort_all(self, slots: list[Slot], waiting: list[Request]) -> None:
        """At shutdown: end every request now with what it has, finish_reason "abort" (vLLM's word for a request the
        server ended): one in a slot with its tokens so far, one still waiting with none. Each gets its "done" event,
        so that a stream ends with its last chunk and [DONE], and a whole response is still a whole response."""
        for s in slots:
            if s.run is not None:
                self.finish(s, "abort")
        now = time.perf_counter()
        for r in waiting:
            self.emit(r, ("done", r.index, Result([], "", "abort", None, len(r.prompt), 0, 0.0, now - r.t_submit)))
