"""A Hugging Face checkpoint's expert tensors, in every form HFSource reads: HFExperts, a base class of HFSource
(hf.py), holds its expert methods; they read through HFSource's `_where` (HF name -> safetensors handle), `config`,
`prefix`, `_read`, `_check`, `_shape` and `_scale_inv`.

    gate, up, down = src.expert(0, 3)                # model.layers.0.mlp.experts.3.{gate,up,down}_proj.weight
    src.expert_types(0), src.expert_bytes(0, 3)      # None for float experts; (MXFP4,) * 3 or (FP8,) * 3 and a row

Experts may be stored one tensor per expert and projection (qwen*_moe/olmoe `mlp.experts.E.gate_proj`, mixtral
`block_sparse_moe.experts.E.w1/w3/w2`) or fused per layer as transformers 5 holds them in memory
(`mlp.experts.gate_up_proj` (E, 2I, H), `mlp.experts.down_proj` (E, H, I)); a fused expert is sliced out of its
stack without reading the rest. Each family's spellings and config.json keys are its entry in arch/families.py.
gpt-oss's float stacks (Family.hf_interleaved) are transposed, gate_up_proj (E, H, 2I) with gate and up in
alternate columns and down_proj (E, I, H), their biases beside them. Fused experts may also be MXFP4 in OpenAI's
packed form (gpt-oss's checkpoints as published, quantization_config quant_method mxfp4: `gate_up_proj_blocks`
(E, 2I, H / 32, 16) with `gate_up_proj_scales` (E, 2I, H / 32), gate and up in alternate rows, `down_proj_blocks`
/ `down_proj_scales`): they are repacked to ggml's MXFP4 blocks (quant/mxfp4.py) and handed out as such
(`expert_types`, `expert_bytes`), so they stay MXFP4 from the file to the slot as a GGUF's do; `expert` gives their
values as float32.

An FP8 checkpoint's experts (one tensor each, quant/fp8.py: e4m3 weights with their 128 x 128 blocks'
`weight_scale_inv`) are handed out as their FP8 bytes (`expert_types`, `expert_bytes`), which the engine keeps as
they are from the file to the slot; `expert` widens them to float32.
"""
from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as Q

from ..arch.families import FAMILIES, first_own
from ..arch.names import EXPERT_STACKS, canonical_shape
from ..errors import UserError
from ..quant import fp8
from ..quant.mxfp4 import check_openai, from_openai
from .hf_names import layers_prefix

PACKED = ("gate_up_proj", "down_proj")      # OpenAI's packed MXFP4 experts: {module}.{p}_blocks and {p}_scales


