"""Engine configs and the flag table: validation that names the flag, flags <-> config both ways, LLM's flat
overrides, "auto" resolved once, the budgets, and `moestream --help` without torch."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from moestream import flags
from moestream.cli import SUBCOMMANDS, build_parser
from moestream.engine_config import Batching, CacheConfig, EngineConfig, Placement
from moestream.errors import UserError
from moestream.experts.budget import cache_slots, check_cache_fits, check_placement_fits
from moestream.experts.prefetch import PrefetchConfig

MiB = 1 << 20


def parser(**changes) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    flags.add_engine_arguments(p, **changes)
    return p


# --- validation ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,value,flag", [
    ("ctx_size", 0, "--ctx-size"), ("batch_size", 0, "-b"), ("ubatch_size", -1, "-ub"),
    ("n_cpu_moe", -1, "--n-cpu-moe"), ("device", "tpu", "--device"), ("dtype", "int8", "--dtype"),
    ("kernel", "fast", "--kernel"), ("moe_cache_mib", -1, "--moe-cache-mib"), ("moe_cache_mib", "4000", "--moe-cache-mib"),
    ("moe_cache_mib", True, "--moe-cache-mib"), ("cache_policy", "fifo", "--cache-policy"),
    ("prefetch_min_batch", 0, "--prefetch-min-batch"), ("lookahead_layers", 5, "--lookahead-layers"),
    ("lookahead_layers", 0, "--lookahead-layers"), ("prefetch_min_use", 1.5, "--prefetch-min-use"),
    ("n_seq", 0, "-np"),
])
def test_a_bad_value_names_its_flag(name, value, flag):
    with pytest.raises(UserError, match=flag):
        flags.apply(EngineConfig(), **{name: value})


def test_the_nested_configs_validate_where_they_are_made():
    with pytest.raises(UserError, match="--ctx-size"):
        Batching(ctx_size=0)
    with pytest.raises(UserError, match="--moe-cache-mib"):
        CacheConfig(mib=-2)
    assert CacheConfig(mib=30.0).mib == 30.0                    # LLM(moe_cache_mib=30.0) runs (a float of MiB)
    with pytest.raises(UserError, match="--lookahead-layers"):
        CacheConfig(prefetch=PrefetchConfig(lookahead_layers=9))
    with pytest.raises(UserError, match="--n-cpu-moe"):
        EngineConfig(placement=Placement(n_cpu_moe=-3))
    assert Placement(device=None).device == "auto"              # LLM(device=None), as before


def test_every_bad_flag_on_the_command_line_is_one_user_error():
    with pytest.raises(UserError, match="--cache-policy"):
        flags.to_config(parser().parse_args(["-m", "x", "--cache-policy", "mru"]))


# --- flags <-> config -------------------------------------------------------------------------------------------
def _non_default_argv(o: flags.Option) -> list[str]:
    """The canonical flags that set option `o` to a value other than its default."""
    long = o.flags[-1]
    if o.kind == "value":
        value = {"device": "cpu", "dtype": "bfloat16", "kernel": "reference", "cache_policy": "lru",
                 "prefetch_min_use": "0.5", "lookahead_layers": "3", "moe_cache_mib": "0",
                 "spec_type": "draft-mtp", "split_mode": "none", "tensor_split": "3,1"}.get(o.name, "7")
        return [long, value]
    if o.kind == "both":
        return ["--no-" + long[2:]]
    return [long]


@pytest.mark.parametrize("option", [o for o in flags.OPTIONS if o.flags], ids=lambda o: o.name)
def test_flags_to_config_to_flags_round_trips_every_flag(option):
    argv = _non_default_argv(option)
    ns = parser().parse_args(["-m", "x", *argv])
    ecfg = flags.to_config(ns)
    assert ecfg.get(option.path) != option.default
    assert flags.to_argv(ecfg) == argv
    for short in option.flags[:-1]:                         # -ub 7 is --ubatch-size 7
        assert flags.to_config(parser().parse_args(["-m", "x", short, *argv[1:]])) == ecfg


def test_defaults_give_the_default_config_and_no_flags():
    ecfg = flags.to_config(parser().parse_args(["-m", "x"]))
    assert ecfg == EngineConfig()
    assert flags.to_argv(ecfg) == []


def test_all_flags_at_once_round_trip_and_reach_their_fields():
    argv = [a for o in flags.OPTIONS if o.flags for a in _non_default_argv(o)]
    ecfg = flags.to_config(parser().parse_args(["-m", "x", *argv]))
    assert flags.to_argv(ecfg) == argv
    assert ecfg.placement.device == "cpu" and ecfg.cache.mib == 0 and ecfg.cache.policy == "lru"
    assert ecfg.cache.prefetch == PrefetchConfig(enabled=False, min_batch=7, seed_previous=False, first_chunk_all=True,
                                                 lookahead=False, prompt_lookahead=False, lookahead_layers=3,
                                                 max_inflight_mib=7, min_use=0.5)
    assert (ecfg.decode.zero_copy, ecfg.decode.read_through, ecfg.decode.cuda_graphs) == (None, False, False)
    assert ecfg.batching == Batching(ctx_size=7, n_seq=1, batch_size=7, ubatch_size=7, by_layer=False)


def test_values_no_flag_spells_are_refused_by_to_argv():
    for kw in ({"n_seq": 2}, {"zero_copy_decode": True}):
        with pytest.raises(ValueError, match="no flag"):
            flags.to_argv(flags.apply(EngineConfig(), **kw))


def test_a_command_can_change_a_flag_and_take_a_subset():
    p = parser(ctx_size=dict(default=512), moe_cache_mib=dict(type=lambda s: [int(x) for x in s.split(",")],
                                                              default=[None]))
    ns = p.parse_args(["-m", "x", "--moe-cache-mib", "0,8"])
    assert ns.ctx_size == 512 and ns.moe_cache_mib == [0, 8]
    p = argparse.ArgumentParser()
    flags.add_engine_arguments(p, flags.PREFETCH_RULES)        # replay's: no -m, no placement
    ns = p.parse_args(["--no-prefetch-seed", "--prefetch-min-batch", "8"])
    assert flags.prefetch_config(ns) == PrefetchConfig(min_batch=8, seed_previous=False)
    with pytest.raises(SystemExit):
        p.parse_args(["--cpu-moe"])


def test_removed_flags_are_gone():
    for flag in ("--shared-reads", "--no-host-decode-graphs", "--no-zero-copy-decode", "--host-compute"):
        with pytest.raises(SystemExit):
            parser().parse_args(["-m", "x", flag])
    for name in ("shared_reads", "host_decode_graphs", "host_compute"):
        with pytest.raises(TypeError, match="unknown engine option"):
            flags.apply(EngineConfig(), **{name: False})


# --- flat overrides --------------------------------------------------------------------------------------------
def test_flat_names_reach_the_nested_fields():
    ecfg = flags.apply(EngineConfig(), cpu_moe=True, moe_cache_mib=16, ubatch_size=256, prefetch_seed=False,
                       zero_copy_decode=False, n_seq=3)
    assert ecfg.placement.cpu_moe and ecfg.cache.mib == 16 and ecfg.batching.ubatch_size == 256
    assert not ecfg.cache.prefetch.seed_previous and ecfg.decode.zero_copy is False and ecfg.batching.n_seq == 3
    assert ecfg.cache.policy == "cycle" and ecfg.batching.ubatch == 256      # untouched fields keep their values
    assert flags.apply(ecfg) == ecfg


def test_an_unknown_override_is_a_type_error_with_a_suggestion():
    with pytest.raises(TypeError, match="'moe_cache_mb'.*did you mean 'moe_cache_mib'"):
        flags.apply(EngineConfig(), moe_cache_mb=16)


def test_llm_takes_a_config_and_flat_overrides():
    from moestream import LLM
    llm = LLM("synth:tiny", ctx_size=64, device="cpu", cpu_moe=True, moe_cache_mib=2)
    c = llm.config
    assert c.placement.cpu_moe and c.cache.mib == 2 and c.batching.ctx_size == 64
    assert llm.engine.host.n_slots == 2 * MiB // llm.engine.host.store.expert_bytes
    base = flags.apply(EngineConfig(), ctx_size=64, device="cpu")
    llm2 = LLM("synth:tiny", base, n_cpu_moe=1)
    assert llm2.config.placement.n_cpu_moe == 1 and llm2.config.batching.ctx_size == 64
    assert llm2.engine.ecfg is llm2.config
    with pytest.raises(TypeError, match="unknown engine option 'cpu_moes'"):
        LLM("synth:tiny", cpu_moes=True)
    with pytest.raises(TypeError, match="unknown engine option"):
        llm.engine.reconfigure_cache(cache_size=3)


# --- resolving "auto" ------------------------------------------------------------------------------------------
def test_resolve_decides_every_auto_once():
    import torch
    from moestream.runtime.plan import resolve
    ecfg = EngineConfig()
    assert not ecfg.resolved
    r = resolve(flags.apply(ecfg, device="cpu"), torch.float16)
    assert r.resolved and r.placement.device == "cpu" and r.placement.dtype == "float16"
    assert r.kernel == "reference" and r.decode.zero_copy is False        # no Triton on the CPU
    assert resolve(flags.apply(ecfg, device="cpu", zero_copy_decode=True), torch.float32).decode.zero_copy is True
    assert resolve(flags.apply(ecfg, device="cpu"), torch.uint8).placement.dtype == "bfloat16"
    assert resolve(flags.apply(ecfg, device="cpu", dtype="float32"), torch.bfloat16).placement.dtype == "float32"
    assert resolve(r, torch.float32) == r                                  # resolving is idempotent


def test_decode_steps_that_fetch_their_experts_are_refused_where_zero_copy_decode_runs(monkeypatch):
    """--no-zero-copy-decode (removed at stop 47) on CUDA: zero_copy=False is refused where the decode kernel runs
    (stood in for here: no CUDA), and stays the CPU's plain path."""
    import torch
    from moestream.runtime import plan
    cpu = flags.apply(EngineConfig(), device="cpu", zero_copy_decode=False)
    assert plan.resolve(cpu, torch.float32).decode.zero_copy is False
    monkeypatch.setattr(plan, "decode_available", lambda device, dtype: True)
    with pytest.raises(UserError, match="zero-copy decode"):
        plan.resolve(cpu, torch.float32)
    assert plan.resolve(flags.apply(EngineConfig(), device="cpu"), torch.float32).decode.zero_copy is True


