"""The serving loop: up to N requests at once, one slot (KV sequence) each, one turn at a time (nano-vllm's
LLMEngine.step: schedule, run, postprocess). The server (scheduler.py runs it on a thread), `LLM.generate` of a
list of prompts and `bench --parallel` all drive it.

    loop = ServingLoop(engine, tokenizer, SchedulerConfig(n_slots=4))   # the engine built with n_seq >= 4
    loop.submit([Request(prompt_ids, SamplingParams(max_tokens=16), emit=callback)])   # QueueFull when full
    while loop.busy:                          # emit(("token", ...)) if streaming, then ("done", ...) or ("error", ...)
        loop.step()

One turn: drop cancelled requests, give waiting requests to idle slots, run ONE prompt batch (or its next N layers),
then ONE decode step of every slot that is generating, batched into one forward (`engine.decode([(seq, token, pos),
...])`) so that the experts uploaded for that step serve every request in it (with prompts_first, a turn that reads
prompts decodes nothing: bench --parallel times the two phases apart).

A prompt batch is llama-server's: up to -b tokens of the prompts being read, oldest request first, each cut into
ubatches (-ub) from where its slot stands (`engine.prefill_parts`). With host experts the batch runs layer by layer,
so a layer's experts cross the link once for every prompt in it rather than once a prompt; all on the device,
where nothing crosses the link, a batch holds one ubatch's worth (-ub tokens, of one prompt or several short
ones). So a long prompt arriving delays the other requests' next token by at most one batch forward; with
--prefill-interval N, while requests are generating, a prompt batch runs only after every N decode steps (so at
most 1 in N of their token gaps carries one); with --scheduler-delay-factor F (vLLM's), only once its oldest prompt
has waited F times the last batch's time or a whole batch waits, so that prompts arriving a few steps apart share a
batch (with host experts: one sweep of the pool instead of several). With --prefill-layers N (by default 1 with
host experts where prompts can pause), while requests generate, a batch runs N layers a loop turn
(engine.prompt_steps), so that their token gaps each carry N layers of it rather than one carrying the whole batch;
its slots take no other request until it ends. Prompt and decode forwards stay separate: mixing them would change
a decode row's numerics (the prompt attention path, other GEMM shapes), and each ubatch of a prompt batch runs as it
would alone, so greedy outputs equal `Generation`'s (with -b a multiple of -ub, the cuts are the same).

With --spec-type draft-mtp a speculating slot's decode step carries its drafts (runtime/speculate.py): the MTP
head (or the request's oracle: bench --parallel --spec-oracle) drafts for every speculating slot together
(draft_together: draft position j of all of them in one head forward), and a step where any slot drafted is one
forward of every generating slot's tokens, [last, drafts] or [last] (_verify).

Each request's stop and detokenize rules are sequence.py's, as `Generation`'s are; what it gets back (each token's
text and logprobs, its end, its slot's release) is replies.py's. Each slot is a context of the engine's routing
store (experts/routing.py: layers x experts counts of its current request and of its previous one, which /slots
shows; the expert cache keeps its prompts' counts there to seed their prefetch), and keeps the tokens whose KV its
sequence holds: a new prompt reuses the longest common prefix (llama-server's cache_prompt). A hybrid model's
sequence (Qwen3-Next: recurrent states besides the KV) cannot be cut back to a prefix, so there a prompt reuses a
slot only as an exact continuation, the slot's whole cache followed by new tokens, and otherwise starts from
position 0; gpt-oss's sliding layers keep a ring of their last positions, so there a common prefix is reused only
where the ring still holds the window before it (runtime/sliding_kv.py). engine.reusable_prefix decides, for all.
"""
from __future__ import annotations

import collections
import logging
import threading
import time

import torch

from ..errors import UserError
from ..models.transformer import Segment
from . import threads
from .prompt_batch import next_batch
from .replies import Replies
from .requests import PromptJob, QueueFull, Request, Run, SchedulerConfig, Slot, at_once, history, speculates
from .sampling import Sampler
from .slot_routing import slot_routing
from .speculate import draft_together

