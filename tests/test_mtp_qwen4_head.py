"""Qwen3.8-Flash-Next's MTP head (models/mtp.py's mtp_streams; GGUF only, blk.{n_layers}.nextn.*), float32 on the
CPU, on synth:tiny-flash-next:mtp=1 (its QSA budget of 16 in blocks of 4, so the 18-token prompt drops blocks).

The reference is llama.cpp b11549's qwen4exp graph_mtp written out in plain torch here (hnorm per stream, enorm's
embedding in every stream, eh_proj a stream, the hc_attn and hc_ffn mixers and combines, nextn.hc_head_* without
inject, the trunk's output), around the repo's own QSA attention and MoE references (models/qsa.py's
qsa_attention, models/next_reference.py's _moe) for the head's block; its input is the trunk's streams before the
output mixer from models/qwen4_reference.py's trace.

Bounds: the trunk's streams and the head's streams and logits within 1e-5 of the reference (measured about 1e-6);
greedy tokens with drafts equal those without; the GGUF round trip bit for bit.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moestream import LLM
from moestream.arch.hybrid_names import hybrid_names
from moestream.loading.source import open_source
from moestream.models.next_reference import KV
from moestream.models.qsa import qsa_attention
from moestream.models.qwen4_reference import Qwen4Reference
from moestream.runtime.speculate import greedy_tokens
from moestream.tools.spec_oracle import Oracle

ATOL = 1e-5
MODEL = "synth:tiny-flash-next:mtp=1"
KW = dict(device="cpu", ctx_size=64)


def ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def engine():
    return LLM(MODEL, spec_type="draft-mtp", **KW).engine


@pytest.fixture(scope="module")
def weights():
    """(config with the head, canonical weights: the experts stacked (E, ., .) as GGUF's)."""
    src = open_source(MODEL)
    cfg = src.config
    w = {}
    for n in hybrid_names(cfg):
        if n.endswith("_exps.weight"):
            continue
        w[n] = src.tensor(n)
    for layer in cfg.expert_layers:
        gate, up, down = zip(*(src.expert(layer, e) for e in range(cfg.n_experts)))
        for name, parts in (("gate", gate), ("up", up), ("down", down)):
            w[f"blk.{layer}.ffn_{name}_exps.weight"] = torch.stack(parts)
    return cfg, w


def hc_mix(x, norm, down, up, inject, hc: int, eps: float):
    """llama.cpp's build_hc_mix: x (T, hc, H) -> (mixed (T, H), inject (T, hc) or None)."""
    T, _, H = x.shape
    xn = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm.view(hc, H)).reshape(T, hc * H)
    gate = F.linear(F.silu(F.linear(xn, down) * (1.0 / hc)), up)
    mixed = (xn * torch.sigmoid(gate)).view(T, hc, H).sum(1) * (1.0 / hc)
    return mixed, None if inject is None else F.linear(xn, inject)


def hc_combine(res, out, inject, hc: int):
    """llama.cpp's build_hc_combine: each stream += out * 2 sigmoid(inject / hc)."""
    return res + out[:, None, :] * (2 * torch.sigmoid(inject * (1.0 / hc)))[:, :, None]


class HeadReference:
    """graph_mtp of qwen4exp (llama.cpp b11549 src/models/qwen4exp.cpp) over one sequence, its own KV and index
    keys for the head's QSA layer."""

    def __init__(self, cfg, w, ref: Qwen4Reference):
        self.cfg, self.ref, self.n = cfg, ref, cfg.n_layers
        p = f"blk.{self.n}."
        self.lw = {k[len(p):]: v for k, v in w.items() if k.startswith(p)}
        self.embd, self.output = w["token_embd.weight"], ref.lm_head
        self.kv = KV(1, 1, 64, cfg.n_kv_heads, cfg.head_dim, torch.float32, "cpu")
        self.index_keys = torch.zeros(1, 64, cfg.indexer_head_dim)

    def step(self, start: int, tokens: list[int], h: torch.Tensor):
        """h (T, hc*H) beside tokens at start..: (logits (T, V), the head's streams (T, hc*H))."""
        cfg, lw, hc, eps = self.cfg, self.lw, self.cfg.hc_count, self.cfg.rms_norm_eps
        T, H = len(tokens), cfg.hidden_size
        h = h.view(T, hc, H)
        h_norm = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * lw["nextn.hnorm.weight"].view(hc, H)
        e = self.embd[torch.tensor(tokens)]
        e_norm = (e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + eps) * lw["nextn.enorm.weight"])
        e_norm = e_norm[:, None, :].expand(T, hc, H)
        res = F.linear(torch.cat([e_norm, h_norm], dim=-1), lw["nextn.eh_proj.weight"])      # (T, hc, H)
        pos = torch.arange(start, start + T)
        cos, sin = self.ref.cos[pos], self.ref.sin[pos]
        x, inject = hc_mix(res, lw["hc_attn_norm.weight"], lw["hc_attn_down.weight"], lw["hc_attn_up.weight"],
                           lw["hc_attn_inject.weight"], hc, eps)
        out = qsa_attention(x, lw, cfg, cos, sin, (self.ref.cos, self.ref.sin), self.kv, self.index_keys, 0, 0,
                            start)
        res = hc_combine(res, out, inject, hc)
        x, inject = hc_mix(res, lw["hc_ffn_norm.weight"], lw["hc_ffn_down.weight"], lw["hc_ffn_up.weight"],
                           lw["hc_ffn_inject.weight"], hc, eps)
        res = hc_combine(res, self.ref._moe(x, lw), inject, hc)
        final, _ = hc_mix(res, lw["nextn.hc_head_norm.weight"], lw["nextn.hc_head_down.weight"],
                          lw["nextn.hc_head_up.weight"], None, hc, eps)
        return F.linear(final, self.output), res.reshape(T, hc * H)


