"""The command line: thin parsers that build configs and call the library.

    moestream generate -m synth:tiny -p "Once upon a time" -n 32
    moestream generate -m model.gguf -p 1,2,3 -n 64 --cpu-moe --hash
    moestream bench -m model.gguf -p 4096 -n 64 -ub 512,2048,4096 --cpu-moe
    moestream make-model tiny out_dir --format hf

Flags follow llama.cpp's names (and its habits: compat.py). A user's mistake prints one line, `error: ...`, and exits
1 (2 for a flag the command does not take: argv.py), leaving no partial file behind (outputs.py).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys

from . import compat, flags
from .argv import Parser, UsageError
from .errors import UserError

# The subcommands besides generate: name -> (module, one-line help). A module is imported only when its command is
# the one being run (or asked for --help), so that `moestream --help` and `moestream generate ...` import none of
# them; `add_arguments(parser)` adds its flags and sets `func`, its entry point.
SUBCOMMANDS = {
    "make-model": ("moestream.tools.make_model",
                   "write a synth preset (or convert a model) as an HF directory or GGUF"),
    "bench": ("moestream.tools.bench", "measure prompt (pp) and generation (tg) speed, like llama-bench"),
    "replay": ("moestream.tools.replay", "replay a routing trace against cache sizes and policies (offline)"),
    "perplexity": ("moestream.tools.perplexity", "perplexity and KL divergence over a text, like llama-perplexity"),
    "quantize": ("moestream.tools.quantize", "write a model as a quantized GGUF (Q4_K_M, ...), like llama-quantize"),
    "imatrix": ("moestream.tools.imatrix", "an importance matrix over a text (for IQ1/IQ2 files), like llama-imatrix"),
    "serve": ("moestream.server.cli", "serve the model over an OpenAI-compatible HTTP API"),
}


def parse_prompt(text: str, has_tokenizer: bool):
    """Text, or token ids written `1,2,3` (the only form a model without a tokenizer takes)."""
    if re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", text) and not has_tokenizer:
        return [int(t) for t in text.split(",")]
    if not has_tokenizer:
        raise UserError("this model has no tokenizer: give the prompt as comma-separated token ids, e.g. -p 1,2,3")
    return text


ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "'": "'", '"': '"', "\\": "\\", "a": "\a", "b": "\b", "f": "\f",
           "v": "\v", "0": "\0"}


def unescape(text: str) -> str:
    """-e: llama.cpp's escapes (\\n, \\t, \\\\, \\xNN, ...) in a prompt; any other backslash stays as it is."""
    def one(m):
        s = m.group(1)
        return chr(int(s[1:], 16)) if len(s) == 3 else ESCAPES.get(s, "\\" + s)       # \xZZ stays as it is
    return re.sub(r"\\(x[0-9a-fA-F]{2}|.)", one, text, flags=re.S)


def load_model(a: argparse.Namespace, ecfg, progress: bool = True, prepare=None, **kw):
    """The LLM of a command's -m and engine flags. Before its weights load: the habit flags that need the model's
    shape (compat.py), --chat-template's file in place of the model's template, and prepare(source), the command's
    own checks of what needs no weights (generate's prompt)."""
    from .api import LLM
    template = compat.read_chat_template(a.chat_template) if getattr(a, "chat_template", None) else None

    def check(source):
        compat.check_model(a, source.config)
        if template is not None:
            if source.tokenizer is None:
                raise UserError("--chat-template needs a model with a tokenizer; this one takes token ids")
            source.tokenizer.chat_templates = {"default": template}
            source.tokenizer.chat_template = template
        if prepare is not None:
            prepare(source)
    return LLM(a.model, ecfg, progress=progress, check=check, **kw)


def prompt_ids(a: argparse.Namespace, source, chat: bool) -> tuple[str | list[int], list[int]]:
    """generate's prompt (text or ids) and its token ids, from the model's tokenizer alone: a prompt the model
    cannot take is refused before its weights load."""
    from .api import chat_prompt, encode
    tok = source.tokenizer
    prompt = parse_prompt(a.prompt, tok is not None)
    if chat:
        if tok is None:
            raise UserError("--chat (and -cnv, -sys) need a model with a tokenizer and a chat template")
        system = [{"role": "system", "content": a.system_prompt}] if a.system_prompt is not None else []
        ids = chat_prompt(tok, [*system, {"role": "user", "content": prompt}])
    else:
        ids = encode(tok, source.config.vocab_size, prompt)
    if not ids:
        raise UserError("empty prompt: give at least one token")
    return prompt, ids


