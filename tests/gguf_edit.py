"""A GGUF copied with some metadata keys changed, for the loaders' tests of what a file's keys say.

    bad = rewrite_gguf(path, tmp_path / "bad.gguf", {"qwen3moe.expert_count": 8, "qwen3moe.rope.freq_base": None})
"""
from __future__ import annotations

import gguf
import numpy as np
from gguf import GGUFValueType


def rewrite_gguf(src, out, change: dict) -> str:
    """A copy of the GGUF `src` at `out` with metadata keys changed ({key: value}, the value's type kept; None
    deletes the key; a new key is written as given: a list as an array, a number as uint32); returns str(out)."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(out, r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or (key in change and change[key] is None):
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(key, change.get(key, f.contents()), f.types[0], sub)
    for key, v in change.items():
        if key not in r.fields and v is not None:
            w.add_array(key, v) if isinstance(v, list) else w.add_uint32(key, v)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return str(out)
