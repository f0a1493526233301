"""The llama.cpp flags that users type from habit: each is taken with its meaning here, or refused in one line that
says what moestream does instead.

    add_arguments(p, "generate")          # -ngl, -fa, -t, -tb, --no-mmap, --mlock, -ot, --no-warmup, chat, sampling
    apply(ns)                             # checks them and folds -ot into --cpu-moe / --n-cpu-moe (cli.main does this)
    check_model(ns, model_config)         # what needs the model: -ngl N against its layers (before the weights load)

| llama.cpp               | here                                                                                 |
| ----------------------- | ------------------------------------------------------------------------------------ |
| -ngl 99 / all / auto    | accepted: attention, routers and the KV cache are always on the GPU                   |
| -ngl 0, -ngl N < layers | refused: experts move by layer (--cpu-moe, --n-cpu-moe N), not whole layers           |
| -ngl 0 --device cpu     | accepted: everything runs on the CPU, as asked                                        |
| -cmoe with -ncmoe N     | --cpu-moe wins (every MoE layer's experts in host memory), as in llama.cpp; a warning  |
| -ot exps=CPU            | --cpu-moe (a pattern matching layers 0..N-1 only: --n-cpu-moe N); other patterns refused |
| -fa on / auto / bare -fa| accepted: prompts always use flash attention; -fa off is refused                      |
| -t N, -tb N             | torch's CPU threads for decode steps and for prompts                                  |
| --no-mmap, --mlock      | accepted: weights are copied into moestream's own buffers; host experts are pinned     |
| --jinja                 | accepted: chat templates are always rendered with jinja2                              |
| --chat-template X       | X a Jinja file (or --chat-template-file FILE): it replaces the model's template        |
| --no-warmup             | bench: no warm-up run; serve: CUDA graphs are captured on first use instead of at start |

Light on purpose (no torch at import), like flags.py: `moestream --help` answers at once.
"""
from __future__ import annotations

import argparse
import logging
import re

from .errors import UserError

log = logging.getLogger("moestream")
ALL_LAYERS = ("all", "auto", "-1")
_FA_ON, _FA_OFF = ("on", "auto", "1", "true", "enabled"), ("off", "0", "false", "disabled")
_EXPERT_NAMES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_MAX_LAYERS = 256                     # -ot patterns are matched against the expert tensors of this many layers


def _list(kind):
    def parse(s: str):
        try:
            return [kind(x.strip()) for x in s.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma list, got {s!r}") from None
    return parse


def add_arguments(p: argparse.ArgumentParser, command: str) -> None:
    """The habit flags of `command` (generate, serve, bench, perplexity). bench takes comma lists for -ngl, -fa and
    -t, as llama-bench does (it sweeps -t; the others have one meaning each here)."""
    bench = command == "bench"
    g = p.add_argument_group("llama.cpp flags (compat.py says what each means here)")
    g.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", dest="n_gpu_layers", metavar="N",
                   type=_list(str) if bench else str, default=None,
                   help="99, all or auto: every layer's attention on the GPU (always so here); experts move with "
                        "--cpu-moe / --n-cpu-moe")
    g.add_argument("-fa", "--flash-attn", dest="flash_attn", nargs="?", const=["on"] if bench else "on",
                   type=_list(str) if bench else str, default=None, metavar="on|off|auto",
                   help="on or auto: prompts always use flash attention here")
    g.add_argument("-t", "--threads", dest="threads", type=_list(int) if bench else int, default=None, metavar="N",
                   help="torch CPU threads" + (" (a comma list sweeps them)" if bench else " for decode steps"))
    if not bench:
        g.add_argument("-tb", "--threads-batch", dest="threads_batch", type=int, default=None, metavar="N",
                       help="torch CPU threads for prompts (default: -t)")
    g.add_argument("--no-mmap", dest="no_mmap", action="store_true",
                   help="accepted: weights are copied into moestream's own buffers at load, mapped or not")
    g.add_argument("--mlock", action="store_true", help="accepted: experts kept in host memory are pinned (locked)")
    g.add_argument("-ot", "--override-tensor", dest="override_tensor", action="append", default=[],
                   metavar="PATTERN=CPU", help="exps=CPU is --cpu-moe; a pattern over layers 0..N-1 is --n-cpu-moe N")
    if command in ("bench", "serve"):
        g.add_argument("--no-warmup", dest="no_warmup", action="store_true",
                       help="bench: no warm-up run before the timed ones" if bench else
                       "capture the decode CUDA graphs when first needed, not at start")
    if command in ("generate", "serve"):
        g.add_argument("--jinja", action="store_true", help="accepted: chat templates are always rendered by jinja2")
        g.add_argument("--chat-template", dest="chat_template", metavar="FILE",
                       help="a Jinja chat template file that replaces the model's")
        g.add_argument("--chat-template-file", dest="chat_template", metavar="FILE", help="the same")


