"""The one serving loop (runtime/serving.py) and its three drivers: `LLM.generate` of a list, `bench --parallel`
(decode_together) and the server give the same requests the same greedy tokens, each the tokens `Generation` gives
its prompt alone; and what the loop's turns do with prompts_first (bench --parallel's phases)."""
from __future__ import annotations

import pytest

from moestream import LLM, SamplingParams
from moestream.runtime.requests import Request, SchedulerConfig
from moestream.runtime.serving import ServingLoop
from moestream.tools.bench_parallel import ParallelTest, decode_together

SEQS, PP, TG = 3, 10, 6
KW = dict(ctx_size=64, device="cpu", cpu_moe=True, moe_cache_mib=1, ubatch_size=4, batch_size=8)


@pytest.fixture(scope="module")
def llm():
    return LLM("synth:tiny", n_seq=SEQS, **KW)


@pytest.fixture(scope="module")
def prompts(llm):
    return ParallelTest(PP, TG, SEQS, seed=11).prompts(llm.model_config.vocab_size, 0)


def test_the_three_drivers_give_each_request_the_tokens_it_gets_alone(llm, prompts):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from serving import Server

    from moestream.server.app import create_app
    alone = LLM("synth:tiny", **KW)
    # the bench's generated tokens follow the one sampled from the prompt: ask the others for TG + 1
    want = [alone.generate(p, max_tokens=TG + 1, ignore_eos=True).token_ids for p in prompts]
    assert len({tuple(w) for w in want}) == SEQS                   # (different prompts, different answers)

    listed = [o.token_ids for o in llm.generate(prompts, max_tokens=TG + 1, ignore_eos=True)]
    bench = decode_together(llm.engine, prompts, PP, TG)["generated"]
    srv = Server(create_app(llm=llm, n_slots=SEQS, max_queue=0))
    try:
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "model": "moestream", "prompt": prompts, "max_tokens": TG + 1, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
    finally:
        srv.stop()
    assert r.status_code == 200, r.text
    served = [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    assert listed == want and served == want
    assert bench == [w[1:] for w in want]


def _loop(llm, **kw):
    return ServingLoop(llm.engine, llm.tokenizer, SchedulerConfig(n_slots=SEQS, **kw))


def _submit(loop, prompts, max_tokens):
    events = []
    loop.submit([Request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True), events.append, index=i)
                 for i, p in enumerate(prompts)])
    return events


def test_prompts_first_reads_every_prompt_before_the_first_decode_step(llm, prompts, monkeypatch):
    """Three 10-token prompts in batches of -b 8 (ubatches of 4: 4+4, 2+4, 4+2, 4+4, 2): five batches, then decode
    steps of all three; the default order decodes a sequence as soon as its prompt has been read."""
    calls = []
    for name in ("prefill_parts", "decode"):
        inner = getattr(llm.engine, name)
        monkeypatch.setattr(llm.engine, name, lambda *a, _n=name, _f=inner, **k: calls.append(_n) or _f(*a, **k))
    for first in (True, False):
        calls.clear()
        loop = _loop(llm, prompts_first=first)
        events = _submit(loop, prompts, 3)
        loop.admit()
        turns = 0
        while loop.reading_prompts:
            loop.step()
            turns += 1
        if first:
            assert calls == ["prefill_parts"] * 5 and turns == 5 and not events
        else:                                          # (the batches while others decode: engine.prompt_steps)
            assert "decode" in calls
        while loop.busy:
            loop.step()
        assert [e[0] for e in events] == ["done"] * SEQS
        if first:                                      # 3 tokens: one from the prompt, two decode steps
            assert calls == ["prefill_parts"] * 5 + ["decode"] * 2


def test_a_request_without_a_prompt_starts_from_its_first_token(llm, prompts):
    """bench --parallel -npp 0: the first token is the input of the first decode step, at position 0, and the first
    of the result's tokens; the sequence then goes on as one whose prompt sampled that token."""
    loop = _loop(llm, prompts_first=True, count_routing=False)
    events = []
    loop.submit([Request([], SamplingParams(max_tokens=4, ignore_eos=True), events.append, index=i, first=p[0])
                 for i, p in enumerate(prompts)])
    while loop.busy:
        loop.step()
    got = {e[1]: e[2].token_ids for e in events}
    assert [got[i][0] for i in range(SEQS)] == [p[0] for p in prompts]
    bench = decode_together(llm.engine, prompts, 0, 3)["generated"]
    assert bench == [got[i][1:] for i in range(SEQS)]
    steps = [llm.engine.decode([(0, prompts[0][0], 0)]).argmax(-1).item()]
    for j in range(2):
        steps.append(llm.engine.decode([(0, steps[-1], j + 1)]).argmax(-1).item())
    assert steps == got[0][1:]
