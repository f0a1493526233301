"""The tokenizer: synth vocabulary, HF and GGUF round trips, streaming decode (chat templates: their own file)."""
from __future__ import annotations

import hashlib
import json
import random

import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as Backend

from moestream.errors import UserError
from moestream.text import tokenizer as tokmod
from moestream.text.tokenizer import Tokenizer, synth_tokenizer

TEXTS = ["Hello world, the river runs past the old mill.", "你好，世界！日本語のテキスト 🌍🚀👩‍👩‍👧 ok",
         "<|im_start|>user\nhi<|im_end|>\n", "  two spaces\n\n\ttab and 12345 and don't", "émoji ✨ mixed 中文 text"]

# Qwen2.5's ChatML template (tools, tool calls, tool responses), as its tokenizer_config.json ships it.
QWEN_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def with_template(tok: Tokenizer, template: str, **kw) -> Tokenizer:
    t = tok.clone()
    t.chat_templates = {"default": template}
    t.chat_template = template
    for k, v in kw.items():
        setattr(t, k, v)
    return t


def hf_dir(tmp_path, tokenizer_config: dict, generation_config: dict | None = None, backend: Backend | None = None):
    (backend or synth_tokenizer()._tok).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if generation_config is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation_config))
    return tmp_path


# ---- the synth tokenizer ----------------------------------------------------------------------------------------
def test_synth_has_1024_tokens_and_the_chatml_specials():
    tok = synth_tokenizer()
    assert tok.vocab_size == 1024
    assert sorted(tok._tok.get_vocab(with_added_tokens=True).values()) == list(range(1024))
    ids = {t: tok._tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert ids == {"<|endoftext|>": 1021, "<|im_start|>": 1022, "<|im_end|>": 1023}
    assert tok.eos_ids == (1023, 1021) and tok.bos_id is None and tok.add_bos is False
    assert tok.special_ids == frozenset(ids.values())
    assert tok.encode("<|im_start|>user") [0] == 1022       # specials stay whole inside text
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_synth_is_deterministic_across_builds():
    first = synth_tokenizer()._tok.to_str()
    tokmod._synth_cached.cache_clear()          # train again (fresh Rust hash maps, so fresh hash seeds)
    assert synth_tokenizer()._tok.to_str() == first
    # The synth:tiny model's token ids depend on these merges: they must never change.
    model = json.loads(first)["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]   # the JSON form varies by version
    digest = hashlib.sha256(json.dumps([model["vocab"], merges], sort_keys=True).encode()).hexdigest()
    assert digest == SYNTH_DIGEST


SYNTH_DIGEST = "14ea833c77a77455060888d402ea6e46cddeb1dd00a1e0280e249c39906b012f"


def test_synth_returns_independent_copies():
    a, b = synth_tokenizer(), synth_tokenizer()
    a._tok.enable_padding(length=50)
    assert len(b._tok.encode("hi").ids) < 50


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(text):
    tok = synth_tokenizer()
    assert tok.decode(tok.encode(text)) == text


def test_bos_is_prepended_only_when_asked():
    tok = synth_tokenizer()
    bos = with_template(tok, tok.chat_template, bos_id=1021, add_bos=True)
    assert bos.encode("hi") == [1021, *tok.encode("hi")]
    assert bos.encode("hi", add_special_tokens=False) == tok.encode("hi")
    assert tok.decode([1022, *tok.encode("x"), 1023], skip_special_tokens=True) == "x"
    assert tok.token_to_piece(tok.encode(" world")[0]).startswith(" ")


# ---- streaming decode -------------------------------------------------------------------------------------------
def stream(tok, ids, skip=False):
    dec = tok.stream_decoder(skip_special_tokens=skip)
    pieces = [dec.push(i) for i in ids]
    return pieces, dec.flush()


@pytest.mark.parametrize("text", TEXTS)
def test_stream_decoder_matches_full_decode_and_never_splits_characters(text):
    tok = synth_tokenizer()
    ids = tok.encode(text)
    pieces, rest = stream(tok, ids)
    assert "".join(pieces) + rest == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces) == any(ord(c) > 127 for c in text)   # multibyte chars were held back


def test_stream_decoder_on_random_ids_including_invalid_utf8():
    tok, rng = synth_tokenizer(), random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(1024) for _ in range(rng.randrange(1, 30))]
        for skip in (False, True):
            pieces, rest = stream(tok, ids, skip)
            assert "".join(pieces) + rest == tok.decode(ids, skip_special_tokens=skip)


