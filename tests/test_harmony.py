"""gpt-oss's harmony format in the server (server/harmony.py, openai_format.py, prompts.py): the analysis channel is
returned as reasoning_content and the final channel as content, streamed and not, on a scripted completion (no
model); reasoning_effort reaches the chat template."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from moestream.server.harmony import HarmonySplit, is_harmony, split
from moestream.server.openai_format import Formatter

TEXT = ("<|channel|>analysis<|message|>The user says hi. <|im|> is not a marker.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?")


def test_split_a_whole_answer():
    assert split(TEXT) == ("The user says hi. <|im|> is not a marker.", "Hello! How can I help?")
    assert split(TEXT + "<|return|>") == split(TEXT)
    assert split("plain text, no channels") == ("", "plain text, no channels")
    assert split("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>") == ("", "{}")


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_in_any_pieces_gives_the_same_split(size):
    """Markers cut over pieces are held back until whole; what the pieces give joins to the whole answer's split."""
    s = HarmonySplit()
    parts = [p for i in range(0, len(TEXT), size) for p in s.feed(TEXT[i:i + size])] + s.finish()
    got = ("".join(t for f, t in parts if f == "reasoning_content"), "".join(t for f, t in parts if f == "content"))
    assert got == split(TEXT)
    assert all(t and "<|channel|>" not in t and "<|message|>" not in t for _, t in parts)
    fields = [f for f, _ in parts]
    assert fields.index("content") > max(i for i, f in enumerate(fields) if f == "reasoning_content")


def _body(stream: bool):
    return SimpleNamespace(n=1, include_usage=False, logprobs=False, top_logprobs=None, return_token_ids=False,
                           stream=stream)


def _result(text: str):
    return SimpleNamespace(text=text, finish_reason="stop", stop_reason=None, token_ids=[1, 2], cached_tokens=0,
                           logprobs=None)


def test_server_answer_streamed_and_not():
    """The chat response's message and its stream's deltas, from the token pieces a gpt-oss model writes."""
    pieces = ["<|channel|>", "analysis", "<|message|>", "The user", " says hi. <|im|> is not a marker.", "<|end|>",
              "<|start|>", "assistant", "<|channel|>", "final", "<|message|>", "Hello!", " How can I help?"]
    out = Formatter("chat", "gpt-oss", None, _body(True), [[1, 2, 3]], harmony=True)
    chunks = [c for p in pieces for c in out.event(("token", 0, p, None))]
    chunks += out.event(("done", 0, _result("".join(pieces))))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user says hi. <|im|> is not a marker."
    assert "".join(d.get("content", "") for d in deltas) == "Hello! How can I help?"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"

    whole = Formatter("chat", "gpt-oss", None, _body(False), [[1, 2, 3]], harmony=True)
    whole.event(("done", 0, _result("".join(pieces))))
    msg = whole.response()["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "Hello! How can I help?",
                   "reasoning_content": "The user says hi. <|im|> is not a marker."}
    plain = Formatter("chat", "m", None, _body(False), [[1]])       # a model without harmony: as it was
    plain.event(("done", 0, _result(TEXT)))
    assert plain.response()["choices"][0]["message"] == {"role": "assistant", "content": TEXT}


def test_reasoning_effort_reaches_the_template():
    from moestream.server.prompts import chat_prompt
    from moestream.server.schemas import ChatRequest
    seen = {}

    class Tok:
        chat_template = "{{ reasoning_effort }}<|start|>assistant<|channel|>"

        def apply_chat_template(self, msgs, add_generation_prompt, tools, **extra):
            seen.update(extra)
            return "x"

        def encode(self, text, add_special_tokens):
            return [1]

    body = ChatRequest(messages=[{"role": "user", "content": "hi"}], reasoning_effort="high")
    assert chat_prompt(SimpleNamespace(tokenizer=Tok()), body) == [1]
    assert seen["reasoning_effort"] == "high" and is_harmony(Tok())
