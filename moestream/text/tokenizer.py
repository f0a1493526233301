"""Text <-> token ids for a model: encoding, chat templates, streaming detokenization, HF and GGUF forms.

    tok = Tokenizer.from_hf_dir("models/Qwen3-30B-A3B")        # or Tokenizer.from_gguf_fields(meta), synth_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    ids = tok.encode(prompt)
    dec = tok.stream_decoder()
    text = "".join(dec.push(i) for i in generated_ids) + dec.flush()

The model families we run ship `tokenizers` pipelines (byte-level BPE for Qwen, OLMoE and Llama 3; Mixtral's BPE with
byte fallback), so this wraps a `tokenizers.Tokenizer` and adds what generation needs: bos/eos ids, the chat template
rendered exactly as transformers renders it, and conversion to and from GGUF's tokenizer metadata.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as _Backend

from ..errors import UserError
from .chat_template import render_chat
from .synth import SYNTH_TEXT

# Pre-tokenizer split regexes, by GGUF `tokenizer.ggml.pre` name; any other byte-level vocabulary gets GPT-2's.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"qwen2": QWEN2_SPLIT, "deepseek-r1-qwen": QWEN2_SPLIT, "llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT,
           "llama-v3": LLAMA3_SPLIT, "dbrx": LLAMA3_SPLIT, "smaug-bpe": LLAMA3_SPLIT}
# GGUF token types (gguf.TokenType).
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
# Control tokens that llama.cpp treats as end of generation whatever the file's eos id says; we do the same, so
# that a GGUF of Qwen stops on both <|im_end|> and <|endoftext|> like its generation_config.json says.
_EOG_TEXTS = frozenset(("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                        "<|return|>", "<|call|>", "<EOT>", "<｜end▁of▁sentence｜>"))
# The named special tokens transformers passes to chat templates (its SPECIAL_TOKENS_ATTRIBUTES).
_NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
SYNTH_VOCAB = 1024
SYNTH_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
SYNTH_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the bos/eos ids, the chat template and the named special tokens of a model."""

    def __init__(self, backend: _Backend, *, bos_id: int | None = None, eos_ids=(), add_bos: bool = False,
                 chat_templates: dict[str, str] | None = None, special_tokens_map: dict[str, str] | None = None,
                 pre: str | None = None, vocab_size: int | None = None):
        self._tok = backend
        self.vocab_size = vocab_size or max(backend.get_vocab(with_added_tokens=True).values()) + 1
        self.bos_id = bos_id
        self.eos_ids = tuple(dict.fromkeys(int(i) for i in eos_ids))   # ordered, without repeats
        self.add_bos = bool(add_bos) and bos_id is not None
        self.chat_templates = dict(chat_templates or {})               # name -> template; "default" is the one used
        self.chat_template = self.chat_templates.get("default")
        self.special_tokens_map = dict(special_tokens_map or {})       # "eos_token" -> "<|im_end|>", for templates
        self.special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self.pre = pre                                                 # GGUF pre-tokenizer name, when known

    def clone(self) -> Tokenizer:
        """An independent copy (the backend is mutable: padding and truncation settings)."""
        return Tokenizer(_Backend.from_str(self._tok.to_str()), bos_id=self.bos_id, eos_ids=self.eos_ids,
                         add_bos=self.add_bos, chat_templates=self.chat_templates,
                         special_tokens_map=self.special_tokens_map, pre=self.pre, vocab_size=self.vocab_size)

    # ---- loading ---------------------------------------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, path) -> Tokenizer:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise UserError(f"{file} not found; the model directory needs its tokenizer.json "
                            "(copy it from the model's repo)")
        try:
            backend = _Backend.from_file(str(file))
        except Exception as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(f"{file} is not a valid tokenizer.json ({why}); download it again") from None
        cfg, gen = _read_json(path / "tokenizer_config.json"), _read_json(path / "generation_config.json")

        # Templates: tokenizer_config's (a string, or named ones in newer checkpoints), then separate files, which
        # win, as in transformers.
        templates: dict[str, str] = {}
        tc = cfg.get("chat_template")
        if isinstance(tc, str):
            templates["default"] = tc
        elif isinstance(tc, list):
            templates.update({t["name"]: t["template"] for t in tc if isinstance(t, dict) and "name" in t})
        legacy = _read_json(path / "chat_template.json").get("chat_template")
        if isinstance(legacy, str):
            templates["default"] = legacy
        if (path / "chat_template.jinja").is_file():
            templates["default"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
        for f in sorted((path / "additional_chat_templates").glob("*.jinja")):
            templates[f.stem] = f.read_text(encoding="utf-8")

        named = {k: c for k in _NAMED if isinstance(c := _content(cfg.get(k)), str)}
        bos_id = backend.token_to_id(named["bos_token"]) if "bos_token" in named else None
        eos = [backend.token_to_id(named["eos_token"])] if "eos_token" in named else []
        g = gen.get("eos_token_id")
        eos += g if isinstance(g, list) else [g]
        add_bos = cfg.get("add_bos_token")
        if not isinstance(add_bos, bool):      # no flag: the tokenizer.json post-processor says (Llama 3 style)
            add_bos = bos_id is not None and _post_processor_adds(backend, bos_id)
        return cls(backend, bos_id=bos_id, eos_ids=[i for i in eos if isinstance(i, int)], add_bos=add_bos,
                   chat_templates=templates, special_tokens_map=named)

    @classmethod
    def from_gguf_fields(cls, fields: dict) -> Tokenizer:
        """From GGUF metadata as plain Python values (lists, ints, strs; numpy values are accepted too)."""
        model = _plain(fields.get("tokenizer.ggml.model"))
        if model != "gpt2":
            raise UserError(f"GGUF tokenizer model {model!r} is not supported yet; pass token ids instead of text "
                            "(e.g. -p 1,2,3), or load the model's Hugging Face directory")
        tokens = [_plain(t) for t in fields["tokenizer.ggml.tokens"]]
        types = [int(t) for t in fields.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))]
        merges = [m if isinstance(m, str) else " ".join(m)
                  for m in map(_plain, fields.get("tokenizer.ggml.merges", []))]
        pre = _plain(fields.get("tokenizer.ggml.pre")) or "default"

        spell, alphabet = _byte_chars(), set(_byte_chars().values())
        vocab: dict[str, int] = {}
        control, user = [], []
        for i, (t, ty) in enumerate(zip(tokens, types)):
            if ty in (CONTROL, USER_DEFINED):   # kept whole in text, spelled as raw text (as llama.cpp does)
                (control if ty == CONTROL else user).append(AddedToken(t, special=ty == CONTROL, normalized=False))
            elif not set(t) <= alphabet:       # some converters store raw text: respell in the byte alphabet
                t = "".join(spell[b] for b in t.encode("utf-8"))
            vocab.setdefault(t, i)             # the vocabulary holds added tokens too, so they keep their ids
        try:
            bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                             ignore_merges=_SPLITS.get(pre) is LLAMA3_SPLIT)
        except Exception as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__       # the tokenizers library's: lines
            raise UserError(f"GGUF tokenizer metadata is inconsistent ({why}); re-convert the model") from None
        backend = _Backend(bpe)
        split = _SPLITS.get(pre)
        backend.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else
                                 pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                          pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                   use_regex=False)]))
        backend.decoder = decoders.ByteLevel()
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
        backend.add_special_tokens(control)
        backend.add_tokens(user)

        def tid(key):
            v = fields.get(f"tokenizer.ggml.{key}")
            return None if v is None else int(v)
        ids = {"bos_token": tid("bos_token_id"), "eos_token": tid("eos_token_id"),
               "unk_token": tid("unknown_token_id"), "pad_token": tid("padding_token_id")}
        named = {name: tokens[i] for name, i in ids.items() if i is not None and i < len(tokens)}
        eos = [tid(k) for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
        eos += [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == CONTROL and t in _EOG_TEXTS]
        # The default template, and named ones under tokenizer.chat_template.NAME (tool_use, rag, ...).
        templates = {"default" if k == "tokenizer.chat_template" else k.rsplit(".", 1)[1]: _plain(v)
                     for k, v in fields.items() if k.split(".")[:2] == ["tokenizer", "chat_template"]}
        return cls(backend, bos_id=tid("bos_token_id"), eos_ids=[i for i in eos if i is not None],
                   add_bos=bool(_plain(fields.get("tokenizer.ggml.add_bos_token", False))), chat_templates=templates,
                   special_tokens_map=named, pre=pre, vocab_size=len(tokens))

    # ---- writing ---------------------------------------------------------------------------------------------
    def gguf_fields(self) -> dict:
        """This tokenizer as GGUF metadata (llama.cpp's keys, plain Python values), for a GGUF writer to embed."""
        spec = json.loads(self._tok.to_str())
        model = spec["model"]
        if model["type"] != "BPE" or (spec.get("decoder") or {}).get("type") != "ByteLevel":
            raise UserError(f"only byte-level BPE tokenizers can be written to GGUF, this one is {model['type']}; "
                            "convert the model with llama.cpp's convert_hf_to_gguf.py instead")
        pre = self.pre or _detect_pre(spec["pre_tokenizer"])
        # Ids no token holds (padding up to the model's size) become "[PADn]" UNUSED tokens, as llama.cpp writes them.
        tokens = [f"[PAD{i}]" for i in range(self.vocab_size)]
        types = [UNUSED] * self.vocab_size
        for t, i in model["vocab"].items():
            tokens[i], types[i] = t, NORMAL
        for a in spec["added_tokens"]:
            tokens[a["id"]], types[a["id"]] = a["content"], CONTROL if a["special"] else USER_DEFINED
        out = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
               "tokenizer.ggml.token_type": types,
               "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in model["merges"]],
               "tokenizer.ggml.add_bos_token": self.add_bos}
        if self.bos_id is not None:
            out["tokenizer.ggml.bos_token_id"] = self.bos_id
        if self.eos_ids:
            out["tokenizer.ggml.eos_token_id"] = self.eos_ids[0]
            # One more stop id fits in eot_token_id; the reader finds the usual end tokens by their text anyway.
            more = [i for i in self.eos_ids[1:] if not (types[i] == CONTROL and tokens[i] in _EOG_TEXTS)]
            if more:
                out["tokenizer.ggml.eot_token_id"] = more[0]
        for name, key in (("pad_token", "padding_token_id"), ("unk_token", "unknown_token_id")):
            if (i := self._tok.token_to_id(self.special_tokens_map.get(name, ""))) is not None:
                out[f"tokenizer.ggml.{key}"] = i
        for name, template in self.chat_templates.items():
            out["tokenizer.chat_template" + ("" if name == "default" else f".{name}")] = template
        return out

    def save_hf(self, out_dir) -> None:
        """Write tokenizer.json and tokenizer_config.json, and add eos_ids to generation_config.json (created if
        absent), so that `Tokenizer.from_hf_dir` and transformers' `AutoTokenizer` read this tokenizer back."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        backend = _Backend.from_str(self._tok.to_str())
        # transformers ignores add_bos_token when there is a tokenizer.json: bos must come from its post-processor.
        if self.add_bos != _post_processor_adds(backend, self.bos_id):
            bos = self._tok.id_to_token(self.bos_id) if self.add_bos else None
            backend.post_processor = (processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                                    special_tokens=[(bos, self.bos_id)])
                                      if bos else processors.TemplateProcessing(single="$A", pair="$A $B"))
        backend.save(str(out / "tokenizer.json"))
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": self.add_bos,
               "clean_up_tokenization_spaces": False, "model_max_length": 1 << 30, **self.special_tokens_map}
        if set(self.chat_templates) == {"default"}:
            cfg["chat_template"] = self.chat_template
        elif self.chat_templates:
            cfg["chat_template"] = [{"name": n, "template": t} for n, t in self.chat_templates.items()]
        (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", "utf-8")
        # The model writer may have written generation_config.json already: add our stop ids to its own.
        gen = _read_json(out / "generation_config.json")
        had = gen.get("eos_token_id")
        gen["eos_token_id"] = list(dict.fromkeys([*(had if isinstance(had, list) else [had] if had is not None else []),
                                                  *self.eos_ids]))
        gen.setdefault("bos_token_id", self.bos_id)
        (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", "utf-8")

    # ---- text <-> ids ----------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # bos is ours to add, not the post-processor's: one rule for HF, GGUF and synth tokenizers.
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_special_tokens and self.add_bos else ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_piece(self, token_id: int) -> str:
        """The text of one token ("\\ufffd" where it holds part of a UTF-8 character)."""
        return self.decode([token_id])

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens)

    # ---- chat ------------------------------------------------------------------------------------------------
    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tools=None, **kwargs) -> str:
        """Render messages with the model's template, the way transformers' `apply_chat_template(tokenize=False)`
        does. The result holds the template's own special tokens (bos too, where it writes one): encode it with
        `add_special_tokens=False` when the template starts with `{{ bos_token }}`."""
        template = self.chat_templates.get("tool_use") if tools is not None else None
        template = template or self.chat_template
        if template is None:
            raise UserError("model has no chat template; use a completion prompt or pass --chat-template FILE")
        return render_chat(template, messages, self.special_tokens_map, add_generation_prompt, tools, **kwargs)


class StreamDecoder:
    """Detokenizes one token at a time: `push(id)` returns only newly completed text, `flush()` the rest.

    Byte-level tokens can end inside a multibyte character, which decodes to a trailing U+FFFD: that text is held
    back until a later token completes it. Each push decodes a short window, ids[prefix:], and returns what it adds
    to ids[prefix:read] (read = ids emitted so far); the prefix tokens give decoders that depend on context (the
    leading-space rule of sentencepiece-style tokenizers) the same context they have in a full decode.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tok, self._skip = tokenizer, skip_special_tokens
        self._ids: list[int] = []
        self._prefix = self._read = 0

    def _new_text(self) -> str:
        before = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        return self._tok.decode(self._ids[self._prefix:], self._skip)[len(before):]

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        text = self._new_text()
        if not text or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text

    def flush(self) -> str:
        """What is still held back (an unfinished character comes out as U+FFFD, as in a full decode)."""
        text = self._new_text()
        self._prefix = self._read = len(self._ids)
        return text


