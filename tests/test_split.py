"""Layers split over several devices in one process (runtime/split.py, --split-mode layer): on the CPU two stand-in
devices ("cpu,cpu") run the split's real bookkeeping (which layers, which pool, which copy queue, where the
activations cross) and must give the one-device logits bit for bit (torch.equal: each layer's math is the same,
only where it runs changes). The `cuda` tests repeat it on two GPUs."""
import pytest
import torch

from moestream import LLM, flags
from moestream.engine_config import EngineConfig
from moestream.errors import UserError
from moestream.experts.per_device import PerDevice
from moestream.runtime.plan import resolve
from moestream.runtime.split import Split
from moestream.device import Device

SMALL = dict(ubatch_size=8, batch_size=16, ctx_size=64)
PROMPT = list(range(3, 40))                     # 37 tokens: batches of 16 cut into ubatches of 8, a short tail


def _llm(model="synth:tiny", **kw):
    return LLM(model, **SMALL, **kw)


def _run(llm, steps=3):
    """The prompt's logits (by layer over ubatches), then greedy decode steps' logits."""
    eng = llm.engine
    out = [eng.prefill(0, PROMPT)]
    pos = len(PROMPT)
    for _ in range(steps):
        tok = int(out[-1][-1].argmax())
        out.append(eng.decode([(0, tok, pos)]))
        pos += 1
    return out


def test_shares_give_contiguous_layers():
    cpu = [Device("cpu"), Device("cpu")]
    assert Split.by_shares(4, cpu, (1.0, 1.0)).first == (0, 2)
    s = Split.by_shares(48, cpu, (3.0, 1.0))
    assert s.first == (0, 36) and list(s.layers(1)) == list(range(36, 48))
    assert [s.index(i) for i in (0, 35, 36, 47, 48)] == [0, 0, 1, 1, 1]           # an MTP head: the last's
    assert [(d.name, run) for d, run in s.runs([34, 35, 36])] == [("cpu", [34, 35]), ("cpu", [36])]
    empty = Split.by_shares(4, [*cpu, Device("cpu")], (1.0, 0.0, 1.0))            # a share of 0 holds nothing
    assert [list(empty.layers(d)) for d in range(3)] == [[0, 1], [], [2, 3]]
    assert empty.describe() == "0-1 on cpu, 2-3 on cpu"


def test_bookkeeping_two_stand_in_devices():
    llm = _llm(device="cpu,cpu", tensor_split=(1, 1), cpu_moe=True, moe_cache_mib=(4, 6))
    eng = llm.engine
    assert eng.split.first == (0, 2) and eng.ecfg.placement.device == "cpu,cpu"
    host = eng.host
    assert isinstance(host, PerDevice) and host.gpus == [0, 1]
    a, b = host.providers
    assert a.layers == [0, 1] and b.layers == [2, 3]                 # each pool caches its own share's layers
    assert host.owner == {0: 0, 1: 0, 2: 1, 3: 1}
    assert a.pool.data_ptr() != b.pool.data_ptr() and a.n_slots != b.n_slots     # a pool per device, its own size
    assert a.slots.queue is not b.slots.queue                        # a copy queue (a stream on CUDA) per device
    assert a.slots.queue.device is host.devices[0] and b.slots.queue.device is host.devices[1]
    assert a.routing is not b.routing is not eng.routing             # each its own prompts' statistics
    # the lookahead stays within a device: layer 1's successors are on the other one
    assert len(eng.model.next_routers[1]) == 0 and len(eng.model.next_routers[0]) == 1
    assert not eng.plan.graphs and not eng.plan.zero_copy and not eng.pauses_prompts     # (CPU: zero-copy not asked)


def test_activations_cross_at_split_points_only(monkeypatch):
    llm = _llm(device="cpu,cpu", tensor_split=(3, 1), cpu_moe=True, moe_cache_mib=0)
    entered = []
    monkeypatch.setattr(Device, "make_current", lambda self: entered.append(self))
    llm.engine.prefill(0, PROMPT[:8])
    assert llm.engine.split.first == (0, 3)
    assert len(entered) == 3            # the first share, the second (the one crossing), the logits back to the first


@pytest.mark.parametrize("kw", [dict(cpu_moe=True, moe_cache_mib=0), dict(n_cpu_moe=2, moe_cache_mib=8),
                                dict(cpu_moe=True), dict()], ids=["cache", "ncmoe-cache", "no-cache", "resident"])
def test_logits_equal_unsplit(kw):
    one = _run(_llm(device="cpu", **kw))
    two = _run(_llm(device="cpu,cpu", tensor_split=(3, 1), **kw))
    assert all(torch.equal(x, y) for x, y in zip(one, two))


