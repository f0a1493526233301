"""Qwen3.5-MoE as llama.cpp's qwen35moe GGUF (loading/gguf.py, loading/gguf_write.py, arch/hybrid_names.py's
reorder_v_heads), from a small random checkpoint transformers writes: the multimodal form real checkpoints have, with
two value heads per key head (so the order of the heads shows) and dv = dk, as llama.cpp's loader takes them.

- written F32 and read back: the checkpoint's config and, in moestream, its logits bit for bit (torch.equal): the
  file holds the canonical values with rows and columns moved, nothing rounded;
- the file is what llama.cpp's converter writes: only keys and tensor names the gguf package lists for QWEN35MOE,
  the keys its qwen35moe loader requires, and each tensor the converter's value of the HF tensor that gguf's
  TensorNameMap maps to it (the value heads tiled by index arithmetic here, 1 + w norms, -exp(A_log));
- quantized by `moestream quantize` (Q8_0; Q4_K_M with K-quant experts): it loads with its experts quantized, its
  logits are those of its weights dequantized, and its greedy tokens are the same at --cpu-moe with and without a
  cache and with every expert on the device;
- a missing or bad key is a one-line error; the multi-token prediction blocks past block_count are not read.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

import gguf
from gguf_edit import rewrite_gguf
from moestream import LLM, UserError
from moestream.loading.gguf import GGUFSource
from moestream.loading.gguf_write import write_gguf
from moestream.loading.hf import HFSource

from conftest import HYBRID_TEXT, HYBRID_VISION, VOCAB, randomize_hybrid

ARCH = "qwen35moe"
KW = dict(device="cpu", ctx_size=128)
TEXT = dict(HYBRID_TEXT, linear_value_head_dim=16)          # dv = dk = 16; 2 key heads, 4 value heads
# The keys llama.cpp's qwen35moe loader reads without a default (load_hparams and its generic part).
REQUIRED = ("block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
            "attention.layer_norm_rms_epsilon", "rope.dimension_sections", "rope.dimension_count", "expert_count",
            "expert_used_count", "ssm.conv_kernel", "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank",
            "ssm.group_count")


def ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def q35(tmp_path_factory):
    """(HF directory, transformers model, its F32 qwen35moe GGUF)."""
    import transformers as tf
    d = tmp_path_factory.mktemp("q35")
    torch.manual_seed(0)
    model = tf.Qwen3_5MoeForConditionalGeneration(tf.Qwen3_5MoeConfig(text_config=TEXT,
                                                                      vision_config=HYBRID_VISION)).eval()
    randomize_hybrid(model)
    model.save_pretrained(str(d / "hf"))
    write_gguf(HFSource(d / "hf"), d / "f32.gguf")
    return str(d / "hf"), model, str(d / "f32.gguf")


def test_an_f32_gguf_gives_the_checkpoints_logits_bit_for_bit(q35):
    hf, model, path = q35
    back = GGUFSource(path)
    assert back.arch == ARCH and back.config == HFSource(hf).config and back.config.family == "qwen3_5_moe"
    prompt = ids(40, seed=11)
    want = LLM(hf, **KW).logits(prompt)
    assert torch.equal(LLM(path, **KW).logits(prompt), want)
    with torch.no_grad():                                  # and both are transformers' model
        assert (model(torch.tensor([prompt])).logits[0] - want).abs().max() < 1e-4


# --- the file, as llama.cpp's converter writes it ----------------------------------------------------------------

def _tiled(t: torch.Tensor, dim: int, width: int, nk: int, nv: int) -> torch.Tensor:
    """The converter's value-head order along `dim`: tiled position p = j*nk + h holds grouped head h*r + j."""
    r = nv // nk
    src = [(p % nk) * r + p // nk for p in range(nv)]
    return t.index_select(dim, torch.tensor([s * width + k for s in src for k in range(width)]))


def _converted(name: str, t: torch.Tensor, c: dict) -> torch.Tensor:
    """What llama.cpp's Qwen3.5-MoE converter stores for HF tensor `name` (the language model's, `model.` names)."""
    nk, nv, dv, qk = (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_value_head_dim"],
                      2 * c["linear_num_key_heads"] * c["linear_key_head_dim"])
    if ".linear_attn." in name:
        if name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):
            t = t.reshape(t.shape[0], -1)                  # the conv (C, 1, K) squeezed to (C, K)
            t = torch.cat([t[:qk], _tiled(t[qk:], 0, dv, nk, nv)])
        elif name.endswith(".in_proj_z.weight"):
            t = _tiled(t, 0, dv, nk, nv)
        elif name.endswith((".in_proj_a.weight", ".in_proj_b.weight", ".A_log", ".dt_proj.bias")):
            t = _tiled(t, 0, 1, nk, nv)
        elif name.endswith(".out_proj.weight"):
            t = _tiled(t, 1, dv, nk, nv)
    if name.endswith(".A_log"):
        return -t.float().exp()
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return t + 1
    return t.reshape(-1) if name.endswith("shared_expert_gate.weight") else t