def synth_tokenizer() -> Tokenizer:
    """A deterministic byte-level BPE tokenizer of exactly 1024 tokens, trained in memory on built-in English text:
    256 byte tokens, 765 merges, then <|endoftext|>, <|im_start|>, <|im_end|> at ids 1021..1023 as in Qwen's layout.
    """
    return _synth_cached().clone()


@lru_cache(maxsize=1)
def _synth_cached() -> Tokenizer:
    backend = _Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    n_learned = SYNTH_VOCAB - len(SYNTH_SPECIALS)
    backend.train_from_iterator([SYNTH_TEXT], trainers.BpeTrainer(
        vocab_size=n_learned, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    if backend.get_vocab_size() != n_learned:   # the text must allow enough merges
        raise RuntimeError(f"synth tokenizer: trained {backend.get_vocab_size()} tokens, wanted {n_learned}")
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SYNTH_SPECIALS])
    ids = {t: backend.token_to_id(t) for t in SYNTH_SPECIALS}
    return Tokenizer(backend, bos_id=None, eos_ids=(ids["<|im_end|>"], ids["<|endoftext|>"]), add_bos=False,
                     chat_templates={"default": SYNTH_TEMPLATE}, pre="qwen2",
                     special_tokens_map={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})


# ---- helpers ---------------------------------------------------------------------------------------------------
def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise UserError(f"{path} is not valid JSON ({e}); download it again") from None
    return data if isinstance(data, dict) else {}


