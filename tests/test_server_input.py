"""The OpenAI-compatible server under bad input: malformed and out-of-range requests answer 4xx with an OpenAI
error body, hostile transports do not stop it, generated requests never answer 5xx; and loading, API keys and the
queue limit."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from moestream import LLM  # noqa: E402
from moestream.server.app import create_app  # noqa: E402

from serving import CTX, PROMPTS, Server, alone, post, served  # noqa: E402

ref = pytest.fixture(scope="module", name="ref")(alone)
srv = pytest.fixture(scope="module", name="srv")(served)


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


@pytest.mark.parametrize("path, body, message", [
    ("/v1/completions", {"prompt": [[]]}, "prompt: must be a non-empty string, a list of token ids, a list of str"),
    ("/v1/completions", {"prompt": None}, "prompt: must be"),          # pydantic's "prompt.constrained-str: ..."
    ("/v1/completions", {"prompt": "hi", "stop": 5}, "stop: must be a non-empty string or a list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content: must be a string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content: a text content part needs its text"),        # not "only text parts ..., got type 'text'"
])
def test_a_value_that_fits_none_of_a_fields_types_names_the_field(srv, path, body, message):
    err = post(srv, path, body).json()["error"]
    assert err["message"].startswith(message) and err["param"] == message.split(":")[0], err


HI = [{"role": "user", "content": "hi"}]


# OpenAI's answers: 400 invalid_request_error, param the field as it writes it, code invalid_type / invalid_value
# ("Invalid type for 'max_tokens': expected an integer, but got a string instead."); tools: not implemented yet, so
# refused as OpenAI refuses a parameter a model does not take (unsupported_parameter), not silently ignored.
@pytest.mark.parametrize("path, body, param, code, message", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": "4"}, "max_tokens", "invalid_type",
     "max_tokens: expected an integer, but got a string instead"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4.0}, "max_tokens", "invalid_type",
     "max_tokens: expected an integer, but got a decimal number instead"),
    ("/v1/chat/completions", {"messages": HI, "stream": "yes"}, "stream", "invalid_type",
     "stream: expected a boolean, but got a string instead"),
    ("/v1/completions", {"prompt": "hi", "echo": 1}, "echo", "invalid_type",
     "echo: expected a boolean, but got an integer instead"),
    ("/v1/completions", {"prompt": "hi", "temperature": "0.5"}, "temperature", "invalid_type",
     "temperature: expected a number, but got a string instead"),
    ("/tokenize", {"content": "hi", "add_special": "true"}, "add_special", "invalid_type",
     "add_special: expected a boolean, but got a string instead"),
    ("/v1/chat/completions", {"messages": [{"role": "narrator", "content": "hi"}]}, "messages[0].role",
     "invalid_value", "messages[0].role: invalid value 'narrator'; supported values are 'system', 'developer', "),
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
     "unsupported_parameter", "tools: moestream does not support tools yet"),
    ("/v1/chat/completions", {"messages": HI, "tool_choice": "required"}, "tool_choice", "unsupported_parameter",
     "tool_choice: moestream does not support tools yet"),
    ("/v1/chat/completions", {"messages": HI, "functions": [{"name": "f"}]}, "functions", "unsupported_parameter",
     "functions: moestream does not support tools yet"),
])
def test_a_value_of_the_wrong_type_or_a_tool_is_a_400_in_one_line(srv, path, body, param, code, message):
    r = post(srv, path, body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "invalid_request_error", r.text
    assert (err["param"], err["code"]) == (param, code) and err["message"].startswith(message), err
    assert "\n" not in err["message"]


def test_neutral_values_of_what_is_not_implemented_are_taken(srv):
    """No tools, a tool choice among none, an integer for a number: what OpenAI takes, and what asks for nothing
    moestream leaves out."""
    r = post(srv, "/v1/chat/completions", {"messages": HI, "max_tokens": 2, "temperature": 0, "tools": [],
                                           "tool_choice": "none", "stream": False})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text


def test_hostile_transport_and_server_keeps_serving(srv, ref):
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