def test_engine_config_imports_nothing_above_config():
    """engine_config.py is plain data: it imports no kernel and no runtime (the decisions are runtime/plan.py's);
    the cache's policy names are the policies experts/policy.py makes."""
    import ast
    import moestream.engine_config as ec
    from moestream.experts.policy import POLICIES
    tree = ast.parse(open(ec.__file__).read())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level}
    assert imported <= {"config", "errors", "experts.prefetch"}, imported
    assert tuple(POLICIES) == ec.POLICIES


def test_engine_load_takes_resolved_configs_only():
    from moestream.loading.source import open_source
    from moestream.runtime.load import load_engine
    with pytest.raises(ValueError, match="resolve"):
        load_engine(open_source("synth:tiny", progress=False), EngineConfig(), progress=False)


# --- budgets ---------------------------------------------------------------------------------------------------
def test_cache_slots_for_none_zero_and_a_size():
    eb = 3 * MiB
    assert cache_slots(None, eb, 8, 4, 64) is None                         # no cache: uploads per ubatch
    assert cache_slots(12, eb, 8, 0, 64) is None                           # nothing in host memory
    assert cache_slots(0, eb, 8, 4, 64) == 8                               # the smallest pool: one layer
    assert cache_slots(12, eb, 8, 4, 64) == 4
    assert cache_slots(10 ** 6, eb, 8, 4, 64) == 32                        # never more than the host experts
    with pytest.raises(UserError, match="--moe-cache-mib 2 holds no expert.*at least 3"):
        cache_slots(2, eb, 8, 4, 64)


