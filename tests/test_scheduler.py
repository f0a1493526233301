"""The slot scheduler without HTTP: routing statistics per slot, prompt-prefix reuse, the queue bound, failures."""
from __future__ import annotations

import queue

import numpy as np
import pytest

from moestream import LLM, SamplingParams
from moestream.runtime.scheduler import QueueFull, Request, Scheduler

from scheduling import CTX, reference_routing, run  # noqa: E402


@pytest.fixture(scope="module")
def llm2():
    return LLM("synth:tiny", ctx_size=CTX, n_seq=2)


@pytest.fixture(scope="module")
def ref():
    return LLM("synth:tiny", ctx_size=CTX)


@pytest.fixture
def sched(llm2):
    s = Scheduler(llm2, n_slots=2, max_queue=4)
    s.start()
    yield s
    s.stop()


def test_routing_counts_per_slot_in_batched_decode(sched, ref):
    """Two requests decode in the same forwards; each slot's counts are exactly its own request's routing."""
    prompts = [ref.encode("Once upon a time there was"), ref.encode("Light travels about")]
    results, reqs = run(sched, prompts, max_tokens=10)
    info = sched.call(sched.slots_info).result(10)
    k = ref.model_config.n_experts_used
    for (_, _, res), req, prompt in zip(results, reqs, prompts):
        want, ids = reference_routing(ref, prompt, 10)
        assert res.token_ids == ids
        slot = next(s["id"] for s in info if s["id_task"] == req.id)
        current, _ = sched.call(lambda: (sched.routing.current(slot), sched.routing.previous[slot])).result(10)
        fed = len(prompt) + len(ids) - 1                 # the last sampled token is never run
        assert current.sum(axis=1).tolist() == [fed * k] * ref.model_config.n_layers
        assert np.array_equal(current, want)


def test_prefix_reuse_and_previous_routing(sched, ref):
    prompt = ref.encode("The market opens at dawn. Farmers unload baskets")
    (first,), _ = run(sched, [prompt], max_tokens=4)
    slot = next(s for s in sched.call(sched.slots_info).result(10) if s["id_task"] == _[0].id)["id"]
    before, _prev = sched.call(lambda: (sched.routing.current(slot), sched.routing.previous[slot])).result(10)
    longer = prompt + ref.encode(" of onions")
    (second,), reqs = run(sched, [longer], max_tokens=4)
    res = second[2]
    assert res.cached_tokens == len(prompt) and res.token_ids == ref.generate(longer, max_tokens=4).token_ids
    info = sched.call(sched.slots_info).result(10)
    assert next(s for s in info if s["id_task"] == reqs[0].id)["id"] == slot      # the slot holding the prefix
    _cur, previous = sched.call(lambda: (sched.routing.current(slot), sched.routing.previous[slot])).result(10)
    assert np.array_equal(previous, before)
    (third,), _ = run(sched, [longer], max_tokens=4, cache_prompt=False)
    assert third[2].cached_tokens == 0 and third[2].token_ids == res.token_ids


def test_queue_bound_counts_idle_slots(llm2):
    s = Scheduler(llm2, n_slots=2, max_queue=1)            # not started: nothing leaves the queue
    req = lambda: Request([1, 2, 3], SamplingParams(max_tokens=1), lambda ev: None)  # noqa: E731
    s.submit([req(), req()])                               # two idle slots
    s.submit([req()])                                      # one waiting place
    with pytest.raises(QueueFull):
        s.submit([req()])
    with pytest.raises(QueueFull):                         # all or none
        Scheduler(llm2, n_slots=2, max_queue=1).submit([req(), req(), req(), req()])


def test_a_failed_forward_fails_its_requests_and_the_loop_goes_on(sched, ref, monkeypatch):
    eng = sched.engine
    real = eng.decode
    calls = []

    def flaky(steps):
        calls.append(steps)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real(steps)

    monkeypatch.setattr(eng, "decode", flaky)
    (ev,), _ = run(sched, [ref.encode("Hello there")], max_tokens=4)
    assert ev[0] == "error" and ev[2] == 500 and "boom" in ev[3]
    (ok,), _ = run(sched, [ref.encode("Hello there")], max_tokens=4)
    assert ok[0] == "done" and ok[2].token_ids == ref.generate(ref.encode("Hello there"), max_tokens=4).token_ids
    assert all(s["state"] == "idle" for s in sched.call(sched.slots_info).result(10))