log = logging.getLogger("moestream.server")


class ServingLoop:
    """The slots and their requests, turned one step at a time by whoever owns the engine; submit() and cancel()
    may come from any thread."""

    def __init__(self, engine, tokenizer, cfg: SchedulerConfig | None = None, metrics=None, **kw):
        cfg = cfg if cfg is not None else SchedulerConfig(**kw)
        eng = engine
        if eng.kv.n_seq < cfg.n_slots:
            raise UserError(f"the engine has {eng.kv.n_seq} sequences for {cfg.n_slots} slots: "
                            f"build it with n_seq={cfg.n_slots}")
        self.engine, self.tokenizer, self.metrics, self.cfg = eng, tokenizer, metrics, cfg
        self.max_queue, self.cache_prompt, self.warm_up = cfg.max_queue, cfg.cache_prompt, cfg.warm_up
        self.slots = [Slot(i) for i in range(cfg.n_slots)]
        self._steps_since_prompt = 0         # decode steps since the last prompt ubatch (--prefill-interval)
        self._last_prompt_s = 0.0            # how long the last prompt batch took (--scheduler-delay-factor)
        self._job: PromptJob | None = None   # the prompt batch being read (--prefill-layers: across decode steps)
        self.pending: collections.deque[Request] = collections.deque()
        self._cv = threading.Condition()     # guards pending and the slots' runs against submit() from elsewhere
        self._stopping = False
        self._sampler = Sampler()
        self.replies = Replies(metrics)      # each token's text and logprobs, each request's end, the slots' release
        self.routing = eng.routing           # per-slot expert counts (/slots), of the engine's routing store
        self.routing.clear_requests()        # a new loop's slots start from zero
        # --prefill-layers: by default 1 where host experts would stall the streams for a whole batch's sweep
        # and prompts can pause (an expert cache, no trace); all on the device a batch is one ubatch's worth
        self.prefill_layers = cfg.prefill_layers
        if self.prefill_layers is None:
            self.prefill_layers = int(eng.host is not None and eng.pauses_prompts)
        elif cfg.prefill_layers and not eng.pauses_prompts:
            log.warning("--prefill-layers %d: this engine reads each prompt batch whole (its experts are uploaded "
                        "per ubatch without --moe-cache-mib, or a routing trace is recorded)", cfg.prefill_layers)

    # --- requests in (any thread) --------------------------------------------------------------------------------
    def submit(self, reqs: list[Request]) -> None:
        """Queue requests, all or none: QueueFull when all slots are busy and the queue has no room for them."""
        with self._cv:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            # Places: the idle slots (a request waits in pending until the loop admits it) and the queue proper.
            if len(self.pending) + len(reqs) > self.max_queue + len(self.slots) - self.n_running:
                raise QueueFull(f"every slot is busy and {len(self.pending)} requests are waiting "
                                f"(--max-queue {self.max_queue})")
            self.pending.extend(reqs)
            self._cv.notify()

    def cancel(self, req: Request) -> None:
        with self._cv:
            req.cancelled = True
            self._cv.notify()

    @property
    def n_waiting(self) -> int:
        return len(self.pending)

    @property
    def n_running(self) -> int:
        return sum(s.run is not None for s in self.slots)

    @property
    def busy(self) -> bool:
        """Whether a request waits or runs: step() has work."""
        return bool(self.pending) or self.n_running > 0

    @property
    def reading_prompts(self) -> bool:
        """Whether a prompt batch is being read or a slot's prompt waits for one."""
        return self._job is not None or any(s.state == "prefill" for s in self.slots)

    # --- one turn (the thread that owns the engine) --------------------------------------------------------------
    def step(self) -> None:
        """Drop cancelled requests, admit waiting ones, read the next prompt batch (or its next layers) and run one
        decode step of every generating slot; with prompts_first, a turn that reads prompts decodes nothing."""
        self._reap()
        self.admit()
        # with prompts_first no decode step waits between a batch's layers: each batch is read whole, as alone
        generating = any(s.state == "generating" for s in self.slots) and not self.cfg.prompts_first
        if self._job is None:
            filling = sorted((s for s in self.slots if s.state == "prefill"), key=lambda s: s.run.req.t_submit)
            if filling and (not generating or self._prompts_due(filling)):
                self._prefill(filling, paced=generating)
        if self._job is not None:
            self._guard(self._read_prompts, self._job.slots, not generating)
            if self.cfg.prompts_first:
                return
        batch = [s for s in self.slots if s.state == "generating"]
        if batch:
            self._guard(self._decode, batch)
            self._steps_since_prompt += 1

    def _prompts_due(self, filling: list[Slot]) -> bool:
        """While requests generate: whether the prompts being read (oldest first) get a batch this turn. After
        --prefill-interval decode steps since the last batch, and (--scheduler-delay-factor F, vLLM's) once the
        oldest has waited F times the last batch's time or a whole batch's tokens wait (_budget): prompts that
        arrive a few steps apart then share one batch, and with host experts one sweep of the pool."""
        if self._steps_since_prompt < self.cfg.prefill_interval - 1:
            return False
        if not self.cfg.delay_factor:
            return True
        waited = time.perf_counter() - filling[0].run.req.t_submit
        waiting = sum(len(s.run.req.prompt) - s.run.done for s in filling)
        return waited >= self.cfg.delay_factor * self._last_prompt_s or waiting >= self._budget()

    def _budget(self) -> int:
        """The prompt tokens a batch takes: -b with host experts; all on the device nothing crosses the link, so a
        bigger batch saves nothing: one ubatch's worth (-ub), and the decode steps in between wait for at most one."""
        batching = self.engine.ecfg.batching
        if self.engine.host is not None or self.cfg.prompts_first:     # (prompts_first: no decode step waits)
            return batching.batch_size
        return batching.ubatch

    def warm_up_decode(self) -> None:
        """Capture the CUDA graphs of every decode batch size and span now rather than in the middle of serving (a
        capture stalls every running request; Engine.warm_up_decode). --no-warmup: none."""
        if not self.warm_up:
            return
        try:
            self.engine.warm_up_decode(len(self.slots))
        except Exception:                    # serving can still try: each batch size is captured when first needed
            log.exception("decode warm-up failed")

    def _guard(self, fn, slots: list[Slot], *args) -> None:
        """Run fn(slots, *args), one forward for those slots; if it fails, fail their requests (400 for a
        UserError) and keep serving."""
        try:
            fn(slots, *args)
        except Exception as e:
            user = isinstance(e, UserError)
            if not user:
                log.exception("forward failed; failing %d request(s)", len(slots))
            for s in slots:
                if s.run is not None:
                    error = ("error", s.run.req.index, 400 if user else 500, str(e) or type(e).__name__)
                    self.replies.emit(s.run.req, error)
                    self.replies.free(s, outcome="error", valid=0)

    def _reap(self) -> None:
        with self._cv:
            gone = [r for r in self.pending if r.cancelled]
            if gone:
                self.pending = collections.deque(r for r in self.pending if not r.cancelled)
        for _ in gone if self.metrics is not None else ():
            self.metrics.on_finish("cancelled")
        for s in self.slots:
            if s.run is not None and s.run.req.cancelled:
                self.replies.free(s, outcome="cancelled")

    def admit(self) -> None:
        """Give waiting requests, oldest first, to idle slots: the one whose cache serves the longest prefix (the
        engine's reusable_prefix: a common prefix, or for a hybrid model an exact continuation), else the LRU."""
        while True:
            with self._cv:                   # under the lock: submit() counts free slots as places to wait in
                busy = self._job.runs if self._job is not None else ()     # (sequences still being written)
                idle = [s for s in self.slots if s.run is None and s.id not in busy]
                if not idle or not self.pending:
                    return
                req = self.pending.popleft()
                if req.cancelled:            # cancelled since _reap ran
                    if self.metrics is not None:
                        self.metrics.on_finish("cancelled")
                    continue
                # a speculating request reads its prompt from 0: the head reads every prompt position's state
                use = req.cache_prompt and self.cache_prompt and not speculates(self.engine, req)

                def reused(s: Slot) -> int:     # at least one prompt token still runs: logits to sample from
                    return self.engine.reusable_prefix(s.cached, req.prompt, s.id) if use else 0
                slot = max(idle, key=lambda s: (reused(s), -s.last_used))
                n = reused(slot)
                slot.run = Run(req, self.engine, self.tokenizer, n, slot.id)
            self.engine.begin_prompt(slot.id)   # the slot's routing: this request's counts start, the last one's
            slot.cached = slot.cached[:n]
            slot.prompt_tokens, slot.generated, slot.n_cached, slot.task = len(req.prompt), 0, n, req.id
            if self.metrics is not None:
                self.metrics.on_admit(req, n)

    def _prefill(self, filling: list[Slot], paced: bool) -> None:
        """The next prompt batch (runtime/prompt_batch.py): the next ubatches of the prompts being read, oldest
        request first, up to -b tokens. Each ubatch is the one its slot would run alone, so each gets the same bits.
        paced (requests are generating) and --prefill-layers N: it runs N layers a loop turn, between decode steps."""
        parts = next_batch([(s.id, s.run.req.prompt, s.run.done) for s in filling], self.engine.ecfg.batching.ubatch,
                           self._budget())
        every = self.prefill_layers if paced and self.engine.pauses_prompts else 0
        # with drafts, each part's hidden states: a speculating request's head reads them
        hidden = [] if any(s.run.spec is not None for s in filling) else None
        kw = {} if hidden is None else {"hidden": hidden}
        steps = (self.engine.prompt_steps(parts, every, **kw) if every
                 else at_once(self.engine.prefill_parts, parts, **kw))
        self._job = PromptJob(steps, filling, parts, hidden)

    def _read_prompts(self, slots: list[Slot], whole: bool) -> None:
        """The prompt batch being read: to its next pause, or to its end (whole: nobody generates). At its end each
        slot's prompt has got that far, and a prompt read to its end samples the request's first token."""
        job, self._job = self._job, None      # (a failure drops it: _guard fails its slots' requests)
        threads.use("prompt")
        t0 = time.perf_counter()
        with self.routing.counting(job.owner if self.cfg.count_routing else None):
            logits = job.advance(whole)
        if self.cfg.delay_factor:            # the batch's time on the device too, not only its queueing
            self.engine.synchronize()
        job.busy_s += time.perf_counter() - t0
        if logits is None:
            self._job = job
            return
        self._steps_since_prompt, self._last_prompt_s = 0, job.busy_s
        if self.metrics is not None:
            self.metrics.on_prompt_batch(len(slots))
        for (q, _, _), h in zip(job.parts, job.hidden or ()):
            if job.runs[q].spec is not None:
                job.runs[q].spec_hidden.append(h)
        for slot in slots:
            run, (at, last) = job.runs[slot.id], job.ends[slot.id]
            run.done = at
            if run.spec is not None and at == len(run.req.prompt):
                run.spec.start(run.req.prompt, torch.cat(run.spec_hidden))
                run.spec_hidden = []
            slot.cached = run.req.prompt[:at]    # (what its sequence holds, even where the request was cancelled)
            if slot.run is not run:
                continue                         # cancelled while its batch was read
            if at == len(run.req.prompt) and run.req.params.max_tokens == 0:
                self.replies.finish(slot)        # "length", before any token
            elif at == len(run.req.prompt):
                token = int(self._sampler.sample(logits[last], [run.req.params], [run.gen], history([slot]))[0])
                self.replies.accept(slot, token, logits[last][0])

    def _decode(self, slots: list[Slot]) -> None:
        # the speculating slots' drafts, the head's steps of all of them together (draft position j: one forward)
        drafting = [s for s in slots if s.run.spec is not None]
        drafts = dict(zip((s.id for s in drafting), draft_together(
            self.engine, [(s.run.spec, s.run.seq.ids[-1], s.run.req.params, s.run.gen) for s in drafting])))
        if any(d for d, _ in drafts.values()):  # (none: the contexts' last positions, whose tokens end them)
            return self._verify(slots, drafts)
        steps = [(s.id, s.run.seq.ids[-1], s.run.seq.pos) for s in slots]
        # decode routing is counted where the engine reports it (host experts, what prefetch serves)
        owner = [s.id for s in slots] if self.engine.reports_decode_routing and self.cfg.count_routing else None
        threads.use("decode")
        with self.routing.counting(owner):
            logits = self.engine.decode(steps)                                              # (B, V)
        for s, (_, tok, _) in zip(slots, steps):
            s.cached.append(tok)
        tokens = self._sampler.sample(logits, [s.run.req.params for s in slots], [s.run.gen for s in slots],
                                      history(slots)).tolist()
        if self.metrics is not None:
            self.metrics.on_decode_batch(len(slots))
        for i, (s, token) in enumerate(zip(slots, tokens)):
            self.replies.accept(s, token, logits[i])

    def _verify(self, slots: list[Slot], drafts: dict) -> None:
        """One step of the generating slots where some drafted (runtime/speculate.py): each speculating slot's
        last token and drafts, each other slot's last token, in one forward (a prompt-like step, each host layer's
        experts once for the union of every token's); each speculating slot accepts its drafts and rolls back,
        the others sample their one token."""
        segments, tokens, owner = [], [], []
        for s in slots:
            d = drafts[s.id][0] if s.id in drafts else []
            segments.append(s.run.spec.segment(d) if s.id in drafts else Segment(s.id, s.run.seq.pos, 1))
            tokens += [s.run.seq.ids[-1], *d]
            owner += [s.id] * (len(d) + 1)
        threads.use("decode")
        hidden: list[torch.Tensor] = []
        with self.routing.counting(owner if self.cfg.count_routing else None):
            logits = self.engine.forward(segments, tokens, all_logits=True, is_prompt=True, hidden=hidden,
                                         keep_states=True)                            # (sum n, V)
        if self.metrics is not None:
            self.metrics.on_decode_batch(len(slots))
        rows = logits.split([g.n for g in segments])
        states = hidden[0].split([g.n for g in segments])
        for s, row, h in zip(slots, rows, states):
            run, last = s.run, s.run.seq.ids[-1]
            if s.id in drafts:
                d, q = drafts[s.id]
                new = run.spec.commit(row, h, d, q, run.req.params, run.gen)
            else:
                new = self._sampler.sample(row, [run.req.params], [run.gen], history([s])).tolist()
            s.cached += [last, *new[:-1]]           # what its sequence holds: the verified positions
            for j, token in enumerate(new):
                self.replies.accept(s, token, row[j])
                if s.run is not run:                # it ended: the rest is dropped
                    break

    def _abort_all(self, waiting: list[Request]) -> None:
        """At shutdown: every request ends now with what it has, finish_reason "abort" (Replies.abort_all)."""
        self.replies.abort_all(self.slots, waiting)

    # --- snapshots (run through call()) ----------------------------------------------------------------------------
    def slots_info(self, top: int = 4) -> list[dict]:
        """/slots: per slot its state, prompt and generated tokens, KV reuse, and its routing's top experts."""
        routing = slot_routing(self.routing, self.engine.cfg.moe_layers, len(self.slots), top)
        return [{"id": s.id, "state": s.state, "id_task": s.task, "n_ctx": self.engine.kv.ctx,
                 "prompt_tokens": s.prompt_tokens, "generated_tokens": s.generated,
                 "n_past": len(s.cached), "n_cached": s.n_cached, "routing": r}
                for s, r in zip(self.slots, routing)]

