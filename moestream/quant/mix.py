"""llama-quantize's type mixes: the GGML type of each tensor for a file type, as llama.cpp's llama_tensor_get_type
(src/llama-quant.cpp) picks it.

    mix = Mix.for_config(cfg, "Q4_K_M")
    mix.type("blk.0.ffn_down_exps.weight", (128, 2048, 768))     # Q6_K: an early layer's ffn_down gets more bits
    mix.type("blk.3.ffn_down_exps.weight", (128, 2048, 768))     # Q4_K
    estimate_bytes(cfg, "Q4_K_M")                                 # the file's tensor bytes, from the config alone

The rules moestream's families meet (no Falcon, no 70B):
- Never quantized: 1-D tensors (norms, biases, the shared expert's gate), `*_norm.weight`, the routers
  `ffn_gate_inp.weight`, the DeltaNet's `ssm_conv1d.weight`: F32, as llama.cpp's converters write them; the QSA
  indexer's `indexer.q_proj.weight` and `indexer.k_proj.weight` (llama-quantize keeps the source's type): F32.
- token_embd.weight and Qwen3.8-Flash-Next's per_layer_token_embd.weight take the embeddings' rules.
- output.weight (token_embd.weight when the embeddings are tied): Q6_K, or Q8_0 for Q8_0 and for rows that are not
  whole blocks of the file type.
- attn_v and the tensors llama.cpp counts with it (category_is_attn_v: attn_qkv, the hybrids' DeltaNet input, and
  attn_kv_b), counted in file order (by layer, then name: i of n, one a layer where each layer has one): Q4_K for
  Q2_K when 4 or more query heads share a kv head, Q3_K otherwise; Q5_K for the first 2 and Q4_K after them for
  Q3_K_M; Q5_K for Q3_K_L; Q6_K where `use_more_bits(i, n)` for Q4_K_M / Q5_K_M, Q5_K for the first 4 for Q4_K_S,
  Q5_K for IQ4_NL / IQ4_XS when 4 or more query heads share a kv head; Q8_0 whatever the type when the model has 8
  experts (llama.cpp's Mixtral rule), as attn_k is then too.
- ffn_down (dense, expert stacks and shared expert alike): the layer is read from the name (llama.cpp does so when
  n_expert > 1) of n_layers, the file's block count (llama.cpp's n_ffn_down, n_layer_all: the MTP heads' blocks
  too), then Q3_K for Q2_K; Q5_K in the first sixteenth of the layers and Q4_K after them for Q3_K_M; Q5_K for
  Q3_K_L; Q6_K in the `use_more_bits` layers for Q4_K_M and Q5_K_M; Q5_K in the first eighth of the layers for
  Q4_K_S, and for IQ4_NL and IQ4_XS without an imatrix; with one, Q4_1 (Q5_1) in the first eighth for Q4_0 (Q5_0).
- attn_output: Q3_K for Q2_K, Q4_K for Q3_K_M, Q5_K for Q3_K_L; with 8 experts instead Q5_K for Q2_K, Q3_K_S,
  Q3_K_M, Q4_K_S, Q4_K_M, IQ4_NL and IQ4_XS (Q3_K_L then keeps Q3_K).
- IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS (which need an imatrix): output.weight (tied token_embd) Q5_K, token_embd Q2_K;
  attn_v, attn_qkv and attn_kv_b Q4_K when 4 or more query heads share a kv head or the model has 4 or more
  experts, Q2_K otherwise; attn_k Q4_K with 8 experts; the first n_layers / 8 ffn_down tensors in llama.cpp's
  order (by layer, then name: a layer's ffn_down_exps before its ffn_down_shexp) Q2_K; attn_output Q5_K with 8
  experts, IQ2_XXS for IQ1_S and IQ1_M.
- A row that is not whole blocks of its type falls back as llama.cpp's does: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ4_XS ->
  IQ4_NL, Q2_K, Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, and to F16 when not whole 32-blocks either
  (so an expert's down projection of rows of 640 is IQ4_NL in an IQ1_M file, Q4_0 in its first eighth, Q5_0 in a
  Q4_K_M file: a layer's three expert tensors may differ in type).
- MXFP4_MOE: expert stacks (3-D, more than one expert) MXFP4, output.weight (and tied embeddings) and every other
  quantized tensor Q8_0; a row that is not whole 32-blocks F16.
- Q2_K_S, IQ2_S, IQ2_M and IQ3_XXS are not offered.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import gguf
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from ..config import ModelConfig
from ..errors import UserError
from ..arch.names import gguf_name, gguf_tensors

F = gguf.LlamaFileType
# file type name (llama-quantize's) -> (general.file_type, the type of the tensors no rule singles out)
FTYPES: dict[str, tuple[F, Q]] = {
    "Q8_0": (F.MOSTLY_Q8_0, Q.Q8_0), "Q4_0": (F.MOSTLY_Q4_0, Q.Q4_0), "Q4_1": (F.MOSTLY_Q4_1, Q.Q4_1),
    "Q5_0": (F.MOSTLY_Q5_0, Q.Q5_0), "Q5_1": (F.MOSTLY_Q5_1, Q.Q5_1), "Q2_K": (F.MOSTLY_Q2_K, Q.Q2_K),
    "Q3_K_S": (F.MOSTLY_Q3_K_S, Q.Q3_K), "Q3_K_M": (F.MOSTLY_Q3_K_M, Q.Q3_K), "Q3_K_L": (F.MOSTLY_Q3_K_L, Q.Q3_K),
    "Q4_K_S": (F.MOSTLY_Q4_K_S, Q.Q4_K), "Q4_K_M": (F.MOSTLY_Q4_K_M, Q.Q4_K),
    "Q5_K_S": (F.MOSTLY_Q5_K_S, Q.Q5_K), "Q5_K_M": (F.MOSTLY_Q5_K_M, Q.Q5_K), "Q6_K": (F.MOSTLY_Q6_K, Q.Q6_K),
    "IQ4_NL": (F.MOSTLY_IQ4_NL, Q.IQ4_NL), "IQ4_XS": (F.MOSTLY_IQ4_XS, Q.IQ4_XS),
    "MXFP4_MOE": (F.MOSTLY_MXFP4_MOE, Q.MXFP4),
    "F16": (F.MOSTLY_F16, Q.F16), "BF16": (F.MOSTLY_BF16, Q.BF16), "F32": (F.ALL_F32, Q.F32),
    "IQ2_XXS": (F.MOSTLY_IQ2_XXS, Q.IQ2_XXS), "IQ2_XS": (F.MOSTLY_IQ2_XS, Q.IQ2_XS),
    "IQ1_S": (F.MOSTLY_IQ1_S, Q.IQ1_S), "IQ1_M": (F.MOSTLY_IQ1_M, Q.IQ1_M),
}
FLOAT = (Q.F32, Q.F16, Q.BF16)
# llama-quant.cpp's tensor_type_fallback today (releases before its 2026 refactor sent Q2_K and Q3_K to IQ4_NL)
FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0, Q.IQ4_XS: Q.IQ4_NL,
            Q.IQ1_S: Q.IQ4_NL, Q.IQ1_M: Q.IQ4_NL, Q.IQ2_XXS: Q.IQ4_NL, Q.IQ2_XS: Q.IQ4_NL}
# The file types whose default type llama-quantize quantizes only with an imatrix (tensor_requires_imatrix), and the
# types that need it: moestream writes these four, with --imatrix; Q2_K_S, IQ2_S, IQ2_M and IQ3_XXS not at all.
IQ_FTYPES = ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M")
NEEDS_IMATRIX = ("Q2_K_S", "IQ2_S", "IQ2_M", "IQ3_XXS")
REQUIRES_IMATRIX = (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ1_S, Q.IQ1_M)
_MORE_BITS_V = ("Q4_K_M", "Q5_K_M")
_IQ4 = ("IQ4_NL", "IQ4_XS")
_ATTN_OUTPUT_8_EXPERTS = ("Q2_K", "Q3_K_S", "Q3_K_M", "Q4_K_S", "Q4_K_M", "IQ4_NL", "IQ4_XS")
_ATTN_OUTPUT = {"Q2_K": Q.Q3_K, "Q3_K_M": Q.Q4_K, "Q3_K_L": Q.Q5_K}       # without 8 experts
# llama-quant.cpp's category_is_attn_v (tensor_get_category tests attn_qkv, then attn_kv_b, then attn_v)
_ATTN_V_LIKE = ("attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight")
# llama-quant.cpp's tensor_name_match_token_embd: the embeddings' rule (and --token-embedding-type) for both
TOKEN_EMBD = ("token_embd.weight", "per_layer_token_embd.weight")
_KEPT = ("_norm.weight", "ffn_gate_inp.weight", "ssm_conv1d.weight", "indexer.k_proj.weight", "indexer.q_proj.weight")


def parse_ftype(name: str) -> str:
    """A file type by name, any case (q4_k_m); a one-line error listing the file types otherwise."""
    key = name.upper()
    if key in NEEDS_IMATRIX:
        raise UserError(f"{key} needs an importance matrix and moestream does not write it (of those types it writes "
                        f"{', '.join(IQ_FTYPES)}, with --imatrix FILE); use Q2_K")
    if key not in FTYPES and "MOSTLY_" + key in F.__members__:
        raise UserError(f"moestream quantize does not write llama-quantize's file type {key}; the types it writes: "
                        f"{', '.join(FTYPES)}")
    if key not in FTYPES:
        raise UserError(f"unknown file type {name!r}; the types: {', '.join(FTYPES)}")
    return key


L_MAX = 1 << 30


def _layer(name: str) -> int:
    return int(name.split(".")[1]) if name.startswith("blk.") else -1


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's pick of the layers that get more bits: the first and last eighth and every third between."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether llama-quantize quantizes this tensor at all (the others keep their float type: F32 here): b11549's
    tensor_allows_quantization, the rules that meet moestream's families (Qwen3.8-Flash-Next's QSA indexer
    projections are kept whatever the arch, as MiniMax's are)."""
    return (name.endswith("weight") and len(shape) >= 2 and not any(k in name for k in _KEPT))


