"""The server's --prefill-layers without HTTP: a prompt batch read a few layers at a time between the generating
requests' decode steps gives every request the tokens it gets alone (tests/test_prompt_batch.py: the bits); and
the prompt budget of serve's batches (-b)."""
from __future__ import annotations

import queue

import numpy as np
import pytest

from moestream import LLM, SamplingParams
from moestream.runtime.scheduler import Request, Scheduler

from scheduling import CTX, reference_routing  # noqa: E402


@pytest.fixture(scope="module")
def ref():
    return LLM("synth:tiny", ctx_size=CTX)


def traced_prompt_steps(llm, calls: list) -> None:
    """Record in `calls` each pause ("L<layer>") and end ("end") of the engine's prompt_steps, and "d" per decode."""
    steps, decode = llm.engine.prompt_steps, llm.engine.decode

    def traced(parts, every):
        layers = steps(parts, every)
        while True:
            try:
                layer = next(layers)
            except StopIteration as done:
                calls.append("end")
                return done.value
            calls.append(f"L{layer}")
            yield layer
    llm.engine.prompt_steps = traced
    llm.engine.decode = lambda steps: (calls.append("d"), decode(steps))[1]


def read_beside_a_stream(s, ref, calls):
    """Start `s`; while a request generates 40 tokens, another's 15-token prompt comes, for 5 tokens. (how many
    calls came before it, the two prompts, each one's final event by index, the second slot's routing counts)"""
    s.start()
    try:
        first = ref.encode("Once upon")
        long = ref.encode("Light travels about three hundred thousand kilometres a second in a vacuum")
        events = queue.Queue()
        s.submit([Request(first, SamplingParams(max_tokens=40, ignore_eos=True), events.put, index=0, stream=True)])
        while events.get(timeout=30)[0] != "token":          # the first request generates
            pass
        n_before = len(calls)
        s.submit([Request(long, SamplingParams(max_tokens=5, ignore_eos=True), events.put, index=1)])
        done = {}
        while len(done) < 2:
            ev = events.get(timeout=30)
            if ev[0] != "token":
                done[ev[1]] = ev
        info = s.call(s.slots_info).result(10)
        slot = next(i["id"] for i in info if i["prompt_tokens"] == len(long))
        counts = s.call(lambda: s.routing.current(slot)).result(10)
    finally:
        s.stop()
    return n_before, (first, long), done, counts


@pytest.fixture(scope="module")
def ref_next():
    return LLM("synth:tiny-next", ctx_size=CTX)


@pytest.mark.parametrize("model,kw", [("tiny", dict()), ("tiny", dict(cpu_moe=True, moe_cache_mib=2)),
                                      ("tiny", dict(cpu_moe=True, moe_cache_mib=12, zero_copy_decode=True)),
                                      ("tiny-next", dict(cpu_moe=True, moe_cache_mib=12))])
def test_prefill_layers_reads_a_prompt_batch_between_decode_steps(request, model, kw):
    """--prefill-layers 1: while a request generates, another's prompt batches run one layer a loop turn, a
    decode step of the first between any two (with an expert cache, its prompt state is set aside and back; a
    hybrid model's recurrent states are each sequence's own); both get the tokens they get alone, and the second
    slot's routing counts are its own request's."""
    ref = request.getfixturevalue("ref" if model == "tiny" else "ref_next")
    llm = LLM(f"synth:{model}", ctx_size=CTX, n_seq=2, ubatch_size=4, batch_size=8, **kw)
    calls = []
    traced_prompt_steps(llm, calls)
    s = Scheduler(llm, n_slots=2, max_queue=4, prefill_layers=1)
    n_before, (first, long), done, counts = read_beside_a_stream(s, ref, calls)
    assert done[0][2].token_ids == ref.generate(first, max_tokens=40, ignore_eos=True).token_ids
    assert done[1][2].token_ids == ref.generate(long, max_tokens=5, ignore_eos=True).token_ids
    want, _ = reference_routing(ref, long, 5)
    assert np.array_equal(counts, want)
    n_layers = llm.model_config.n_layers
    marks = [c for c in calls[n_before:] if c != "d"]
    assert marks[:n_layers] == [f"L{i}" for i in range(n_layers - 1)] + ["end"], calls    # one batch, paused
    assert len(long) > 8 and marks.count("end") >= 2                                      # -b 8: two batches
    pauses = [k for k, c in enumerate(calls) if k >= n_before and c != "d"]
    assert all("d" in calls[a + 1:b] for a, b in zip(pauses, pauses[1:])), calls


