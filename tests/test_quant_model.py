"""Quantized GGUF experts end to end on the CPU: the blocks stay quantized from the file to the store to the slot,
the model computes what the same weights dequantized compute, and the numerics contract holds per file."""
from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType

from moestream import LLM
from moestream.experts.buffered import BufferedCache, buffer_decodes
from moestream.experts.cache import ExpertCache
from moestream.loading.gguf import GGUFSource
from moestream.loading.gguf_write import write_gguf
from moestream.loading.synth import SynthSource
from moestream.quant.layout import ExpertLayout

EXPS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")


def quantize_experts(src: str, out, types) -> None:
    """Copy a float32 GGUF with its expert stacks quantized: types(layer, stack) -> the GGML type. gguf.quants
    quantizes the types it can; the others (K-quants, IQ types) get random valid blocks (quant/dequant.py): the
    weights change, the files stay what their types say."""
    from moestream.quant.dequant import random_blocks
    from moestream.quant.types import block_size
    g = torch.Generator().manual_seed(0)
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(out, r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub)
    for t in r.tensors:
        data = np.array(t.data)
        m = EXPS.fullmatch(t.name)
        if m and t.tensor_type == Q.F32:
            q = types(int(m[1]), m[2])
            try:
                blocks = gguf.quants.quantize(data, q)
            except NotImplementedError:
                blocks = random_blocks(q, data.size // block_size(q), g).numpy().reshape(*data.shape[:-1], -1)
            w.add_tensor(t.name, blocks, raw_dtype=q)
        else:
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def _mixed(layer, stack):                 # like a `_M` mix: down gets more bits, and not in every layer
    return Q.Q8_0 if stack == "down" and layer % 2 == 0 else (Q.Q5_0 if stack == "down" else Q.Q4_0)


MIXES = {"q8_0": lambda l, s: Q.Q8_0, "q4_0": lambda l, s: Q.Q4_0, "q5_0": lambda l, s: Q.Q5_0, "mixed": _mixed}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("quant")
    write_gguf(SynthSource.from_spec("tiny"), d / "f32.gguf", dtype="float32")
    out = {}
    for name, mix in MIXES.items():
        quantize_experts(str(d / "f32.gguf"), d / f"{name}.gguf", mix)
        # The same weights as float32: GGUFSource dequantizes what it hands out as floats.
        write_gguf(GGUFSource(d / f"{name}.gguf"), d / f"{name}-deq.gguf", dtype="float32")
        out[name] = (str(d / f"{name}.gguf"), str(d / f"{name}-deq.gguf"))
    return out


def _prompt(n, seed):
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_experts_stay_in_their_blocks(files):
    """The host store holds each layer's raw blocks (uint8), a slot the widest layer's row, and an upload moves a
    layer's own bytes."""
    path, _ = files["mixed"]
    llm = LLM(path, ubatch_size=16, ctx_size=128, device="cpu", cpu_moe=True, moe_cache_mib=1)
    store, cfg = llm.engine.host.store, llm.model_config
    I, H = cfg.moe_intermediate_size, cfg.hidden_size
    for l in cfg.moe_layers:
        lay = store.layouts[l]
        assert lay == ExpertLayout(I, H, (Q.Q4_0, Q.Q4_0, _mixed(l, "down")))
        assert store.rows[l].dtype == torch.uint8 and store.rows[l].shape == (cfg.n_experts, lay.nbytes)
        raw = GGUFSource(path).expert_bytes(l, 3)
        assert torch.equal(store.rows[l][3], raw)
    q4 = I * H // 32 * 18                                      # Q4_0: 32 values in 18 bytes
    assert store.layer_bytes(0) == 2 * q4 + H * I // 32 * 34 and store.layer_bytes(1) == 2 * q4 + H * I // 32 * 22
    assert store.expert_bytes == store.layer_bytes(0)           # a slot holds the widest row
    llm.logits(_prompt(40, 0))
    per = llm.stats()["per_layer"]
    for l in cfg.moe_layers:
        assert per[l]["uploaded_bytes"] == per[l]["misses"] * store.layer_bytes(l) > 0


@pytest.mark.parametrize("name", list(MIXES))
def test_logits_equal_the_dequantized_weights(files, name):
    """A quantized file computes exactly what its weights dequantized to float32 compute (CPU, float32): the
    offsets of gate, up and down in a row, each type's blocks, the dequantized scratch of a ubatch's experts."""
    qpath, fpath = files[name]
    for kw in (dict(), dict(cpu_moe=True, moe_cache_mib=1)):
        q = LLM(qpath, ubatch_size=16, ctx_size=128, device="cpu", **kw)
        f = LLM(fpath, ubatch_size=16, ctx_size=128, device="cpu", **kw)
        assert q.engine.quantized and not f.engine.quantized
        for s in range(2):
            assert torch.equal(q.logits(_prompt(40, s)), f.logits(_prompt(40, s))), (name, kw, s)


@pytest.mark.parametrize("name", ["q4_0", "mixed"])
def test_numerics_contract_per_quantized_file(files, name):
    """Bit-identical logits whatever the placement, cache size and policy; the same greedy decode."""
    path, _ = files[name]
    base = LLM(path, ubatch_size=16, ctx_size=128, device="cpu")
    want = [base.logits(_prompt(40, s)) for s in range(3)]
    greedy = base.generate(_prompt(12, 9), max_tokens=12, ignore_eos=True).sha256
    for kw in (dict(cpu_moe=True), dict(cpu_moe=True, moe_cache_mib=0), dict(cpu_moe=True, moe_cache_mib=1),
               dict(n_cpu_moe=2, moe_cache_mib=3, cache_policy="lru"), dict(cpu_moe=True, moe_cache_mib=1000)):
        llm = LLM(path, ubatch_size=16, ctx_size=128, device="cpu", **kw)
        for s, w in enumerate(want):
            assert torch.equal(llm.logits(_prompt(40, s)), w), (kw, s)
        assert llm.generate(_prompt(12, 9), max_tokens=12, ignore_eos=True).sha256 == greedy, kw


def test_a_cache_of_quantized_experts_gives_the_float_weights_logits(files):
    """Quantized rows reach the kernel as a compact dequantized stack of the slots a ubatch reads: a cache of them
    gives the logits of the float weights' cache."""
    qpath, fpath = files["mixed"]
    kw = dict(ubatch_size=32, ctx_size=128, device="cpu", cpu_moe=True, moe_cache_mib=3)
    q, f = LLM(qpath, **kw), LLM(fpath, **kw)
    ids = _prompt(64, 5)
    assert torch.equal(q.logits(ids), f.logits(ids))
    q.engine.host.residency.check()
    assert q.stats()["total"]["hits"] + q.stats()["total"]["misses"] > q.engine.host.n_slots // 2


def test_a_trace_of_a_quantized_file_replays_its_live_counts(files, tmp_path):
    """A trace says its experts were quantized, and its replay gives the live cache's counts."""
    from moestream.experts.trace import TraceRecorder, load_trace, replay
    llm = LLM(files["q4_0"][0], ubatch_size=16, ctx_size=128, device="cpu", cpu_moe=True, moe_cache_mib=3,
              prefetch=False)           # (one type: a replay counts every upload at a slot's bytes)
    cfg = llm.model_config
    rec = TraceRecorder(cfg.n_layers, cfg.n_experts, llm.engine.host.store.expert_bytes, llm.engine.quantized)
    llm.engine.observe(rec)
    for s in range(2):
        llm.generate(_prompt(40, s), max_tokens=6, ignore_eos=True)
    rec.save(str(tmp_path / "q.npz"))
    trace = load_trace(str(tmp_path / "q.npz"))
    assert trace.quantized
    slots = llm.stats()["cache"]["slots"]
    timing = ("sync_s", "host_s", "wait_s")
    live = {k: v for k, v in llm.stats()["total"].items() if k not in timing}
    def replayed():
        return {k: v for k, v in replay(trace, slots, llm.engine.ecfg.cache.policy)["total"].items() if k not in timing}
    assert replayed() == live


def test_a_quantized_file_runs_float32_on_the_cpu(files):
    """dtype auto: a quantized checkpoint has no float dtype of its own; the CPU runs it in float32."""
    llm = LLM(files["q8_0"][0], ctx_size=64, device="cpu")
    assert llm.engine.dtype == torch.float32 and llm.config.placement.dtype == "float32"


def test_bench_shows_the_type_mix_and_bytes_per_expert(files, capsys):
    from moestream.cli import main
    args = ["bench", "-m", files["mixed"][0], "-p", "16", "-n", "2", "-r", "1", "--cpu-moe", "--device", "cpu"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "file: F32 " in err and "Q4_0" in err
    assert ("experts (gate/up/down): Q4_0/Q4_0/Q8_0 in 2 layers, Q4_0/Q4_0/Q5_0 in 2 layers; 0.06-0.07 MB per expert"
            in err)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["q8_0", "mixed"])
def test_numerics_contract_per_quantized_file_on_cuda(files, name):
    """On the GPU in bf16 with the grouped kernel: bit-identical logits all on the GPU and over the cache at every
    size, and the same greedy tokens (the decode path chosen for quantized experts)."""
    path, _ = files[name]
    kw = dict(ubatch_size=16, ctx_size=128, device="cuda", dtype="bfloat16")     # (its dense tensors are F32)
    base = LLM(path, **kw)
    assert base.engine.quantized and base.engine.dtype == torch.bfloat16
    want = [base.logits(_prompt(40, s)) for s in range(3)]
    greedy = base.generate(_prompt(12, 9), max_tokens=12, ignore_eos=True).sha256
    for extra in (dict(cpu_moe=True), dict(cpu_moe=True, moe_cache_mib=0), dict(cpu_moe=True, moe_cache_mib=1),
                  dict(cpu_moe=True, moe_cache_mib=1000)):
        llm = LLM(path, **kw, **extra)
        for s, w in enumerate(want):
            assert torch.equal(llm.logits(_prompt(40, s)), w), (extra, s)
        assert llm.generate(_prompt(12, 9), max_tokens=12, ignore_eos=True).sha256 == greedy, extra


def test_zero_copy_decode_reads_quantized_rows_in_place(files):
    """Decode steps read each quantized expert where it lies (a slot or its host row), staged or in place: the
    same tokens at every cache size, and the same as the steps with every expert on the device. Staged (the
    default for quantized experts) a step lands what it reads in free slots (read-through); in place it does not."""
    path, _ = files["mixed"]
    kw = dict(ubatch_size=16, ctx_size=128, device="cpu", zero_copy_decode=True)
    base = LLM(path, **kw)
    assert base.engine.decode_kernel is not None
    want = base.generate(_prompt(12, 4), max_tokens=10, ignore_eos=True)
    for extra in (dict(cpu_moe=True), dict(cpu_moe=True, moe_cache_mib=1), dict(cpu_moe=True, moe_cache_mib=1000),
                  dict(cpu_moe=True, stage_host_reads=False), dict(cpu_moe=True, moe_cache_mib=1,
                                                                   stage_host_reads=False)):
        llm = LLM(path, **kw, **extra)
        got = llm.generate(_prompt(12, 4), max_tokens=10, ignore_eos=True)
        assert got.sha256 == want.sha256, extra
        staged = extra.get("stage_host_reads", True)
        host, cfg = llm.engine.host, llm.engine.cfg   # no cache: the upload buffer, which may decode as a cache
        lands = llm.engine.plan.lands
        buffered = "moe_cache_mib" not in extra and buffer_decodes(cfg.n_experts, cfg.n_layers, cfg.n_experts_used,
                                                                   lands)
        assert isinstance(host, BufferedCache) == buffered
        if isinstance(host, ExpertCache):
            zc = host.zero_copy
            assert zc is not None and (zc.scratch is not None) == staged
            assert zc.n_land == (cfg.n_experts_used if staged else 0)
            host.flush_decode()
            landed = host.stats.summary(host.stats.total)["landed"]
            assert (landed > 0) == (staged and zc.rt.holds_a_step(cfg.n_experts_used)), (extra, landed)
        else:
            assert host.staged == staged


# --- K-quants, through moestream's quantizer and llama-quantize's mixes -------------------------------------------
@pytest.fixture(scope="module")
def kquant_files(tmp_path_factory):
    """tiny with an expert FFN of 256 (whole K-quant blocks in down's rows too), float32 and in three mixes."""
    from moestream.config import ModelConfig
    from moestream.loading.synth import PRESETS, TINY_ROUTER_SCALE
    from moestream.quant.mix import Mix
    d = tmp_path_factory.mktemp("kquant")
    cfg = ModelConfig(**dict(PRESETS["tiny"], moe_intermediate_size=256))
    src = SynthSource(cfg, router_scale=TINY_ROUTER_SCALE)
    write_gguf(src, d / "f32.gguf", dtype="float32")
    out = {"f32": str(d / "f32.gguf")}
    for ft in ("Q4_K_M", "Q6_K", "IQ4_XS"):
        mix = Mix.for_config(cfg, ft)
        write_gguf(src, d / f"{ft}.gguf", types=mix.type, file_type=mix.file_type, device="cpu")
        out[ft] = str(d / f"{ft}.gguf")
    return out


def test_q4_k_m_keeps_llama_quantizes_types_per_layer(kquant_files):
    llm = LLM(kquant_files["Q4_K_M"], ctx_size=64, device="cpu", cpu_moe=True)
    types = {l: lay.types for l, lay in llm.engine.host.store.layouts.items()}
    assert {t[0] for t in types.values()} == {Q.Q4_K} and {t[2] for t in types.values()} == {Q.Q4_K, Q.Q6_K}


# KL divergence of each mix's next-token distributions against the float32 original, over 64 positions of a
# random prompt (random weights amplify quantization error; a trained model's is far smaller): measured
# 2026-12-01 Q6_K 0.015, Q4_K_M 0.116, IQ4_XS 0.131 (Q8_0: 0.0017). The bounds leave room for other prompts.
KL_BOUND = {"Q6_K": 0.03, "Q4_K_M": 0.2, "IQ4_XS": 0.25}


@pytest.mark.parametrize("ftype", list(KL_BOUND))
def test_k_quant_files_are_close_to_the_float_model_and_keep_the_contract(kquant_files, ftype):
    ids = _prompt(64, 0)
    kw = dict(ctx_size=128, ubatch_size=64, device="cpu")
    ref = torch.log_softmax(LLM(kquant_files["f32"], **kw).engine.prefill(0, ids, all_logits=True).float(), -1)
    q = LLM(kquant_files[ftype], **kw)
    got = q.engine.prefill(0, ids, all_logits=True)
    kl = (ref.exp() * (ref - torch.log_softmax(got.float(), -1))).sum(-1).mean().item()
    assert 0 < kl < KL_BOUND[ftype], kl
    cached = LLM(kquant_files[ftype], **kw, cpu_moe=True, moe_cache_mib=1)        # waves, the cache, uploads
    assert torch.equal(cached.engine.prefill(0, ids, all_logits=True), got)


# --- the grid IQ types and Q2_K/Q3_K, which no quantizer here writes: random valid blocks ---------------------------
def _grid_mix(layer, stack):              # every grid kernel branch in one file: IQ1_M, IQ2_XXS, Q3_K, IQ3_S
    if stack == "down":
        return Q.Q3_K if layer % 2 else Q.IQ2_XXS
    return Q.IQ1_M if layer % 2 else Q.IQ3_S


@pytest.fixture(scope="module")
def grid_files(kquant_files, tmp_path_factory):
    """kquant_files' float32 model with random blocks of _grid_mix's types for experts, and those weights as F32."""
    d = tmp_path_factory.mktemp("grid")
    quantize_experts(kquant_files["f32"], d / "grid.gguf", _grid_mix)
    write_gguf(GGUFSource(d / "grid.gguf"), d / "grid-deq.gguf", dtype="float32")
    return str(d / "grid.gguf"), str(d / "grid-deq.gguf")


def test_a_grid_type_file_computes_its_dequantized_weights_and_keeps_the_contract(grid_files):
    """IQ1_M, IQ3_S, IQ2_XXS and Q3_K experts: the logits of the same weights as float32, and the same bits at
    every placement and cache size (CPU, float32)."""
    qpath, fpath = grid_files
    kw = dict(ubatch_size=16, ctx_size=128, device="cpu")
    base = LLM(qpath, **kw)
    types = {lay.types for lay in LLM(qpath, **kw, cpu_moe=True).engine.host.store.layouts.values()}
    assert types == {(Q.IQ3_S, Q.IQ3_S, Q.IQ2_XXS), (Q.IQ1_M, Q.IQ1_M, Q.Q3_K)}
    want = base.logits(_prompt(40, 0))
    assert torch.isfinite(want).all()
    assert torch.equal(LLM(fpath, **kw).logits(_prompt(40, 0)), want)
    for extra in (dict(cpu_moe=True), dict(cpu_moe=True, moe_cache_mib=1)):
        assert torch.equal(LLM(qpath, **kw, **extra).logits(_prompt(40, 0)), want), extra


@pytest.mark.cuda
def test_a_grid_type_file_decodes_zero_copy_on_cuda_and_keeps_the_contract(grid_files):
    """On the GPU the grid types have Triton paths (kernels/qblocks_iq.py): zero-copy decode steps, and the same
    logits and greedy tokens all on the GPU and over the cache at every size."""
    qpath, _ = grid_files
    kw = dict(ubatch_size=16, ctx_size=128, device="cuda", dtype="bfloat16")
    base = LLM(qpath, **kw)
    assert base.engine.decode_kernel is not None
    want = base.logits(_prompt(40, 1))
    greedy = base.generate(_prompt(12, 9), max_tokens=12, ignore_eos=True).sha256
    for extra in (dict(cpu_moe=True), dict(cpu_moe=True, moe_cache_mib=1), dict(cpu_moe=True, moe_cache_mib=1000)):
        llm = LLM(qpath, **kw, **extra)
        assert llm.engine.decode_kernel is not None
        assert torch.equal(llm.logits(_prompt(40, 1)), want), extra
        assert llm.generate(_prompt(12, 9), max_tokens=12, ignore_eos=True).sha256 == greedy, extra


def _one_tensor_gguf(path, rows: int, cols: int, qtype=Q.Q8_0):
    w = gguf.GGUFWriter(path, "qwen3moe")
    data = gguf.quants.quantize(np.ones((rows, cols), dtype=np.float32), qtype)
    w.add_tensor("token_embd.weight", data, raw_dtype=qtype)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()


def test_a_row_that_is_not_whole_blocks_or_short_data_is_one_line(tmp_path):
    """A tensor whose rows are not whole blocks of its type, or whose data is shorter than its type and shape
    need: one line naming the problem (the GGUF header is edited by hand, as a damaged file would be)."""
    from moestream.errors import UserError
    path = tmp_path / "rows.gguf"
    _one_tensor_gguf(path, 2, 64)
    raw = bytearray(path.read_bytes())
    at = raw.index(b"token_embd.weight") + len(b"token_embd.weight")
    n_dims = int.from_bytes(raw[at:at + 4], "little")
    assert n_dims == 2 and int.from_bytes(raw[at + 4:at + 12], "little") == 64
    raw[at + 4:at + 12] = (40).to_bytes(8, "little")               # 40 values a row: not whole Q8_0 blocks of 32
    (tmp_path / "bad_rows.gguf").write_bytes(raw)
    with pytest.raises(UserError) as e:
        GGUFSource(tmp_path / "bad_rows.gguf")
    assert "\n" not in str(e.value) and "Q8_0" in str(e.value) and "damaged" in str(e.value)
    raw[at + 4:at + 12] = (64).to_bytes(8, "little")
    raw[at + 12:at + 20] = (1 << 20).to_bytes(8, "little")          # far more rows than the file holds
    (tmp_path / "short.gguf").write_bytes(raw)
    with pytest.raises(UserError, match="truncated or damaged") as e:
        GGUFSource(tmp_path / "short.gguf")
    assert "\n" not in str(e.value)