@pytest.mark.parametrize("kw", [dict(cpu_moe=True, moe_cache_mib=1), dict(cpu_moe=True, moe_cache_mib=16),
                                dict(n_cpu_moe=2, moe_cache_mib=8), dict(cpu_moe=True), dict()],
                         ids=["small-cache", "cache", "ncmoe-cache", "no-cache", "resident"])
def test_zero_copy_decode_equal_unsplit(kw):
    """Zero-copy decode steps of a split read each host layer's experts by address through its own device's
    provider (its table, its landing slots): the unsplit zero-copy logits bit for bit, whatever the cache size; and
    the greedy tokens of the split's fetching steps (the by-address kernel's math is its own: the same tokens, as
    tests/test_zero_copy.py's agreement on the CPU)."""
    one = _run(_llm(device="cpu", zero_copy_decode=True, **kw), steps=4)
    llm = _llm(device="cpu,cpu", tensor_split=(1, 1), zero_copy_decode=True, **kw)
    two = _run(llm, steps=4)
    assert llm.engine.plan.zero_copy and llm.engine.decode_kernel is not None
    assert all(torch.equal(x, y) for x, y in zip(one, two))
    fetched = _run(_llm(device="cpu,cpu", tensor_split=(1, 1), **kw), steps=4)
    assert [int(x[-1].argmax()) for x in fetched] == [int(x[-1].argmax()) for x in two]
    for p in getattr(llm.engine.host, "providers", []):
        if getattr(p, "zero_copy", None) is not None:
            assert p.zero_copy.pending is not None          # each device's provider ran the steps of its layers


@pytest.mark.parametrize("zero_copy", [False, True])
def test_hybrid_family_equal_unsplit(zero_copy):
    """Qwen3-Next's DeltaNet states and attention KV on their layers' devices."""
    kw = dict(cpu_moe=True, moe_cache_mib=0, zero_copy_decode=zero_copy)
    one = _run(_llm("synth:tiny-next", device="cpu", **kw), steps=2)
    llm = _llm("synth:tiny-next", device="cpu,cpu", tensor_split=(1, 1), **kw)
    two = _run(llm, steps=2)
    assert all(torch.equal(x, y) for x, y in zip(one, two))


def test_counters_per_device():
    llm = _llm(device="cpu,cpu", tensor_split=(1, 1), cpu_moe=True, moe_cache_mib=0)
    _run(llm, steps=2)
    st = llm.stats()
    per = st["per_device"]
    assert [d["gpu"] for d in per] == [0, 1] and [d["layers"] for d in per] == [[0, 1], [2, 3]]
    for key in ("hits", "misses", "uploaded_bytes", "copies"):
        assert sum(d["total"][key] for d in per) == st["total"][key]
    assert all(d["total"]["misses"] > 0 for d in per)
    assert st["cache"]["slots"] == sum(d["cache"]["slots"] for d in per)
    from moestream.server.metrics import ServerMetrics, engine_snapshot
    m = ServerMetrics()
    m.set_engine_stats(engine_snapshot(llm))
    text = m.render().decode()
    assert 'moestream_expert_cache_misses_total{gpu="0"}' in text
    assert 'moestream_pool_slots{gpu="1"}' in text


def test_one_device_has_no_split():
    llm = _llm(device="cpu", cpu_moe=True, moe_cache_mib=0)
    assert llm.engine.split is None and llm.engine.model.split is None
    assert "per_device" not in llm.stats() and not isinstance(llm.engine.host, PerDevice)


@pytest.mark.parametrize("overrides, says", [
    (dict(tensor_split=(1, 1)), "--tensor-split 1,1 splits the layers over several devices, but only cpu"),
    (dict(device="cpu,cpu", tensor_split=(1, 1, 1)), "gives 3 shares, but 2 devices"),
    (dict(device="cpu,cpu", main_gpu=2), "--main-gpu 2: there are 2 device(s)"),
    (dict(main_gpu=1), "--main-gpu 1: there is 1 device(s)"),
    (dict(device="cpu,cpu", moe_cache_mib=(1, 2, 3)), "gives 3 figures, but 2 device(s)"),
    (dict(split_mode="row"), "--split-mode 'row' is not run"),
    (dict(tensor_split=(1, -1)), "none negative"),
])
def test_refusals_in_one_line(overrides, says, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError) as e:
        resolve(flags.apply(EngineConfig(), **overrides), torch.float32)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_flags_spell_the_split():
    from moestream.argv import Parser
    p = Parser()
    flags.add_engine_arguments(p)
    ns = p.parse_args(["-m", "synth:tiny", "-dev", "cpu,cpu", "-sm", "layer", "-ts", "3/1", "-mg", "1",
                       "--moe-cache-mib", "4000,8000"])
    ecfg = flags.to_config(ns)
    assert ecfg.placement.tensor_split == (3.0, 1.0) and ecfg.placement.main_gpu == 1
    assert ecfg.cache.mib == (4000, 8000)
    assert flags.to_argv(ecfg)[:2] == ["--device", "cpu,cpu"]
    one = resolve(flags.apply(EngineConfig(), device="cpu,cpu", split_mode="none", main_gpu=1), torch.float32)
    assert one.placement.device == "cpu" and one.placement.tensor_split is None


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


