"""The server's scheduler: one thread owns the engine and turns the serving loop (serving.py) while requests wait
or run; the HTTP side submits requests and snapshots from its own threads.

    sched = Scheduler(llm, SchedulerConfig(n_slots=4))      # llm built with n_seq=4 (or Scheduler(llm, n_slots=4))
    sched.start()
    sched.submit([Request(prompt_ids, SamplingParams(max_tokens=16), emit=callback)])   # QueueFull when full
    ...                                      # emit(("token", ...)) if streaming, then ("done", ...) or ("error", ...)
    sched.call(sched.slots_info).result()    # a snapshot, taken between two forwards
    sched.stop()

One thread turn: run queued calls (snapshots for /slots and /metrics), then one turn of the loop (ServingLoop.step).
"""
from __future__ import annotations

import collections
import threading
from concurrent.futures import Future

import torch

from .requests import QueueFull, Request, SchedulerConfig
from .serving import ServingLoop

__all__ = ["QueueFull", "Request", "Scheduler", "SchedulerConfig"]


class Scheduler(ServingLoop):
    def __init__(self, llm, cfg: SchedulerConfig | None = None, metrics=None, **kw):
        super().__init__(llm.engine, llm.tokenizer, cfg, metrics, **kw)
        self.llm = llm
        self._calls: list[tuple[object, Future]] = []
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="moestream-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def call(self, fn) -> Future:
        """Run fn() on the scheduler thread between two forwards (it owns the engine); its result as a Future."""
        fut: Future = Future()
        with self._cv:
            if self._stopping:
                fut.set_exception(RuntimeError("the scheduler has stopped"))
            else:
                self._calls.append((fn, fut))
                self._cv.notify()
        return fut

    # --- the scheduler thread ------------------------------------------------------------------------------------
    def _loop(self) -> None:
        if self.engine.device.is_cuda:       # a new thread's current device is cuda:0 whatever the engine's
            torch.cuda.set_device(self.engine.device.torch)
        self.warm_up_decode()
        while True:
            with self._cv:
                while not (self._stopping or self.pending or self._calls or self.n_running):
                    self._cv.wait()
                if self._stopping:
                    break
                calls, self._calls = self._calls, []
            for fn, fut in calls:
                if not fut.set_running_or_notify_cancel():   # its caller gave up waiting
                    continue
                try:
                    fut.set_result(fn())
                except Exception as e:           # a failed snapshot must not stop the loop
                    fut.set_exception(e)
            self.step()
        self._shutdown()

    def _shutdown(self) -> None:
        with self._cv:
            waiting, self.pending = list(self.pending), collections.deque()
            calls, self._calls = self._calls, []
        self._abort_all(waiting)
        for _, fut in calls:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(RuntimeError("the scheduler has stopped"))
