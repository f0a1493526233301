"""bench/make_mtp_head.py: a random MTP head beside a target GGUF that ships none (issue 51's GPU rows on the
Qwen3-Next reference). The head holds what llama.cpp b11549's loader reads from an MTP-only file (its qwen3next
load_block_mtp, src/models/qwen3next.cpp: names and shapes from the file's own keys), the target's metadata and its
token_embd and output bit for bit, loads with --model-draft, and greedy output with its drafts equals greedy output
without them. Targets: synth:tiny-next (float32 and Q4_K_M), tiny-glm, tiny-deepseek, tiny-flash-next, and
qwen35moe from a transformers checkpoint; a family without heads is refused in one line.
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

from moestream import LLM, SamplingParams, UserError
from moestream.loading.gguf import read_gguf
from moestream.loading.gguf_write import write_gguf
from moestream.loading.source import open_source

KW = dict(device="cpu", ctx_size=64)
PROMPT = [5, 9, 13, 2, 7, 11]
spec = importlib.util.spec_from_file_location("make_mtp_head",
                                              Path(__file__).resolve().parents[1] / "bench" / "make_mtp_head.py")
make_mtp_head = importlib.util.module_from_spec(spec)
spec.loader.exec_module(make_mtp_head)


@pytest.fixture(scope="module")
def next_files(tmp_path_factory):
    """(target GGUF, its head) of synth:tiny-next, 2 layers (DeltaNet, attention), float32."""
    d = tmp_path_factory.mktemp("next_head")
    target = write_gguf(open_source("synth:tiny-next:layers=2"), d / "next.gguf")
    return target, make_mtp_head.make_head(str(target), str(d / "head.gguf"), seed=3)


def fields(path) -> dict:
    return {k: f.contents() for k, f in read_gguf(path).fields.items() if not k.startswith("GGUF.")}


def llama_cpp_qwen3next_mtp_block(kv: dict, il: int) -> dict[str, tuple[int, ...]]:
    """The tensors llama.cpp b11549's qwen3next loader creates for MTP block `il` of a file with these keys (GGUF
    dims, innermost first; load_block_mtp over load_block_trunk of an attention layer), required and optional."""
    a = "qwen3next."
    H, nh, hd = kv[a + "embedding_length"], kv[a + "attention.head_count"], kv[a + "attention.key_length"]
    nkv, E = kv[a + "attention.head_count_kv"], kv[a + "expert_count"]
    ff, ffs = kv[a + "expert_feed_forward_length"], kv[a + "expert_shared_feed_forward_length"]
    p = f"blk.{il}."
    return {p + "attn_norm.weight": (H,), p + "post_attention_norm.weight": (H,),
            p + "attn_q.weight": (H, hd * nh * 2), p + "attn_k.weight": (H, hd * nkv),
            p + "attn_v.weight": (H, hd * nkv),
            p + "attn_output.weight": (hd * nh, H), p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,),
            p + "ffn_gate_inp.weight": (H, E), p + "ffn_down_exps.weight": (ff, H, E),
            p + "ffn_gate_exps.weight": (H, ff, E), p + "ffn_up_exps.weight": (H, ff, E),
            p + "ffn_gate_inp_shexp.weight": (H,), p + "ffn_gate_shexp.weight": (H, ffs),
            p + "ffn_up_shexp.weight": (H, ffs), p + "ffn_down_shexp.weight": (ffs, H),
            p + "nextn.eh_proj.weight": (2 * H, H), p + "nextn.enorm.weight": (H,), p + "nextn.hnorm.weight": (H,),
            p + "nextn.shared_head_norm.weight": (H,)}


def test_the_head_is_llama_cpps_mtp_only_file_of_the_target(next_files):
    target, head = next_files
    t_kv, h_kv = fields(target), fields(head)
    n = t_kv["qwen3next.block_count"]
    # the target's metadata, but for the block count, the head count and the one more (attention) layer kind
    assert h_kv.pop("qwen3next.block_count") == n + 1 and h_kv.pop("qwen3next.nextn_predict_layers") == 1
    layers = "qwen3next.attention.recurrent_layers"
    assert h_kv.pop(layers) == t_kv.pop(layers) + [False]
    h_kv.pop("general.file_type"), t_kv.pop("general.file_type"), t_kv.pop("qwen3next.block_count")
    assert h_kv == t_kv
    # the globals llama.cpp requires of any file (token_embd, output_norm; output where untied), the target's bytes
    tensors = {t.name: t for t in read_gguf(head).tensors}
    by_name = {t.name: t for t in read_gguf(target).tensors}
    for name in ("token_embd.weight", "output_norm.weight", "output.weight"):
        assert tensors[name].tensor_type == by_name[name].tensor_type
        assert np.array_equal(np.asarray(tensors.pop(name).data), np.asarray(by_name[name].data))
    # no trunk layer (llama.cpp's nextn_flags: blk.0.attn_norm absent makes the trunk not required), and the head's
    # block exactly as llama.cpp's loader creates it from these keys
    want = llama_cpp_qwen3next_mtp_block(fields(head), n)
    assert {k: tuple(int(d) for d in t.shape) for k, t in tensors.items()} == want
    # every name one gguf-py knows for the architecture (its NEXTN_* for the head's own: this gguf predates them
    # in qwen3next's list)
    from gguf.constants import MODEL_ARCH, MODEL_TENSOR, MODEL_TENSORS, TENSOR_NAMES
    known = {TENSOR_NAMES[t] for t in MODEL_TENSORS[MODEL_ARCH.QWEN3NEXT]} | \
        {TENSOR_NAMES[t] for t in MODEL_TENSOR if t.name.startswith("NEXTN_")}
    assert {re.sub(r"^blk\.\d+\.", "blk.{bid}.", k).rsplit(".", 1)[0] for k in want} <= known


def test_greedy_with_the_random_head_equals_greedy_without(next_files):
    target, head = next_files
    with_head = LLM(str(target), spec_type="draft-mtp", model_draft=str(head), **KW)
    assert with_head.engine.cfg.nextn_layers == 1
    a = with_head.generate(PROMPT, SamplingParams(max_tokens=12))
    b = LLM(str(target), **KW).generate(PROMPT, SamplingParams(max_tokens=12))
    assert a.token_ids == b.token_ids and a.timings["spec"]["drafted"] > 0


def test_a_quantized_targets_head_copies_its_embedding_and_output_bit_for_bit(next_files, tmp_path):
    """Q4_K_M: token_embd Q4_K, output Q6_K, copied as stored (Q6_K would not survive a requantization); the head's
    own block in Q4_K_M's mix."""
    from moestream.tools.quantize import quantize_model
    q4 = quantize_model(str(next_files[0]), tmp_path / "q4.gguf", "Q4_K_M", allow_requantize=True, device="cpu",
                        progress=False)[0]
    head = make_mtp_head.make_head(str(q4), str(tmp_path / "head.gguf"), ftype="Q4_K_M", device="cpu")
    mine = {t.name: t for t in read_gguf(head).tensors}
    for t in read_gguf(q4).tensors:
        if not t.name.startswith("blk."):
            assert mine[t.name].tensor_type == t.tensor_type
            assert np.array_equal(np.asarray(mine[t.name].data), np.asarray(t.data))
    assert mine["blk.2.ffn_gate_exps.weight"].tensor_type.name == "Q4_K"
    a = LLM(str(q4), spec_type="draft-mtp", model_draft=str(head), spec_draft_n_max=3, **KW)
    b = LLM(str(q4), **KW)
    assert (a.generate(PROMPT, SamplingParams(max_tokens=10)).token_ids
            == b.generate(PROMPT, SamplingParams(max_tokens=10)).token_ids)