def test_cancel_before_and_during_a_request(sched, ref):
    events = queue.Queue()
    long = Request(ref.encode("Once upon a time"), SamplingParams(max_tokens=100, ignore_eos=True), events.put,
                   stream=True)
    pending = Request(ref.encode("Never run"), SamplingParams(max_tokens=5), events.put)
    pending.cancelled = True                               # cancelled while waiting: never admitted
    sched.submit([long, pending])
    assert events.get(timeout=10)[0] == "token"
    sched.cancel(long)
    info = None
    for _ in range(500):
        info = sched.call(sched.slots_info).result(10)
        if all(s["state"] == "idle" for s in info):
            break
    assert all(s["state"] == "idle" for s in info)
    seen = []
    while not events.empty():
        seen.append(events.get()[0])
    assert "done" not in seen and "error" not in seen      # a cancelled request just stops
    assert 0 < max(s["generated_tokens"] for s in info) < 100


def test_host_experts_batched_and_their_counters_in_metrics(ref):
    """Experts in host memory behind a small GPU-style cache: batched results still equal each request alone,
    and /metrics exports the engine's cache counters that exist (and only those)."""
    from moestream.server.metrics import ServerMetrics
    llm = LLM("synth:tiny", ctx_size=CTX, n_seq=2, cpu_moe=True, moe_cache_mib=2)
    m = ServerMetrics()
    s = Scheduler(llm, n_slots=2, max_queue=4, metrics=m)
    s.start()
    try:
        prompts = [ref.encode("Good software is written twice"), ref.encode("In 1969 two astronauts")]
        results, _ = run(s, prompts, max_tokens=6)
        assert [r[2].token_ids for r in results] == [ref.generate(p, max_tokens=6).token_ids for p in prompts]
        m.set_engine_stats(s.call(llm.stats).result(10))
    finally:
        s.stop()
    text = m.render().decode()
    assert "moestream_expert_cache_misses_total" in text and "moestream_expert_uploaded_bytes_total" in text
    m.set_engine_stats({"uploaded_bytes": 7})                  # an engine before the cache: what it has
    text = m.render().decode()
    assert "moestream_expert_uploaded_bytes_total 7.0" in text and "cache_misses" not in text


def test_zero_copy_decode_batched_keeps_results_and_slot_routing(ref):
    """Zero-copy decode (experts read in place, the cache learning one step later) under the scheduler: batched
    results equal each request alone, and each slot's routing counts are its own request's, step for step."""
    llm = LLM("synth:tiny", ctx_size=CTX, n_seq=2, cpu_moe=True, moe_cache_mib=12, zero_copy_decode=True)
    s = Scheduler(llm, n_slots=2, max_queue=4)
    s.start()
    try:
        prompts = [ref.encode("Once upon a time there was"), ref.encode("Light travels about")]
        results, reqs = run(s, prompts, max_tokens=10)
        info = s.call(s.slots_info).result(10)
        for (_, _, res), req, prompt in zip(results, reqs, prompts):
            want, ids = reference_routing(ref, prompt, 10)
            assert res.token_ids == ids
            slot = next(i["id"] for i in info if i["id_task"] == req.id)
            assert np.array_equal(s.call(lambda: s.routing.current(slot)).result(10), want)
        assert s.call(llm.stats).result(10)["total"]["host_reads"] > 0
    finally:
        s.stop()


def test_prefill_interval_paces_prompts_between_decode_steps(ref):
    """--prefill-interval N: while a request generates, another request's prompt batches run only after every N
    decode steps (and back to back when nobody generates); the results still equal each request alone."""
    llm = LLM("synth:tiny", ctx_size=CTX, n_seq=2, ubatch_size=2, batch_size=2)
    calls = []
    prefill, decode = llm.engine.prefill_parts, llm.engine.decode
    llm.engine.prefill_parts = lambda *a, **kw: (calls.append("p"), prefill(*a, **kw))[1]
    llm.engine.decode = lambda steps: (calls.append(f"d{len(steps)}"), decode(steps))[1]
    s = Scheduler(llm, n_slots=2, max_queue=4, prefill_interval=3)
    s.start()
    try:
        first, long = ref.encode("Once upon"), ref.encode("Light travels about three hundred thousand kilometres")
        events = queue.Queue()
        s.submit([Request(first, SamplingParams(max_tokens=40, ignore_eos=True), events.put, index=0, stream=True)])
        while events.get(timeout=30)[0] != "token":          # the first request generates
            pass
        n_before = len(calls)
        results, _ = run(s, [long], max_tokens=4)
    finally:
        s.stop()
    assert results[0][2].token_ids == ref.generate(long, max_tokens=4).token_ids
    # the long prompt's ubatches (of 2 tokens): at least 2 decode steps between any two of them
    starts = [k for k, c in enumerate(calls) if c == "p" and k >= n_before]
    between = [sum(c.startswith("d") for c in calls[a + 1:b]) for a, b in zip(starts, starts[1:])]
    assert len(starts) >= 3 and all(n >= 2 for n in between), calls