def test_the_head_computes_llama_cpps_graph(engine, weights):
    """The trunk's prompt streams (before the output mixer) are what the head reads; the head's first step over
    the prompt and a chained second one (reading its own streams) match the reference."""
    cfg, w = weights
    trunk = cfg.replace(nextn_layers=0)
    ref = Qwen4Reference(trunk, {n: t for n, t in w.items() if not n.startswith(f"blk.{cfg.n_layers}.")}, ctx=64)
    prompt, trace = ids(18, seed=2), []
    ref.forward(ref.new_state(), [(0, 0, prompt)], trace=trace)
    engine.begin_prompt(0)
    logits = engine.prefill(0, prompt, 0, hidden=(hidden := []))
    hidden = torch.cat(hidden)
    assert hidden.shape == (18, cfg.hc_count * cfg.hidden_size)
    torch.testing.assert_close(hidden, trace[-1], atol=ATOL, rtol=0)
    token = int(logits[-1].argmax())
    head = HeadReference(cfg, w, ref)
    got_logits, got = engine.head_step(0, 0, prompt[1:] + [token], hidden)
    want_logits, want = head.step(0, prompt[1:] + [token], trace[-1])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(got_logits, want_logits[-1:], atol=ATOL, rtol=0)
    draft = int(got_logits[-1].argmax())
    got_logits, got = engine.head_step(0, 18, [draft], got[-1:])
    want_logits, want = head.step(18, [draft], want[-1:])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(got_logits, want_logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("n_max", [1, 3])
def test_greedy_with_the_head_equals_greedy_without(engine, n_max):
    prompt = ids(12, seed=3)
    plain, _ = greedy_tokens(engine, prompt, 10, 0)
    tokens, counts = greedy_tokens(engine, prompt, 10, n_max)
    assert tokens == plain and sum(counts.drafted) > 0


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_the_oracle_accepts_all_at_one_and_none_at_zero(engine, p):
    prompt, n = ids(10, seed=5), 12
    plain, _ = greedy_tokens(engine, prompt, n, 0)
    tokens, counts = greedy_tokens(engine, prompt, n, 2, Oracle(len(prompt), plain, p, engine.cfg.vocab_size))
    assert tokens == plain
    assert sum(counts.accepted) == (sum(counts.drafted) if p else 0) and sum(counts.drafted) > 0


def test_a_gguf_round_trip_keeps_the_head_bit_for_bit(tmp_path):
    """write_gguf as llama.cpp's qwen4exp reads it: block_count n_layers + 1, nextn_predict_layers 1, blk.{n}.nextn.*
    (hnorm and hc_head_norm (hc*H,), read by llama.cpp as {H, hc}) beside the head's block; read back, every head
    tensor the same bits and the same head step."""
    from moestream.loading.gguf import read_gguf
    from moestream.loading.gguf_write import write_gguf
    src = open_source(MODEL)
    write_gguf(src, tmp_path / "m.gguf", dtype="float32")
    reader = read_gguf(tmp_path / "m.gguf")
    n = src.config.n_layers
    assert reader.fields["qwen4exp.block_count"].contents() == n + 1
    assert reader.fields["qwen4exp.nextn_predict_layers"].contents() == 1
    back = open_source(str(tmp_path / "m.gguf"))
    assert back.config.nextn_layers == 1
    head = [name for name in hybrid_names(src.config) if name.startswith(f"blk.{n}.")]
    assert {f"blk.{n}.nextn.{t}.weight" for t in ("eh_proj", "enorm", "hnorm", "hc_head_norm", "hc_head_down",
                                                   "hc_head_up")} <= set(head)
    for name in head:
        if name.endswith("_exps.weight"):
            continue
        assert torch.equal(src.tensor(name), back.tensor(name)), name
    for e in (0, src.config.n_experts - 1):
        assert all(torch.equal(a, b) for a, b in zip(src.expert(n, e), back.expert(n, e)))
    prompt, outs = ids(9, seed=4), []
    for model in (MODEL, str(tmp_path / "m.gguf")):
        eng = LLM(model, spec_type="draft-mtp", **KW).engine
        eng.prefill(0, prompt, hidden=(hidden := []))
        outs.append(eng.head_step(0, 0, prompt[1:] + [5], torch.cat(hidden)))
    assert torch.equal(outs[0][1], outs[1][1])
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=0)


def test_the_head_from_its_own_gguf_drafts_the_same(tmp_path):
    """--model-draft: the head's own GGUF (write_gguf head_only) beside a target without one, the same head step."""
    from moestream.loading.gguf_write import write_gguf
    src = open_source(MODEL)
    write_gguf(src, tmp_path / "m.gguf", dtype="float32")
    write_gguf(src, tmp_path / "head.gguf", dtype="float32", head_only=True)
    prompt, outs = ids(9, seed=6), []
    for extra in ({}, {"model_draft": str(tmp_path / "head.gguf")}):
        eng = LLM(str(tmp_path / "m.gguf"), spec_type="draft-mtp", **extra, **KW).engine
        eng.prefill(0, prompt, hidden=(hidden := []))
        outs.append(eng.head_step(0, 0, prompt[1:] + [5], torch.cat(hidden)))
    assert torch.equal(outs[0][1], outs[1][1]) and torch.equal(outs[0][0], outs[1][0])


def test_writing_the_head_as_hf_is_refused_in_one_line(tmp_path):
    from moestream import UserError
    from moestream.loading.hf_write import write_hf
    with pytest.raises(UserError, match="MTP head, which its HF form does not hold"):
        write_hf(open_source(MODEL), tmp_path)