def _attn_v_like(name: str) -> bool:
    return any(k in name for k in _ATTN_V_LIKE)


def _fits(qtype: Q, n: int) -> bool:
    return n % GGML_QUANT_SIZES[qtype][0] == 0


@dataclass(frozen=True)
class Mix:
    """The tensor types of one file type for one model shape; `type(name, shape)` is what write_gguf asks."""
    ftype: str
    n_layers: int                       # the file's block count (llama.cpp's n_layer_all: the MTP heads' too)
    n_expert: int
    n_gqa: int                          # query heads per kv head
    tied: bool                          # no output.weight: token_embd.weight takes its rule
    pure: bool = False                  # every quantized tensor of the default type (llama-quantize --pure)
    output_type: Q | None = None        # --output-tensor-type
    token_embd_type: Q | None = None    # --token-embedding-type
    has_imatrix: bool = False           # --imatrix given (a few rules differ with one)
    ffn_down_rank: dict = field(default_factory=dict, compare=False)  # name -> its index among the ffn_down tensors
    attn_v_rank: dict = field(default_factory=dict, compare=False)    # name -> its index among the attn_v-like ones

    def __post_init__(self):
        object.__setattr__(self, "ftype", parse_ftype(self.ftype))      # q4_k_m -> Q4_K_M, or a UserError

    @classmethod
    def for_config(cls, cfg: ModelConfig, ftype: str, **kw) -> "Mix":
        # llama.cpp visits the tensors by layer, then (GGUF) name (llama_model_loader's weight_name_comparer); its IQ
        # rules count the ffn_down tensors so, and its attn_v rules the attn_v-like ones (llama-quant.cpp
        # init_quantize_state_counters: n_attention_wv; i_attention_wv rises as each is visited)
        names = sorted((n for n, _ in gguf_tensors(cfg)), key=lambda n: (_layer(n), gguf_name(cfg, n)))
        downs = [n for n in names if "ffn_down" in n]
        vs = [n for n in names if _attn_v_like(n)]
        return cls(ftype, cfg.n_stored_layers, cfg.n_experts, cfg.n_heads // cfg.n_kv_heads,
                   cfg.tie_word_embeddings, ffn_down_rank={n: i for i, n in enumerate(downs)},
                   attn_v_rank={n: i for i, n in enumerate(vs)}, **kw)

    @property
    def file_type(self) -> F:
        return FTYPES[self.ftype][0]

    def type(self, name: str, shape: tuple[int, ...]) -> Q:
        """The GGML type of tensor `name` of torch shape `shape` (rows of shape[-1] values)."""
        if not quantizable(name, shape):
            return Q.F32
        t = FTYPES[self.ftype][1]
        if t not in FLOAT and not self.pure:
            t = self._rule(name, shape, t)
        if name in TOKEN_EMBD and self.token_embd_type is not None:
            t = self.token_embd_type
        if name == "output.weight" and self.output_type is not None:
            t = self.output_type
        return self._fallback(t, shape[-1])

    def _rule(self, name: str, shape: tuple[int, ...], t: Q) -> Q:
        f, L, n = self.ftype, self.n_layers, shape[-1]
        layer = _layer(name)
        if name == "output.weight" or (self.tied and name in TOKEN_EMBD):
            return (Q.Q8_0 if not _fits(t, n) or t in (Q.Q8_0, Q.MXFP4) else Q.Q5_K if f in IQ_FTYPES
                    else Q.Q6_K)
        if f == "MXFP4_MOE":            # expert stacks (E > 1 matrices) MXFP4, every other quantized tensor Q8_0
            return Q.MXFP4 if len(shape) == 3 and shape[0] > 1 else Q.Q8_0
        if name in TOKEN_EMBD:
            return Q.Q2_K if f in IQ_FTYPES else t
        if f in IQ_FTYPES:
            return self._iq_rule(name, t)
        if _attn_v_like(name):
            # b11549's llama-quant.cpp llama_tensor_get_type_impl: the category_is_attn_v branch comes before the
            # ATTENTION_QKV one, which is so never reached: attn_qkv takes attn_v's rules, counted with it
            i, n = self.attn_v_rank.get(name, layer), len(self.attn_v_rank) or L   # (a name not in the file: its layer)
            if f == "Q2_K":
                t = Q.Q4_K if self.n_gqa >= 4 else Q.Q3_K
            elif f == "Q3_K_M":
                t = Q.Q5_K if i < 2 else Q.Q4_K
            elif f == "Q3_K_L":
                t = Q.Q5_K
            elif f in _IQ4 and self.n_gqa >= 4:
                t = Q.Q5_K
            elif f in _MORE_BITS_V and use_more_bits(i, n):
                t = Q.Q6_K
            elif f == "Q4_K_S" and i < 4:
                t = Q.Q5_K
            return Q.Q8_0 if self.n_expert == 8 else t
        if "attn_k.weight" in name:
            return Q.Q8_0 if self.n_expert == 8 else t
        if "ffn_down" in name:
            if f == "Q2_K":
                return Q.Q3_K
            if f == "Q3_K_M":
                return Q.Q5_K if layer < L // 16 else Q.Q4_K
            if f == "Q3_K_L":
                return Q.Q5_K
            if f == "Q4_K_M" and use_more_bits(layer, L):
                return Q.Q6_K
            if layer < L // 8 and f in _IQ4 and not self.has_imatrix:
                return Q.Q5_K
            if f == "Q5_K_M" and use_more_bits(layer, L):
                return Q.Q6_K
            if f == "Q4_K_S" and layer < L // 8:
                return Q.Q5_K
            if f in ("Q4_0", "Q5_0") and self.has_imatrix and layer < L // 8:
                return Q.Q4_1 if f == "Q4_0" else Q.Q5_1
            return t
        if "attn_output.weight" in name:
            if self.n_expert == 8:
                return Q.Q5_K if f in _ATTN_OUTPUT_8_EXPERTS else t
            return _ATTN_OUTPUT.get(f, t)
        return t

    def _iq_rule(self, name: str, t: Q) -> Q:
        """llama.cpp's branch for IQ2_XXS, IQ2_XS, IQ1_S and IQ1_M files (IQ2_S and IQ2_M share it there)."""
        if _attn_v_like(name):
            return Q.Q4_K if self.n_gqa >= 4 or self.n_expert >= 4 else Q.Q2_K
        if "attn_k.weight" in name:
            return Q.Q4_K if self.n_expert == 8 else t
        if "attn_q.weight" in name:
            return t
        if "attn_output.weight" in name:
            return Q.Q5_K if self.n_expert == 8 else Q.IQ2_XXS if self.ftype in ("IQ1_S", "IQ1_M") else t
        if "ffn_up" in name or "ffn_gate" in name:
            return t
        if "ffn_down" in name and self.ffn_down_rank.get(name, L_MAX) < self.n_layers // 8:
            return Q.Q2_K
        return t

    @staticmethod
    def _fallback(t: Q, n: int) -> Q:
        if _fits(t, n):
            return t
        t = FALLBACK.get(t, t)
        return t if _fits(t, n) else Q.F16


def tensor_bytes(qtype: Q, shape: tuple[int, ...]) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows * (shape[-1] // block) * size


def file_types(cfg: ModelConfig, ftype: str, **kw) -> dict[str, Q]:
    """Every tensor of the model's GGUF file -> its type under `ftype` (Mix options as keywords)."""
    mix = Mix.for_config(cfg, ftype, **kw)
    return {name: mix.type(name, shape) for name, shape in gguf_tensors(cfg)}


def estimate_bytes(cfg: ModelConfig, ftype: str, **kw) -> int:
    """The tensor bytes of the model's `ftype` GGUF (without metadata and alignment), from the config alone."""
    mix = Mix.for_config(cfg, ftype, **kw)
    return sum(tensor_bytes(mix.type(name, shape), shape) for name, shape in gguf_tensors(cfg))
