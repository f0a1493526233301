"""--moe-cache-mib auto: the arithmetic over a given free-memory figure, the flag in every command that takes it,
and LLM(moe_cache_mib="auto"). On the CPU auto is 0, the smallest pool (runtime/placement.py says why)."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from moestream import LLM, flags
from moestream.cli import build_parser, main
from moestream.engine_config import CacheConfig, EngineConfig
from moestream.errors import UserError
from moestream.kernels.stage import staging_bytes
from moestream.loading.source import open_source
from moestream.runtime.memory import AUTO_RESERVE, MiB, auto_cache_mib
from moestream.runtime.placement import auto_cache
from moestream.runtime.plan import decode_plan

TINY = ["-m", "synth:tiny"]


def test_auto_is_what_is_left_after_the_rest_the_scratch_and_the_reserve():
    free, rest, scratch = 24_000 * MiB, 3_900 * MiB, 1_152 * MiB
    left = (free - rest - scratch - AUTO_RESERVE) // MiB                         # 17924
    assert auto_cache_mib(free, rest, scratch, most=40_000 * MiB) == left
    assert auto_cache_mib(free, rest, scratch, most=17_000 * MiB) == 17_000     # never more than every host expert
    assert auto_cache_mib(free, rest, scratch, most=17_000 * MiB + 1) == 17_001  # ... rounded up to whole MiB
    assert auto_cache_mib(free, rest, scratch, most=0) == 0
    assert auto_cache_mib(4_000 * MiB, rest, scratch, most=40_000 * MiB) == 0   # nothing left: the smallest pool


class FakeCuda:
    """A device that says it is CUDA with `free` bytes free: auto's figure without a GPU."""
    is_cuda, name = True, "cuda:0"

    def __init__(self, free: int):
        self.free = free

    def free_memory(self) -> int:
        return self.free


def test_auto_on_a_gpu_counts_the_scratch_and_the_staging_rows_and_logs_the_figure(caplog):
    cfg = open_source("synth:tiny").config
    slot, rest = 4 * MiB + 1000, 50 * MiB                          # 64 host experts: 256 MiB and some
    scratch = cfg.n_experts * cfg.expert_numel * 2                                # a layer's experts in bfloat16
    host = len(cfg.moe_layers)
    ecfg = flags.apply(EngineConfig(), cpu_moe=True, moe_cache_mib="auto")
    plan = lambda e, quantized: decode_plan(e, True, quantized, True, True)     # noqa: E731  (staged or not)
    with caplog.at_level(logging.INFO, logger="moestream"):
        got = auto_cache(cfg, ecfg, plan(ecfg, False), FakeCuda(100 * MiB + scratch + AUTO_RESERVE + rest),
                         torch.bfloat16, host, slot, rest=rest)
    assert got.cache.mib == 100 and got.cache.policy == ecfg.cache.policy
    assert "moe cache: auto = 100 MiB" in caplog.text
    # quantized experts that zero-copy decode stages: their scratch rows come out of the same free memory
    staged = flags.apply(ecfg, zero_copy_decode=True)
    free = 100 * MiB + scratch + AUTO_RESERVE + rest
    assert plan(staged, True).staged
    assert auto_cache(cfg, staged, plan(staged, True), FakeCuda(free), torch.bfloat16, host, slot,
                      rest=rest).cache.mib == (100 * MiB - staging_bytes(slot, cfg.n_experts_used)) // MiB
    # a roomy device caches every host expert, no more
    assert auto_cache(cfg, ecfg, plan(ecfg, False), FakeCuda(1 << 40), torch.bfloat16, host, slot).cache.mib == \
        -(-host * cfg.n_experts * slot // MiB)
    # a number, or no host layer, is left as it is
    assert auto_cache(cfg, ecfg, plan(ecfg, False), FakeCuda(1 << 40), torch.bfloat16, 0, slot) is ecfg
    sized = flags.apply(ecfg, moe_cache_mib=8)
    assert auto_cache(cfg, sized, plan(sized, False), FakeCuda(1 << 40), torch.bfloat16, host, slot) is sized


def test_the_flag_takes_auto_in_every_command_and_refuses_other_words(capsys):
    for command in ("generate", "serve"):
        p = build_parser(command)
        assert p.parse_args([command, *TINY, "--moe-cache-mib", "auto"]).moe_cache_mib == "auto"
        assert p.parse_args([command, *TINY, "--moe-cache-mib", "16"]).moe_cache_mib == 16
    bench = build_parser("bench")
    assert bench.parse_args(["bench", *TINY, "--moe-cache-mib", "0,auto,16"]).moe_cache_mib == [0, "auto", 16]
    assert main(["generate", *TINY, "-p", "hi", "--moe-cache-mib", "most"]) != 0
    assert "expected a number of MiB or auto, got 'most'" in capsys.readouterr().err
    assert CacheConfig(mib="auto").mib == "auto"
    with pytest.raises(UserError, match="or auto"):
        CacheConfig(mib="all")
    assert flags.to_argv(flags.apply(EngineConfig(), moe_cache_mib="auto")) == ["--moe-cache-mib", "auto"]


def test_llm_and_bench_resolve_auto_on_the_cpu_to_the_smallest_pool(capsys):
    llm = LLM("synth:tiny", cpu_moe=True, moe_cache_mib="auto", progress=True)
    assert "moe cache: auto = 0 MiB" in capsys.readouterr().err
    assert llm.engine.ecfg.cache.mib == 0 and llm.engine.host.n_slots == llm.model_config.n_experts
    llm.engine.reconfigure_cache(moe_cache_mib=8)
    llm.engine.reconfigure_cache(moe_cache_mib="auto")            # a new cache over the loaded model, as bench's
    assert llm.engine.ecfg.cache.mib == 0 and llm.engine.host.n_slots == llm.model_config.n_experts
    assert main(["bench", *TINY, "-p", "8", "-n", "2", "-r", "1", "--cpu-moe", "--moe-cache-mib", "8,auto",
                 "-o", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["moe_cache_mib"] for r in rows] == [8, 8, 0, 0]    # the figure auto became, not the word


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_on_a_gpu_with_little_left_takes_what_is_left_and_runs():
    """5 GiB left free (a filler takes the rest): auto caches part of the host experts, and a prompt of two
    ubatches and its decode run there; the greedy tokens are the smallest cache's."""
    free = torch.cuda.mem_get_info()[0]
    filler = torch.empty(free - (5 << 30), dtype=torch.uint8, device="cuda")
    prompt = [(7 * i) % 1000 + 1 for i in range(600)]
    llm = LLM("synth:qwen3-30b-a3b:layers=2", cpu_moe=True, moe_cache_mib="auto")
    mib = llm.engine.ecfg.cache.mib
    every = 2 * llm.model_config.n_experts * llm.engine.host.store.expert_bytes
    assert 0 < mib * MiB < every                            # a part of the experts: the arithmetic, not the cap
    got = llm.generate(prompt, max_tokens=8).token_ids
    del llm, filler
    torch.cuda.empty_cache()
    want = LLM("synth:qwen3-30b-a3b:layers=2", cpu_moe=True, moe_cache_mib=0).generate(prompt, max_tokens=8)
    assert got == want.token_ids
