"""CUDA-graph timing for the kernel benches (bench/gemv.py, bench/quant_kernels.py, bench/shared_expert.py): calls
replayed from one graph, as the engine's decode steps are, so no call pays its launch on the host.

    ms = graph_ms(lambda i: kernel(inputs[i]), n_calls=16, reps=50)     # median milliseconds of one call
"""
import statistics

import torch


def graph_ms(fn, n_calls: int, reps: int) -> float:
    """fn(0) .. fn(n_calls - 1), warmed up on a side stream (compiles and workspaces stay out of the capture), then
    captured in one CUDA graph: the median over `reps` timed replays (CUDA events) of a replay / n_calls, in ms."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(n_calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n_calls):
            fn(i)
    graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / n_calls)
    return statistics.median(times)
