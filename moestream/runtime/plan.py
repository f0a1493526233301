"""Where every choice of how the engine runs is made, once, at setup: "auto" resolved, then the decode plan.

    ecfg = resolve(flags.apply(EngineConfig(), cpu_moe=True), torch.bfloat16)   # "auto" decided (LLM does this)
    plan = decode_plan(ecfg, cuda=True, quantized=False, host=True, capturable=True)   # DecodePlan: graphs, landings
    engine, cache, MoE block: read plan's fields; nothing re-decides them per step

`resolve` decides the device, the dtype, the expert GEMM and whether decode reads experts where they lie
(zero-copy decode) from the machine and the checkpoint's dtype. `decode_plan` decides from the resolved config,
the experts' types and placement, and the model, how decode steps run: zero-copy or fetched, replayed as CUDA
graphs or eager, landing what they read from host (read-through), staging host reads. The engine takes the plan
(runtime/engine.py), hands it to the host provider (experts/cache.py's enable_zero_copy, runtime/placement.py) and
builds its decode path from it (runtime/decode.py); the MoE block gets the plan's decode kernel on each step's
batch. A new cache (Engine.reconfigure_cache) gets a new plan, from the same function.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine_config import DRAFT_N_MAX, EngineConfig, SpecConfig
from ..errors import UserError
from ..kernels import experts_reference, pick_kernel
from ..kernels.decode import MAX_TOKENS, decode_available
from .split import split_devices


def resolve(ecfg: EngineConfig, file_dtype) -> EngineConfig:
    """`ecfg` with every "auto" decided for this machine and a checkpoint whose weights are the torch dtype
    `file_dtype` (None: quantized): the device, the dtype, the expert kernel, zero-copy decode. Raises UserError
    for a device or kernel this machine does not have. Idempotent. Several devices (runtime/split.py) become
    their list ("cuda:0,cuda:1") and each one's share of the layers (--tensor-split: by free memory unless given),
    and --moe-cache-mib a figure per device where it is a list."""
    devices, shares = split_devices(ecfg.placement)
    dev = devices[0]
    mib = ecfg.cache.mib
    if isinstance(mib, tuple) and len(mib) != len(devices):
        raise UserError(f"--moe-cache-mib {','.join(map(str, mib))} gives {len(mib)} figures, but {len(devices)} "
                        f"device(s) are in use ({', '.join(d.name for d in devices)}); give one figure per device, "
                        "or one for each")
    dtype_name = ecfg.placement.dtype
    if dtype_name == "auto" and file_dtype is None:      # a quantized checkpoint: bf16 kernels on CUDA
        dtype_name = "bfloat16" if dev.is_cuda else "float32"
    elif dtype_name == "auto":
        dtype_name = {torch.float32: "float32", torch.float16: "float16"}.get(file_dtype, "bfloat16")
    dtype = getattr(torch, dtype_name)
    kernel = "reference" if pick_kernel(ecfg.kernel, dev.torch, dtype) is experts_reference else "grouped"
    zero_copy = ecfg.decode.zero_copy
    if zero_copy is None:
        zero_copy = decode_available(dev.torch, dtype)
    elif not zero_copy and decode_available(dev.torch, dtype):
        raise UserError("decode steps on CUDA read each expert where it lies (zero-copy decode); fetching them "
                        "instead (--no-zero-copy-decode) was removed: bench/RESULTS.md, stop 47")
    return ecfg.updated({"placement.device": ",".join(d.name for d in devices), "placement.tensor_split": shares,
                         "placement.dtype": dtype_name, "kernel": kernel, "decode.zero_copy": zero_copy})


@dataclass(frozen=True)
class DecodePlan:
    """How decode steps run, for one engine and one host provider.

    zero_copy: steps of at most max_tokens tokens read each expert where it lies, a slot or pinned host memory
        (kernels/decode.py; the plain-torch oracle on the CPU); else they fetch their experts through the provider.
    staged: zero-copy steps copy their host reads into device rows first, in one launch (kernels/stage.py).
    lands: zero-copy steps write what they read from host into free cache slots (read-through).
    reads_once: a several-token step's kernel reads each routed expert once (any kernel staged, or float rows); the
        unstaged quantized kernel reads it once per choice (what the host-read counters count).
    graphs: steps replay CUDA graphs (runtime/graphs.py): on CUDA with --cuda-graphs, a model whose steps may be
        captured, an expert kernel with no host sync, and no host step inside a step (every float expert on the
        device, or zero-copy decode).
    graph_all: the graphs take steps of any size (no host experts and float rows: no host step at any size);
        else only zero-copy steps of at most max_tokens tokens, the eager path the rest.
    """
    zero_copy: bool
    staged: bool
    lands: bool
    reads_once: bool
    graphs: bool
    graph_all: bool
    max_tokens: int = MAX_TOKENS


def decode_plan(ecfg: EngineConfig, cuda: bool, quantized: bool, host: bool, capturable: bool,
                by_address: bool = True) -> DecodePlan:
    """The plan for a resolved `ecfg` on a CUDA device or not: quantized expert rows or not, some experts in host
    memory or not, a model whose decode steps may be captured or not, an expert MLP the zero-copy decode kernels
    compute or not (`by_address`: kernels.by_address_kernels of the family's blocks, SwiGLU and gpt-oss's clamped
    SwiGLU with biases; a family whose MLP they do not compute fetches its experts in decode steps, and on CUDA
    replays graphs only where nothing is on the host). Layers split over several devices (runtime/split.py) take
    the same plan: zero-copy steps read each layer's experts through its device's provider, and a step's graphs are
    one per device's share (runtime/graphs.py)."""
    d = ecfg.decode
    zero_copy = bool(d.zero_copy) and by_address
    staged = zero_copy and (d.stage if d.stage is not None else quantized)
    # Quantized rows land and are read once a step only staged (the unstaged quantized kernel reads a row once per
    # choice, and lands nothing).
    lands = zero_copy and d.read_through and (staged or not quantized)
    # Quantized experts are dequantized per ubatch (a host sync, to size the scratch) unless decode reads in place;
    # the reference expert kernel reads its slot counts back.
    fetch_ok = not host and not quantized
    graphs = (d.cuda_graphs and cuda and capturable and ecfg.kernel != "reference"
              and (fetch_ok or zero_copy))
    return DecodePlan(zero_copy, staged, lands, staged or not quantized, graphs, graphs and fetch_ok)


def draft_n_max(spec: SpecConfig, cuda: bool, host: bool, cache_mib) -> int:
    """The drafts an MTP decode step takes: --spec-draft-n-max where given; else DRAFT_N_MAX, but none where every
    step's experts cross the link (host experts on CUDA with no cache). A verify step of n + 1 tokens reads about
    n + 1 times one token's experts there (tokens share few of a layer's experts) for 1 + P + ... + P^n tokens at
    acceptance P: fewer tokens than bytes for any P < 1, so drafting would cost speed. (cache_mib: a figure, or one
    per device.)"""
    if spec.draft_n_max is not None:
        return spec.draft_n_max
    nothing_cached = all(m == 0 for m in (cache_mib if isinstance(cache_mib, tuple) else (cache_mib,)))
    return 0 if cuda and host and nothing_cached else DRAFT_N_MAX