def apply(a: argparse.Namespace) -> None:
    """Check the habit flags in `a` and fold those that are engine flags into them (-ot into cpu_moe/n_cpu_moe).
    UserError for a value with no meaning here."""
    for v in _as_list(getattr(a, "n_gpu_layers", None)):
        _check_ngl(v, getattr(a, "device", "auto"))
    for v in _as_list(getattr(a, "flash_attn", None)):
        if v.lower() in _FA_OFF:
            raise UserError(f"-fa {v}: moestream has no attention without flash attention (prompts use it, decode "
                            "steps their own kernel); leave -fa out")
        if v.lower() not in _FA_ON:
            raise UserError(f"-fa takes on, off or auto, got {v!r}")
    for name in ("threads", "threads_batch"):
        for n in _as_list(getattr(a, name, None)):
            if n < 1:
                raise UserError(f"-{'t' if name == 'threads' else 'tb'} must be at least 1, got {n}")
    for spec in getattr(a, "override_tensor", None) or ():
        for part in spec.split(","):
            _apply_override(a, part.strip())
    ncmoe = [n for n in _as_list(getattr(a, "n_cpu_moe", None)) if n]
    if getattr(a, "cpu_moe", False) and ncmoe:      # as in llama.cpp, where -cmoe's override covers -ncmoe's
        log.warning("--cpu-moe keeps every MoE layer's experts in host memory; -ncmoe %s adds nothing", ncmoe[0])
    if getattr(a, "no_mmap", False) or getattr(a, "mlock", False):
        log.info("--no-mmap/--mlock: nothing to change (weights are copied at load; host experts are pinned)")
    threads = getattr(a, "threads", None)
    if threads is not None and not isinstance(threads, list) or getattr(a, "threads_batch", None) is not None:
        from .runtime import threads as th
        th.configure(threads, getattr(a, "threads_batch", None))


def check_model(a: argparse.Namespace, cfg) -> None:
    """What needs the model's shape, checked before its weights load: -ngl N below its layer count."""
    ngl = _as_list(getattr(a, "n_gpu_layers", None))
    if ngl and getattr(a, "device", "auto") in ("auto", "cpu"):
        import torch
        if a.device == "cpu" or not torch.cuda.is_available():
            if any(v.lower() in ALL_LAYERS or int(v) for v in ngl):
                log.warning("-ngl %s: there is no GPU here (or --device cpu): everything runs on the CPU", ngl[0])
    for v in ngl:                         # -ngl 0 is here only with --device cpu (apply): what it asks
        if v.lower() in ALL_LAYERS or int(v) == 0 or int(v) >= cfg.n_layers:
            continue
        keep = min(cfg.n_layers - int(v), len(cfg.moe_layers))
        raise UserError(f"-ngl {v}: moestream keeps all {cfg.n_layers} layers' attention on the GPU and moves "
                        f"experts instead: --n-cpu-moe {keep} keeps the first {keep} MoE layers' experts in host "
                        f"memory, --cpu-moe all of them (and -ngl 99 or no -ngl)")


def read_chat_template(path: str) -> str:
    """The text of a --chat-template FILE, checked to be a Jinja template."""
    try:
        text = open(path, encoding="utf-8").read()
    except FileNotFoundError:
        raise UserError(f"--chat-template {path!r}: no such file (give a Jinja template file; moestream has no "
                        "built-in templates by name)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read --chat-template {path!r}: {getattr(e, 'strerror', None) or e}") from None
    if not text.strip():
        raise UserError(f"--chat-template {path!r} is empty; give a Jinja chat template file (or leave the flag out "
                        "for the model's own)")
    import jinja2
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise UserError(f"--chat-template {path!r} is not a Jinja template: line {e.lineno}: {e.message}") from None
    return text


def _as_list(v) -> list:
    return [] if v is None else v if isinstance(v, list) else [v]


def _check_ngl(v: str, device: str) -> None:
    if v.lower() in ALL_LAYERS:
        return
    try:
        n = int(v)
    except ValueError:
        raise UserError(f"-ngl takes a number of layers, all or auto, got {v!r}") from None
    if n == 0 and device != "cpu":         # with --device cpu, -ngl 0 asks what moestream does
        raise UserError("-ngl 0: moestream always keeps attention and routers on the GPU; keep the experts in host "
                        "memory with --cpu-moe (or --n-cpu-moe N), or run everything on the CPU with --device cpu")
    if n < 0:
        raise UserError(f"-ngl must be a number of layers, all or auto, got {v}")


def _apply_override(a: argparse.Namespace, spec: str) -> None:
    """One -ot PATTERN=BUFFER: experts to CPU become --cpu-moe or --n-cpu-moe N; anything else is refused."""
    pattern, sep, buft = spec.rpartition("=")
    if not sep or not pattern:
        raise UserError(f"-ot takes PATTERN=BUFFER (e.g. -ot exps=CPU), got {spec!r}")
    if buft.upper() != "CPU":
        raise UserError(f"-ot {spec}: moestream keeps every tensor but experts on the GPU already; only experts "
                        "to CPU has a meaning (-ot exps=CPU, which is --cpu-moe)")
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise UserError(f"-ot {spec}: {pattern!r} is not a regular expression ({e})") from None
    hit = [all(rx.search(f"blk.{l}.{n}.weight") for n in _EXPERT_NAMES) for l in range(_MAX_LAYERS)]
    some = [any(rx.search(f"blk.{l}.{n}.weight") for n in _EXPERT_NAMES) for l in range(_MAX_LAYERS)]
    other = any(rx.search(f"blk.0.{n}.weight") for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp"))
    if all(hit) and not other:
        a.cpu_moe = True
        return
    n = hit.index(False) if False in hit else _MAX_LAYERS
    if n and not any(some[n:]) and some[:n] == hit[:n] and not other:
        a.n_cpu_moe = max(a.n_cpu_moe or 0, n)
        return
    raise UserError(f"-ot {spec}: moestream moves experts by whole MoE layers, not by tensor pattern: use "
                    "-ot exps=CPU (--cpu-moe), a pattern over layers 0..N-1 (--n-cpu-moe N), or those flags")
