"""Request bodies of the OpenAI-compatible API, as pydantic models, and the errors' shape.

    req = ChatRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8})

Unknown fields are ignored (OpenAI clients send extras: user, metadata, store, ...). Types are strict, as OpenAI's
are (max_tokens "4" or stream "yes" is a 400 `invalid_type`, not read as 4 or true), and so are a message's roles
(OpenAI's six; `invalid_value`). Ranges are checked here, so that a bad value is a 400 naming its field; what
depends on the model (the context length, the tokenizer) is checked by the routes. Fields we accept but do not
implement must keep their neutral value (no logit_bias, response_format text, no tools: `unsupported_parameter`),
so that a client never silently gets something other than what it asked for. Penalties follow llama-server's rule
(runtime/sampling.py): presence_penalty, frequency_penalty and repeat_penalty count the last repeat_last_n tokens
(64) of prompt and completion. Extensions, as vLLM and llama-server spell them: top_k, min_p, repeat_penalty,
repeat_last_n, ignore_eos, stop_token_ids, cache_prompt, speculative, return_token_ids, chat_template_kwargs.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator
from pydantic_core import PydanticCustomError

Stop = Annotated[str, StringConstraints(min_length=1)]
TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]
Text = Annotated[str, StringConstraints(min_length=1)]


class _Body(BaseModel):
    # NaN and infinity are not numbers a sampler can use (Python's json reads NaN and Infinity). strict: a value of
    # another JSON type is refused, not converted ("4" is no integer, "yes" no boolean; an integer is a number).
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, lt=1 << 31)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)      # torch.Generator.manual_seed's range
    stop: Stop | list[Stop] | None = Field(None, max_length=16)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=64)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repeat_penalty: float = Field(1.0, gt=0, le=10)
    repeat_last_n: int = Field(64, ge=-1, le=1 << 20)
    # Not implemented: the schema says so (only empty), and the validator below says it in words.
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra={"maxProperties": 0})
    ignore_eos: bool = False
    cache_prompt: bool = True
    speculative: bool = True            # false: no drafts for this request where the server speculates (--spec-type)
    return_token_ids: bool = False

    @model_validator(mode="after")
    def _unsupported(self):
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        return self

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    # A string, a list of token ids (the only form a model without a tokenizer takes), or a batch of either.
    prompt: Text | Annotated[list[TokenId], Field(min_length=1)] | Annotated[list[Text], Field(min_length=1)] | \
        Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)] = Field(...)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=16, description="only null or equal to n")
    logprobs: int | None = Field(None, ge=0, le=5)

    @model_validator(mode="after")
    def _check(self):
        if self.suffix:
            raise ValueError("suffix (fill-in-the-middle) is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it must equal n)")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported (prompt logprobs)")
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            if len(self.prompt) > 64:
                raise ValueError("at most 64 prompts in one request")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts (one for a string or one list of ids)."""
        p = self.prompt
        return list(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]


class ContentPart(_Body):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    type: str
    text: str | None = None


class Message(_Body):
    # Extra keys (tool_calls, tool_call_id, reasoning_content, ...) reach the chat template, as in transformers.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]     # OpenAI's
    content: str | list[ContentPart] | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, v):
        if isinstance(v, list):
            bad = [p.type for p in v if p.type != "text"]
            if bad:
                raise ValueError(f"only text content parts are supported, got type {bad[0]!r}")
            if any(p.text is None for p in v):
                raise ValueError('a text content part needs its text: {"type": "text", "text": "..."}')
            return "".join(p.text for p in v)
        return v


class ChatRequest(_Sampling):
    messages: list[Message] = Field(..., min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Not implemented yet: refused unless neutral (none given, or a choice among none).
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    functions: list[dict] | None = None       # (OpenAI's older spelling of tools)
    function_call: str | dict | None = None
    response_format: dict | None = None
    chat_template_kwargs: dict | None = None
    reasoning_effort: str | None = None       # low | medium | high: to the chat template (gpt-oss's harmony)

    @field_validator("tools", "tool_choice", "functions", "function_call")
    @classmethod
    def _no_tools(cls, v):
        if v and v not in ("none", "auto"):
            raise PydanticCustomError("unsupported_parameter", "moestream does not support tools yet")
        return v

    @model_validator(mode="after")
    def _check(self):
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format other than text is not supported")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


class TokenizeRequest(_Body):
    content: str = Field(..., max_length=1 << 23)
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(_Body):
    tokens: list[TokenId] = Field(..., max_length=1 << 20)


# What a field of several types takes, said when a value fits none of them: pydantic reports each type's failure
# under a tag of the type's name ("prompt.list[constrained-int].0: Input should be a valid integer"), which names
# neither the field's types nor, often, the problem.
TAKES = {"prompt": "a non-empty string, a list of token ids, a list of strings or a list of lists of token ids",
         "stop": "a non-empty string or a list of at most 16 of them",
         "content": 'a string or a list of text parts ({"type": "text", "text": "..."})'}


# A strict type's error: the JSON type it expected (OpenAI's words: "expected an integer, but got a string instead").
EXPECTED = {"int_type": "an integer", "float_type": "a number", "bool_type": "a boolean", "string_type": "a string",
            "list_type": "an array", "dict_type": "an object", "model_type": "an object",
            "model_attributes_type": "an object"}


def json_type(value) -> str:
    """The JSON type of a parsed value, in words."""
    for kind, name in ((bool, "a boolean"), (int, "an integer"), (float, "a decimal number"), (str, "a string"),
                       (list, "an array"), (dict, "an object")):
        if isinstance(value, kind):
            return name
    return "null" if value is None else type(value).__name__


def validation_message(error: dict) -> tuple[str, str | None, str | None]:
    """The message, param and code of a request's first validation error (one of pydantic's error dicts). param as
    OpenAI writes it: messages[0].role."""
    loc = [x for x in error.get("loc", ()) if x != "body"]
    kind = error.get("type")
    if kind == "json_invalid":
        return "the body is not valid JSON", None, None
    if not loc and kind == "model_attributes_type":
        return "the body must be a JSON object, sent with Content-Type: application/json", None, None
    for i, key in enumerate(loc[:-1]):
        if key in TAKES:                    # followed by a type's tag: the value fits none of the field's types
            where = _param(loc[:i + 1])
            return f"{where}: must be {TAKES[key]}", where, None
    where, code = _param(loc), None
    msg = error.get("msg", "invalid").removeprefix("Value error, ")
    if kind in EXPECTED:
        msg, code = f"expected {EXPECTED[kind]}, but got {json_type(error.get('input'))} instead", "invalid_type"
    elif kind == "literal_error":
        msg = f"invalid value {error.get('input')!r}; supported values are {error['ctx']['expected']}"
        code = "invalid_value"
    elif kind == "unsupported_parameter":
        code = kind
    return (f"{where}: {msg}" if where else msg), where or None, code


def _param(loc: list) -> str:
    return "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".")


ErrorType = Literal["invalid_request_error", "authentication_error", "not_found_error", "server_error",
                    "unavailable_error", "request_too_large"]


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.body, self.headers = status, error_body(message, type_, param, code), headers