def test_the_file_is_llama_cpps_qwen35moe(q35):
    """Names and keys from the gguf package (MODEL_TENSORS / TensorNameMap / Keys for QWEN35MOE); values from the
    converter's rules applied to the checkpoint's own tensors, the experts as their stacks."""
    from safetensors.torch import load_file
    hf, _, path = q35
    reader = gguf.GGUFReader(path)
    file = {t.name: torch.from_numpy(np.array(t.data)) for t in reader.tensors}
    assert all(t.tensor_type == Q.F32 for t in reader.tensors)
    templates = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.QWEN35MOE]}
    for name in file:
        base = name.removesuffix(".weight").removesuffix(".bias")
        assert (base.split(".", 2)[0] + ".{bid}." + base.split(".", 2)[2] if base.startswith("blk.") else base) \
            in templates, name

    keys = {k for k in reader.fields if not k.startswith(("general.", "tokenizer.", "GGUF.", "moestream."))}
    listed = {v.replace("{arch}", ARCH) for group in vars(gguf.Keys).values() if isinstance(group, type)
              for v in vars(group).values() if isinstance(v, str)}
    # the layer kinds: llama.cpp's LLM_KV_ATTENTION_RECURRENT_LAYERS (llama-arch.cpp, b11549), which its qwen35moe
    # loader reads first; newer than the gguf package installed here
    listed.add(f"{ARCH}.attention.recurrent_layers")
    assert keys <= listed and all(k.startswith(ARCH + ".") for k in keys)
    assert {f"{ARCH}.{k}" for k in REQUIRED} <= keys
    assert reader.fields["general.architecture"].contents() == ARCH
    assert reader.fields[f"{ARCH}.rope.dimension_sections"].contents() == [11, 11, 10, 0]

    c = TEXT
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35MOE, c["num_hidden_layers"])
    sd = {k.replace("model.language_model.", "model."): v for k, v in load_file(f"{hf}/model.safetensors").items()
          if not k.startswith(("model.visual.", "mtp."))}
    want, experts = {}, {}
    for name, t in sd.items():
        if name.endswith(".dt_bias"):                      # the converter's rename before the name map
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        if ".mlp.experts." in name:                        # model.layers.N.mlp.experts.E.P.weight, stacked by E
            _, _, layer, _, _, e, proj, _ = name.split(".")
            experts.setdefault(f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight", {})[int(e)] = t
            continue
        gname = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        want[gname] = _converted(name, t, c)
    want |= {name: torch.stack([by_e[e] for e in range(len(by_e))]) for name, by_e in experts.items()}
    assert set(want) == set(file)
    for name, t in want.items():
        assert torch.equal(file[name], t.float()), name


# --- quantized --------------------------------------------------------------------------------------------------

def _same_tokens_placed_anywhere(path: str) -> list[int]:
    prompt = ids(16, seed=3)
    runs = [LLM(path, **KW, **kw) for kw in ({}, {"cpu_moe": True, "moe_cache_mib": 0},
                                             {"cpu_moe": True, "moe_cache_mib": 1})]
    assert all(llm.engine.quantized for llm in runs)
    tokens = [llm.generate(prompt, max_tokens=8, ignore_eos=True).token_ids for llm in runs]
    assert tokens[1] == tokens[0] and tokens[2] == tokens[0]
    assert runs[2].stats()["uploaded_experts"] > 0          # the cache was used
    return tokens[0]


def test_q8_0_decodes_the_same_tokens_with_and_without_a_cache(q35, tmp_path):
    from moestream.tools.quantize import quantize_model
    _, _, f32 = q35
    path, _, summary = quantize_model(f32, tmp_path / "q8.gguf", "Q8_0", device="cpu", progress=False)
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == ARCH and "Q8_0" in summary
    assert {t.tensor_type for t in reader.tensors if "_exps." in t.name} == {Q.Q8_0}
    src = GGUFSource(path)
    assert src.config == GGUFSource(f32).config
    # Its dense tensors read back within Q8_0's rounding of the float ones, heads in place (tiled wrongly, a
    # tensor would be O(1) off).
    for name in ("blk.0.attn_qkv.weight", "blk.0.attn_gate.weight", "blk.0.ssm_out.weight", "blk.0.ssm_beta.weight"):
        f = GGUFSource(f32).tensor(name)
        assert (src.tensor(name) - f).abs().max() <= f.abs().max() / 127 * 1.01, name
    write_gguf(src, tmp_path / "deq.gguf", dtype="float32")  # the same weights, dequantized, as float32
    prompt = ids(30, seed=4)
    assert torch.equal(LLM(str(path), **KW).logits(prompt), LLM(str(tmp_path / "deq.gguf"), **KW).logits(prompt))
    _same_tokens_placed_anywhere(str(path))


def _q4_k_m(tmp_path, device: str = "cpu"):
    """(a synth Qwen3.5-MoE of tiny-next's shapes, whose rows are whole 256-blocks, and its Q4_K_M GGUF's path),
    written F32 and quantized by the CLI's `moestream quantize`."""
    from moestream.cli import main
    from moestream.loading.synth import SynthSource
    nxt = SynthSource.from_spec("tiny-next")
    src = SynthSource(nxt.config.replace(family="qwen3_5_moe"), tokenizer=nxt.tokenizer, router_scale=3.0)
    write_gguf(src, tmp_path / "f32.gguf")
    assert main(["quantize", str(tmp_path / "f32.gguf"), str(tmp_path / "q4.gguf"), "Q4_K_M", "--device", device]) == 0
    return src, str(tmp_path / "q4.gguf")


def test_moestream_quantize_q4_k_m_keeps_k_quant_experts(tmp_path):
    src, _ = _q4_k_m(tmp_path)
    reader = gguf.GGUFReader(tmp_path / "q4.gguf")
    assert reader.fields["general.architecture"].contents() == ARCH
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == Q.Q4_K and types["blk.0.ffn_up_exps.weight"] == Q.Q4_K
    assert types["blk.0.ssm_conv1d.weight"] == Q.F32 and types["blk.0.ssm_a"] == Q.F32
    q4 = GGUFSource(tmp_path / "q4.gguf")
    for name in ("blk.0.attn_qkv.weight", "blk.0.ssm_out.weight", "blk.0.attn_gate.weight"):
        f = src.tensor(name)
        assert (q4.tensor(name) - f).norm() < 0.15 * f.norm(), name      # Q4_K's error, heads in place
    assert torch.equal(q4.tensor("blk.0.ssm_a"), src.tensor("blk.0.ssm_a"))
    assert len(_same_tokens_placed_anywhere(str(tmp_path / "q4.gguf"))) == 8


# --- keys ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change, named", [
    ({"ssm.state_size": None}, "lacks metadata key qwen35moe.ssm.state_size"),
    ({"ssm.time_step_rank": None}, "lacks metadata key qwen35moe.ssm.time_step_rank"),
    ({"ssm.inner_size": 33}, "qwen35moe.ssm.inner_size 33 for ssm.time_step_rank 4"),
    ({"attention.recurrent_layers": None, "full_attention_interval": 0}, "qwen35moe.full_attention_interval 0"),
    ({"attention.recurrent_layers": [True, False]}, "qwen35moe.attention.recurrent_layers [True, False] for "
                                                    "block_count"),
    ({"ssm.group_count": 3}, "4 linear value heads are not a multiple of 3 key heads"),
    ({"ssm.group_count": 1}, "tensor blk.0.attn_qkv.weight has shape (128, 64) but qwen35moe.ssm.group_count 1, "),
])
def test_a_missing_or_bad_key_is_one_line(q35, tmp_path, change, named):
    path = rewrite_gguf(q35[2], tmp_path / "bad.gguf", {f"{ARCH}.{k}": v for k, v in change.items()})
    with pytest.raises(UserError) as e:
        LLM(path, **KW)
    assert named in str(e.value) and "\n" not in str(e.value)


