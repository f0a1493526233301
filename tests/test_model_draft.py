"""--model-draft FILE (llama.cpp's spelling): an MTP head in a GGUF of its own, read beside its target
(loading/draft.py). The head file as moestream's writer makes it (write_gguf head_only: llama.cpp b11549's MTP-only
layout, the target's metadata, token_embd, output_norm, output and blk.{n_layers}.*, no trunk layer), from the same
synth model as a GGUF that embeds the head: the same drafts, bit for bit, and the same tokens and acceptance.
"""
from __future__ import annotations

import pytest
import torch

from moestream import LLM, SamplingParams, UserError
from moestream.loading.gguf import read_gguf
from moestream.loading.gguf_write import write_gguf
from moestream.loading.source import open_source

KW = dict(device="cpu", ctx_size=64)
MODEL = "synth:tiny-next:layers=2"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(a GGUF with its head, the same trunk without it, the head alone)."""
    d = tmp_path_factory.mktemp("draft")
    with_head = open_source(f"{MODEL}:mtp=1")
    return (write_gguf(with_head, d / "full.gguf"), write_gguf(open_source(MODEL), d / "trunk.gguf"),
            write_gguf(with_head, d / "head.gguf", head_only=True))


def test_the_head_file_holds_the_head_alone(files):
    n = open_source(MODEL).config.n_layers
    names = {t.name for t in read_gguf(files[2]).tensors}
    assert {"token_embd.weight", f"blk.{n}.nextn.eh_proj.weight", f"blk.{n}.ffn_gate_exps.weight"} <= names
    assert not any(x.startswith(tuple(f"blk.{i}." for i in range(n))) for x in names)


def test_a_head_beside_its_target_drafts_as_the_embedded_head(files):
    full, trunk, head = files
    engines = [LLM(str(full), spec_type="draft-mtp", **KW).engine,
               LLM(str(trunk), spec_type="draft-mtp", model_draft=str(head), **KW).engine]
    tokens = [5, 9, 13, 2, 7, 11]
    outs = []
    for eng in engines:
        assert eng.cfg.nextn_layers == 1
        eng.prefill(0, tokens, hidden=(hidden := []))
        outs.append(eng.head_step(0, 0, tokens[1:] + [4], torch.cat(hidden)))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    runs = [LLM(str(full), spec_type="draft-mtp", **KW), LLM(str(trunk), spec_type="draft-mtp",
                                                             model_draft=str(head), **KW)]
    a, b = (llm.generate(tokens, SamplingParams(max_tokens=10)) for llm in runs)
    assert a.token_ids == b.token_ids and a.timings["spec"] == b.timings["spec"]
    assert a.timings["spec"]["drafted"] > 0


def test_a_draft_file_is_refused_in_one_line_where_it_does_not_fit(files, tmp_path):
    full, trunk, head = files
    with pytest.raises(UserError, match="--model-draft is an MTP head's GGUF: add --spec-type draft-mtp"):
        LLM(str(trunk), model_draft=str(head), **KW)
    with pytest.raises(UserError, match="is not an MTP head of this model"):
        LLM(str(trunk), spec_type="draft-mtp", model_draft=str(trunk), **KW)
    other = write_gguf(open_source("synth:tiny-glm:mtp=1"), tmp_path / "glm.gguf", head_only=True)
    with pytest.raises(UserError, match="is not an MTP head of this model"):
        LLM(str(trunk), spec_type="draft-mtp", model_draft=str(other), **KW)
