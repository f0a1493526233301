"""The engine's options, each written once: its flat name, its place in EngineConfig, its flags and help.

    p = argparse.ArgumentParser(); add_engine_arguments(p)          # -m, every engine flag, -v
    ns = p.parse_args(["-m", "synth:tiny", "--cpu-moe", "--moe-cache-mib", "16"])
    ecfg = to_config(ns)                 # EngineConfig(placement=Placement(cpu_moe=True), cache=CacheConfig(mib=16))
    to_argv(ecfg)                        # ["--cpu-moe", "--moe-cache-mib", "16"]: the flags that give it back
    apply(ecfg, ubatch_size=256)         # by flat names, as LLM(..., ubatch_size=256) and reconfigure_cache take them

The flat name is the argparse dest, LLM's keyword and reconfigure_cache's; defaults come from the config
dataclasses, so a new option is its config field (engine_config.py) plus one row here. Light on purpose: no torch, so
`moestream --help` answers at once.
"""
from __future__ import annotations

import argparse
import difflib
from dataclasses import dataclass

from .engine_config import EngineConfig

@dataclass(frozen=True)
class Option:
    """One engine option. Its kind says how it is a flag: "value" takes an argument; "on" is a switch that sets
    True; "off" a --no-... switch that sets False (from a default of True, or of None: "auto"); "both" is --X and
    --no-X. Its default is the config field's."""
    name: str                       # flat name: the argparse dest, LLM(name=...), reconfigure_cache(name=...)
    path: str                       # where it lives: "cache.prefetch.min_batch"
    flags: tuple[str, ...]          # argparse spellings, the long one last; () for none (n_seq: serve's -np)
    help: str = ""
    kind: str = "value"
    type: type | None = None
    metavar: str | None = None

    @property
    def default(self):
        return EngineConfig().get(self.path)


def mib(s: str) -> int | str | tuple:
    """--moe-cache-mib's value: whole MiB, or auto (what the device has left at load: runtime/placement.py); with
    several devices a figure per device, 4000,8000 (or 4000/8000, llama-bench's spelling where commas sweep)."""
    if "," in s or "/" in s:
        return tuple(mib(x) for x in s.replace("/", ",").split(","))
    if s == "auto":
        return s
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of MiB or auto, got {s!r}") from None


