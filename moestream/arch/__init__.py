"""The family table, the ground floor under loading/, quant/ and models/ (as llama.cpp's llama-arch.cpp): per
family its Hugging Face names and config.json keys, its GGUF architecture, its tensor names and the blocks its
math picks, with their options. Plain data and name mappings; no math, no I/O.

    families.py       FAMILIES: one Family entry per family (HF and GGUF names, config keys, HF tensor spellings,
                      the blocks: attention kind, mixer, router, expert MLP, residual, each with its options)
    blocks.py         Blocks: the attention kind, mixer, router, expert MLP and residual an entry picks, with the
                      options each has (and room for the next families'); models/blocks.py builds them
    hf_config.py      config_from_hf: config.json -> ModelConfig, as the family's entry maps the keys
    names.py          the canonical tensor names (GGUF's) and shapes every loader and the model share
    hybrid_names.py   the hybrid families' names and values (Gated DeltaNet, gated attention) against HF's and GGUF's

    fam = family_named("Qwen3MoeForCausalLM")     # FAMILIES["qwen3_moe"]
    cfg = config_from_hf(json.load(open("config.json")))
"""
from .families import BY_GGUF_ARCH, FAMILIES, Family, family_named
from .hf_config import config_from_hf

__all__ = ["BY_GGUF_ARCH", "FAMILIES", "Family", "config_from_hf", "family_named"]