@pytest.mark.parametrize("prompt_len,held", [(4, True), (8, False)])
def test_the_delay_factor_holds_prompts_until_they_fill_a_batch_or_have_waited(ref, prompt_len, held):
    """--scheduler-delay-factor F: while a request generates, a prompt waits until it has waited F times the last
    batch's time (here never: F is huge, so until nobody generates), unless -b tokens wait (8 here): then it is read
    at once. Either way each request gets the tokens it gets alone."""
    llm = LLM("synth:tiny", ctx_size=CTX, n_seq=2, ubatch_size=8, batch_size=8)
    s = Scheduler(llm, n_slots=2, max_queue=4, delay_factor=1e9)
    s.start()
    try:
        first = ref.encode("Once upon")
        second = list(range(3, 3 + prompt_len))
        events = queue.Queue()
        s.submit([Request(first, SamplingParams(max_tokens=30, ignore_eos=True), events.put, index=0, stream=True)])
        while events.get(timeout=30)[0] != "token":          # the first request generates
            pass
        s.submit([Request(second, SamplingParams(max_tokens=3, ignore_eos=True), events.put, index=1, stream=True)])
        order = []
        while len([e for e in order if e[0] != "token"]) < 2:
            order.append(events.get(timeout=30))
    finally:
        s.stop()
    first_done = next(k for k, e in enumerate(order) if e[0] != "token" and e[1] == 0)
    second_first = next(k for k, e in enumerate(order) if e[1] == 1)
    assert (second_first > first_done) == held, order
    done = {e[1]: e for e in order if e[0] != "token"}
    assert done[0][2].token_ids == ref.generate(first, max_tokens=30, ignore_eos=True).token_ids
    assert done[1][2].token_ids == ref.generate(second, max_tokens=3, ignore_eos=True).token_ids


def test_scheduler_config_rejects_bad_values(llm2):
    from moestream.errors import UserError
    with pytest.raises(UserError, match="prefill_interval must be at least 1"):
        Scheduler(llm2, n_slots=2, prefill_interval=0)
    with pytest.raises(UserError, match="delay_factor must be at least 0"):
        Scheduler(llm2, n_slots=2, delay_factor=-1)
    with pytest.raises(UserError, match="prefill_layers must be at least 0"):
        Scheduler(llm2, n_slots=2, prefill_layers=-1)


@pytest.mark.parametrize("kw,budget", [(dict(cpu_moe=True, moe_cache_mib=1), 8), (dict(), 4)])
def test_prompts_arriving_together_run_as_one_batch_of_at_most_b_tokens(ref, kw, budget):
    """Prompts waiting together run in prompt batches of up to -b tokens with host experts (-ub all on the
    device, where nothing crosses the link), oldest request first, each cut into ubatches of -ub from where its slot
    stands; each result still equals the request alone."""
    llm = LLM("synth:tiny", ctx_size=CTX, n_seq=3, ubatch_size=4, batch_size=8, **kw)
    batches = []
    prefill, steps = llm.engine.prefill_parts, llm.engine.prompt_steps     # (whole, and paused: --prefill-layers)
    llm.engine.prefill_parts = lambda parts: (batches.append(list(parts)), prefill(parts))[1]
    llm.engine.prompt_steps = lambda parts, every: (batches.append(list(parts)), steps(parts, every))[1]
    s = Scheduler(llm, n_slots=3, max_queue=4)
    s.start()
    try:
        prompts = [ref.encode("Once upon a time"), ref.encode("Light travels about three hundred thousand"),
                   ref.encode("The")]
        results, _ = run(s, prompts, max_tokens=6)
    finally:
        s.stop()
    for (_, _, res), p in zip(results, prompts):
        assert res.token_ids == ref.generate(p, max_tokens=6).token_ids
    assert all(sum(len(t) for _, _, t in b) <= budget and all(len(t) <= 4 for _, _, t in b) for b in batches)
    assert any(sum(len(t) for _, _, t in b) > 4 for b in batches) == (budget > 4), batches
    assert any(len({q for q, _, _ in b}) > 1 for b in batches), batches      # several prompts shared a batch
    fed = sorted((q, st, tuple(t)) for b in batches for q, st, t in b)
    assert sum(len(t) for _, _, t in fed) == sum(map(len, prompts))           # every prompt token ran once