class HFExperts:
    """HFSource's experts: per expert, fused stacks (gpt-oss's interleaved), FP8 block-scaled, packed MXFP4."""

    def _check_experts(self) -> None:
        """Every expert tensor's shape (from the headers) against the config's, as expert() would hand it out."""
        cfg = self.config
        fam, every = FAMILIES[cfg.family], FAMILIES.values()
        packed = [layer for layer in cfg.moe_layers if self._packed(layer)]
        if packed and len(packed) < len(cfg.moe_layers):
            raise UserError(f"MoE layers {sorted(set(cfg.moe_layers) - set(packed))} have no packed MXFP4 experts "
                            f"where layer {packed[0]}'s are: every layer's experts must be MXFP4 or none")
        for layer in packed:
            self._check_packed(layer)
        for layer in (l for l in cfg.expert_layers if l not in packed):
            p = layers_prefix(cfg, layer, self.prefix)
            for mod in first_own(fam.hf_fused, [f.hf_fused for f in every]):
                gate_up, down = f"{p}{mod}.gate_up_proj", f"{p}{mod}.down_proj"
                if gate_up in self._where and down in self._where:
                    E, inter, H = canonical_shape(cfg, "ffn_gate_exps.weight")    # gate_up: gate rows, then up
                    inter_t = fam.hf_interleaved            # gpt-oss: (E, H, 2I) and (E, I, H)
                    self._check(f"blk.{layer}.ffn_gate_exps.weight", gate_up, self._shape(gate_up),
                                want=(E, H, 2 * inter) if inter_t else (E, 2 * inter, H))
                    self._check(f"blk.{layer}.ffn_down_exps.weight", down, self._shape(down),
                                want=(E, inter, H) if inter_t else None)
                    break
            else:
                for mod, g, u, d in first_own(fam.hf_experts, [f.hf_experts for f in every]):
                    first = f"{p}{mod}.0.{g}.weight"
                    if first in self._where:  # experts one tensor each: as many as there are, stacked
                        n = 1
                        while f"{p}{mod}.{n}.{g}.weight" in self._where:
                            n += 1
                        for proj, stack in zip((g, u, d), EXPERT_STACKS):
                            name = f"{p}{mod}.0.{proj}.weight"
                            if name in self._where:
                                self._check(f"blk.{layer}.{stack}.weight", f"{p}{mod}.{{0..{n - 1}}}.{proj}.weight",
                                            (n, *self._shape(name)))
                        break

    def _packed(self, layer: int) -> str | None:
        """The layer's experts module prefix (`model.layers.N.mlp.experts.`) where its experts are OpenAI's packed
        MXFP4 (a `gate_up_proj_blocks` tensor), else None."""
        fam, every = FAMILIES[self.config.family], FAMILIES.values()
        for mod in first_own(fam.hf_fused, [f.hf_fused for f in every]):
            p = f"{self.prefix}layers.{layer}.{mod}."
            if f"{p}gate_up_proj_blocks" in self._where:
                return p
        return None

    def _check_packed(self, layer: int) -> None:
        """Both pairs present, each blocks' shape its scales' + [16], and the matrices they hold the config's."""
        p = self._packed(layer)
        E, inter, H = canonical_shape(self.config, "ffn_gate_exps.weight")
        for proj, stack, want in zip(PACKED, ("ffn_gate_exps", "ffn_down_exps"), ((E, 2 * inter, H), None)):
            blocks, scales = f"{p}{proj}_blocks", f"{p}{proj}_scales"
            for n in (blocks, scales):
                if n not in self._where:
                    raise UserError(f"checkpoint lacks tensor {n} (MXFP4 experts of layer {layer}): is the download "
                                    "complete?")
            shape = self._shape(blocks)
            check_openai(shape, self._shape(scales), blocks)
            self._check(f"blk.{layer}.{stack}.weight", blocks, (*shape[:-2], shape[-2] * 32), want=want)

    def expert(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._packed(layer):
            from ..quant.dequant import dequantize
            return tuple(dequantize(m, Q.MXFP4) for m in self._packed_expert(layer, e))
        names = self._expert_names(layer, e)
        if names is not None:
            gate, up, down = (self._read(n) for n in names)
            return gate, up, down
        p = layers_prefix(self.config, layer, self.prefix)
        fam, every = FAMILIES[self.config.family], FAMILIES.values()
        for mod in first_own(fam.hf_fused, [f.hf_fused for f in every]):
            gate_up, down = f"{p}{mod}.gate_up_proj", f"{p}{mod}.down_proj"
            if gate_up in self._where and down in self._where:
                return self._fused_expert(gate_up, down, e)
        raise UserError(f"checkpoint lacks tensor {p}mlp.experts.{e}.gate_proj.weight (expert {e} of layer "
                        f"{layer}): is the download complete?")

    def expert_types(self, layer: int) -> tuple | None:
        """(MXFP4,) * 3 for OpenAI's packed experts, (FP8,) * 3 where the layer's experts are FP8 (both kept as their
        bytes); None for float experts, which the engine converts to the model's dtype."""
        if self._packed(layer):
            return (Q.MXFP4,) * 3
        names = self._expert_names(layer, 0)
        return (fp8.FP8,) * 3 if names is not None and self._is_fp8(names[0]) else None

    def expert_bytes(self, layer: int, e: int) -> torch.Tensor:
        """Expert e of a quantized layer as its row (quant/layout.py): gate | up | down, each ggml's MXFP4 blocks
        (packed experts) or its e4m3 bytes and scales (FP8)."""
        if self._packed(layer):
            return torch.cat([m.reshape(-1) for m in self._packed_expert(layer, e)])
        names = self._expert_names(layer, e)
        if names is None:
            raise UserError(f"layer {layer}'s experts are float: this checkpoint has no quantized expert blocks "
                            "there")
        parts = []
        for n in names:
            if not self._is_fp8(n):
                raise UserError(f"tensor {n} is {self._where[n].get_slice(n).get_dtype()} while its expert's gate "
                                "is FP8; moestream reads experts whose three matrices are all FP8 or all float")
            parts.append(fp8.pack(self._where[n].get_tensor(n), self._scale_inv(n)))
        return torch.cat(parts)

    def _expert_bias(self, name: str) -> torch.Tensor:
        """gpt-oss's expert bias `name` (blk.N.ffn_{gate,up,down}_exps.bias), read from the one HF keeps beside its
        stacks: gate_up_proj_bias (E, 2I) alternates gate and up."""
        _, layer, suffix = name.split(".", 2)
        p = f"{self.prefix}layers.{layer}.{FAMILIES[self.config.family].hf_fused[0]}."
        if suffix == "ffn_down_exps.bias":
            return self._read(p + "down_proj_bias")
        both = self._read(p + "gate_up_proj_bias")
        return both[:, suffix == "ffn_up_exps.bias"::2].contiguous()

    def _is_fp8(self, name: str) -> bool:
        return self._where[name].get_slice(name).get_dtype() == "F8_E4M3"

    def _expert_names(self, layer: int, e: int) -> list[str] | None:
        """Expert e's gate, up and down tensor names where the layer's experts are tensors of their own; None for
        fused stacks."""
        p = layers_prefix(self.config, layer, self.prefix)
        fam, every = FAMILIES[self.config.family], FAMILIES.values()
        for mod, g, u, d in first_own(fam.hf_experts, [f.hf_experts for f in every]):
            names = [f"{p}{mod}.{e}.{proj}.weight" for proj in (g, u, d)]
            if names[0] in self._where:
                return names
        return None

    def _packed_expert(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert e's gate (I, H / 32 * 17), up and down (H, I / 32 * 17) as ggml's MXFP4 rows, read from its slice
        of the packed stacks alone."""
        p = self._packed(layer)
        gate_up, down = (from_openai(self._slice(f"{p}{proj}_blocks", e), self._slice(f"{p}{proj}_scales", e),
                                     f"{p}{proj}_blocks") for proj in PACKED)
        if FAMILIES[self.config.family].hf_interleaved:
            return gate_up[0::2], gate_up[1::2], down
        inter = self.config.moe_intermediate_size
        return gate_up[:inter], gate_up[inter:], down

    def _slice(self, name: str, e: int) -> torch.Tensor:
        return self._where[name].get_slice(name)[e]

    def _fused_expert(self, gate_up: str, down: str, e: int):
        if self._is_fp8(gate_up) or self._is_fp8(down):
            raise UserError(f"{gate_up} is an FP8 stack of every expert; moestream reads FP8 experts stored one "
                            "tensor each (as the published FP8 checkpoints are)")
        inter = self.config.moe_intermediate_size          # the stacks' shapes were checked at open
        gu, dn = self._where[gate_up].get_slice(gate_up), self._where[down].get_slice(down)
        pair = gu[e]
        if FAMILIES[self.config.family].hf_interleaved:    # (H, 2I): gate and up in alternate columns; down (I, H)
            return pair[:, ::2].t().contiguous(), pair[:, 1::2].t().contiguous(), dn[e].t().contiguous()
        return pair[:inter], pair[inter:], dn[e]                   # (2I, H): gate rows, then up rows