def test_a_seed_makes_the_same_head_and_another_seed_another(next_files, tmp_path):
    target, head = next_files
    again = make_mtp_head.make_head(str(target), str(tmp_path / "again.gguf"), seed=3)
    other = make_mtp_head.make_head(str(target), str(tmp_path / "other.gguf"), seed=4)
    assert Path(again).read_bytes() == Path(head).read_bytes() != Path(other).read_bytes()


def hf_qwen35moe(path) -> str:
    from conftest import hybrid_model, randomize_hybrid
    model = hybrid_model("qwen3_5_moe").eval()
    randomize_hybrid(model)
    model.save_pretrained(str(path))
    return str(path)


@pytest.mark.parametrize("model", ["synth:tiny-glm:layers=2", "synth:tiny-deepseek:layers=2", "qwen35moe",
                                   "synth:tiny-flash-next:layers=2"])
def test_the_other_families_heads_load_and_keep_greedy(model, tmp_path):
    src = open_source(hf_qwen35moe(tmp_path / "hf") if model == "qwen35moe" else model)
    target = write_gguf(src, tmp_path / "target.gguf")
    head = make_mtp_head.make_head(str(target), str(tmp_path / "head.gguf"))
    n = src.config.n_layers
    assert {f"blk.{n}.nextn.eh_proj.weight", f"blk.{n}.ffn_gate_exps.weight", "token_embd.weight"} <= \
        {t.name for t in read_gguf(head).tensors}
    prompt = [p % src.config.vocab_size for p in PROMPT]
    a = LLM(str(target), spec_type="draft-mtp", model_draft=str(head), **KW).generate(prompt,
                                                                                       SamplingParams(max_tokens=8))
    b = LLM(str(target), **KW).generate(prompt, SamplingParams(max_tokens=8))
    assert a.token_ids == b.token_ids and a.timings["spec"]["drafted"] > 0


def test_a_family_without_heads_is_refused_in_one_line(tmp_path):
    target = write_gguf(open_source("synth:tiny"), tmp_path / "tiny.gguf")
    with pytest.raises(UserError, match="a family without an MTP head moestream reads; heads are made for qwen3next"):
        make_mtp_head.make_head(str(target), str(tmp_path / "head.gguf"))
    assert make_mtp_head.main([str(target), str(tmp_path / "head.gguf")]) == 2
    assert not (tmp_path / "head.gguf").exists()