def test_stream_decoder_with_a_sentencepiece_style_decoder():
    # Mixtral-style: metaspace, byte fallback, and a leading space stripped at the start of a decode only.
    backend = Backend(models.BPE(byte_fallback=True, unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    backend.train_from_iterator([tokmod.SYNTH_TEXT], trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                                         show_progress=False))
    tok = Tokenizer(backend, bos_id=1, eos_ids=[2], add_bos=True)
    for text in TEXTS:
        ids = tok.encode(text)
        pieces, rest = stream(tok, ids)
        assert "".join(pieces) + rest == tok.decode(ids)
        assert all("\ufffd" not in p for p in pieces)


# ---- Hugging Face directories -----------------------------------------------------------------------------------
def test_from_hf_dir_reads_templates_tokens_and_generation_config(tmp_path):
    d = hf_dir(tmp_path, {"bos_token": {"__type": "AddedToken", "content": "<|endoftext|>", "special": True},
                          "eos_token": {"content": "<|im_end|>"}, "add_bos_token": True,
                          "chat_template": [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]},
               {"eos_token_id": [1021, 1023]})
    tok = Tokenizer.from_hf_dir(d)
    assert (tok.bos_id, tok.eos_ids, tok.add_bos) == (1021, (1023, 1021), True)
    assert tok.chat_template == "D" and tok.apply_chat_template([]) == "D"
    assert tok.apply_chat_template([], tools=[]) == "T"
    assert tok.encode("hi")[0] == 1021
    (d / "chat_template.jinja").write_text("J{{ eos_token }}")    # a separate file wins, as in transformers
    assert Tokenizer.from_hf_dir(d).apply_chat_template([]) == "J<|im_end|>"


def test_from_hf_dir_infers_bos_from_the_post_processor(tmp_path):
    t = with_template(synth_tokenizer(), "x", bos_id=1021, add_bos=True,
                      special_tokens_map={"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"})
    t.save_hf(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del cfg["add_bos_token"]                                 # Llama 3 style: only tokenizer.json says so
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.add_bos and tok.encode("hi") == [1021, *synth_tokenizer().encode("hi")]


@pytest.mark.parametrize("problem", ["missing", "corrupt", "bad_config"])
def test_from_hf_dir_errors_are_user_errors(tmp_path, problem):
    if problem != "missing":
        hf_dir(tmp_path, {})
    if problem == "corrupt":
        (tmp_path / "tokenizer.json").write_text('{"model": 3')
    if problem == "bad_config":
        (tmp_path / "tokenizer_config.json").write_text("{nope")
    with pytest.raises(UserError, match="tokenizer"):
        Tokenizer.from_hf_dir(tmp_path)


def test_save_hf_round_trips(tmp_path):
    tok = synth_tokenizer()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1023, "temperature": 0.7}))
    tok.save_hf(tmp_path)
    back = Tokenizer.from_hf_dir(tmp_path)
    for attr in ("vocab_size", "bos_id", "eos_ids", "add_bos", "chat_template", "special_ids", "special_tokens_map"):
        assert getattr(back, attr) == getattr(tok, attr), attr
    assert json.loads((tmp_path / "generation_config.json").read_text())["temperature"] == 0.7
    assert all(back.encode(t) == tok.encode(t) for t in TEXTS)