def test_fit_checks_name_the_flag_and_a_size_that_fits():
    check_cache_fits(100, 50 * MiB, 40 * MiB, 100 * MiB, "cuda:0")
    with pytest.raises(UserError, match=r"--moe-cache-mib 800 does not fit: 1000 MiB are free on cuda:0 and the rest "
                                        r"of the model takes 300 MiB; use --moe-cache-mib 444 or less"):
        check_cache_fits(800, 800 * MiB, 300 * MiB, 1000 * MiB, "cuda:0")
    with pytest.raises(UserError, match=r"1000 MiB are free on cuda:0; use --moe-cache-mib 744 or less"):
        check_cache_fits(2000, 2000 * MiB, 0, 1000 * MiB, "cuda:0")     # a new cache over a loaded model
    check_placement_fits(10 * MiB, 10 * MiB, "cuda:0", MiB, 4, 4)
    with pytest.raises(UserError, match="needs about 1200 MiB on cuda:0 but 1000 MiB.*--n-cpu-moe 2"):
        check_placement_fits(1200 * MiB, 1000 * MiB, "cuda:0", 100 * MiB, 10, 10)


# --- the command line -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["generate", *SUBCOMMANDS])
def test_each_subcommand_builds_its_parser_alone(command):
    p = build_parser(command)
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == {"generate", *SUBCOMMANDS}
    assert sub.choices[command].get_default("func") is not None


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["replay", "--help"], ["serve", "--help"]])
def test_help_imports_no_torch(argv):
    code = ("import sys\nfrom moestream.cli import main\ntry:\n    main(%r)\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, 'triton' in sys.modules, 'moestream.server.app' in sys.modules)" % argv)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "usage: moestream" in out
    assert out.splitlines()[-1] == "False False False", out[-300:]


