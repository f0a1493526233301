"""What the serving loop (serving.py) works with: its config, a request and its result, a slot and the run of a
request in it.

    cfg = SchedulerConfig(n_slots=4)     # -np, --max-queue, cache_prompt, warm-up, --prefill-interval, delay
    req = Request(prompt_ids, SamplingParams(max_tokens=16), emit=callback)
    slot.run = Run(req, engine, tokenizer, n_cached)  # a request in a slot: its prompt progress and sequence state
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from ..errors import UserError
from .prompt_batch import reached
from .sampling import SamplingParams, make_generator
from .sequence import SequenceState
from .speculate import MTPDecode

_ids = itertools.count(1)


@dataclass(frozen=True)
class SchedulerConfig:
    """How the loop schedules: its slots (-np), the queue behind them, KV reuse, the warm-up, prompt pacing."""
    n_slots: int = 1
    max_queue: int = 64
    cache_prompt: bool = True                 # reuse a slot's KV for the prefix a new prompt shares with its last
    warm_up: bool = True                      # capture the decode graphs of every batch size before serving
    prefill_interval: int = 1                 # while requests generate: a prompt batch after every N decode steps
    delay_factor: float = 0.0                 # while requests generate: a prompt batch waits until its oldest prompt
                                              # has waited F x the last batch's time, or a whole batch waits
    prefill_layers: int | None = None         # while requests generate: a prompt batch runs N layers between two
                                              # decode steps (0: all of them at once; None: 1 with host experts
                                              # where prompts can pause, else 0)
    prompts_first: bool = False               # a turn reads prompts or, once none waits, decodes (nano-vllm's
                                              # order; bench --parallel's phases, llama-batched-bench's)
    count_routing: bool = True                # each slot's expert counts, for /slots (a bench leaves them out)

    def __post_init__(self):
        for name, low in (("n_slots", 1), ("max_queue", 0), ("prefill_interval", 1), ("delay_factor", 0),
                          ("prefill_layers", 0)):
            value = getattr(self, name)
            if value is not None and not low <= value < float("inf"):
                raise UserError(f"{name} must be at least {low}, got {value}")


class QueueFull(Exception):
    """More requests are waiting than --max-queue allows."""


@dataclass(eq=False)
class Request:
    """One completion. `emit(event)` is called on the scheduler thread; it must be thread-safe and quick."""
    prompt: list[int]
    params: SamplingParams
    emit: object                              # callable(event)
    index: int = 0                            # the choice index this request answers
    logprobs: int | None = None               # None: none; n: the chosen token's and the top n
    cache_prompt: bool = True
    stream: bool = False                      # False: only the final event (with every logprob) is emitted
    speculative: bool = True                  # draft with the MTP head where the engine has one (--spec-type)
    draft_n_max: int | None = None            # drafts a step, at most SpecConfig.most (None: the engine's choice;
                                              # 0: none): bench --parallel's list of n-max, one engine
    oracle: object = None                     # fn(position, n) -> n drafts instead of the head's (bench
                                              # --spec-oracle, tools/spec_oracle.py), or None
    first: int | None = None                  # no prompt: the first token, fed by a decode step at position 0
                                              # (bench --parallel -npp 0), and the first of the result's tokens
    id: int = field(default_factory=lambda: next(_ids))
    cancelled: bool = False
    t_submit: float = field(default_factory=time.perf_counter)


@dataclass
class Result:
    token_ids: list[int]
    text: str
    finish_reason: str                        # stop | length | abort (the server stopped)
    stop_reason: str | int | None             # the stop string or stop token that ended it
    prompt_tokens: int
    cached_tokens: int                        # prompt tokens whose KV was reused
    ttft_s: float
    duration_s: float
    logprobs: list = field(default_factory=list)   # (token, logprob, [(id, logprob)] top n) per generated token


class Run:
    """A request in a slot: its prompt progress, its random stream and its sequence state (sequence.py: the stop
    and detokenize rules of generate.Generation)."""

    def __init__(self, req: Request, engine, tokenizer, n_cached: int, seq: int = 0):
        self.req, self.n_cached, self.done = req, n_cached, n_cached     # done: prompt tokens in the KV cache
        self.gen = make_generator(req.params, engine.device.torch)
        self.seq = SequenceState(req.params, tokenizer, engine.cfg.eos_token_ids, len(req.prompt), engine.kv.ctx)
        if req.first is not None:
            self.seq.push(req.first)
        # speculative decoding (runtime/speculate.py), where the engine drafts and the request lets it: not under
        # penalties (they read each token's history on the host), not without a prompt (the head reads its states)
        self.spec = None
        if speculates(engine, req):
            self.spec = MTPDecode(engine, seq, drafts_of(engine, req), req.oracle)
        self.spec_hidden: list = []           # the prompt's post-norm hidden states so far, part by part
        self.lps: list = []                   # logprob entries not yet sent with a piece
        self.all_lps: list = []
        self.t_first = self.t_last = 0.0


class Slot:
    def __init__(self, sid: int):
        self.id = sid
        self.run: Run | None = None
        self.cached: list[int] = []          # tokens whose K/V this slot's sequence holds, from position 0
        self.last_used = 0.0
        self.prompt_tokens = self.generated = self.n_cached = 0
        self.task: int | None = None

    @property
    def state(self) -> str:
        if self.run is None:
            return "idle"
        return "prefill" if self.run.done < len(self.run.req.prompt) else "generating"


class PromptJob:
    """A prompt batch being read: how far each of its sequences gets, its slots and their runs as they were when it
    began (a slot whose request is cancelled meanwhile is not given another until the batch ends: its sequence is
    still being written), and the engine's steps through it (Engine.prompt_steps, or the whole batch at once)."""

    def __init__(self, steps, filling: list[Slot], parts: list[tuple[int, int, list[int]]],
                 hidden: list | None = None):
        """steps: through the batch of `parts` (seq, start, tokens); filling: the slots of prompts being read;
        hidden: the list the steps fill with each part's post-norm hidden states (speculating requests'), or None."""
        self.steps, self.parts, self.hidden = steps, parts, hidden
        self.ends = reached(parts)            # each sequence's (how far its prompt gets, its last part's index)
        self.slots = slots = [s for s in filling if s.id in self.ends]
        self.runs = {s.id: s.run for s in slots}
        self.owner = slots[0].id if len(slots) == 1 else [q for q, _, t in parts for _ in t]   # routing rows
        self.busy_s = 0.0                     # the time its steps took, the decode steps between them not counted

    def advance(self, whole: bool):
        """Run it to its next pause, or to its end (whole): its logits (a list, one (1, V) a part) once it has
        ended, else None."""
        while True:
            try:
                next(self.steps)
            except StopIteration as done:
                return done.value
            if not whole:
                return None


def drafts_of(engine, req: Request) -> int:
    """A request's drafts a step: the engine's choice (Engine.draft_n_max), or the request's own at most what the
    KV cache and the sliding rings were sized for."""
    return engine.draft_n_max if req.draft_n_max is None else min(req.draft_n_max, engine.ecfg.spec.most)


def speculates(engine, req: Request) -> bool:
    """Whether a request's decode drafts: the engine's --spec-type draft-mtp (with drafts), the request's
    `speculative` and drafts a step (drafts_of), no penalties and a prompt."""
    return (engine.ecfg.spec.drafts and req.speculative and not req.params.penalized and req.first is None
            and len(req.prompt) > 0 and drafts_of(engine, req) > 0)


def at_once(fn, *args, **kw):
    """fn(*args, **kw) as steps that do not pause (a PromptJob's steps where its batch runs whole)."""
    return fn(*args, **kw)
    yield                                     # (a generator that returns fn's result)


def history(slots: list[Slot]) -> list[list[int]] | None:
    """Each slot's tokens so far (prompt, then generated), for the penalties; None when no request has one."""
    if not any(s.run.req.params.penalized for s in slots):
        return None
    return [s.run.req.prompt + s.run.seq.ids if s.run.req.params.penalized else [] for s in slots]