def test_a_request_cancelled_while_its_prompt_batch_is_read_frees_its_slot_after_the_batch(ref):
    """A request cancelled while its batch is paused: its slot takes no other request until the batch has ended
    (its sequence is still being written); the next request then gets the tokens it gets alone."""
    llm = LLM("synth:tiny", ctx_size=CTX, n_seq=2, ubatch_size=4, batch_size=8, cpu_moe=True, moe_cache_mib=2)
    waiting = []                            # at each pause of the cancelled batch: requests waiting for a slot
    steps = llm.engine.prompt_steps

    def cancelling(parts, every):           # at the batch's first pause: cancel it, and a new request comes
        layers = steps(parts, every)
        if waiting:                         # (the third request's batch)
            return (yield from layers)
        while True:
            try:
                layer = next(layers)
            except StopIteration as end:
                return end.value
            if not waiting:
                long.cancelled = True
                s.submit([Request(third, SamplingParams(max_tokens=4), events.put, index=2)])
            waiting.append(s.n_waiting)
            yield layer
    llm.engine.prompt_steps = cancelling
    s = Scheduler(llm, n_slots=2, max_queue=4, prefill_layers=1)
    events = queue.Queue()
    first, third = ref.encode("Once upon"), ref.encode("The moon")
    long = Request(ref.encode("Light travels about three hundred thousand"), SamplingParams(max_tokens=5),
                   events.put, index=1)
    s.start()
    try:
        s.submit([Request(first, SamplingParams(max_tokens=30, ignore_eos=True), events.put, index=0, stream=True)])
        while events.get(timeout=30)[0] != "token":
            pass
        s.submit([long])
        done = {}
        while len(done) < 2:
            ev = events.get(timeout=30)
            if ev[0] != "token":
                done[ev[1]] = ev
    finally:
        s.stop()
    assert set(done) == {0, 2} and done[2][2].token_ids == ref.generate(third, max_tokens=4).token_ids
    assert waiting == [1] * (llm.model_config.n_layers - 1)      # the cancelled slot stayed out of reach


def test_prefill_layers_reads_whole_batches_where_prompts_cannot_pause(ref, caplog):
    """Experts uploaded per ubatch (--cpu-moe, no cache) fill the rows decode steps read: there a prompt batch
    runs whole, and the scheduler says so once."""
    llm = LLM("synth:tiny", ctx_size=CTX, n_seq=2, ubatch_size=4, batch_size=8, cpu_moe=True)
    calls = []
    traced_prompt_steps(llm, calls)
    assert not llm.engine.pauses_prompts
    with caplog.at_level("WARNING", logger="moestream.server"):
        s = Scheduler(llm, n_slots=2, max_queue=4, prefill_layers=1)
    assert "reads each prompt batch whole" in caplog.text
    _, (first, long), done, _ = read_beside_a_stream(s, ref, calls)
    assert not [c for c in calls if c != "d"]                # prompt_steps never ran: whole batches
    assert done[1][2].token_ids == ref.generate(long, max_tokens=5, ignore_eos=True).token_ids


@pytest.mark.parametrize("kw,want", [(dict(cpu_moe=True, moe_cache_mib=2), 1), (dict(cpu_moe=True), 0), (dict(), 0)])
def test_prefill_layers_defaults_to_one_with_host_experts_that_can_pause(kw, want, caplog):
    """Unset, --prefill-layers is 1 where host experts would stall the streams for a whole batch and prompts can
    pause (an expert cache); 0 with no cache (said nowhere: the user asked for nothing) and all on the device."""
    llm = LLM("synth:tiny", ctx_size=CTX, n_seq=2, ubatch_size=4, batch_size=8, **kw)
    with caplog.at_level("WARNING", logger="moestream.server"):
        s = Scheduler(llm, n_slots=2)
    assert s.prefill_layers == want and "prefill-layers" not in caplog.text
    assert Scheduler(llm, n_slots=2, prefill_layers=3).prefill_layers == 3


def test_serve_reads_prompt_batches_of_8192_tokens_unless_told():
    """The server's prompt budget with host experts (-b) is vLLM's online 8192, not generate's 2048; -b (which
    vLLM spells --max-num-batched-tokens) still sets it."""
    from moestream import flags
    from moestream.cli import build_parser
    from moestream.server.cli import SERVE_BATCH

    def batch(*argv):
        return flags.to_config(build_parser("serve").parse_args(["serve", "-m", "synth:tiny", *argv])).batching
    assert SERVE_BATCH == 8192 and batch().batch_size == SERVE_BATCH
    assert batch("-b", "2048").batch_size == 2048
    assert flags.to_config(build_parser("generate").parse_args(["generate", "-m", "synth:tiny"])).batching.batch_size \
        == 2048
