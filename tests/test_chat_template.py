"""Chat templates (text/chat_template.py) rendered as transformers renders them, through Tokenizer."""
from __future__ import annotations

import json

import pytest

from moestream.errors import UserError
from moestream.text.tokenizer import Tokenizer, synth_tokenizer
from test_tokenizer import QWEN_TEMPLATE, with_template

CHATS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "Réponds en français. <b>bold</b>"}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "Et 你好 ×3?"}],
    [{"role": "user", "content": "Weather in Paris?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}}]},
     {"role": "tool", "content": '{"temp": 21}'}, {"role": "tool", "content": '{"rain": false}'}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> for a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def qwen_pair(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("qwen")
    tok = with_template(synth_tokenizer(), QWEN_TEMPLATE)
    tok.save_hf(d)
    return Tokenizer.from_hf_dir(d), transformers.AutoTokenizer.from_pretrained(str(d))


@pytest.mark.parametrize("chat", range(len(CHATS)))
@pytest.mark.parametrize("gen_prompt", [True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chat_template_renders_like_transformers(qwen_pair, chat, gen_prompt, tools):
    ours, hf = qwen_pair
    want = hf.apply_chat_template(CHATS[chat], tools=tools, add_generation_prompt=gen_prompt, tokenize=False)
    assert ours.apply_chat_template(CHATS[chat], add_generation_prompt=gen_prompt, tools=tools) == want
    assert ours.encode(want, add_special_tokens=False) == hf.apply_chat_template(
        CHATS[chat], tools=tools, add_generation_prompt=gen_prompt, tokenize=True, return_dict=False)


def test_chat_template_extras_like_transformers(qwen_pair):
    _, hf = qwen_pair
    template = ("{% for m in messages %}{{ m | tojson(indent=2) }}{% if m.reasoning_content %}[{{ m.reasoning_content }}]"
                "{% endif %}{% generation %}{{ m.role }}{% endgeneration %}{% break %}{% endfor %}"
                "{{ eos_token }}{{ bos_token }}{{ enable_thinking }}{{ strftime_now('%Y') | length }}")
    ours = with_template(synth_tokenizer(), template)
    msgs = [{"role": "assistant", "content": "é <tag>", "reasoning_content": "hmm"}, {"role": "user"}]
    assert ours.apply_chat_template(msgs, enable_thinking=False) == hf.apply_chat_template(
        msgs, chat_template=template, tokenize=False, add_generation_prompt=True, enable_thinking=False)


def test_messages_are_normalized_like_recent_transformers():
    # transformers >= 5.2x drops keys set to None (OpenAI clients send content=None with tool calls) and passes
    # reasoning sent under an older name as reasoning_content too.
    ours = with_template(synth_tokenizer(), "{% for m in messages %}{{ m | tojson }}{% endfor %}")
    msgs = [{"role": "assistant", "content": None, "reasoning": "hmm"}]
    assert json.loads(ours.apply_chat_template(msgs)) == \
        {"thinking": "hmm", "role": "assistant", "reasoning": "hmm", "reasoning_content": "hmm"}
    assert msgs[0]["content"] is None                         # the caller's messages are left alone


def test_chat_template_variables():
    tok = with_template(synth_tokenizer(), "{{ eos_token }}|{{ documents | tojson }}|{{ tools | tojson }}|{{ x }}|"
                                           "{{ bos_token is defined }}|{{ add_generation_prompt }}")
    assert tok.apply_chat_template([], documents=[{"text": "d"}], x=1) == '<|im_end|>|[{"text": "d"}]|null|1|False|True'
    assert tok.apply_chat_template([], False, tools=TOOLS[:1], eos_token="E").startswith('E|null|[{"type"')


def test_chat_template_errors():
    tok = synth_tokenizer()
    with pytest.raises(UserError, match="model has no chat template; use a completion prompt or pass --chat-template"):
        with_template(tok, None).apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(UserError, match="only user and assistant roles"):
        with_template(tok, "{{ raise_exception('only user and assistant roles') }}").apply_chat_template([])
    with pytest.raises(UserError, match="chat template"):
        with_template(tok, "{% for %}").apply_chat_template([])
    with pytest.raises(UserError, match="chat template"):      # the sandbox refuses internals
        with_template(tok, "{{ messages.__class__.__mro__ }}").apply_chat_template([])
    for broken in ("{{ messages[0].content + 1 }}", "{{ 1 / 0 }}"):         # the template's own code fails
        with pytest.raises(UserError, match=r"chat template failed: (TypeError|ZeroDivisionError): .*--chat-templ"):
            with_template(tok, broken).apply_chat_template([{"role": "user", "content": "x"}])


def test_an_empty_chat_template_file_is_refused_as_such(tmp_path):
    from moestream.compat import read_chat_template
    (tmp_path / "t.jinja").write_text(" \n")
    with pytest.raises(UserError, match=r"--chat-template '.*t.jinja' is empty; give a Jinja chat template file"):
        read_chat_template(str(tmp_path / "t.jinja"))             # not "empty prompt" once it renders nothing
