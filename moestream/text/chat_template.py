"""Chat templates rendered as transformers renders them (`apply_chat_template(tokenize=False)`): a sandboxed jinja2
environment with transformers' extras (`{% generation %}`, `raise_exception`, `strftime_now`, a `tojson` that does
not escape HTML), and transformers' clean-up of the messages.

    text = render_chat(template, [{"role": "user", "content": "Hi"}], {"eos_token": "<|im_end|>"})
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from ..errors import UserError


def render_chat(template: str, messages, special_tokens_map: dict, add_generation_prompt: bool = True, tools=None,
                **kwargs) -> str:
    # As transformers does: keys set to None are dropped (OpenAI clients send content=None with tool calls),
    # and reasoning given under an older name is also passed as reasoning_content (and thinking).
    msgs = []
    for m in messages:
        m = {k: v for k, v in dict(m).items() if v is not None}
        reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        msgs.append(m)
    context = {**special_tokens_map, "documents": None, **kwargs, "messages": msgs, "tools": tools,
               "add_generation_prompt": add_generation_prompt}
    try:
        return _compile(template).render(context)
    except jinja2.TemplateError as e:
        raise UserError(f"chat template failed: {e}; fix the template or pass --chat-template FILE") from None
    except UserError:                       # raise_exception's
        raise
    except Exception as e:                  # the template's own expressions: a string plus a number, 1 / 0, ...
        raise UserError(f"chat template failed: {type(e).__name__}: {e}; fix the template or pass --chat-template "
                        "FILE") from None


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers' marker of assistant text; renders its body as is."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise UserError(f"chat template: {message}")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes HTML characters, which changes the prompt; transformers overrides it the same way
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise UserError(f"chat template does not parse (line {e.lineno}: {e.message}); "
                        "pass --chat-template FILE") from None
