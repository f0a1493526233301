"""FP8 block-scaled checkpoints for tests: a float Hugging Face directory's linear weights quantized as the published
FP8 checkpoints are (transformers' FineGrainedFP8: e4m3 weights, a float32 `weight_scale_inv` per 128 x 128 block,
the edge blocks partial), and the same model with those weights dequantized, in float32.

    fp8_checkpoint(float_dir, fp8_dir, deq_dir)     # fp8_dir: the FP8 checkpoint; deq_dir: its dequantized weights
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moestream.quant import fp8

# What the published checkpoints keep in their float dtype: embeddings, the head, norms, the routers.
KEEP = re.compile(r"embed_tokens|lm_head|norm|mlp\.gate\.weight|shared_expert_gate")
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                       "activation_scheme": "dynamic"}


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, C) float -> (R, C) e4m3 and (ceil R/128, ceil C/128) float32 scales: per block amax / 448."""
    R, C = w.shape
    sr, sc = fp8.scale_shape(R, C)
    padded = torch.zeros(sr * 128, sc * 128)
    padded[:R, :C] = w.float()
    blocks = padded.view(sr, 128, sc, 128)
    scale = blocks.abs().amax(dim=(1, 3)) / 448
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (blocks / scale[:, None, :, None]).clamp(-448, 448).view(sr * 128, sc * 128)[:R, :C]
    return q.to(fp8.E4M3), scale


def fp8_checkpoint(float_dir, fp8_dir, deq_dir, keep=KEEP) -> None:
    """Write float_dir (a one-file float checkpoint) as an FP8 checkpoint and as its dequantized float32 weights."""
    float_dir, fp8_dir, deq_dir = Path(float_dir), Path(fp8_dir), Path(deq_dir)
    tensors = load_file(str(float_dir / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, t in tensors.items():
        if name.endswith(".weight") and t.dim() == 2 and not keep.search(name):
            q, s = quantize(t)
            quantized[name], quantized[fp8.scale_name(name)] = q, s
            dequantized[name] = fp8.dequantize(q, s)
        else:
            quantized[name] = dequantized[name] = t
    for out, weights in ((fp8_dir, quantized), (deq_dir, dequantized)):
        shutil.copytree(float_dir, out, dirs_exist_ok=True)
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIG
    (fp8_dir / "config.json").write_text(json.dumps(config, indent=2))
