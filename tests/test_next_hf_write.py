"""The hybrid families written as Hugging Face directories (`make-model --format hf`: loading/hf.py's write_hf,
arch/hybrid_names.py's hf_value): Qwen3-Next, and Qwen3.5-MoE in its text-only form (Qwen3_5MoeForCausalLM).

- synth models of tiny-next's shapes, two layers (a DeltaNet layer, then gated attention; Qwen3.5-MoE made as
  tests/test_next_gguf.py makes one), read back as the same config and every tensor and expert bit for bit, float32:
  their logits are the same bits (torch.equal). hf_value's inverses are exact: a norm's w = c - 1 (Sterbenz, c >=
  0.5) and A_log, searched so that -exp(A_log) gives ssm_a back;
- transformers loads each directory with no key missing, left over or of another shape, and its float32 logits are
  within 1e-4 of moestream's (the family tests' bound; measured 5.5e-6 (qwen3_next) and 4.3e-6 (qwen3_5_moe), of
  logits O(4));
- a checkpoint transformers wrote (conftest's three forms, float32) converted by make-model holds the checkpoint's
  tensors bit for bit under the text form's names, but for two whose canonical values are the same bits: A_log, where
  another float32 has the same -exp (measured: 8 of 24 values), and the zero-centred norms' w, which come back as
  fl(1 + w) - 1 (the reader's 1 + w rounds a float32 w; measured: 1761 of 1920 values, each within 2**-24); so
  transformers gives the same logits from it bit for bit;
- hf_value alone: a norm of c >= 0.5 comes back exact in float32, bfloat16 and float16, a bfloat16 w too, a c below
  0.5 within 2**-25; ssm_a exact for 4096 A_log in [-8, 8];
- a Qwen3.5-MoE with dense layers, which its config.json cannot say, is a one-line UserError before anything is
  written.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from moestream import flags
from moestream.engine_config import EngineConfig
from moestream.errors import UserError
from moestream.loading.hf import HFSource, write_hf
from moestream.loading.synth import SynthSource
from moestream.arch.names import dense_names
from moestream.arch.hybrid_names import canonical_value, hf_value
from moestream.runtime.load import load_engine
from moestream.runtime.plan import resolve
from moestream.tools.make_model import make_model

ATOL = 1e-4
PRESET = "tiny-next:layers=2"
ZERO_CENTRED = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight")   # HF's, as 1 + w
ARCH = {"qwen3_next": ("Qwen3NextForCausalLM", "qwen3_next"),
        "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text")}


def _logits(source, ids: list[int]) -> torch.Tensor:
    """moestream's float32 logits at every position (N, V), on the CPU, as LLM.logits computes them."""
    ecfg = resolve(flags.apply(EngineConfig(), device="cpu", ctx_size=64), source.dtype_of("token_embd.weight"))
    eng = load_engine(source, ecfg, progress=False)
    eng.begin_prompt(0)
    with torch.no_grad():
        return eng.prefill(0, ids, 0, all_logits=True).float()


def _ids(n: int, vocab: int, seed: int = 1) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_same_tensors(a, b):
    """Every canonical tensor and expert of source `a` is `b`'s, dtype and bits."""
    assert a.config == b.config
    for n in dense_names(a.config):
        x, y = a.tensor(n), b.tensor(n)
        assert x.dtype == y.dtype and torch.equal(x, y), n
    for layer in a.config.moe_layers:
        for e in range(a.config.n_experts):
            assert all(torch.equal(x, y) for x, y in zip(a.expert(layer, e), b.expert(layer, e))), (layer, e)


@pytest.fixture(scope="module", params=list(ARCH))
def written(request, tmp_path_factory):
    """(family, synth source, the HF directory written of it): Qwen3-Next by make-model, Qwen3.5-MoE (no preset of
    its own) by write_hf."""
    out = tmp_path_factory.mktemp(request.param) / "hf"
    nxt = SynthSource.from_spec(PRESET)
    if request.param == "qwen3_next":
        make_model("synth:" + PRESET, out, "hf", progress=False)
        return request.param, nxt, out
    src = SynthSource(nxt.config.replace(family="qwen3_5_moe"), tokenizer=nxt.tokenizer, router_scale=3.0)
    write_hf(src, out)
    return request.param, src, out