@pytest.mark.parametrize("add_bos", [False, True])
def test_transformers_reads_save_hf_the_same(tmp_path, add_bos):
    transformers = pytest.importorskip("transformers")
    tok = with_template(synth_tokenizer(), QWEN_TEMPLATE, bos_id=1021 if add_bos else None, add_bos=add_bos)
    if add_bos:
        tok.special_tokens_map["bos_token"] = "<|endoftext|>"
    tok.save_hf(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert (hf.bos_token_id, hf.eos_token, hf.pad_token) == (tok.bos_id, "<|im_end|>", "<|endoftext|>")
    for text in TEXTS:
        assert hf.encode(text) == tok.encode(text)
        assert hf.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    assert hf.chat_template == tok.chat_template


# ---- GGUF -------------------------------------------------------------------------------------------------------
def check_same(a: Tokenizer, b: Tokenizer):
    for attr in ("vocab_size", "bos_id", "eos_ids", "add_bos", "chat_templates", "special_ids"):
        assert getattr(a, attr) == getattr(b, attr), attr
    for text in TEXTS:
        assert a.encode(text) == b.encode(text)
        assert a.decode(a.encode(text)) == b.decode(a.encode(text))


def test_gguf_fields_round_trip():
    tok = synth_tokenizer()
    fields = tok.gguf_fields()
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "qwen2"
    assert len(fields["tokenizer.ggml.tokens"]) == 1024 and fields["tokenizer.ggml.token_type"][1021:] == [3, 3, 3]
    assert fields["tokenizer.ggml.eos_token_id"] == 1023 and "tokenizer.ggml.bos_token_id" not in fields
    check_same(tok, Tokenizer.from_gguf_fields(fields))


def test_gguf_file_round_trip_and_transformers_agrees(tmp_path):
    gguf = pytest.importorskip("gguf")
    tok = synth_tokenizer()
    f = tok.gguf_fields()
    path = tmp_path / "tok.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_tokenizer_model(f["tokenizer.ggml.model"])
    w.add_tokenizer_pre(f["tokenizer.ggml.pre"])
    w.add_token_list(f["tokenizer.ggml.tokens"])
    w.add_token_types(f["tokenizer.ggml.token_type"])
    w.add_token_merges(f["tokenizer.ggml.merges"])
    w.add_eos_token_id(f["tokenizer.ggml.eos_token_id"])
    w.add_pad_token_id(f["tokenizer.ggml.padding_token_id"])
    w.add_add_bos_token(f["tokenizer.ggml.add_bos_token"])
    w.add_chat_template(f["tokenizer.chat_template"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    fields = {k: v.contents() for k, v in gguf.GGUFReader(str(path)).fields.items()}
    back = Tokenizer.from_gguf_fields(fields)
    check_same(tok, back)
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4 builds GGUF tokenizers differently")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert all(hf.encode(t, add_special_tokens=False) == back.encode(t) for t in TEXTS)


def test_gguf_other_pre_tokenizers_and_padding_ids():
    tok = synth_tokenizer()
    fields = dict(tok.gguf_fields(), **{"tokenizer.ggml.pre": "default"})
    gpt2 = Tokenizer.from_gguf_fields(fields)
    assert gpt2.decode(gpt2.encode(TEXTS[1])) == TEXTS[1]
    assert gpt2.gguf_fields()["tokenizer.ggml.pre"] == "default"
    # A model vocabulary larger than the tokenizer's: ids past the last token are [PADn] UNUSED tokens.
    padded = Tokenizer(tok._tok, eos_ids=tok.eos_ids, vocab_size=1030)
    f = padded.gguf_fields()
    assert f["tokenizer.ggml.tokens"][1029] == "[PAD1029]" and f["tokenizer.ggml.token_type"][1029] == 5
    assert Tokenizer.from_gguf_fields(f).vocab_size == 1030


def test_gguf_of_a_gpt2_style_hf_tokenizer():
    backend = Backend.from_str(synth_tokenizer()._tok.to_str())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)     # GPT-2's own split regex
    tok = Tokenizer(backend, eos_ids=[1021, 1023])
    fields = tok.gguf_fields()
    assert fields["tokenizer.ggml.pre"] == "gpt-2"
    check_same(tok, Tokenizer.from_gguf_fields(fields))


def test_gguf_llama3_eog_tokens_are_stop_ids():
    fields = synth_tokenizer().gguf_fields()
    fields["tokenizer.ggml.tokens"][1021] = "<|eot_id|>"
    fields["tokenizer.ggml.eos_token_id"] = 1022
    # eos first, then the control tokens llama.cpp ends a generation on: <|eot_id|> and <|im_end|>
    assert Tokenizer.from_gguf_fields(fields).eos_ids == (1022, 1021, 1023)


def test_gguf_unsupported_tokenizer_models():
    with pytest.raises(UserError, match="GGUF tokenizer model 'llama' is not supported yet; pass token ids"):
        Tokenizer.from_gguf_fields({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<s>"]})
    backend = Backend(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(UserError, match="byte-level BPE"):
        Tokenizer(backend).gguf_fields()
    backend = Backend(models.BPE({"a": 0}, []))
    backend.add_special_tokens([AddedToken("<x>", special=True)])
    with pytest.raises(UserError, match="byte-level BPE"):
        Tokenizer(backend).gguf_fields()
