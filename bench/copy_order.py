"""When a small host array queued on the compute stream reaches the device: by copy call or by kernel
(kernels/host_arrays.py), in the prompt path's order. The `arrays` suite of bench/gpu.sh runs it.

    python bench/copy_order.py [--rows 900] [--row-mib 2.25] [-r 3]

The copy stream gets a layer's missed experts (100 rows); the compute stream waits for them and queues a 4 KB
array and a kernel that reads it; then the copy stream gets the next layer's experts (the other rows), as the
slot pool copies them (a batch call a piece of 13 rows). Printed: how long after the first copies had landed the
array was there, and whether the later copies were still running then.
"""
import argparse
import time

import numpy as np
import torch

from moestream.kernels import host_arrays
from moestream.kernels.batch_copy import batch_copy, batch_copy_available

ap = argparse.ArgumentParser()
ap.add_argument("--rows", type=int, default=900)
ap.add_argument("--row-mib", type=float, default=2.25)      # a Qwen3-Next Q4_K_M expert's slot
ap.add_argument("-r", type=int, default=3)
ns = ap.parse_args()
dev = torch.device("cuda", torch.cuda.current_device())
row, E, DEMAND, PIECE = int(ns.row_mib * (1 << 20)) // 16 * 16, ns.rows, 100, 13
src = torch.empty(E, row, dtype=torch.uint8, pin_memory=True)
dst = torch.empty(E, row, dtype=torch.uint8, device=dev)
side = torch.cuda.Stream()
print(torch.cuda.get_device_name(dev), f"{E} rows of {row} bytes, batch calls: {batch_copy_available(dev)}")


def copies(a: int, b: int) -> torch.cuda.Event:
    """Rows [a, b) on the copy stream, a piece at a time; an event after them."""
    with torch.cuda.stream(side):
        at = np.arange(a, b, dtype=np.uint64) * np.uint64(row)
        to, frm = np.uint64(dst.data_ptr()) + at, np.uint64(src.data_ptr()) + at
        for i in range(0, b - a, PIECE):
            if batch_copy_available(dev):
                batch_copy(to[i:i + PIECE], frm[i:i + PIECE], row, side)
            else:
                dst[a + i:min(a + i + PIECE, b)].copy_(src[a + i:min(a + i + PIECE, b)], non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
    return ev


def by_copy_call(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a).pin_memory().to(dev, non_blocking=True)


array = np.arange(512, dtype=np.int64)
host_arrays.upload(array, dev).sum()                 # compiled, and every kernel loaded, before any clock
by_copy_call(array).sum()
for _ in range(ns.r):
    for how, up in (("kernel", lambda a: host_arrays.upload(a, dev)), ("copy call", by_copy_call)):
        torch.cuda.synchronize()
        demand = copies(0, DEMAND)
        torch.cuda.current_stream().wait_event(demand)
        total = up(array).sum()
        there = torch.cuda.Event()
        there.record()
        later = copies(DEMAND, E)
        demand.synchronize()
        t0 = time.perf_counter()
        there.synchronize()
        t1 = time.perf_counter()
        running = not later.query()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        assert total.item() == int(array.sum())
        print(f"{how:9s}: there {1e3 * (t1 - t0):6.2f} ms after the first copies; the later ones "
              f"{'still running' if running else 'done'} (all done after {1e3 * (t2 - t0):.2f} ms)")
