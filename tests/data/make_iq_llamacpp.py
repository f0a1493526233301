"""Write tests/data/iq_llamacpp.json: llama.cpp b11549's own IQ quantizers on test_quantize_iq's rows (not run by tests).

    tar xzf ../shared/llamacpp/llama.cpp-b11549.tar.gz -C /tmp          # /tmp/lcu
    PYTHONPATH=. python tests/data/make_iq_llamacpp.py /tmp/lcu

ggml-quants.c is compiled alone into a shared library (a stub for the three ggml functions it links against) and
called through ctypes: quantize_iq2_xxs, _iq2_xs, _iq1_s, _iq1_m, _iq4_nl and _iq4_xs with quant_weights (the
imatrix), and IQ1_M also without.
"""
from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

STUB = """
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
void ggml_abort(const char * file, int line, const char * fmt, ...) { fprintf(stderr, "%s:%d\\n", file, line); abort(); }
size_t ggml_row_size(int t, int64_t n) { abort(); }
const char * ggml_type_name(int t) { return "?"; }
size_t ggml_type_size(int t) { abort(); }
"""
TYPES = (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ1_S, Q.IQ1_M, Q.IQ4_NL, Q.IQ4_XS)


def build(src: Path, out: Path) -> ctypes.CDLL:
    stub = out.with_suffix(".c")
    stub.write_text(STUB)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-I", src / "ggml/include", "-I", src / "ggml/src",
                    src / "ggml/src/ggml-quants.c", stub, "-o", out, "-lm"], check=True)
    return ctypes.CDLL(str(out))


def quantize(lib, x: np.ndarray, qtype: Q, qw: np.ndarray | None) -> np.ndarray:
    if qtype in (Q.IQ2_XXS, Q.IQ2_XS, Q.IQ1_S, Q.IQ1_M):
        lib.iq2xs_init_impl(ctypes.c_int(int(qtype)))
    x = np.ascontiguousarray(x, dtype=np.float32)
    block, size = GGML_QUANT_SIZES[qtype]
    out = np.zeros((x.shape[0], x.shape[1] // block * size), dtype=np.uint8)
    qw = None if qw is None else np.ascontiguousarray(qw, dtype=np.float32)
    getattr(lib, "quantize_" + qtype.name.lower())(
        x.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(x.shape[0]),
        ctypes.c_int64(x.shape[1]), None if qw is None else qw.ctypes.data_as(ctypes.c_void_p))
    return out


def main(src: str) -> None:
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from test_quantize_iq import _importance, _rows
    x, imp = _rows().numpy(), _importance().numpy()
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(Path(src), Path(tmp) / "libq.so")
        out = {t.name: [r.tobytes().hex() for r in quantize(lib, x, t, imp)] for t in TYPES}
        out["IQ1_M_no_imatrix"] = [r.tobytes().hex() for r in quantize(lib, x, Q.IQ1_M, None)]
    (Path(__file__).parent / "iq_llamacpp.json").write_text(json.dumps(out, indent=0))


if __name__ == "__main__":
    main(sys.argv[1])