@pytest.mark.cuda
@two_gpus
@pytest.mark.parametrize("kw", [dict(cpu_moe=True, moe_cache_mib=64), dict()], ids=["cache", "resident"])
def test_two_gpus_equal_one(kw):
    """bf16 on two GPUs against one (the same kernels: zero-copy decode steps on both, --no-cuda-graphs)."""
    one = _run(_llm(device="cuda:0", cuda_graphs=False, **kw))
    llm = _llm(device="cuda:0,cuda:1", tensor_split=(1, 1), cuda_graphs=False, **kw)
    two = _run(llm)
    assert all(torch.equal(x, y) for x, y in zip(one, two))
    assert llm.engine.kv.k[0].device.index == 0 and llm.engine.kv.k[-1].device.index == 1


@pytest.mark.cuda
@two_gpus
@pytest.mark.parametrize("kw", [dict(cpu_moe=True, moe_cache_mib=64), dict(cpu_moe=True, moe_cache_mib=2), dict()],
                         ids=["cache", "small-cache", "resident"])
def test_two_gpus_graphs_equal_one(kw):
    """bf16 decode steps replayed as CUDA graphs, one per GPU's share, against one GPU's graph and against the
    split's eager steps: the same bits, the steps of one and of two sequences; the graphs are the split's."""
    from batched import join_and_leave
    one = join_and_leave(LLM("synth:tiny", device="cuda:0", ctx_size=128, n_seq=2, **kw).engine)
    two = LLM("synth:tiny", device="cuda:0,cuda:1", tensor_split=(1, 1), ctx_size=128, n_seq=2, **kw)
    eng = two.engine
    assert eng.plan.graphs and eng.plan.zero_copy
    got = join_and_leave(eng)
    assert sorted(eng.decoder.graphs.pools) == [0, 1]
    eager = join_and_leave(LLM("synth:tiny", device="cuda:0,cuda:1", tensor_split=(1, 1), ctx_size=128, n_seq=2,
                               cuda_graphs=False, **kw).engine)
    assert all(torch.equal(x, y) for x, y in zip(one, got))
    assert all(torch.equal(x, y) for x, y in zip(eager, got))


@pytest.mark.cuda
@two_gpus
def test_two_gpus_default_split_by_free_memory():
    llm = _llm(cpu_moe=True, moe_cache_mib=64)
    assert llm.engine.split is not None and len(llm.engine.split) == torch.cuda.device_count()
    assert all(d["cache"] is not None for d in llm.stats()["per_device"])


@pytest.mark.parametrize("model, kw", [("synth:tiny", dict(cpu_moe=True, moe_cache_mib=1)),
                                       ("synth:tiny", dict(cpu_moe=True, moe_cache_mib=16)),
                                       ("synth:tiny", dict(n_cpu_moe=2, moe_cache_mib=8)),
                                       ("synth:tiny", dict()),
                                       ("synth:tiny-next", dict(cpu_moe=True, moe_cache_mib=16))],
                         ids=["small-cache", "cache", "ncmoe-cache", "resident", "hybrid"])
def test_captured_shares_replayed_give_the_eager_bits(monkeypatch, model, kw):
    """A split's decode step as one graph per device's share (runtime/graphs.py's _capture_split), CUDA graphs stood
    in for on the CPU (tests/test_decode_paths.py): sequences joining and leaving give the split's eager zero-copy
    bits, which are the unsplit run's; each device's share has its own graph memory pool."""
    from batched import join_and_leave
    from test_decode_paths import _replaying_on_the_cpu

    def script(device, replayed):
        llm = LLM(model, device=device, ctx_size=128, n_seq=2, zero_copy_decode=True,
                  **(dict(tensor_split=(1, 1)) if "," in device else {}), **kw)
        eng, asked = llm.engine, []
        if replayed:
            _replaying_on_the_cpu(monkeypatch, eng)
            if isinstance(eng.host, PerDevice):        # each share's graph runs its own device's step ops
                ops_of = eng.host.ops_of
                monkeypatch.setattr(eng.host, "ops_of", lambda d: (asked.append(d), ops_of(d))[1])
        outs = join_and_leave(eng)
        if replayed:
            assert sorted(eng.decoder.graphs.pools) == [0, 1] and len(eng.decoder.graphs.graphs) == 2
            assert asked == ([0, 1] * 2 if isinstance(eng.host, PerDevice) else [])
        return outs
    one = script("cpu", False)
    for replayed in (False, True):
        assert all(torch.equal(x, y) for x, y in zip(one, script("cpu,cpu", replayed))), replayed
