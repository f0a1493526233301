"""The OpenAI-compatible server, started for real on a loopback port and driven with the official `openai` client.

Greedy outputs must equal `LLM.generate` of the same prompt run alone, whatever else the server runs at the time.
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import socket
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from moestream import LLM  # noqa: E402
from moestream.server.app import create_app  # noqa: E402

CTX = 256
PROMPTS = ["Once upon a time", "The river runs past the old mill", "Numbers, dates and prices",
           "She opened the window", "Winter came early that year", "A mixture of experts is"]


class Server:
    """uvicorn in a background thread, on a socket bound here (so the port is known and never raced for)."""

    def __init__(self, app):
        self.app = app
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = "http://127.0.0.1:%d" % sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def ref():
    return LLM("synth:tiny", ctx_size=CTX)


@pytest.fixture(scope="module")
def srv():
    s = Server(create_app(llm=LLM("synth:tiny", ctx_size=CTX, n_seq=4), n_slots=4, max_queue=8,
                          model_name=["tiny", "tiny-alias"], max_body=1 << 20, access_log=True))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def post(srv, path, body, **kw):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(srv.url + path, content=data, headers={"Content-Type": "application/json"}, timeout=30, **kw)


def wait_idle(srv, timeout=10.0) -> list[dict]:
    end = time.time() + timeout
    while True:
        slots = httpx.get(srv.url + "/slots").json()
        if all(s["state"] == "idle" for s in slots) or time.time() > end:
            return slots
        time.sleep(0.02)


def metric(srv, name: str, *labels: str) -> float:
    """The value of metric `name` on the line holding every one of `labels` (e.g. 'kind="model_not_found"')."""
    for line in httpx.get(srv.url + "/metrics").text.splitlines():
        if (line.startswith(name + " ") or line.startswith(name + "{")) and all(l in line for l in labels):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


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


def test_n_and_prompt_batch(client, ref):
    out = client.completions.create(model="tiny", prompt=PROMPTS[:2], n=2, max_tokens=5, temperature=0)
    texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
    want = [ref.generate(p, max_tokens=5).text for p in PROMPTS[:2]]
    assert texts == [want[0], want[0], want[1], want[1]]


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
    assert post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": "many"}).status_code == 400
    assert metric(srv, "moestream_http_errors_total", 'kind="invalid_request_error"', 'status="400"') == bad + 1


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
        r = post(srv, "/v1/chat/completions", {"messages": [{"role": "narrator", "content": "hi"}], "max_tokens": 2})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "messages[0].role" and "'narrator'" in err["message"]
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
    from moestream.server.app import template_roles
    assert template_roles(QWEN_LIKE) == {"system", "user", "assistant", "tool"}
    assert template_roles("{{ messages[0]['role'] }}") == set()              # writes any role: no check


def test_one_access_log_line_per_request(srv, caplog):
    caplog.set_level(logging.INFO, logger="moestream.access")
    httpx.get(srv.url + "/health")
    post(srv, "/v1/completions", {"prompt": "hi", "model": "nope"})
    end = time.time() + 5                       # a line is written once the answer is sent, maybe after it arrives
    while len(lines := [r.getMessage() for r in caplog.records if r.name == "moestream.access"]) < 2 \
            and time.time() < end:
        time.sleep(0.01)
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


# --- hostile input ---------------------------------------------------------------------------------------------------
BAD = [
    ("/v1/completions", b'{"prompt": "hi", ', 400),                                   # malformed JSON
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400),                              # invalid UTF-8
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400),
    ("/v1/completions", {"prompt": 5}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10 ** 30}, 400),
    ("/v1/completions", {"prompt": "hi", "max_tokens": CTX}, 400),                    # beyond the context
    ("/v1/completions", {"prompt": "hi", "seed": 10 ** 30}, 400),
    ("/v1/completions", {"prompt": "hi", "temperature": 1e308}, 400),
    ("/v1/completions", {"prompt": "hi", "n": 1000}, 400),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3.0}, 400),                # OpenAI's range: -2..2
    ("/v1/completions", {"prompt": "hi", "repeat_penalty": 0}, 400),
    ("/v1/completions", {"prompt": [10 ** 12]}, 400),
    ("/v1/completions", {"prompt": [5000]}, 400),                                     # outside the vocabulary
    ("/v1/completions", {"prompt": ""}, 400),
    ("/v1/completions", {"prompt": "word " * 2 * CTX, "max_tokens": 1}, 400),          # longer than the context
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": "hi"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 100}, 400),
    ("/detokenize", {"tokens": [-1]}, 400),
    ("/tokenize", {"content": 12}, 400),
]


@pytest.mark.parametrize("path, body, status", BAD, ids=range(len(BAD)))
def test_bad_request(srv, path, body, status):
    r = post(srv, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and set(err) == {"message", "type", "param", "code"}


def test_hostile_transport_and_server_keeps_serving(srv, client, ref):
    big = b'{"prompt": "' + b"a" * (1 << 20) + b'"}'
    assert post(srv, "/v1/completions", big).status_code == 413                    # Content-Length
    chunked = httpx.post(srv.url + "/v1/completions", content=iter([big[:1 << 19], big[1 << 19:]]),
                         headers={"Content-Type": "application/json"})
    assert chunked.status_code == 413 and "error" in chunked.json()                   # no Content-Length
    assert httpx.get(srv.url + "/v1/completions").status_code == 405
    assert httpx.get(srv.url + "/nowhere").json()["error"]["type"] == "not_found_error"
    ok = post(srv, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0,
                                       "unknown": {"nested": [1, 2]}, "user": "x", "metadata": {}})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == ref.generate(PROMPTS[0], max_tokens=4).text


def test_schemathesis_no_server_errors(srv):
    """Property-based requests from the server's own OpenAPI schema: nothing may answer 5xx."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
    deadline = time.time() + 25          # past it, every operation still runs, with fewer examples
    checked = []
    operations = [result.ok() for result in schema.get_all_operations()]
    for op in operations:
        modes = [schemathesis.GenerationMode.POSITIVE]
        if op.method.upper() == "POST":                  # an operation without inputs has no negative cases
            modes.append(schemathesis.GenerationMode.NEGATIVE)
        for mode in modes:
            @settings(max_examples=12 if time.time() < deadline else 2, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def check(case):
                body = case.body if isinstance(case.body, dict) else {}
                for key in ("max_tokens", "max_completion_tokens"):     # valid but short: keep the run quick
                    if type(body.get(key)) in (int, float) and body[key] > 8:
                        body[key] = 8
                response = case.call(base_url=srv.url, timeout=30)
                assert response.status_code < 500, (case.method, case.path, case.body, response.text)

            check()
            checked.append((op.method, op.path, mode))
    assert len(operations) >= 5 and len({(m, p) for m, p, _ in checked}) == len(operations)
    assert httpx.get(srv.url + "/health").status_code == 200


# --- loading, keys, the queue ----------------------------------------------------------------------------------------
def test_loading_auth_no_tokenizer_and_queue_limit():
    gate = threading.Event()

    def loader():                                         # a model without a tokenizer, slow to load
        gate.wait(10)
        llm = LLM("synth:tiny", ctx_size=CTX)
        llm.tokenizer = None
        return llm

    s = Server(create_app(loader=loader, n_slots=1, max_queue=0, api_key="sekrit"))
    try:
        assert httpx.get(s.url + "/health").status_code == 503                      # still loading
        auth = {"Authorization": "Bearer sekrit"}
        r = httpx.post(s.url + "/v1/completions", json={"prompt": [1, 2]}, headers=auth)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        assert r.headers["retry-after"] == "5"
        gate.set()
        end = time.time() + 20
        while httpx.get(s.url + "/health").status_code != 200 and time.time() < end:
            time.sleep(0.02)
        assert httpx.get(s.url + "/health").status_code == 200                      # no key needed
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
            r = httpx.post(s.url + "/v1/completions", json={"prompt": [1, 2]}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="sekrit", max_retries=0)
        with pytest.raises(openai.NotFoundError):                               # not the served name
            c.completions.create(model="x", prompt=[1, 2], max_tokens=1)
        ids = [300, 301, 302, 303]
        out = c.completions.create(model="moestream", prompt=ids, max_tokens=4, temperature=0,
                                   extra_body={"return_token_ids": True}).choices[0]
        assert out.text == "".join(f"{t} " for t in out.token_ids) and len(out.token_ids) == 4
        for call in (lambda: c.completions.create(model="moestream", prompt="text", max_tokens=2),
                     lambda: c.chat.completions.create(model="moestream",
                                                       messages=[{"role": "user", "content": "hi"}])):
            with pytest.raises(openai.BadRequestError):
                call()
        stream = c.completions.create(model="moestream", prompt=ids, max_tokens=100, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        next(iter(stream))                                # the one slot is busy, and no request may wait
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model="moestream", prompt=ids, max_tokens=2)
        assert e.value.status_code == 503 and "busy" in e.value.message
        assert e.value.response.headers["retry-after"] == "1"                       # when to try again
        stream.close()
    finally:
        gate.set()
        s.stop()
