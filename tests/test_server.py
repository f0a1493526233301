"""The OpenAI-compatible server, started for real on a loopback port and driven with the official `openai` client.

Greedy outputs must equal `LLM.generate` of the same prompt run alone, whatever else the server runs at the time.
(Bad input, loading, keys and the queue: test_server_input.py.)
"""
from __future__ import annotations

import concurrent.futures
import logging
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from serving import PROMPTS, alone, metric, post, served, wait_idle  # noqa: E402

ref = pytest.fixture(scope="module", name="ref")(alone)
srv = pytest.fixture(scope="module", name="srv")(served)


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)


# --- results --------------------------------------------------------------------------------------------------------
def test_health_and_models(srv, client):
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny", "tiny-alias"]


def test_completion_equals_generate(client, ref):
    out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                    extra_body={"return_token_ids": True})
    want = ref.generate(PROMPTS[0], max_tokens=12)
    c = out.choices[0]
    assert c.token_ids == want.token_ids and c.text == want.text
    assert c.finish_reason == want.finish_reason
    assert out.usage.prompt_tokens == len(ref.encode(PROMPTS[0]))
    assert out.usage.completion_tokens == len(want.token_ids)


def test_streams_equal_whole(client, ref):
    msgs = [{"role": "user", "content": "Hi, how are you?"}]
    want = ref.chat(msgs, max_tokens=10)
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    whole = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
    assert whole.choices[0].message.content == want.text

    pieces = list(client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == ref.generate(PROMPTS[1], max_tokens=8).text


def test_concurrent_requests_each_equal_alone(srv, client, ref):
    """More requests than slots at once: decode steps are batched, results are each request's alone."""
    batches0 = metric(srv, "moestream_decode_batch_size_count")
    ones0 = metric(srv, 'moestream_decode_batch_size_bucket{le="1.0"}')

    def one(p):
        return client.completions.create(model="tiny", prompt=p, max_tokens=24, temperature=0,
                                         extra_body={"return_token_ids": True}).choices[0].token_ids

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(one, PROMPTS))
    assert got == [ref.generate(p, max_tokens=24).token_ids for p in PROMPTS]
    batches = metric(srv, "moestream_decode_batch_size_count") - batches0
    singles = metric(srv, 'moestream_decode_batch_size_bucket{le="1.0"}') - ones0
    assert batches > singles, "no decode step served more than one request"


def test_n_and_prompt_batch(srv, client, ref):
    """A request of two prompts, n=2: four requests admitted together, whose prompts are read in one batch."""
    def several() -> float:                   # prompt batches of more than one prompt so far
        return (metric(srv, "moestream_prompt_batch_size_count")
                - metric(srv, 'moestream_prompt_batch_size_bucket{le="1.0"}'))
    several0 = several()
    out = client.completions.create(model="tiny", prompt=PROMPTS[:2], n=2, max_tokens=5, temperature=0)
    texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    want = [ref.generate(p, max_tokens=5).text for p in PROMPTS[:2]]
    assert texts == [want[0], want[0], want[1], want[1]]
    assert several() > several0, "no prompt batch read more than one prompt"


def test_stop_seed_logprobs(client, ref):
    full = ref.generate(PROMPTS[2], max_tokens=16).text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    out = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=16, temperature=0, stop=[stop])
    assert out.choices[0].text == full[:full.index(stop)] and out.choices[0].finish_reason == "stop"

    kw = dict(max_tokens=10, temperature=0.9, top_p=0.95, seed=7)
    a = client.completions.create(model="tiny", prompt=PROMPTS[3], **kw).choices[0].text
    assert a == client.completions.create(model="tiny", prompt=PROMPTS[3], **kw).choices[0].text
    assert a == ref.generate(PROMPTS[3], **kw).text

    lp = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2)
    info = lp.choices[0].logprobs
    assert len(info.tokens) == 6 and "".join(info.tokens) == lp.choices[0].text
    assert all(v <= 0 for v in info.token_logprobs) and all(len(t) <= 2 for t in info.top_logprobs)
    # greedy: the chosen token is the most probable one
    assert all(abs(max(t.values()) - v) < 1e-5 for t, v in zip(info.top_logprobs, info.token_logprobs))
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)


def test_prompt_cache_reuses_prefix(srv, client, ref):
    wait_idle(srv)
    prompt = PROMPTS[4] + " and the trains were late"
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    again = client.completions.create(model="tiny", prompt=prompt + ", the library", max_tokens=6, temperature=0)
    n = len(ref.encode(prompt))
    assert again.usage.prompt_tokens_details.cached_tokens >= n - 1
    assert again.choices[0].text == ref.generate(prompt + ", the library", max_tokens=6).text
    off = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                    extra_body={"cache_prompt": False})
    assert off.usage.prompt_tokens_details.cached_tokens == 0 and off.choices[0].text == first.choices[0].text


