"""quantize: write a model moestream reads as a quantized GGUF, shaped like llama-quantize.

    moestream quantize models/Qwen3-30B-A3B q4_k_m.gguf Q4_K_M          # an HF directory
    moestream quantize ref-bf16.gguf ref-q8_0.gguf Q8_0 --device cuda     # a GGUF
    moestream quantize q8_0.gguf q4_k_m.gguf Q4_K_M --allow-requantize   # an already quantized GGUF
    moestream quantize synth:tiny tiny.gguf Q4_K_M --output-tensor-type q8_0
    moestream quantize model.gguf iq1_m.gguf IQ1_M --imatrix imatrix.gguf     # IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS need one

    quantize_model("synth:tiny", "tiny-q4_k_m.gguf", "Q4_K_M", device="cpu")

The tensor types follow llama-quantize's mixes (moestream/quant/mix.py); the blocks are ggml's, so llama.cpp reads the
file as its own. Metadata is written from the model's config and tokenizer, not copied from IN's keys.

--imatrix FILE (llama-imatrix's GGUF or legacy .dat, or `moestream imatrix`'s) gives the quantizers that take one
(IQ2_XXS, IQ2_XS, IQ1_S, IQ1_M, IQ4_NL, IQ4_XS) each column's importance, per expert for expert stacks, as
llama-quantize does; the k-quants' are ggml's reference ones and do not read it (llama.cpp's Q2_K..Q6_K would, and
Q4_0..Q5_1's). The file's imatrix is named in the quantize.imatrix.* keys llama-quantize writes.
"""
from __future__ import annotations

import argparse
import collections
import os
from pathlib import Path

from ..errors import UserError
from ..outputs import check_writable
from ..quant.mix import FLOAT, FTYPES, IQ_FTYPES, REQUIRES_IMATRIX, Mix, parse_ftype, tensor_bytes
from ..quant.types import parse_type

# torch (quant.quantize, loading) is imported where it is used, so that `moestream quantize --help` answers at once.


def quantized_tensors(model: str) -> dict[str, str]:
    """IN's quantized tensors (name -> type) when IN is a GGUF file; {} for anything else (which open_source
    judges)."""
    from ..loading.gguf import read_gguf
    try:
        reader = read_gguf(model)
    except UserError:       # not a GGUF file, or a damaged one: open_source says what is wrong with it
        return {}
    return {t.name: t.tensor_type.name for t in reader.tensors if t.tensor_type not in FLOAT}


def resolve_device(device: str) -> str:
    import torch
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device here; use --device cpu (or auto)")
    if device not in ("cpu", "cuda"):
        raise UserError(f"--device must be auto, cpu or cuda, got {device!r}")
    return device


def quantize_model(model: str, out: str | os.PathLike, ftype: str, *, allow_requantize: bool = False,
                   output_type: str | None = None, token_embd_type: str | None = None, pure: bool = False,
                   device: str = "auto", progress: bool = True, imatrix: str | None = None) -> tuple[Path, Mix, dict]:
    """Write `model` (an HF directory, a GGUF or synth:SPEC) to `out` as a GGUF of file type `ftype`.

    Refuses an existing `out`, and a quantized GGUF without allow_requantize (requantizing compounds the
    rounding errors), as llama-quantize does. Returns the path, the mix and {type name: (tensors, bytes)}.
    """
    from ..loading.source import open_source
    from ..quant.quantize import ENCODERS
    ftype = parse_ftype(ftype)
    if ftype in IQ_FTYPES and imatrix is None:
        raise UserError(f"{ftype} needs an importance matrix (llama-quantize refuses it without one): make one with "
                        "`moestream imatrix -m IN -f TEXT` and pass --imatrix FILE")
    im = None
    if imatrix is not None:
        from ..quant.imatrix import read_imatrix
        im = read_imatrix(imatrix)
    out = Path(out)
    check_writable(out, "OUT", new=True, parents=True)       # write_gguf makes the folders OUT needs
    override_types = tuple(ENCODERS) + FLOAT      # what --output-tensor-type / --token-embedding-type may name
    overrides = {k: parse_type(v, override_types) for k, v in
                 (("output_type", output_type), ("token_embd_type", token_embd_type)) if v is not None}
    quantized = quantized_tensors(model)
    if quantized and not allow_requantize:
        kinds = ", ".join(sorted(set(quantized.values())))
        raise UserError(f"{model!r} is already quantized ({kinds}); requantizing loses accuracy: quantize the F16/"
                        "BF16 model, or pass --allow-requantize")
    device = resolve_device(device)
    source = open_source(model)
    mix = Mix.for_config(source.config, ftype, pure=pure, has_imatrix=im is not None, **overrides)
    from ..loading.gguf_write import write_gguf
    from ..arch.names import gguf_name, gguf_tensors
    extra = {}
    if im is not None:
        check_imatrix(im, imatrix, [(gguf_name(source.config, n), s, mix.type(n, s))
                                    for n, s in gguf_tensors(source.config)], ftype)
        extra = {"quantize.imatrix.file": str(imatrix), "quantize.imatrix.entries_count": len(im.sums),
                 "quantize.imatrix.chunks_count": im.chunk_count}
        if im.datasets:
            extra["quantize.imatrix.dataset"] = im.datasets[0]
    path = write_gguf(source, out, types=mix.type, file_type=mix.file_type, device=device, progress=progress, new=True,
                      importance=im.importance if im is not None else None, extra_kv=extra)
    summary: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for name, shape in gguf_tensors(source.config):
        t = mix.type(name, shape)
        summary[t.name][0] += 1
        summary[t.name][1] += tensor_bytes(t, shape)
    return path, mix, dict(summary)


