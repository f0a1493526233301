"""The command line: thin parsers that build configs and call the library.

    moestream generate -m synth:tiny -p "Once upon a time" -n 32
    moestream generate -m model.gguf -p 1,2,3 -n 64 --cpu-moe --hash
    moestream bench -m model.gguf -p 4096 -n 64 -ub 512,2048,4096 --cpu-moe
    moestream make-model tiny out_dir --format hf

Flags follow llama.cpp's names. A user's mistake prints one line, `error: ...`, and exits 1.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import re
import sys

from . import flags
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
    "serve": ("moestream.server.cli", "serve the model over an OpenAI-compatible HTTP API"),
}


def parse_prompt(text: str, has_tokenizer: bool):
    """Text, or token ids written `1,2,3` (the only form a model without a tokenizer takes)."""
    if re.fullmatch(r"\s*\d+(\s*,\s*\d+)*\s*", text) and not has_tokenizer:
        return [int(t) for t in text.split(",")]
    if not has_tokenizer:
        raise UserError("this model has no tokenizer: give the prompt as comma-separated token ids, e.g. -p 1,2,3")
    return text


def cmd_generate(a: argparse.Namespace) -> int:
    from .api import LLM
    from .runtime.sampling import SamplingParams

    if a.file:
        try:
            a.prompt = open(a.file, encoding="utf-8").read()
        except OSError as e:
            raise UserError(f"cannot read prompt file {a.file!r}: {e.strerror}") from None
    if a.prompt is None:
        raise UserError("no prompt: give -p PROMPT or -f FILE")
    llm = LLM(a.model, flags.to_config(a), progress=True)
    params = SamplingParams(max_tokens=a.n_predict, temperature=a.temp, top_k=a.top_k, top_p=a.top_p,
                            min_p=a.min_p, seed=a.seed, stop=tuple(a.stop), ignore_eos=a.ignore_eos)
    prompt = parse_prompt(a.prompt, llm.tokenizer is not None)
    if a.chat:
        if llm.tokenizer is None:
            raise UserError("--chat needs a model with a tokenizer and a chat template")
        ids = llm.chat_prompt([{"role": "user", "content": prompt}])
    else:
        ids = llm.encode(prompt)
    recorder = None
    if a.trace:
        from .experts.trace import TraceRecorder
        cfg = llm.model_config
        recorder = TraceRecorder(cfg.n_layers, cfg.n_experts, cfg.expert_numel * llm.engine.dtype.itemsize)
        llm.engine.observe(recorder)
    gen = llm.stream(ids, params)
    if not a.hash_only:
        if llm.tokenizer is not None and not a.chat:
            sys.stdout.write(prompt if isinstance(prompt, str) else "")
        for piece in gen:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
    else:
        gen.run()
    res = gen.result
    if recorder is not None:
        recorder.save(a.trace)
    if a.hash or a.hash_only:
        print(f"sha256 {res.sha256} ({len(res.token_ids)} tokens)")
    if a.verbose or a.timings:
        n = len(res.token_ids)
        print(f"prompt: {res.prompt_tokens} tokens in {res.prompt_s * 1e3:.1f} ms "
              f"({res.prompt_tokens / max(res.prompt_s, 1e-9):.1f} tok/s); "
              f"generated: {n} tokens in {res.decode_s * 1e3:.1f} ms ({n / max(res.decode_s, 1e-9):.1f} tok/s); "
              f"finish: {res.finish_reason}", file=sys.stderr)
        print_stats(llm.stats(), per_layer=a.verbose)
    return 0


def print_stats(st: dict, per_layer: bool) -> None:
    """The cache counters: this prompt's, the cumulative ones, and (with -v) per layer."""
    if st["cache"]:
        c = st["cache"]
        print(f"moe cache: {c['mib']:.0f} MiB, {c['slots']} slots, {c['policy']}", file=sys.stderr)
    for name in ("prompt", "total"):
        t = st[name]
        print(f"{name}: hits {t['hits']}, misses {t['misses']}, hit rate {t['hit_rate']:.3f}, evictions "
              f"{t['evictions']}, uploaded {t['uploaded_bytes'] / 1e9:.3f} GB in {t['copies']} copies; prefetched "
              f"{t['prefetched']} ({t['prefetch_used']} used, {t['prefetch_wasted']} wasted); waits "
              f"{t['wait_s'] * 1e3:.1f} ms" + (f"; decode read {t['host_read_bytes'] / 1e9:.3f} GB in place "
                                               f"({t['host_reads']} experts)" if t["host_reads"] else ""),
              file=sys.stderr)
    for layer, t in (st["per_layer"].items() if per_layer else ()):
        print(f"  layer {layer:3d}: hit rate {t['hit_rate']:.3f}, uploaded {t['uploaded_bytes'] / 1e6:.1f} MB",
              file=sys.stderr)


def add_arguments(g: argparse.ArgumentParser) -> None:
    """generate's flags: the engine's (flags.py), the prompt's and the sampler's."""
    flags.add_engine_arguments(g)
    g.add_argument("-p", "--prompt", help="prompt text, or comma-separated token ids")
    g.add_argument("-f", "--file", help="read the prompt from a file")
    g.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate (default 64)")
    g.add_argument("--temp", type=float, default=0.0, help="temperature; 0 is greedy (default 0)")
    g.add_argument("--top-k", type=int, default=0, help="top-k sampling; 0 is off")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1.0 is off")
    g.add_argument("--min-p", type=float, default=0.0, help="min-p sampling; 0 is off")
    g.add_argument("-s", "--seed", type=int, default=None, help="random seed for sampling")
    g.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--hash", action="store_true", help="print the sha256 of the generated token ids")
    g.add_argument("--hash-only", action="store_true", help="print only the hash, not the text")
    g.add_argument("--trace", metavar="FILE", help="record the routing of every MoE layer to FILE (.npz)")
    g.add_argument("--timings", action="store_true", help="print prompt and generation speed")
    g.set_defaults(func=cmd_generate)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser. Every subcommand is listed; only `command`'s flags are added (its module
    imported), so parsing one command never imports another's module."""
    ap = argparse.ArgumentParser(prog="moestream", description="Run MoE language models bigger than the GPU.")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt")
    if command == "generate":
        add_arguments(g)
    for name, (module, help) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help)
        if command == name:
            importlib.import_module(module).add_arguments(p)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(name)s: %(message)s")
    try:
        return args.func(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
