"""make-model: write a synth preset (or convert any model moestream reads) as a Hugging Face directory or a GGUF.

    moestream make-model tiny models/tiny                        # HF directory: config, safetensors, tokenizer
    moestream make-model qwen3-30b-a3b:layers=24 ref.gguf        # GGUF (the format follows OUT's suffix)
    moestream make-model models/Qwen3-30B-A3B q.gguf --dtype q8_0

    make_model("synth:tiny", "out.gguf", "gguf")
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..errors import UserError
from ..outputs import atomic_dir, check_writable

FORMATS = ("hf", "gguf")
DTYPES = ("auto", "float32", "bfloat16", "float16", "q8_0")


def resolve_spec(spec: str) -> str:
    """A model path as it is, a bare preset name as `synth:NAME`."""
    if spec.startswith("synth:") or os.path.exists(spec) or "/" in spec or spec.endswith(".gguf"):
        return spec
    return "synth:" + spec


def make_model(preset_spec: str, out: str | os.PathLike, fmt: str | None = None, dtype: str = "auto",
               progress: bool = True) -> Path:
    """Open `preset_spec` (a synth preset, `synth:...`, an HF directory or a GGUF) and write it to `out`.

    fmt: hf or gguf; None picks gguf for a `.gguf` path and hf otherwise. Refuses to overwrite: a wrong OUT
    should not replace a model someone downloaded. Written next to OUT and moved there once whole, so that a failed
    write leaves nothing behind.
    """
    out = Path(out)
    fmt = fmt or ("gguf" if out.suffix == ".gguf" else "hf")
    if fmt not in FORMATS:
        raise UserError(f"unknown format {fmt!r}; use --format hf or --format gguf")
    if dtype not in DTYPES or (fmt == "hf" and dtype == "q8_0"):
        raise UserError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)} (q8_0 only with --format gguf)")
    check_writable(out, "OUT", new=True, directory=fmt == "hf", parents=True)     # the folders OUT needs are made
    from ..loading.source import open_source     # torch: here, not at import, so that --help answers at once
    source = open_source(resolve_spec(preset_spec))
    if fmt == "gguf":
        from ..loading.gguf_write import write_gguf
        return write_gguf(source, out, dtype=dtype, progress=progress, new=True)
    from ..loading.hf import write_hf
    with atomic_dir(out) as tmp:
        write_hf(source, tmp, dtype=dtype, progress=progress)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Write a synth:PRESET model, or convert a model moestream reads, to a Hugging Face directory or "
                     "a GGUF file (Mixtral: HF only; Qwen3.5-MoE's HF directory in its text-only form). Presets: "
                     "tiny, qwen3-30b-a3b, tiny-next, qwen3-next-80b-a3b; options like "
                     "qwen3-30b-a3b:layers=4:seed=1:dtype=float32.")
    p.add_argument("preset", metavar="PRESET", help="synth preset (tiny, qwen3-30b-a3b[:layers=N], tiny-next, "
                   "qwen3-next-80b-a3b) or a model path")
    p.add_argument("out", metavar="OUT", help="output directory (hf) or .gguf file")
    p.add_argument("--format", choices=FORMATS, default=None, help="hf or gguf (default: gguf for a .gguf OUT)")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="weight dtype to write (default: the source's)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    path = make_model(args.preset, args.out, args.format, args.dtype)
    print(f"wrote {path}")
    return 0
