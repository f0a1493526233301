"""A model's config against its tensors, at open and in one line (issue 49's bugs 4 and 6).

Bug 4: an HF config that disagrees with its weights (num_experts 8 over 16 experts, a wrong hidden_size, a missing
num_experts, vocab_size "big") is refused when the directory is opened, from the safetensors headers, naming the key
and the tensor; the GGUF loader shares the check (models/names.check_shape).
Bug 6: a hybrid GGUF's layer kinds come from {arch}.attention.recurrent_layers, as llama.cpp's converter writes them
from config.json's layer_types, whatever full_attention_interval says; moestream writes that key too.
"""
from __future__ import annotations

import json
import shutil

import gguf
import pytest
import torch

from gguf_edit import rewrite_gguf
from moestream import LLM
from moestream.cli import main
from moestream.errors import UserError
from moestream.loading.gguf import GGUFSource
from moestream.loading.gguf_write import write_gguf
from moestream.loading.hf import HFSource, write_hf
from moestream.loading.synth import SynthSource

# tiny-next with attention where no interval puts it (layers 0 and 3), as a config.json's layer_types may say
ODD_TYPES = ("full_attention", "linear_attention", "linear_attention", "full_attention")


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "tiny"
    write_hf(SynthSource.from_spec("tiny"), out)
    return out


def _with_config(src, dst, change: dict):
    shutil.copytree(src, dst)
    c = json.loads((dst / "config.json").read_text())
    for k, v in change.items():
        c.pop(k) if v is None else c.__setitem__(k, v)
    (dst / "config.json").write_text(json.dumps(c))
    return dst


@pytest.mark.parametrize("change,named", [
    ({"num_experts": 8}, "tensor model.layers.0.mlp.gate.weight has shape (16, 256) but num_experts 8 makes it "
                         "(8, 256): config.json does not match the weights"),
    ({"hidden_size": 128}, "tensor model.embed_tokens.weight has shape (1024, 256) but hidden_size 128 makes it "
                           "(1024, 128)"),
    ({"num_attention_heads": 4}, "tensor model.layers.0.self_attn.q_proj.weight has shape (256, 256) but "
                                 "num_attention_heads 4 and head_dim 32 make it (128, 256)"),
    ({"moe_intermediate_size": 64}, "tensor model.layers.0.mlp.experts.{0..15}.gate_proj.weight has shape "
                                    "(16, 128, 256) but moe_intermediate_size 64 makes it (16, 64, 256)"),
    ({"num_experts": None}, "config.json lacks 'num_experts'"),
    ({"vocab_size": "big"}, "config.json: vocab_size must be a whole number, got 'big'"),
    ({"num_experts_per_tok": 2.5}, "config.json: num_experts_per_tok must be a whole number, got 2.5"),
    ({"rms_norm_eps": "small"}, "config.json: rms_norm_eps must be a number"),
])
def test_an_hf_config_that_disagrees_with_its_tensors_is_one_line_at_open(tiny_hf, tmp_path, monkeypatch, change,
                                                                          named):
    bad = _with_config(tiny_hf, tmp_path / "bad", change)
    monkeypatch.setattr(HFSource, "_read", lambda *a: pytest.fail("a weight was read before the check"))
    with pytest.raises(UserError) as e:
        HFSource(bad)
    assert named in str(e.value) and "\n" not in str(e.value)


def test_num_experts_below_the_weights_is_refused_by_generate(capsys, tiny_hf, tmp_path):
    """The issue's case: it loaded, and then every request failed with an IndexError in the expert kernel."""
    bad = _with_config(tiny_hf, tmp_path / "bad", {"num_experts": 8})
    assert main(["generate", "-m", str(bad), "-p", "hi", "-n", "2"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "num_experts 8" in err and "loaded" not in err


def test_a_config_that_matches_opens_and_reads_as_before(tiny_hf):
    src, synth = HFSource(tiny_hf), SynthSource.from_spec("tiny")
    assert src.config == synth.config
    assert torch.equal(src.tensor("blk.1.attn_q.weight"), synth.tensor("blk.1.attn_q.weight"))


def test_a_gguf_whose_expert_count_disagrees_is_one_line_at_open(tmp_path, monkeypatch):
    """The same check, shared: the GGUF's keys against its tensor table, before any tensor's data is read."""
    path = write_gguf(SynthSource.from_spec("tiny"), tmp_path / "tiny.gguf")
    bad = rewrite_gguf(path, tmp_path / "bad.gguf", {"qwen3moe.expert_count": 8})
    monkeypatch.setattr("moestream.loading.gguf._to_torch", lambda *a: pytest.fail("data read before the check"))
    with pytest.raises(UserError) as e:
        GGUFSource(bad)
    assert ("tensor blk.0.ffn_gate_inp.weight has shape (16, 256) but qwen3moe.expert_count 8 makes it (8, 256)"
            in str(e.value)) and "\n" not in str(e.value)


# --- bug 6: layer kinds --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family,arch", [("qwen3_next", "qwen3next"), ("qwen3_5_moe", "qwen35moe")])
def test_layer_types_no_interval_says_are_written_and_read(tmp_path, family, arch):
    """Attention at layers 0 and 3: the GGUF lists the kinds in attention.recurrent_layers (llama.cpp's converter's
    key), reads back as the same config, and gives the HF directory's logits bit for bit (float32)."""
    nxt = SynthSource.from_spec("tiny-next")
    odd = SynthSource(nxt.config.replace(family=family, layer_types=ODD_TYPES), tokenizer=nxt.tokenizer)
    path = write_gguf(odd, tmp_path / "odd.gguf")
    flags = gguf.GGUFReader(path).fields[f"{arch}.attention.recurrent_layers"].contents()
    assert flags == [False, True, True, False]
    write_hf(odd, tmp_path / "hf")
    assert GGUFSource(path).config == HFSource(tmp_path / "hf").config == odd.config
    prompt = [5, 17, 300, 2, 9, 44, 12]
    a = LLM(str(path), device="cpu", ctx_size=32).engine.prefill(0, prompt, 0, all_logits=True)
    b = LLM(str(tmp_path / "hf"), device="cpu", ctx_size=32).engine.prefill(0, prompt, 0, all_logits=True)
    assert torch.equal(a, b)


def test_recurrent_layers_win_over_full_attention_interval(tmp_path):
    """A file as llama.cpp's converter writes one from a config.json with layer_types: the list is the truth, an
    interval beside it (here every second layer, which would want blk.1.attn_qkv) is not read."""
    nxt = SynthSource.from_spec("tiny-next")
    odd = SynthSource(nxt.config.replace(layer_types=ODD_TYPES), tokenizer=nxt.tokenizer)
    path = write_gguf(odd, tmp_path / "odd.gguf")
    both = rewrite_gguf(path, tmp_path / "both.gguf", {"qwen3next.full_attention_interval": 2})
    assert GGUFSource(both).config.layer_types == ODD_TYPES
    blocks = rewrite_gguf(path, tmp_path / "mtp.gguf", {"qwen3next.block_count": 5, "qwen3next.nextn_predict_layers": 1,
                                                         "qwen3next.attention.recurrent_layers": [0, 1, 1, 0, 0]})
    assert GGUFSource(blocks).config.layer_types == ODD_TYPES        # one flag a block, the MTP block's too
    short = rewrite_gguf(path, tmp_path / "short.gguf", {"qwen3next.attention.recurrent_layers": [0, 1, 1]})
    with pytest.raises(UserError, match="attention.recurrent_layers .* for block_count 4"):
        GGUFSource(short)
