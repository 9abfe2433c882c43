"""The timer of the kernel sweeps (GPU): median µs per call of a CUDA graph that replays a list of calls.

Imported by `tune_decode.py`, `gemv_sweep.py`, `decode_attention_sweep.py` and `block_chain.py` (run as `python
bench/<script>.py`,
so this directory is on the path). The calls run once on a side stream first (compilation, workspaces), then are
captured in order into one graph, timed with `triton.testing.do_bench` (median).
"""

from __future__ import annotations

import torch
import triton


def graph_us(calls, warmup: int = 25, rep: int = 100) -> float:
    """Median µs per call of a CUDA graph replaying `calls` (list of zero-arg callables) in order."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:  # warm-up / compile outside the graph
            c()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    torch.cuda.synchronize()
    return triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median") * 1e3 / len(calls)