def shares(s: str) -> tuple[float, ...]:
    """--tensor-split's value: each device's share of the layers, 3,1 (or 3/1, llama-bench's spelling)."""
    try:
        return tuple(float(x) for x in s.replace("/", ",").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a share per device, e.g. 3,1; got {s!r}") from None


OPTIONS = (
    Option("ctx_size", "batching.ctx_size", ("-c", "--ctx-size"), "KV cache length (default 4096)", type=int),
    Option("batch_size", "batching.batch_size", ("-b", "--batch-size"), "logical batch size (default 2048)", type=int),
    Option("ubatch_size", "batching.ubatch_size", ("-ub", "--ubatch-size"), "physical batch size (default 512)",
           type=int),
    Option("batch_by_layer", "batching.by_layer", ("--no-batch-by-layer",),
           "with host experts, run a prompt's batch (-b) ubatch by ubatch through every layer, as llama.cpp does, "
           "instead of each layer over all its ubatches (then a host layer's experts cross the link once a batch, "
           "not once a ubatch; the same logits either way)", "off"),
    Option("n_seq", "batching.n_seq", ()),
    Option("cpu_moe", "placement.cpu_moe", ("-cmoe", "--cpu-moe"), "keep every MoE layer's experts in host memory",
           "on"),
    Option("n_cpu_moe", "placement.n_cpu_moe", ("-ncmoe", "--n-cpu-moe"),
           "keep the experts of the first N MoE layers in host memory", type=int, metavar="N"),
    Option("device", "placement.device", ("-dev", "--device"),
           "auto, cpu, cuda, cuda:N, or a list of devices that split the layers: cuda:0,cuda:1 (default auto: every "
           "CUDA GPU, split by --split-mode layer)"),
    Option("split_mode", "placement.split_mode", ("-sm", "--split-mode"),
           "with several GPUs: layer (default: each holds a contiguous share of the layers, their KV cache and an "
           "expert cache of its own) or none (one GPU, --main-gpu)"),
    Option("tensor_split", "placement.tensor_split", ("-ts", "--tensor-split"),
           "each GPU's share of the layers, e.g. 3,1 (default: by free memory)", type=shares, metavar="A,B,..."),
    Option("main_gpu", "placement.main_gpu", ("-mg", "--main-gpu"),
           "the GPU of --split-mode none (default 0)", type=int, metavar="N"),
    Option("dtype", "placement.dtype", ("--dtype",), "auto (the checkpoint's), float32, bfloat16, float16"),
    Option("kernel", "kernel", ("--kernel",), "expert kernel: auto, reference, grouped"),
    Option("moe_cache_mib", "cache.mib", ("--moe-cache-mib",),
           "GPU cache for host-resident experts, in MiB (0: the smallest that works; auto: what the GPU has left "
           "after the rest of the model, logged); with several GPUs each GPU's, or one figure per GPU: 4000,8000",
           type=mib, metavar="MIB"),
    Option("cache_policy", "cache.policy", ("--cache-policy",),
           "expert cache eviction: cycle (default: lfru, but a prompt ubatch that routes nearly every expert of a "
           "layer evicts the layers it has just passed first), lfru (decayed frequency) or lru"),
    Option("prefetch", "cache.prefetch.enabled", ("--no-prefetch",),
           "upload on demand only: no copy-ahead, with a cache or without", "off"),
    Option("prefetch_min_batch", "cache.prefetch.min_batch", ("--prefetch-min-batch",),
           "ubatches of at least N tokens copy experts ahead (default 256)", type=int, metavar="N"),
    Option("prefetch_seed", "cache.prefetch.seed_previous", ("--no-prefetch-seed",),
           "the first big chunk of a prompt does not seed from the previous prompt's routing", "off"),
    Option("prefetch_first_all", "cache.prefetch.first_chunk_all", ("--prefetch-first-all",),
           "the first big chunk of a prompt copies every expert ahead", "on"),
    Option("prefetch_min_use", "cache.prefetch.min_use", ("--prefetch-min-use",),
           "copy ahead only experts the ubatch routes with probability >= P (default 0: all seen)", type=float,
           metavar="P"),
    Option("lookahead", "cache.prefetch.lookahead", ("--no-lookahead",),
           "no next-layer expert prediction (decode and prompts)", "off"),
    Option("prompt_lookahead", "cache.prefetch.prompt_lookahead", ("--no-prompt-lookahead",),
           "prompt ubatches prefetch from routing statistics only, not through the next layer's router", "off"),
    Option("lookahead_layers", "cache.prefetch.lookahead_layers", ("--lookahead-layers",),
           "prompt lookahead guesses N MoE layers ahead: the next layer's experts are copied at once, the later "
           "layers' whenever the copy stream runs short of work (default 2; 1 to 4)", type=int, metavar="N"),
    Option("prefetch_max_inflight_mib", "cache.prefetch.max_inflight_mib", ("--prefetch-max-inflight-mib",),
           "at most this many MiB of copies ahead on the link at once (default 512; misses a ubatch waits for go "
           "first)", type=int, metavar="MIB"),
    Option("zero_copy_decode", "decode.zero_copy", (),
           "on the CPU: decode steps read each expert where it lies through the plain-torch oracle (zero-copy "
           "decode's tests); on CUDA the device decides (engine_config.DecodeConfig)"),
    Option("read_through", "decode.read_through", ("--read-through",),
           "zero-copy decode of one token also writes each expert it reads from host memory into a free cache "
           "slot, so the next token reads it there (default: on)", "both"),
    Option("stage_host_reads", "decode.stage", ("--stage-host-reads",),
           "zero-copy decode copies the experts a step reads from host memory into device memory first, in one "
           "launch, and computes from there (default: on for quantized experts)", "both"),
    Option("cuda_graphs", "decode.cuda_graphs", ("--no-cuda-graphs",), "decode eagerly, without CUDA graphs", "off"),
    Option("spec_type", "spec.type", ("--spec-type",),
           "speculative decoding: none (default) or draft-mtp (the model's multi-token prediction head drafts, the "
           "model verifies the drafts in one step; greedy output unchanged up to near-ties)"),
    Option("spec_draft_n_max", "spec.draft_n_max", ("--spec-draft-n-max",),
           "tokens the MTP head drafts a step (default 2; 0 on CUDA with host experts and no cache, where each "
           "drafted token's experts would cross the link again)", type=int, metavar="N"),
    Option("model_draft", "spec.model_draft", ("-md", "--spec-draft-model", "--model-draft"),
           "the MTP head's own GGUF (llama.cpp's MTP-only file: the head's block, its embedding and output), read "
           "beside the model's, with --spec-type draft-mtp (default: the head the model ships)", metavar="FILE"),
)
BY_NAME = {o.name: o for o in OPTIONS}
# The prefetch rules' own flags, which `moestream replay` takes too (it switches prefetch on with --prefetch).
PREFETCH_RULES = ("prefetch_min_batch", "prefetch_seed", "prefetch_first_all", "prefetch_min_use", "lookahead",
                  "prompt_lookahead")


def add_engine_arguments(p: argparse.ArgumentParser, names=None, **changes: dict) -> None:
    """-m, the engine flags (all, or those of `names`) and -v. `changes` adjusts a flag for one command, by flat
    name: bench's sweeps take comma lists (moe_cache_mib=dict(type=ints, default=[None])), perplexity's -c has
    another default and help."""
    if names is None:
        p.add_argument("-m", "--model", required=True, help="Hugging Face directory, .gguf file, or synth:NAME")
    for o in OPTIONS:
        if o.flags and (names is None or o.name in names):
            p.add_argument(*o.flags, **{**_argparse_kwargs(o), **changes.get(o.name, {})})
    if names is None:
        p.add_argument("-v", "--verbose", action="store_true", help="log loading and placement; print statistics")


def _argparse_kwargs(o: Option) -> dict:
    kw = dict(dest=o.name, default=o.default, help=o.help)
    if o.kind == "value":
        kw.update(type=o.type, metavar=o.metavar)
    elif o.kind == "on":
        kw.update(action="store_true")
    elif o.kind == "off":
        kw.update(action="store_const", const=False)
    else:
        kw.update(action=argparse.BooleanOptionalAction)
    return kw


def to_config(ns: argparse.Namespace, names=None) -> EngineConfig:
    """The EngineConfig the engine flags in `ns` spell: those of every option with a flag, or of `names` for a
    parser that took only those (add_engine_arguments(p, names))."""
    names = [o.name for o in OPTIONS if o.flags] if names is None else names
    return apply(EngineConfig(), **{n: getattr(ns, n) for n in names})


def to_argv(ecfg: EngineConfig) -> list[str]:
    """The flags that give `ecfg` back from the defaults (long spellings, in table order). ValueError for a
    value no flag spells (n_seq, zero_copy_decode=True: LLM can ask for them, the flags cannot)."""
    argv = []
    for o in OPTIONS:
        value = ecfg.get(o.path)
        if value == o.default:
            continue
        if o.kind == "value" and o.flags:
            argv += [o.flags[-1], _spell(value)]
        elif o.kind == "on" and value is True or o.kind == "off" and value is False:
            argv.append(o.flags[-1])
        elif o.kind == "both" and isinstance(value, bool):
            argv.append(o.flags[-1] if value else "--no-" + o.flags[-1][2:])
        else:
            raise ValueError(f"no flag sets {o.name}={value!r}")
    return argv


def _spell(value) -> str:
    """A value as its flag takes it: a list (--tensor-split, --moe-cache-mib per device) with commas, a share of
    3.0 as 3."""
    if isinstance(value, tuple):
        return ",".join(str(int(v)) if isinstance(v, float) and v.is_integer() else str(v) for v in value)
    return str(value)


def apply(ecfg: EngineConfig, **overrides) -> EngineConfig:
    """`ecfg` with options changed by flat name: apply(ecfg, cpu_moe=True, moe_cache_mib=16). TypeError for a
    name that is no option; UserError (naming the flag) for a bad value."""
    unknown = [k for k in overrides if k not in BY_NAME]
    if unknown:
        close = difflib.get_close_matches(unknown[0], BY_NAME, n=1)
        raise TypeError(f"unknown engine option {unknown[0]!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                        + f"; the options are: {', '.join(BY_NAME)}")
    return ecfg.updated({BY_NAME[k].path: v for k, v in overrides.items()})


def prefetch_config(ns: argparse.Namespace):
    """The PrefetchConfig (enabled) that the prefetch rules' flags in `ns` spell: `moestream replay --prefetch`."""
    return to_config(ns, PREFETCH_RULES).cache.prefetch
