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

from .errors import UserError

# Modules that add a subcommand each: `add_parser(subparsers)` registers it, with `func` as its entry point.
SUBCOMMANDS = ("moestream.tools.make_model", "moestream.tools.bench", "moestream.tools.replay",
               "moestream.tools.perplexity", "moestream.server.cli")


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The flags every engine-running command shares (placement, batching, device)."""
    p.add_argument("-m", "--model", required=True, help="Hugging Face directory, .gguf file, or synth:NAME")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="KV cache length (default 4096)")
    p.add_argument("-b", "--batch-size", type=int, default=2048, help="logical batch size (default 2048)")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512, help="physical batch size (default 512)")
    p.add_argument("-cmoe", "--cpu-moe", action="store_true", help="keep every MoE layer's experts in host memory")
    p.add_argument("-ncmoe", "--n-cpu-moe", type=int, default=0, metavar="N",
                   help="keep the experts of the first N MoE layers in host memory")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16, float16")
    p.add_argument("--kernel", default="auto", help="expert kernel: auto, reference, grouped")
    p.add_argument("--moe-cache-mib", type=int, default=None, metavar="MIB",
                   help="GPU cache for host-resident experts, in MiB (0: the smallest that works)")
    p.add_argument("--cache-policy", default="lfru", help="expert cache eviction: lfru (default) or lru")
    p.add_argument("--no-prefetch", action="store_true", help="with a cache: upload on demand only")
    p.add_argument("--prefetch-min-batch", type=int, default=256, metavar="N",
                   help="ubatches of at least N tokens copy experts ahead (default 256)")
    p.add_argument("--no-prefetch-seed", action="store_true",
                   help="the first big chunk of a prompt does not seed from the previous prompt's routing")
    p.add_argument("--prefetch-first-all", action="store_true",
                   help="the first big chunk of a prompt copies every expert ahead")
    p.add_argument("--prefetch-min-use", type=float, default=0.0, metavar="P",
                   help="copy ahead only experts the ubatch routes with probability >= P (default 0: all seen)")
    p.add_argument("--no-lookahead", action="store_true", help="no next-layer expert prediction (decode and prompts)")
    p.add_argument("--no-prompt-lookahead", action="store_true",
                   help="prompt ubatches prefetch from routing statistics only, not through the next layer's router")
    p.add_argument("--lookahead-layers", type=int, default=2, metavar="N",
                   help="prompt lookahead guesses N MoE layers ahead: the next layer's experts are copied at once, "
                        "the later layers' whenever the copy stream runs short of work (default 2; 1 to 4)")
    p.add_argument("--no-host-decode-graphs", action="store_true",
                   help="with a cache: decode eagerly instead of as CUDA-graph segments between host layers")
    p.add_argument("--no-zero-copy-decode", dest="zero_copy_decode", action="store_const", const=False, default=None,
                   help="decode steps fetch their experts through the cache (a host step per layer) instead of "
                        "reading each expert where it lies, a cache slot or pinned host memory")
    p.add_argument("--read-through", action=argparse.BooleanOptionalAction, default=True,
                   help="zero-copy decode of one token also writes each expert it reads from host memory into a "
                        "free cache slot, so the next token reads it there (default: on)")
    p.add_argument("--shared-reads", action="store_true",
                   help="a zero-copy decode step of several tokens reads an expert several of them chose once, not "
                        "once per token (measured in the server: no gain at 4 or 8 streams)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly, without CUDA graphs")
    p.add_argument("-v", "--verbose", action="store_true", help="log loading and placement; print statistics")


def engine_kwargs(a: argparse.Namespace) -> dict:
    return dict(cpu_moe=a.cpu_moe, n_cpu_moe=a.n_cpu_moe, ubatch_size=a.ubatch_size, batch_size=a.batch_size,
                ctx_size=a.ctx_size, device=a.device, dtype=a.dtype, kernel=a.kernel,
                cuda_graphs=not a.no_cuda_graphs, moe_cache_mib=a.moe_cache_mib, cache_policy=a.cache_policy,
                prefetch=not a.no_prefetch, prefetch_min_batch=a.prefetch_min_batch,
                prefetch_seed=not a.no_prefetch_seed, prefetch_first_all=a.prefetch_first_all,
                lookahead=not a.no_lookahead, prompt_lookahead=not a.no_prompt_lookahead,
                lookahead_layers=a.lookahead_layers,
                prefetch_min_use=a.prefetch_min_use,
                host_decode_graphs=not a.no_host_decode_graphs, zero_copy_decode=a.zero_copy_decode,
                read_through=a.read_through, shared_reads=a.shared_reads)


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
    llm = LLM(a.model, progress=True, **engine_kwargs(a))
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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moestream", description="Run MoE language models bigger than the GPU.")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text from a prompt")
    add_engine_flags(g)
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

    for name in SUBCOMMANDS:
        importlib.import_module(name).add_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(name)s: %(message)s")
    try:
        return args.func(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