def check_imatrix(im, path, tensors: list[tuple[str, tuple[int, ...], object]], ftype: str) -> None:
    """Refuse, before any work, an imatrix that lacks a tensor whose type needs one, or whose entry is not that
    tensor's shape (llama-quantize's checks: its columns, times the experts for a stack)."""
    for name, shape, qtype in tensors:
        if name not in im.sums:
            if qtype in REQUIRES_IMATRIX and name not in ("token_embd.weight", "output.weight"):
                raise UserError(f"importance matrix {str(path)!r} has no entry for {name}, which {ftype} quantizes to "
                                f"{qtype.name}: it was made for another model; make one for IN with "
                                "`moestream imatrix -m IN -f TEXT`")
            continue
        want = (shape[0] if len(shape) == 3 else 1, shape[-1])
        if im.sums[name].shape != want and not (im.legacy and im.sums[name].size == want[0] * want[1]):
            raise UserError(f"importance matrix {str(path)!r} has {im.sums[name].size} values for {name}, which "
                            f"takes {want[0] * want[1]} ({want[0]} x {want[1]}): it was made for another model")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Quantize a model (a Hugging Face directory, a GGUF or synth:SPEC) to a GGUF file, with "
                     f"llama-quantize's type mixes. Types: {', '.join(FTYPES)}.")
    p.add_argument("model", metavar="IN", help="HF directory, .gguf file or synth:SPEC")
    p.add_argument("out", metavar="OUT", help="the .gguf file to write (must not exist)")
    p.add_argument("ftype", metavar="TYPE", help=f"file type: {', '.join(FTYPES)}")
    p.add_argument("nthreads", metavar="NTHREADS", type=int, nargs="?", default=0,
                   help="CPU threads (default: torch's)")
    p.add_argument("--allow-requantize", action="store_true",
                   help="allow an IN whose tensors are already quantized (they are dequantized first)")
    p.add_argument("--output-tensor-type", metavar="T", help="type of output.weight (e.g. q8_0, q6_k, f16)")
    p.add_argument("--token-embedding-type", metavar="T", help="type of token_embd.weight")
    p.add_argument("--pure", action="store_true", help="every quantized tensor of TYPE's type, no mix")
    p.add_argument("--imatrix", metavar="FILE",
                   help="importance matrix (llama-imatrix's GGUF or .dat; `moestream imatrix` writes one): needed "
                        f"for {', '.join(IQ_FTYPES)}")
    p.add_argument("--device", default="auto", help="where to quantize: auto (CUDA when there is one), cpu, cuda")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.nthreads < 0:
        raise UserError(f"NTHREADS must be positive, got {args.nthreads}")
    if args.nthreads:
        import torch
        torch.set_num_threads(args.nthreads)
    path, mix, summary = quantize_model(args.model, args.out, args.ftype, allow_requantize=args.allow_requantize,
                                        output_type=args.output_tensor_type,
                                        token_embd_type=args.token_embedding_type, pure=args.pure,
                                        device=args.device, imatrix=args.imatrix)
    total = sum(b for _, b in summary.values())
    mix_text = ", ".join(f"{n} x {t}" for t, (n, _) in sorted(summary.items(), key=lambda kv: -kv[1][1]))
    print(f"wrote {path}: {mix.ftype}, {total / 2**30:.2f} GiB of tensors ({mix_text}); "
          f"file {path.stat().st_size / 1e9:.2f} GB")
    return 0
