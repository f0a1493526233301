"""A random MTP head for a target GGUF that ships none: a head-only GGUF (llama.cpp b11549's MTP-only layout) whose
one NextN block has random weights at the target's real shapes, for `--model-draft FILE --spec-type draft-mtp` in
moestream and llama.cpp alike. The `mtp` suite of bench/gpu.sh runs it on the Qwen3-Next reference.

    python bench/make_mtp_head.py TARGET.gguf OUT.gguf [--seed S] [--type TYPE] [--device auto|cpu|cuda]

The file is moestream's writer's head_only layout (loading/gguf_write.py): the target's metadata with block_count
n_layers + 1 and nextn_predict_layers 1; the target's globals (token_embd, output_norm, output) copied as it stores
them, bit for bit whatever their type, streamed from the map (llama.cpp's MTP-only loader requires token_embd and
output_norm, and the head then reads the target's embedding and output; moestream keeps them once, runtime/load.py
head_io); and the block blk.{n_layers}: the trunk's block kind (full attention for the hybrids) with its experts,
and nextn.eh_proj, enorm, hnorm and shared_head_norm (qwen4exp: nextn.hc_head_* instead). Families: those whose
heads moestream reads (qwen3next, qwen35moe, deepseek2, glm4moe, qwen4exp); others are refused in one line.

Weights as the shared reference generators draw theirs: normal(0, fan_in**-0.5) with fan_in the contracted (last)
dimension (hidden for a bias), rounded to bf16; norms 1; a router's correction bias normal(0, 0.1). Each tensor (and
each expert) from torch's CPU generator seeded by (--seed, its name), so a head does not depend on the device or the
order written. --type: a llama-quantize file type (default BF16; Q4_K_M gives the head's experts the Q4_K_M
target's sizes), encoded on --device (auto: CUDA where there is one). Host memory: the head's three expert stacks
at once, in bf16 (3.2 GB at Qwen3-Next's 512 experts of 2048 x 512; BF16 at those shapes measured 4.6 GB peak RSS,
the target's mapped embedding and output included), plus, for a quantized --type on the CPU, the quantizer's
working copies of one stack.
"""
from __future__ import annotations

import argparse
import sys
import time
import zlib

import torch

from moestream.arch.families import FAMILIES
from moestream.arch.names import canonical_shape, gguf_tensors, optional_names
from moestream.errors import UserError
from moestream.loading.gguf import GGUFSource
from moestream.loading.gguf_write import write_gguf
from moestream.quant.mix import IQ_FTYPES, Mix, parse_ftype
from moestream.tools.quantize import resolve_device

def head_families() -> list[str]:
    """The GGUF architectures whose MTP heads moestream reads."""
    return [f.gguf_arch for f in FAMILIES.values() if (f.hf_mtp or f.gguf_mtp) and f.gguf_arch]


def draw(name: str, shape: tuple[int, ...], hidden: int, g: torch.Generator) -> torch.Tensor:
    """One random tensor as the reference generators draw it (see the module's docstring)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith("exp_probs_b.bias"):
        return torch.randn(shape, generator=g) * 0.1
    fan_in = hidden if name.endswith(".bias") else shape[-1]
    return torch.randn(shape, generator=g).mul_(fan_in ** -0.5).to(torch.bfloat16)


class RandomHead:
    """The WeightSource write_gguf(head_only=True) reads: the target's config with one MTP head after its trunk,
    the head's tensors random, the globals the target's (copied as stored)."""

    def __init__(self, target: GGUFSource, seed: int):
        self.target, self.seed = target, seed
        self.config = target.config.replace(nextn_layers=1)
        self.tokenizer = target.tokenizer
        self._head = f"blk.{self.config.n_layers}."

    def _generator(self, key: str) -> torch.Generator:
        return torch.Generator().manual_seed(zlib.crc32(f"{self.seed}:{key}".encode()))   # (CPU seeds: 32 bits)

    def has(self, name: str) -> bool:
        if name in optional_names(self.config):       # no embedding or output head of its own: the target's
            return False
        return name.startswith(self._head) or self.target.has(name)

    def tensor(self, name: str) -> torch.Tensor:
        if not name.startswith(self._head):
            return self.target.tensor(name)
        return draw(name, canonical_shape(self.config, name), self.config.hidden_size, self._generator(name))

    def stored(self, name: str):
        return self.target.stored(name)

    def expert(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        H, inter = self.config.hidden_size, self.config.moe_intermediate_size
        g = self._generator(f"blk.{layer}.expert.{e}")
        return tuple(draw("", shape, H, g) for shape in ((inter, H), (inter, H), (H, inter)))


def make_head(target_path: str, out: str, seed: int = 0, ftype: str = "BF16", device: str = "auto",
              progress: bool = False):
    """Write a random MTP head of the GGUF at target_path to `out` (see the module's docstring); returns its path."""
    if not str(target_path).endswith(".gguf"):
        raise UserError(f"{target_path!r}: give the target's .gguf file")
    target = GGUFSource(target_path)
    fam = FAMILIES[target.config.family]
    if fam.gguf_arch not in head_families():
        raise UserError(f"{target_path!r} is a {fam.title} model ({fam.gguf_arch}), a family without an MTP head "
                        f"moestream reads; heads are made for {', '.join(head_families())}")
    ftype = parse_ftype(ftype)
    if ftype in IQ_FTYPES:
        raise UserError(f"--type {ftype} needs an importance matrix, which a random head has none of; use Q4_K_M")
    source = RandomHead(target, seed)
    mix = Mix.for_config(source.config, ftype)
    copied = [n for n, _ in gguf_tensors(source.config) if not n.startswith("blk.")]     # the target's globals
    return write_gguf(source, out, types=mix.type, file_type=mix.file_type, device=resolve_device(device),
                      progress=progress, head_only=True, copied=copied)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", metavar="TARGET.gguf")
    ap.add_argument("out", metavar="OUT.gguf")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--type", default="BF16", help="llama-quantize file type of the head (default BF16)")
    ap.add_argument("--device", default="auto", help="where quantized tensors are encoded: auto, cpu or cuda")
    a = ap.parse_args(argv)
    t = time.time()
    try:
        path = make_head(a.target, a.out, a.seed, a.type, a.device, progress=sys.stderr.isatty())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}: {path.stat().st_size / 1e9:.2f} GB in {time.time() - t:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
