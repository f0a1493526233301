"""What the engine is told: one frozen dataclass per concern, validated where it is made (a model's own config is
config.py). Each field is documented once, here; flags.py maps every command-line flag (and LLM's flat keyword) to
one of them. "auto" values are decided by runtime/plan.py's resolve, before runtime/load.py's load_engine, which
takes resolved configs only. Plain data: it decides nothing (no kernel, no device).

    eng = EngineConfig(placement=Placement(cpu_moe=True), batching=Batching(ubatch_size=512))
    eng = flags.apply(EngineConfig(), cpu_moe=True, ubatch_size=512)       # the same, by flat names (flags.py)
    eng = resolve(eng, torch.bfloat16)    # "auto" decided for this machine and checkpoint (runtime/plan.py; LLM)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .config import ModelConfig
from .errors import UserError
from .experts.prefetch import PrefetchConfig

POLICIES = ("lfru", "lru", "cycle")     # the cache's victim orders (experts/policy.py makes each)


def _number(v) -> bool:
    """An int or a float, not a bool (True would pass as 1 MiB, or a share of 1)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class Placement:
    """Where the weights live. Several devices (a comma list, or every CUDA GPU with --split-mode layer) each hold
    a contiguous share of the layers (runtime/split.py)."""
    device: str = "auto"             # auto (every CUDA GPU with split_mode layer, else cuda:main_gpu; cpu where no
                                     # CUDA) | cpu | cuda | cuda:N | a comma list: "cuda:0,cuda:1" ("cpu,cpu": two
                                     # stand-ins on the CPU, the split's tests)
    dtype: str = "auto"              # auto (the checkpoint's, bfloat16 for other types) | float32 | bfloat16 | float16
    cpu_moe: bool = False            # every MoE layer's experts in pinned host memory
    n_cpu_moe: int = 0               # the first N MoE layers' experts in host memory
    split_mode: str = "layer"        # layer: several devices each hold a share of the layers | none: one device
    tensor_split: tuple[float, ...] | None = None   # each device's share of the layers (None: by free memory)
    main_gpu: int = 0                # the device of split_mode none (an index among the devices)

    def __post_init__(self):
        if self.device is None:                       # LLM(device=None), as before: auto
            object.__setattr__(self, "device", "auto")
        for d in self.device.split(","):
            if not (d in ("auto", "cpu") or d.startswith("cuda")):
                raise UserError(f"unknown device {d!r}; use --device cpu, cuda, cuda:N or a list cuda:0,cuda:1")
        if self.split_mode not in SPLIT_MODES:
            raise UserError(f"--split-mode {self.split_mode!r} is not run by moestream; use --split-mode layer "
                            "(each GPU a share of the layers) or none (one GPU: --main-gpu)")
        if self.tensor_split is not None:
            shares = tuple(self.tensor_split)
            if not shares or any(not _number(x) or x < 0 for x in shares) or not sum(shares):
                raise UserError(f"--tensor-split takes a share per device, none negative, not all 0 (e.g. 3,1); "
                                f"got {','.join(map(str, shares))}")
            object.__setattr__(self, "tensor_split", shares)
        if not isinstance(self.main_gpu, int) or self.main_gpu < 0:
            raise UserError(f"--main-gpu must be a device index >= 0, got {self.main_gpu!r}")
        if self.dtype not in ("auto", *DTYPE_NAMES):
            raise UserError(f"--dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.n_cpu_moe < 0:
            raise UserError(f"--n-cpu-moe must be >= 0, got {self.n_cpu_moe}")

    def host_layers(self, cfg: ModelConfig) -> set[int]:
        """Layers whose experts live in pinned host memory. An MTP head's (cfg.head_layers) go where the trunk's
        last MoE layer's do: with --cpu-moe on the host, with --n-cpu-moe N below every layer on the device."""
        moe = cfg.moe_layers
        if self.cpu_moe:
            return set(cfg.expert_layers)
        if self.n_cpu_moe > len(moe):
            raise UserError(f"--n-cpu-moe {self.n_cpu_moe} is more than the model's {len(moe)} MoE layers; "
                            f"use --n-cpu-moe {len(moe)} or --cpu-moe")
        return set(moe[: self.n_cpu_moe]) | (set(cfg.head_layers) if self.n_cpu_moe == len(moe) else set())


SPLIT_MODES = ("layer", "none")    # llama.cpp's --split-mode, less row (tensor parallel: not run)


@dataclass(frozen=True)
class Batching:
    """How work is cut: sequences, their context, and the tokens of one forward."""
    ctx_size: int = 4096             # KV cache length per sequence
    n_seq: int = 1                   # sequences with a KV cache each (the server's slots, -np)
    batch_size: int = 2048           # logical batch: tokens submitted per call
    ubatch_size: int = 512           # physical batch: tokens per forward
    by_layer: bool = True            # with host experts, a prompt's batch runs layer by layer over its ubatches

    def __post_init__(self):
        if self.ctx_size <= 0:
            raise UserError(f"--ctx-size must be positive, got {self.ctx_size}")
        if self.ubatch_size <= 0 or self.batch_size <= 0:
            raise UserError(f"-b and -ub must be positive, got {self.batch_size} and {self.ubatch_size}")
        if self.n_seq <= 0:
            raise UserError(f"the number of sequences (-np) must be positive, got {self.n_seq}")

    @property
    def ubatch(self) -> int:
        """Tokens per forward: -ub, never more than -b."""
        return min(self.ubatch_size, self.batch_size)


@dataclass(frozen=True)
class CacheConfig:
    """The GPU expert cache over host layers, and what it copies ahead (experts/prefetch.py documents those)."""
    mib: int | str | tuple | None = None   # None: no cache, each ubatch uploads its experts; 0: the smallest pool
                                     # that works (one layer's experts); N: N MiB (experts/budget.py turns it into
                                     # slots); "auto": what the device has left, decided at load
                                     # (runtime/placement.py). With several devices, N is each device's pool; a
                                     # tuple gives one figure per device
    policy: str = "cycle"            # cycle (lfru; sweeps evict the layers just passed) | lfru | lru (policy.py)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)

    def __post_init__(self):
        if isinstance(self.mib, (tuple, list)):
            object.__setattr__(self, "mib", tuple(self.mib))
            if len(self.mib) == 1:
                object.__setattr__(self, "mib", self.mib[0])
        for mib in self.mib if isinstance(self.mib, tuple) else (self.mib,):
            if mib not in (None, "auto") and (not _number(mib) or mib < 0):
                raise UserError(f"--moe-cache-mib must be >= 0 (a number of MiB) or auto, got {self.mib!r}")
        if self.policy not in POLICIES:
            raise UserError(f"--cache-policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        pf = self.prefetch
        if pf.min_batch <= 0:
            raise UserError(f"--prefetch-min-batch must be positive, got {pf.min_batch}")
        if not 1 <= pf.lookahead_layers <= 4:
            raise UserError(f"--lookahead-layers must be 1 to 4, got {pf.lookahead_layers}")
        if not _number(pf.max_inflight_mib) or pf.max_inflight_mib < 0:
            raise UserError(f"--prefetch-max-inflight-mib must be >= 0 (a number of MiB), got {pf.max_inflight_mib!r}")
        if not 0.0 <= pf.min_use <= 1.0:
            raise UserError(f"--prefetch-min-use must be within [0, 1], got {pf.min_use}")


@dataclass(frozen=True)
class DecodeConfig:
    """How decode steps run."""
    zero_copy: bool | None = None    # decode kernels read each expert where it lies, a slot or pinned host memory
                                     # (None: where the Triton kernel runs, CUDA with 16-bit weights; elsewhere
                                     # decode steps fetch their experts, the plain path). True on the CPU: through
                                     # the plain-torch oracle (zero-copy decode's tests). Not False where it runs.
    read_through: bool = True        # ... and a one-token step writes what it read from host into free cache slots
    stage: bool | None = None        # ... copying the step's host reads into device rows first, in one launch
                                     # (kernels/stage.py; None: for quantized experts)
    cuda_graphs: bool = True         # decode steps replay CUDA graphs (on CUDA, with a kernel other than reference)


SPEC_TYPES = ("none", "draft-mtp")
DRAFT_N_MAX = 2                      # the MTP head's drafts a step where --spec-draft-n-max is not given


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding (runtime/speculate.py): llama.cpp's --spec-type and --spec-draft-n-max."""
    type: str = "none"               # none | draft-mtp (the checkpoint's MTP head drafts, models/mtp.py)
    draft_n_max: int | None = None   # tokens the head drafts a step; the target verifies them and one more (0: the
                                     # head is loaded, no step drafts: bench's baseline in the same process; None:
                                     # the engine picks, runtime/plan.py's draft_n_max)
    model_draft: str | None = None   # the head's own GGUF, read beside the target (loading/draft.py)

    def __post_init__(self):
        if self.type not in SPEC_TYPES:
            raise UserError(f"--spec-type {self.type!r} is not run by moestream; use --spec-type draft-mtp (the "
                            "model's own MTP head) or none")
        n = self.draft_n_max
        if n is not None and (not isinstance(n, int) or not 0 <= n <= 16):
            raise UserError(f"--spec-draft-n-max must be a whole number from 0 to 16, got {self.draft_n_max!r}")

    @property
    def mtp(self) -> bool:
        """The MTP head is loaded (--spec-type draft-mtp)."""
        return self.type == "draft-mtp"

    @property
    def most(self) -> int:
        """The most drafts a step may take: what the KV cache and the sliding rings make room for."""
        return DRAFT_N_MAX if self.draft_n_max is None else self.draft_n_max

    @property
    def drafts(self) -> bool:
        """Decode steps may draft and verify."""
        return self.mtp and self.most > 0


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine is told: built from flags (flags.py) or LLM(..., **overrides), resolved, then loaded.

        ecfg = resolve(EngineConfig(cache=CacheConfig(mib=16000)), torch.bfloat16)      # runtime/plan.py
        ecfg.placement.host_layers(model_cfg), ecfg.batching.ubatch, ecfg.cache.prefetch.min_batch
    """
    placement: Placement = field(default_factory=Placement)
    batching: Batching = field(default_factory=Batching)
    cache: CacheConfig = field(default_factory=CacheConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    kernel: str = "auto"             # the expert GEMM of every forward: auto (grouped where it runs) | reference
                                     # | grouped

    def __post_init__(self):
        if self.kernel not in ("auto", "reference", "grouped"):
            raise UserError(f"--kernel must be auto, reference or grouped, got {self.kernel!r}")

    def get(self, path: str):
        """The value at a dotted path: get("cache.prefetch.min_batch")."""
        obj = self
        for name in path.split("."):
            obj = getattr(obj, name)
        return obj

    def updated(self, changes: dict[str, object]) -> "EngineConfig":
        """A copy with {dotted path: value} changed; each concern touched is validated again."""
        return _replace_paths(self, changes)

    @property
    def resolved(self) -> bool:
        """Whether every "auto" is decided (what load_engine takes: runtime/plan.py's resolve decides them)."""
        return (self.placement.device != "auto" and self.placement.dtype != "auto" and self.kernel != "auto"
                and self.decode.zero_copy is not None)


DTYPE_NAMES = ("float32", "bfloat16", "float16")


def _replace_paths(obj, changes: dict[str, object]):
    """dataclasses.replace through nested frozen dataclasses: {"cache.prefetch.min_batch": 8} rebuilds the
    PrefetchConfig, then the CacheConfig holding it, then obj."""
    direct: dict[str, object] = {}
    nested: dict[str, dict[str, object]] = {}
    for path, value in changes.items():
        head, _, rest = path.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            direct[head] = value
    for head, sub in nested.items():
        direct[head] = _replace_paths(getattr(obj, head), sub)
    return dataclasses.replace(obj, **direct) if direct else obj