def test_token_id_prompts_tokenize_detokenize(srv, client, ref):
    ids = ref.encode(PROMPTS[5])
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0)
    assert out.choices[0].text == ref.generate(ids, max_tokens=5).text
    assert post(srv, "/tokenize", {"content": PROMPTS[5]}).json() == {"tokens": ids}
    pieces = post(srv, "/tokenize", {"content": PROMPTS[5], "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids and "".join(p["piece"] for p in pieces) == PROMPTS[5]
    assert post(srv, "/detokenize", {"tokens": ids}).json() == {"content": PROMPTS[5]}


def test_slots_and_metrics(srv, client):
    client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=3, temperature=0)
    slots = wait_idle(srv)
    assert [s["id"] for s in slots] == [0, 1, 2, 3]
    used = max(slots, key=lambda s: s["routing"]["routed"])
    assert used["n_past"] > 0 and used["prompt_tokens"] > 0 and used["generated_tokens"] > 0
    assert set(used["routing"]["current"]) == {"0", "1", "2", "3"} and used["routing"]["current"]["0"]
    text = httpx.get(srv.url + "/metrics").text
    for name in ("moestream_requests_total", "moestream_generation_tokens_total", "moestream_prompt_tokens_total",
                 "moestream_time_to_first_token_seconds_bucket", "moestream_inter_token_latency_seconds_bucket",
                 "moestream_requests_running", "moestream_requests_waiting", "moestream_expert_uploaded_bytes_total"):
        assert name in text


# --- what an OpenAI client and a vLLM user expect --------------------------------------------------------------------
def test_unknown_model_is_404_aliases_answer_and_errors_are_counted_by_kind(srv, client):
    before = metric(srv, "moestream_http_errors_total", 'kind="model_not_found"', 'status="404"')
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    r = post(srv, "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert metric(srv, "moestream_http_errors_total", 'kind="model_not_found"', 'status="404"') == before + 2
    out = client.completions.create(model="tiny-alias", prompt="hi", max_tokens=2, temperature=0)
    assert out.model == "tiny-alias"                                       # answered under the name asked for
    bad = metric(srv, "moestream_http_errors_total", 'kind="invalid_request_error"', 'status="400"')
    assert post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 0}).status_code == 400
    assert metric(srv, "moestream_http_errors_total", 'kind="invalid_request_error"', 'status="400"') == bad + 1
    typed = metric(srv, "moestream_http_errors_total", 'kind="invalid_type"', 'status="400"')    # its code, where set
    assert post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": "many"}).status_code == 400
    assert metric(srv, "moestream_http_errors_total", 'kind="invalid_type"', 'status="400"') == typed + 1


def test_penalties_are_applied_as_generate_applies_them(client, ref):
    plain = ref.generate(PROMPTS[1], max_tokens=24)
    for kw in (dict(presence_penalty=2.0), dict(frequency_penalty=1.5), dict(repeat_penalty=3.0)):
        want = ref.generate(PROMPTS[1], max_tokens=24, **kw)
        assert want.token_ids != plain.token_ids, kw                    # the penalty changes the greedy tokens
        extra = {"return_token_ids": True}
        if "repeat_penalty" in kw:
            extra.update(kw)                                           # llama-server's name, an extension
            kw = {}
        got = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=24, temperature=0,
                                        extra_body=extra, **kw)
        assert got.choices[0].token_ids == want.token_ids, kw


def test_message_without_content_or_with_an_unknown_role_is_a_400_naming_it(srv):
    r = post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"},
                                                         {"role": "assistant", "content": None}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].content", r.text
    llm = srv.app.app.state.moestream.llm
    generic = llm.tokenizer.chat_template                            # chatml: any role is written as it is
    llm.tokenizer.chat_template = QWEN_LIKE
    try:
        r = post(srv, "/v1/chat/completions", {"messages": [{"role": "function", "content": "hi"}], "max_tokens": 2})
        err = r.json()["error"]                                        # OpenAI's role, not this template's
        assert r.status_code == 400 and err["param"] == "messages[0].role" and "'function'" in err["message"]
        ok = post(srv, "/v1/chat/completions", {"messages": [{"role": "developer", "content": "be brief"},
                                                             {"role": "user", "content": "hi"}], "max_tokens": 2})
        assert ok.status_code == 200, ok.text                          # developer is system here
    finally:
        llm.tokenizer.chat_template = generic


QWEN_LIKE = ("{%- for message in messages %}{%- if message.role == 'system' or message.role == 'user' %}"
             "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
             "{%- elif message['role'] == \"assistant\" %}{{- '<|im_start|>assistant\\n' + message.content }}"
             "{%- elif message.role in ['tool'] %}{{- message.content }}{%- endif %}{%- endfor %}"
             "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_template_roles():
    from moestream.server.prompts import template_roles
    assert template_roles(QWEN_LIKE) == {"system", "user", "assistant", "tool"}
    assert template_roles("{{ messages[0]['role'] }}") == set()              # writes any role: no check


def test_one_access_log_line_per_request(srv, caplog):
    caplog.set_level(logging.INFO, logger="moestream.access")
    httpx.get(srv.url + "/health")
    post(srv, "/v1/completions", {"prompt": "hi", "model": "nope"})
    end = time.time() + 5                       # a line is written once the answer is sent, maybe after it arrives
    ours = ('"GET /health"', '"POST /v1/completions"')  # (an earlier test's last line may land here late: not ours)

    def lines():
        msgs = [r.getMessage() for r in caplog.records if r.name == "moestream.access"]
        return [m for m in msgs if any(o in m for o in ours)]
    while len(lines()) < 2 and time.time() < end:
        time.sleep(0.01)
    lines = lines()
    assert len(lines) == 2, lines
    assert '"GET /health" 200' in lines[0] and '"POST /v1/completions" 404' in lines[1]


# --- disconnects ---------------------------------------------------------------------------------------------------
def test_disconnect_frees_slot(srv):
    cancelled = metric(srv, 'moestream_requests_total{outcome="cancelled"}')
    body = {"prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")          # it runs: now hang up
    slots = wait_idle(srv)
    assert all(s["state"] == "idle" for s in slots)
    with pytest.raises(httpx.ReadTimeout):                # not streamed: a client that times out goes away too
        httpx.post(srv.url + "/v1/completions", json={**body, "stream": False}, timeout=0.2)
    assert all(s["state"] == "idle" for s in wait_idle(srv))
    assert metric(srv, 'moestream_requests_total{outcome="cancelled"}') == cancelled + 2