def _content(v):
    """A special token as tokenizer_config.json spells it: "<s>", or {"content": "<s>", ...} (AddedToken form)."""
    return v.get("content") if isinstance(v, dict) else v


def _plain(v):
    """A GGUF value as plain Python: numpy scalars and arrays to int/str/list, bytes to str."""
    if isinstance(v, (bytes, bytearray)):
        return bytes(v).decode("utf-8", errors="replace")
    if hasattr(v, "tolist"):
        return v.tolist()
    return v


def _post_processor_adds(backend: _Backend, bos_id: int | None) -> bool:
    return bos_id is not None and backend.encode("a", add_special_tokens=True).ids[:1] == [bos_id]


def _detect_pre(pre: dict | None) -> str:
    """The GGUF pre-tokenizer name of a tokenizer.json byte-level pre-tokenizer."""
    if pre and pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else []
    regexes = [s["pattern"].get("Regex") for s in steps if s.get("type") == "Split"]
    for name in ("qwen2", "llama-bpe"):
        if regexes == [_SPLITS[name]]:
            return name
    raise UserError("this tokenizer's pre-tokenizer has no GGUF name we know (qwen2, llama-bpe, gpt-2); "
                    "convert the model with llama.cpp's convert_hf_to_gguf.py instead")


@lru_cache(maxsize=1)
def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet byte-level vocabularies are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(rest)}}