def test_the_directory_reads_back_bit_for_bit(written):
    family, src, out = written
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"][0], config["model_type"]) == ARCH[family]
    back = HFSource(out)
    _assert_same_tensors(src, back)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:       # HF's values, not the canonical ones
        a_log = f.get_tensor("model.layers.0.linear_attn.A_log")
        conv = f.get_tensor("model.layers.0.linear_attn.conv1d.weight")
        norm = f.get_tensor("model.layers.1.self_attn.q_norm.weight")
    assert a_log.dtype == torch.float32 and torch.equal(-a_log.exp(), src.tensor("blk.0.ssm_a"))
    assert conv.shape[1] == 1 and torch.equal(norm + 1, src.tensor("blk.1.attn_q_norm.weight"))
    ids = _ids(24, src.config.vocab_size)
    assert torch.equal(_logits(back, ids), _logits(src, ids))


def test_transformers_loads_the_directory(written):
    tf = pytest.importorskip("transformers")
    family, src, out = written
    model, info = tf.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert type(model).__name__ == ARCH[family][0]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = _ids(24, src.config.vocab_size)
    with torch.no_grad():
        want = model.eval().float()(torch.tensor([ids])).logits[0]
    err = (_logits(HFSource(out), ids) - want).abs().max().item()
    assert err < ATOL, (family, err)


def test_a_transformers_checkpoint_converts_to_itself(hybrid_checkpoint, tmp_path):
    """make-model of each form transformers writes (Qwen3.5-MoE's multimodal one too) gives its tensors back."""
    tf = pytest.importorskip("transformers")
    form, path, model = hybrid_checkpoint
    out = tmp_path / "hf"
    make_model(path, out, "hf", progress=False)
    src = HFSource(path)
    _assert_same_tensors(src, HFSource(out))
    with safe_open(str(Path(path) / "model.safetensors"), framework="pt") as f, \
            safe_open(str(out / "model.safetensors"), framework="pt") as g:
        for k in g.keys():                  # the text form's names: the language model's under model.
            x, y = f.get_tensor(src.prefix + k[len("model."):] if k.startswith("model.") else k), g.get_tensor(k)
            assert x.dtype == y.dtype, k
            if k.endswith("A_log"):         # a float32 of the same -exp, where log(-a) found one nearer
                assert torch.equal(-x.exp(), -y.exp()), k
            elif k.endswith(ZERO_CENTRED):  # float32 w back as fl(1 + w) - 1: the reader's 1 + w rounds
                assert torch.equal(1 + x, 1 + y) and (x - y).abs().max() <= 2 ** -24, k
            else:
                assert torch.equal(x, y), k
        assert len(g.keys()) == len([k for k in f.keys() if k.startswith(src.prefix) or k == "lm_head.weight"])
    again = tf.AutoModelForCausalLM.from_pretrained(str(out))
    ids = torch.tensor([_ids(20, src.config.vocab_size, seed=3)])
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits), form


def test_hf_value_inverts_canonical_value():
    """Exact for a norm of c >= 0.5 (any dtype it came in) and for every ssm_a a float32 A_log gives; below 0.5, c
    comes back within 2**-25 (c - 1 rounds to float32's grid around -0.5..-1)."""
    cfg = SynthSource.from_spec(PRESET).config
    g = torch.Generator().manual_seed(0)
    c = torch.cat([torch.linspace(0.5, 4, 1001), 1 + 1e-3 * torch.randn(1000, generator=g)])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        w = hf_value(cfg, "attn_norm.weight", c.to(dtype), dtype)
        assert w.dtype == dtype and torch.equal(canonical_value(cfg, "attn_norm.weight", w), c.to(dtype).float())
    w = (0.1 * torch.randn(1000, generator=g)).bfloat16()       # a bfloat16 checkpoint's w comes back exact
    assert torch.equal(hf_value(cfg, "ffn_norm.weight", canonical_value(cfg, "ffn_norm.weight", w), w.dtype), w)
    small = torch.rand(1000, generator=g) * 0.5
    back = canonical_value(cfg, "output_norm.weight", hf_value(cfg, "output_norm.weight", small))
    assert (back - small).abs().max() <= 2 ** -25
    a = -torch.empty(4096).uniform_(-8, 8, generator=g).exp()
    assert torch.equal(canonical_value(cfg, "ssm_a", hf_value(cfg, "ssm_a", a)), a)


def test_a_config_json_that_cannot_say_the_model_is_a_one_line_error(tmp_path):
    nxt = SynthSource.from_spec(PRESET)
    src = SynthSource(nxt.config.replace(family="qwen3_5_moe", dense_layers=(0,), intermediate_size=64))
    with pytest.raises(UserError, match="cannot express dense layers") as e:
        write_hf(src, tmp_path / "hf")
    assert "\n" not in str(e.value) and not (tmp_path / "hf").exists()
