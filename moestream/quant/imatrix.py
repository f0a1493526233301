"""Importance matrices in llama.cpp's files: the GGUF format llama-imatrix writes (b11549) and its legacy .dat.

    im = Imatrix(sums={"blk.0.ffn_down_exps.weight": s}, counts={...}, datasets=["wiki.txt"], chunk_count=4,
                 chunk_size=512)          # s (n_mat, n): per matrix (one, or one per expert) the sum of x^2 by column
    write_imatrix("imatrix.gguf", im)
    im = read_imatrix("imatrix.gguf")     # or a .dat
    im.importance("blk.0.ffn_down_exps.weight")   # (n_mat, n) float32: what llama-quantize hands its quantizers

The GGUF file: general.type "imatrix", imatrix.datasets (strings), imatrix.chunk_count and imatrix.chunk_size
(u32), and per weight matrix NAME the F32 tensors NAME.in_sum2 (n_mat rows of the column sums of squared
activations), NAME.counts (n_mat rows of 1: the activations counted; for an expert stack, the tokens routed to each
expert) and NAME.in_sum (the plain sums). llama-imatrix also writes NAME.stats (12 derived statistics that
llama-quantize does not read): not written here. The importance is in_sum2 / counts per matrix, 1 for a matrix that
saw no token, as llama-quantize's load_imatrix computes it; a .dat holds sums already scaled as (sum / count) *
ncall, divided by ncall on reading.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError

SUFFIXES = (".in_sum2", ".counts", ".in_sum")
KEYS = ("imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size")


@dataclass
class Imatrix:
    sums: dict[str, np.ndarray]                 # name -> (n_mat, n) sums of x^2 (a .dat's: already normalised)
    counts: dict[str, np.ndarray]               # name -> (n_mat,) activations counted (a .dat's: ncall)
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    in_sum: dict[str, np.ndarray] = field(default_factory=dict)      # name -> (n_mat, n) sums of x
    legacy: bool = False

    def importance(self, name: str) -> torch.Tensor | None:
        """(n_mat, n) float32 per-column importance of weight `name`, or None when the file has no entry."""
        if name not in self.sums:
            return None
        s, c = self.sums[name].astype(np.float64), self.counts[name].astype(np.float64)
        if self.legacy:
            out = s / c[:, None] if c[0] > 0 else s
        else:
            out = np.where(c[:, None] > 0, s / np.where(c > 0, c, 1)[:, None], 1.0)
        return torch.from_numpy(out.astype(np.float32))


def _damaged(path, why: str) -> UserError:
    return UserError(f"importance matrix {str(path)!r} is damaged or not one ({why}); make it again with "
                     "`moestream imatrix` or llama-imatrix")


def read_imatrix(path: str | os.PathLike) -> Imatrix:
    """A GGUF imatrix, or a legacy .dat (any file that does not start with GGUF's magic); a one-line UserError for a
    missing, damaged or foreign file."""
    path = Path(path)
    try:
        head = path.open("rb").read(4)
    except OSError as e:
        raise UserError(f"cannot read importance matrix {str(path)!r}: {e.strerror}") from None
    im = _read_gguf(path) if head == b"GGUF" else _read_dat(path)
    bad = [n for n, s in im.sums.items() if not np.isfinite(s).all()]
    if bad:
        raise _damaged(path, f"non-finite values in {bad[0]}")
    if not im.sums:
        raise _damaged(path, "no entries")
    return im


def _read_gguf(path: Path) -> Imatrix:
    import gguf
    try:
        r = gguf.GGUFReader(path)
    except Exception as e:              # gguf raises ValueError, struct errors, IndexError on a cut file
        raise _damaged(path, f"{type(e).__name__}: {e}") from None
    missing = [k for k in KEYS if k not in r.fields]
    if missing:
        raise _damaged(path, f"no {missing[0]} key: a model, not an imatrix?")
    f = r.fields
    datasets = [bytes(f["imatrix.datasets"].parts[i]).decode("utf-8", "replace") for i in f["imatrix.datasets"].data]
    tensors = {t.name: t for t in r.tensors}
    sums, counts, in_sum = {}, {}, {}
    for tname, t in tensors.items():
        if not tname.endswith(".in_sum2"):
            continue
        name = tname[:-len(".in_sum2")]
        c = tensors.get(name + ".counts")
        if c is None:
            raise _damaged(path, f"{name} has in_sum2 but no counts")
        if t.tensor_type != gguf.GGMLQuantizationType.F32 or c.tensor_type != gguf.GGMLQuantizationType.F32:
            raise _damaged(path, f"{name}'s sums and counts must be F32")
        n_mat = int(np.prod(c.shape))
        if n_mat == 0 or t.n_elements % n_mat:
            raise _damaged(path, f"{name}: {t.n_elements} sums for {n_mat} counts")
        sums[name] = np.array(t.data, dtype=np.float32).reshape(n_mat, -1)
        counts[name] = np.rint(np.array(c.data, dtype=np.float32).reshape(n_mat))
        s1 = tensors.get(name + ".in_sum")
        if s1 is not None and s1.n_elements == t.n_elements:
            in_sum[name] = np.array(s1.data, dtype=np.float32).reshape(n_mat, -1)
    return Imatrix(sums, counts, datasets, int(f["imatrix.chunk_count"].parts[-1][0]),
                   int(f["imatrix.chunk_size"].parts[-1][0]), in_sum)


def _read_dat(path: Path) -> Imatrix:
    """llama.cpp's legacy format: int32 n_entries, then per entry int32 len, name, int32 ncall, int32 nval, nval
    float32; then optionally int32 chunk count and int32 len + the dataset name."""
    data = path.read_bytes()
    pos = 0

    def take(fmt: str):
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(data):
            raise _damaged(path, f"it ends at byte {len(data)}, inside an entry")
        out = struct.unpack_from(fmt, data, pos)
        pos += size
        return out

    n_entries, = take("<i")
    if n_entries < 1 or n_entries > len(data) // 12:
        raise _damaged(path, "neither GGUF nor a legacy .dat")
    sums, counts = {}, {}
    for _ in range(n_entries):
        n, = take("<i")
        if n < 1 or n > 4096:
            raise _damaged(path, "a bad name length")
        name = take(f"<{n}s")[0].decode("utf-8", "replace")
        ncall, nval = take("<ii")
        if nval < 1:
            raise _damaged(path, f"{name} has {nval} values")
        sums[name] = np.array(take(f"<{nval}f"), dtype=np.float32).reshape(1, nval)
        counts[name] = np.array([ncall], dtype=np.float64)
    chunk_count, datasets = 0, []
    if pos + 4 <= len(data):
        chunk_count, = take("<i")
        if pos + 4 <= len(data):
            n, = take("<i")
            if 0 < n <= len(data) - pos:
                datasets.append(take(f"<{n}s")[0].decode("utf-8", "replace"))
    return Imatrix(sums, counts, datasets, chunk_count, 0, legacy=True)


def write_imatrix(path: str | os.PathLike, im: Imatrix) -> Path:
    """Write `im` as llama-imatrix's GGUF (names sorted, as it sorts them), atomically: nothing at `path` until done."""
    import gguf
    from ..outputs import atomic_path
    path = Path(path)
    with atomic_path(path) as tmp:
        w = gguf.GGUFWriter(tmp, arch="imatrix")
        w.kv_data[0].pop("general.architecture", None)      # llama-imatrix's file names no architecture
        w.add_type("imatrix")
        w.add_array("imatrix.datasets", list(im.datasets) or [""])    # gguf writes no empty array
        w.add_uint32("imatrix.chunk_count", im.chunk_count)
        w.add_uint32("imatrix.chunk_size", im.chunk_size)
        for name in sorted(im.sums):
            s = np.ascontiguousarray(im.sums[name], dtype=np.float32)
            w.add_tensor(name + ".in_sum2", s)
            w.add_tensor(name + ".counts", np.asarray(im.counts[name], dtype=np.float32).reshape(-1, 1))
            if name in im.in_sum:
                w.add_tensor(name + ".in_sum", np.ascontiguousarray(im.in_sum[name], dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return path