def cmd_generate(a: argparse.Namespace) -> int:
    from .runtime.sampling import SamplingParams

    if a.file:
        if a.prompt is not None:            # llama.cpp takes the later one without a word
            raise UserError("-p and -f both give the prompt: give one of them")
        try:
            a.prompt = open(a.file, encoding="utf-8").read()
        except OSError as e:
            raise UserError(f"cannot read prompt file {a.file!r}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise UserError(f"prompt file {a.file!r} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    if a.prompt is None:
        raise UserError("no prompt: give -p PROMPT or -f FILE")
    if a.escape:
        a.prompt, a.stop = unescape(a.prompt), [unescape(s) for s in a.stop]
        a.system_prompt = a.system_prompt and unescape(a.system_prompt)
    if a.n_predict < -2:
        raise UserError(f"-n must be a number of tokens, or -1 (until a stop or the end of the context), got "
                        f"{a.n_predict}")
    if a.n_predict < 0:                       # llama.cpp's -n -1 (and -2): until the context is full or a stop
        a.n_predict = 1 << 62
    params = SamplingParams(max_tokens=a.n_predict, temperature=a.temp, top_k=a.top_k, top_p=a.top_p,
                            min_p=a.min_p, seed=a.seed, stop=tuple(a.stop), ignore_eos=a.ignore_eos,
                            repeat_penalty=a.repeat_penalty, repeat_last_n=a.repeat_last_n,
                            presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty)
    if a.trace:
        from .experts.trace import check_trace_path
        check_trace_path(a.trace)
    chat = a.chat or a.conversation or a.system_prompt is not None
    found = []                                # the prompt and its ids, made before the weights load
    llm = load_model(a, flags.to_config(a), prepare=lambda src: found.extend(prompt_ids(a, src, chat)))
    prompt, ids = found
    ctx = llm.engine.kv.ctx
    room = ctx - len(ids) + 1                 # the last token is sampled, never written to the KV cache
    if 0 < room < a.n_predict < 1 << 62:
        print(f"note: -n {a.n_predict} is clipped to {room}: the prompt has {len(ids)} tokens and the context "
              f"-c {ctx}", file=sys.stderr)
    recorder = None
    if a.trace:
        from .experts.trace import record
        recorder = record(llm)
    gen = llm.stream(ids, params)
    if not a.hash_only:
        if llm.tokenizer is not None and not chat:
            sys.stdout.write(prompt if isinstance(prompt, str) else "")
        for piece in gen:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
    else:
        gen.run()
    res = gen.result
    if recorder is not None:
        from .experts.trace import save_trace
        save_trace(recorder, a.trace)
    if a.hash or a.hash_only:
        print(f"sha256 {res.sha256} ({len(res.token_ids)} tokens)")
    if a.verbose or a.timings:
        n = len(res.token_ids)
        steps = max(n - 1, 0)                 # the first token comes from the prompt's logits
        print(f"prompt: {res.prompt_tokens} tokens in {res.prompt_s * 1e3:.1f} ms "
              f"({res.prompt_tokens / max(res.prompt_s, 1e-9):.1f} tok/s); generated: {n} tokens, {steps} decode "
              f"steps in {res.decode_s * 1e3:.1f} ms ({steps / max(res.decode_s, 1e-9):.1f} tok/s); "
              f"finish: {res.finish_reason}", file=sys.stderr)
        spec = res.timings.get("spec")
        if spec and spec["steps"]:
            print(f"draft-mtp: {spec['steps']} verify steps, {spec['accepted']} of {spec['drafted']} drafts accepted "
                  f"({100 * spec['acceptance']:.1f}%), {spec['tokens_per_step']:.2f} tokens a step", file=sys.stderr)
        print_stats(llm.stats(), per_layer=a.verbose)
    return 0


def print_stats(st: dict, per_layer: bool) -> None:
    """The expert counters of the run (its prompt and decode steps) and, with -v, per layer. Nothing about a cache
    where there is none, nor about uploads where every expert is on the device."""
    c, t = st["cache"], st["total"]
    if st.get("ple_bytes"):
        print(f"n-gram embeddings: {st['ple_bytes'] / 1e6:.1f} MB of rows gathered on the host", file=sys.stderr)
    if c is None and not t["copies"] and not t["host_reads"]:
        print("experts: all on the device; none crossed the link", file=sys.stderr)
        return
    parts = []
    if c is not None:
        if c.get("buffer"):
            print(f"moe cache: none; decode keeps recent experts in the {c['mib']:.0f} MiB upload buffer "
                  f"({c['slots']} slots, {c['policy']})", file=sys.stderr)
        else:
            print(f"moe cache: {c['mib']:.0f} MiB, {c['slots']} slots, {c['policy']}", file=sys.stderr)
        parts.append(f"hits {t['hits']}, misses {t['misses']}, hit rate {t['hit_rate']:.3f}, "
                     f"evictions {t['evictions']}")
    parts.append(f"uploaded {t['uploaded_bytes'] / 1e9:.3f} GB in {t['copies']} copies")
    if t["prefetched"]:
        parts.append(prefetch_words(t))
    if c is not None:
        parts.append(f"waits {t['wait_s'] * 1e3:.1f} ms")
    if t["host_reads"]:
        parts.append(f"decode read {t['host_read_bytes'] / 1e9:.3f} GB in place ({t['host_reads']} experts)")
    print("experts (prompt and decode): " + "; ".join(parts), file=sys.stderr)
    for layer, lt in (st["per_layer"].items() if per_layer else ()):
        hit = f"hit rate {lt['hit_rate']:.3f}, " if c is not None else ""
        print(f"  layer {layer:3d}: {hit}uploaded {lt['uploaded_bytes'] / 1e6:.1f} MB", file=sys.stderr)


def prefetch_words(t: dict) -> str:
    """The prefetch counters in words that add up: of the experts copied ahead, those used, those evicted unused,
    and those still in the cache, not used yet."""
    n, used, wasted = t["prefetched"], t["prefetch_used"], t["prefetch_wasted"]
    waiting = n - used - wasted
    if waiting < 0:                          # counters of a window that saw uses of earlier prefetches
        return f"prefetched {n}; {used} prefetched experts used and {wasted} evicted unused (some copied earlier)"
    return f"prefetched {n}: {used} used, {wasted} evicted unused, {waiting} in the cache not used yet"


def add_arguments(g: argparse.ArgumentParser) -> None:
    """generate's flags: the engine's (flags.py), the prompt's, the sampler's, and llama.cpp's habits (compat.py)."""
    flags.add_engine_arguments(g)
    g.add_argument("-p", "--prompt", help="prompt text, or comma-separated token ids")
    g.add_argument("-f", "--file", help="read the prompt from a file (UTF-8 text)")
    g.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate (default 64; -1: until a "
                   "stop or the end of the context)")
    g.add_argument("--temp", type=float, default=0.0, help="temperature; 0 is greedy (default 0)")
    g.add_argument("--top-k", type=int, default=0, help="top-k sampling; 0 is off")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1.0 is off")
    g.add_argument("--min-p", type=float, default=0.0, help="min-p sampling; 0 is off")
    g.add_argument("--repeat-penalty", type=float, default=1.0, help="penalize repeated tokens; 1.0 is off")
    g.add_argument("--repeat-last-n", type=int, default=64, help="tokens the penalties look at (default 64; -1: all)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="lower tokens already seen; 0 is off")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="lower tokens by how often seen; 0 is off")
    g.add_argument("-s", "--seed", type=int, default=None, help="random seed for sampling")
    g.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("-cnv", "--conversation", action="store_true",
                   help="as --chat: one turn, the prompt as the user's message (generate is not interactive)")
    g.add_argument("-no-cnv", "--no-conversation", dest="conversation", action="store_false",
                   help="a plain completion of the prompt (the default)")
    g.add_argument("-sys", "--system-prompt", default=None, help="a system message before the prompt (implies --chat)")
    g.add_argument("-e", "--escape", action="store_true", help="process escapes (\\n, \\t, \\xNN, ...) in -p, -sys, --stop")
    g.add_argument("--no-escape", dest="escape", action="store_false", help="take them literally (the default)")
    g.add_argument("--hash", action="store_true", help="print the sha256 of the generated token ids")
    g.add_argument("--hash-only", action="store_true", help="print only the hash, not the text")
    g.add_argument("--trace", metavar="FILE", help="record the routing of every MoE layer to FILE (.npz)")
    g.add_argument("--timings", action="store_true", help="print prompt and generation speed")
    compat.add_arguments(g, "generate")
    g.set_defaults(func=cmd_generate)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser. Every subcommand is listed; only `command`'s flags are added (its module
    imported), so parsing one command never imports another's module. Flags are taken only as spelled (argv.py)."""
    from . import __version__
    version = f"moestream {__version__}"
    ap = Parser(prog="moestream", description="Run MoE language models bigger than the GPU.")
    ap.add_argument("--version", action="version", version=version)
    sub = ap.add_subparsers(dest="command", required=True, parser_class=Parser)
    g = sub.add_parser("generate", help="generate text from a prompt")
    if command == "generate":
        add_arguments(g)
    for name, (module, help) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help)
        if command == name:
            importlib.import_module(module).add_arguments(p)
    for p in sub.choices.values():
        p.add_argument("--version", action="version", version=version)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser(argv[0] if argv else None).parse_args(argv)
        logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                            format="%(name)s: %(message)s")
        compat.apply(args)
        from tqdm.contrib.logging import logging_redirect_tqdm
        with logging_redirect_tqdm():        # a warning during a load goes above its bar, not onto its line
            return args.func(args)
    except UsageError as e:
        return _fail(str(e), 2)
    except UserError as e:
        return _fail(str(e), 1)
    except KeyboardInterrupt:
        _end_bars()
        return 130
    except BrokenPipeError:                  # `moestream generate ... | head`: the reader has gone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (MemoryError, RuntimeError) as e:
        if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or "can't allocate memory" in str(e):
            return _fail(f"out of memory: {str(e).splitlines()[0] if str(e) else 'an allocation failed'} "
                         "(a smaller -c, --moe-cache-mib or -np, or experts in host memory: --cpu-moe)", 1)
        raise


def _fail(message: str, code: int) -> int:
    _end_bars()
    print(f"error: {message}", file=sys.stderr)
    return code


def _end_bars() -> None:
    """Close the progress bars a failed load left open, so that what comes next starts on a line of its own."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", None) or ()):
        bar.close()