def test_python_m_moestream_help_answers():
    out = subprocess.run([sys.executable, "-m", "moestream", "--help"], capture_output=True, text=True, check=True)
    assert all(name in out.stdout for name in ("generate", *SUBCOMMANDS))


def test_a_context_too_big_for_the_device_names_c_not_the_experts():
    """When the KV cache of -c (with attention and embeddings) cannot fit whatever the experts do, the error names
    -c, its size and a -c that fits, not --cpu-moe; a context that fits goes on to the placement check."""
    import types

    import torch
    from moestream.loading.synth import SynthSource
    from moestream.quant.layout import expert_layouts
    from moestream.runtime.placement import check_device_fits
    from moestream.runtime.plan import decode_plan
    src = SynthSource.from_spec("tiny")
    cfg = src.config
    layouts = expert_layouts(src, cfg)
    dev = types.SimpleNamespace(is_cuda=True, name="cuda:0", free_memory=lambda: 64 * MiB)
    big = flags.apply(EngineConfig(), ctx_size=1 << 20, cpu_moe=True)
    with pytest.raises(UserError, match=r"^-c 1048576: the KV cache needs \d+ MiB on cuda:0 .* use -c \d+ or less$"):
        check_device_fits(cfg, big, decode_plan(big, True, False, True, True), dev, torch.float32,
                          set(cfg.moe_layers), None, layouts)
    ok = flags.apply(EngineConfig(), ctx_size=4096, cpu_moe=True)
    check_device_fits(cfg, ok, decode_plan(ok, True, False, True, True), dev, torch.float32, set(cfg.moe_layers),
                      None, layouts)
