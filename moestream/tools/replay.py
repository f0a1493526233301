"""`moestream replay`: a recorded routing trace against cache sizes and policies, offline (no GPU, no model).

    moestream generate -m model.gguf -p 1,2,3 -n 64 --cpu-moe --trace run.npz
    moestream replay run.npz --moe-cache-mib 8000,16000 --policy lfru,lru
    moestream replay run.npz --moe-cache-mib 16000 --policy lfru --prefetch --zero-copy [--no-read-through]
                                                                       [--stage-host-reads]

`--zero-copy` replays decode steps as zero-copy decode runs them (the default on CUDA): the cache learns one step
late, and the misses are read in place (the "read in place" column); `--stage-host-reads` as a quantized file's
steps run them (kernels/stage.py: what lands is the distinct host-read experts in order of first choice).
"""
from __future__ import annotations

import argparse

from .. import flags
from ..errors import UserError
from ..experts.policy import POLICIES


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="a trace written by generate --trace")
    p.add_argument("--moe-cache-mib", type=_ints, default=None,
                   help="cache sizes in MiB, comma list (0: the smallest pool, one layer's experts, as live)")
    p.add_argument("--slots", type=_ints, default=None, help="cache sizes in expert slots, comma list")
    p.add_argument("--policy", default="cycle,lfru,lru", help="policies, comma list (default cycle,lfru,lru)")
    p.add_argument("--prefetch", action="store_true",
                   help="also run the prefetch: the prompt-path rules, and lookahead from the guesses the trace holds")
    flags.add_engine_arguments(p, flags.PREFETCH_RULES)        # the rules' flags, as the engine takes them
    p.add_argument("--zero-copy", action="store_true", help="decode steps as zero-copy decode runs them")
    p.add_argument("--read-through", action=argparse.BooleanOptionalAction, default=None,
                   help="with --zero-copy: read-through, as live decode runs it (default: on)")
    p.add_argument("--stage-host-reads", action="store_true",
                   help="with --zero-copy: staged host reads, as live decode of quantized experts runs them")
    p.set_defaults(func=main)


def main(a: argparse.Namespace) -> int:
    from ..experts.budget import cache_slots
    from ..experts.trace import load_trace, replay
    policies = a.policy.split(",")
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise UserError(f"--policy takes {', '.join(POLICIES)} (a comma list), got {bad[0]!r}")
    if not (a.slots or a.moe_cache_mib):
        raise UserError("give cache sizes with --moe-cache-mib or --slots")
    tr = load_trace(a.trace)
    pf = flags.prefetch_config(a) if a.prefetch else None
    sizes = list(a.slots or [])
    # the live cache's rule: 0 is one layer's experts, and a size holds at most every expert of the trace
    sizes += [cache_slots(m, tr.expert_bytes, tr.n_experts, tr.n_layers, 0) for m in (a.moe_cache_mib or [])]
    n_ubatch = sum(1 for i, l in enumerate(tr.layers.tolist()) if i == 0 or l <= tr.layers[i - 1])
    print(f"trace: {n_ubatch} ubatches, {tr.n_layers} layers x {tr.n_experts} experts of {tr.expert_bytes / 1e6:.2f} MB")
    for flag, given in (("--read-through", a.read_through is not None), ("--stage-host-reads", a.stage_host_reads)):
        if given and not a.zero_copy:
            raise UserError(f"{flag} is a mode of zero-copy decode: add --zero-copy")
    read_through = a.read_through is not False
    print("| policy | slots | MiB | hit rate | misses | uploaded GB | prefetched | used | wasted | read in place GB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for policy in policies:
        for n in sizes:
            if n < 1:
                raise UserError(f"a cache of {n} slots holds nothing; give a larger size")
            t = replay(tr, n, policy, pf, a.zero_copy, read_through, a.stage_host_reads)["total"]
            print(f"| {policy} | {n} | {n * tr.expert_bytes / (1 << 20):.0f} | {t['hit_rate']:.4f} | "
                  f"{t['misses']} | {t['uploaded_bytes'] / 1e9:.3f} | {t['prefetched']} | {t['prefetch_used']} | "
                  f"{t['prefetch_wasted']} | {t['host_read_bytes'] / 1e9:.3f} |")
    return 0
