"""The family table (arch/families.py): each family's HF and GGUF names round-trip through the writers and
readers; unknown architectures are refused with the table's families; loading and text sit below the runtime."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
from safetensors import safe_open

from moestream.arch.families import FAMILIES
from moestream.arch.hf_config import config_from_hf
from moestream.arch.names import dense_names, gguf_name, gguf_tensors
from moestream.config import ModelConfig
from moestream.errors import UserError
from moestream.loading.gguf import GGUFSource
from moestream.loading.gguf_write import write_gguf
from moestream.loading.hf import HFSource, hf_names, write_hf
from moestream.loading.synth import SynthSource

PACKAGE = Path(__file__).resolve().parent.parent / "moestream"
SMALL = dict(vocab_size=96, hidden_size=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, n_experts=4,
             n_experts_used=2, moe_intermediate_size=16, max_position_embeddings=256)
# Each family with the options that set it apart switched on, as its config.json can say them.
OPTIONS = {
    "qwen3_moe": dict(qk_norm="head", norm_topk_prob=True, dense_layers=(1,), intermediate_size=24),
    "qwen2_moe": dict(attn_bias=True, shared_expert_intermediate_size=20),
    "mixtral": dict(norm_topk_prob=True),
    "olmoe": dict(qk_norm="full", clip_qkv=4.0),
    "glm4_moe": dict(qk_norm="head", attn_bias=True, partial_rotary_factor=0.5, gating="sigmoid", router_bias=True,
                     n_group=2, topk_group=1, routed_scaling_factor=2.5, shared_expert_intermediate_size=32,
                     dense_layers=(0,), intermediate_size=24, norm_topk_prob=True),
    "deepseek_v3": dict(n_kv_heads=4, head_dim=12, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8,
                        qk_rope_head_dim=4, v_head_dim=6, rope_interleave=True, gating="sigmoid", router_bias=True,
                        n_group=2, topk_group=1, routed_scaling_factor=2.5, shared_expert_intermediate_size=16,
                        dense_layers=(0,), intermediate_size=24, norm_topk_prob=True,
                        rope_scaling=(("beta_fast", 32), ("beta_slow", 1), ("factor", 4.0), ("mscale", 1.0),
                                      ("mscale_all_dim", 1.0), ("original_max_position_embeddings", 64),
                                      ("rope_type", "yarn"))),
}


# The hybrid families (Qwen3-Next, Qwen3.5-MoE) have their own tests: tests/test_next_family.py, test_next_engine.py,
# test_next_gguf.py and test_next_hf_write.py (their HF directories, whose values write_hf turns back into HF's);
# gpt-oss too (its experts fused and interleaved in HF): tests/test_gptoss.py.
ENGINE_FAMILIES = [name for name, f in FAMILIES.items() if not f.hybrid and not f.hf_interleaved]


def test_every_family_has_a_test_model():
    assert set(OPTIONS) == set(ENGINE_FAMILIES)


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_family_names_round_trip(family, tmp_path):
    """write_hf writes the table's architecture and first spellings and reads back the same model; write_gguf
    writes the table's GGUF architecture (or refuses a family without one) and reads back the same model."""
    fam = FAMILIES[family]
    cfg = ModelConfig(family=family, **(SMALL | OPTIONS[family]))
    src = SynthSource(cfg, seed=3)
    write_hf(src, tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (written["architectures"], written["model_type"]) == ([fam.hf_architecture], fam.hf_model_type)
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    want = {hf_names(n, family)[0] for n in dense_names(cfg)}
    mod, g, u, d = fam.hf_experts[0]
    want |= {f"model.layers.{i}.{mod}.{e}.{p}.weight" for i in cfg.moe_layers for e in range(cfg.n_experts)
             for p in (g, u, d)}
    assert keys == want
    assert f"model.layers.{cfg.moe_layers[0]}.{fam.hf_router[0]}" in keys
    back = HFSource(tmp_path / "hf")
    assert back.config == cfg
    assert all(back.tensor(n).equal(src.tensor(n)) for n in dense_names(cfg))
    assert all(x.equal(y) for x, y in zip(back.expert(2, 3), src.expert(2, 3)))

    if fam.gguf_arch is None:
        with pytest.raises(UserError, match=f"GGUF export of {family} is not supported yet"):
            write_gguf(src, tmp_path / "m.gguf")
        return
    write_gguf(src, tmp_path / "m.gguf")
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    assert reader.fields["general.architecture"].contents() == fam.gguf_arch
    assert {t.name for t in reader.tensors} == {gguf_name(cfg, n) for n, _ in gguf_tensors(cfg)}
    out = GGUFSource(tmp_path / "m.gguf")
    assert out.config == cfg
    assert all(x.equal(y) for x, y in zip(out.expert(2, 1), src.expert(2, 1)))


def test_unknown_architectures_list_the_table():
    with pytest.raises(UserError) as e:
        config_from_hf({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    assert "'LlamaForCausalLM'" in str(e.value) and all(f.title in str(e.value) for f in FAMILIES.values())
    with pytest.raises(UserError, match="supported: " + ", ".join(FAMILIES)):   # at the table's first lookup
        dense_names(ModelConfig(family="llama", **SMALL))


def test_unknown_gguf_architecture_lists_the_table(tmp_path):
    w = gguf.GGUFWriter(tmp_path / "llama.gguf", "llama")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    archs = [f.gguf_arch for f in FAMILIES.values() if f.gguf_arch]
    with pytest.raises(UserError, match="unsupported GGUF architecture 'llama'; supported: " + ", ".join(archs)):
        GGUFSource(tmp_path / "llama.gguf")


# --- layering --------------------------------------------------------------------------------------------------
# Each module alone in a fresh interpreter, with the package's __init__ (which imports the whole API) left out,
# so what is counted is what the module itself imports; open_source's lazy imports are exercised too.
_ALONE = """
import importlib, sys, types
pkg = types.ModuleType("moestream")
pkg.__path__ = [{path!r}]
sys.modules["moestream"] = pkg
importlib.import_module({module!r})
if {module!r} == "moestream.loading.source":
    from moestream.loading.source import open_source
    assert open_source("synth:tiny").tokenizer is not None
    import moestream.loading.hf, moestream.loading.gguf
print(" ".join(sorted(m for m in sys.modules if m.startswith("moestream."))))
"""
LOADING = ["moestream.loading.source", "moestream.loading.hf", "moestream.loading.gguf", "moestream.loading.synth"]
TEXT = ["moestream.text.tokenizer", "moestream.text.chat_template", "moestream.text.synth"]


@pytest.mark.parametrize("module", LOADING + TEXT)
def test_loading_and_text_import_no_runtime(module):
    run = subprocess.run([sys.executable, "-c", _ALONE.format(path=str(PACKAGE), module=module)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    imported = run.stdout.split()
    assert module in imported
    assert not [m for m in imported if m.startswith("moestream.runtime")], imported
    if module.startswith("moestream.text"):
        assert not [m for m in imported if m.startswith(("moestream.loading", "moestream.models"))], imported


def _imports_within(package: str) -> dict[str, set[str]]:
    """module -> the modules of `package` it imports, at the top or inside functions (relative imports)."""
    graph = {}
    for file in sorted((PACKAGE / package).glob("*.py")):
        deps = set()
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps |= {node.module} if node.module else {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 2 and (node.module or "").startswith(package):
                deps.add(node.module.split(".", 1)[1] if "." in node.module else "__init__")
        graph[file.stem] = deps
    return graph


@pytest.mark.parametrize("package", ["loading", "text"])
def test_no_import_circle(package):
    """source.py opens the three sources; they import neither it nor each other (lazy imports counted too), not even
    through their own modules (hf.py's hf_experts.py, hf_names.py, hf_write.py; gguf.py's gguf_config.py)."""
    graph = _imports_within(package)
    done: set[str] = set()

    def visit(m: str, path: tuple[str, ...]):
        assert m not in path, f"import circle in {package}/: {' -> '.join(path + (m,))}"
        if m in done:
            return
        for d in graph.get(m, ()):
            visit(d, path + (m,))
        done.add(m)

    for m in graph:
        visit(m, ())
    if package == "loading":
        assert graph["source"] == {"synth", "hf", "gguf"}
        for m in ("hf", "gguf", "synth"):
            reached, todo = set(), [m]
            while todo:                 # the loading modules m imports, directly or through others
                new = graph.get(todo.pop(), set()) - reached
                reached |= new
                todo += new
            assert not reached & {"source", "hf", "gguf", "synth"}, f"{m} imports {sorted(reached)}"
