"""A request's prompt and sampling parameters, checked into what the serving loop takes: token ids (the chat
template applied to messages) and SamplingParams; each mistake a 400 (ApiError) that names the field.

    ids = chat_prompt(llm, body)                         # ChatRequest -> token ids
    p = params(llm, body, len(ids), default_max=16, i=0)
"""
from __future__ import annotations

import re

from ..errors import UserError
from ..runtime.sampling import SamplingParams
from .schemas import ApiError, ChatRequest


def encode(llm, prompt) -> list[int]:
    if isinstance(prompt, str) and llm.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer: give the prompt as token ids (prompt: [1, 2, 3])",
                       param="prompt")
    ids = llm.encode(prompt)                 # UserError (-> 400) for ids outside the vocabulary
    if not ids:
        raise ApiError(400, "the prompt is empty: give at least one token", param="prompt")
    return ids


def chat_prompt(llm, body: ChatRequest) -> list[int]:
    tok = llm.tokenizer
    msgs = [m.model_dump(exclude_none=True) for m in body.messages]
    check_messages(msgs, tok.chat_template)
    reserved = {"messages", "tools", "add_generation_prompt"}
    extra = {k: v for k, v in (body.chat_template_kwargs or {}).items() if k.isidentifier() and k not in reserved}
    if body.reasoning_effort is not None:    # gpt-oss's template reads it (chat_template_kwargs' own wins)
        extra.setdefault("reasoning_effort", body.reasoning_effort)
    try:
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tools=body.tools, **extra)
    except UserError:
        raise
    except Exception as e:                   # a template tripping on unusual input is the input's fault
        raise ApiError(400, f"the chat template failed on these messages: {e}", param="messages") from None
    ids = tok.encode(text, add_special_tokens=False)
    if not ids:
        raise ApiError(400, "the chat template rendered an empty prompt", param="messages")
    return ids


_ROLE_TESTS = (re.compile(r"""role['"]?\]?\s*[!=]=\s*['"]([\w-]+)['"]"""),        # message.role == 'user'
               re.compile(r"""['"]([\w-]+)['"]\s*[!=]=\s*\w+(?:\.role|\[['"]role['"]\])"""))   # 'user' == m.role
_ROLE_LISTS = re.compile(r"""role['"]?\]?\s+(?:not\s+)?in\s*[\[(]([^\])]*)[\])]""")        # role in ['a', 'b']


def template_roles(template: str | None) -> set[str]:
    """The roles a chat template tells apart; empty for a template that writes any role as it is (chatml's)."""
    if not template:
        return set()
    roles = {m for rx in _ROLE_TESTS for m in rx.findall(template)}
    for group in _ROLE_LISTS.findall(template):
        roles.update(re.findall(r"""['"]([\w-]+)['"]""", group))
    return roles


def check_messages(msgs: list[dict], template: str | None) -> None:
    """400s naming the field, for what a template would trip on or silently drop: a message without content
    (only an assistant message calling tools may have none) and a role the template does not know. OpenAI's newer
    `developer` role is `system` for a template that knows only that."""
    roles = template_roles(template)
    for i, m in enumerate(msgs):
        if "content" not in m and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise ApiError(400, f"messages[{i}].content: a {m['role']} message needs content (null is only for an "
                                "assistant message with tool_calls)", param=f"messages[{i}].content")
        if roles and m["role"] not in roles:
            if m["role"] == "developer" and "system" in roles:
                m["role"] = "system"
                continue
            raise ApiError(400, f"messages[{i}].role: {m['role']!r} is not a role this model's chat template knows "
                                f"({', '.join(sorted(roles))})", param=f"messages[{i}].role")


def tokenizer(llm):
    if llm.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer")
    return llm.tokenizer


def check_ids(llm, ids, param) -> None:
    V = llm.model_config.vocab_size
    bad = [i for i in ids if not 0 <= i < V]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{V - 1})", param=param)


def params(llm, body, n_prompt: int, default_max: int | None, i: int) -> SamplingParams:
    ctx, chat = llm.engine.kv.ctx, isinstance(body, ChatRequest)
    if n_prompt >= ctx:
        raise ApiError(400, f"the prompt has {n_prompt} tokens but the context is {ctx} (-c): shorten it",
                       param="messages" if chat else "prompt", code="context_length_exceeded")
    asked = (body.max_completion_tokens if chat else None) or body.max_tokens
    if asked is not None and n_prompt + asked > ctx:
        raise ApiError(400, f"this model's context is {ctx} tokens, but you asked for {n_prompt + asked} "
                            f"({n_prompt} in the prompt, {asked} to generate)", param="max_tokens",
                       code="context_length_exceeded")
    max_tokens = asked if asked is not None else min(default_max or ctx, ctx - n_prompt)
    seed = body.seed
    if seed is not None and i:               # n > 1: each choice its own stream, all reproducible
        seed = (seed + i + (1 << 63)) % (1 << 64) - (1 << 63)
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                              top_k=body.top_k or 0, top_p=1.0 if body.top_p is None else body.top_p,
                              min_p=body.min_p or 0.0, seed=seed, stop=body.stops,
                              stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
                              presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                              repeat_penalty=body.repeat_penalty, repeat_last_n=body.repeat_last_n)
    except UserError as e:
        raise ApiError(400, str(e)) from None