def test_multi_token_prediction_blocks_are_not_read(q35, tmp_path):
    """llama.cpp's converter counts Qwen3.5's MTP layers in block_count and says how many in nextn_predict_layers."""
    f32 = q35[2]
    n = GGUFSource(f32).config.n_layers
    path = rewrite_gguf(f32, tmp_path / "mtp.gguf", {f"{ARCH}.block_count": n + 1, f"{ARCH}.nextn_predict_layers": 1})
    assert GGUFSource(path).config == GGUFSource(f32).config


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_q4_k_m_on_cuda_bit_identical_across_placements(tmp_path):
    """The Q4_K_M file on CUDA (quantized experts through the Triton decode kernels): the same logits bits and
    greedy tokens with every expert on the GPU and behind caches of two sizes."""
    _, path = _q4_k_m(tmp_path, device="cuda")
    prompt = ids(37, seed=5)
    outs = []
    for kw in ({}, {"cpu_moe": True, "moe_cache_mib": 1}, {"cpu_moe": True, "moe_cache_mib": 64}):
        llm = LLM(path, ctx_size=128, device="cuda", **kw)
        assert llm.engine.quantized
        logits = llm.engine.prefill(0, prompt, 0, all_logits=True).float().cpu()
        outs.append((logits, llm.generate(prompt, max_tokens=12, ignore_eos=True).token_ids))
    for logits, tokens in outs[1:]:
        assert torch.equal(logits, outs[0][0]) and tokens == outs[0][1]
