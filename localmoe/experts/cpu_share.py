"""The CPU's share of an offloaded long prompt piece (issue #29's "use both"): while the GPU stages and computes a
layer's other experts, a worker thread computes some absent experts' SwiGLU MLPs on the CPU from their host master
copies, and their rows are copied into the piece's slot rows before the tokens' sums.

`Staging.cpu_share` (experts/staging.py `cpu_experts`) picks the experts: the last share of the layer's absent ones
by id, a choice that needs no routing, so the layer ahead is staged without them. `DensePath._grouped` starts the
job before its spans and puts the rows after them. Plain experts only: dequantizing 4-bit experts on the CPU costs
~100x an expert's PCIe time. `bench/cpu_misses.py` bounds the gain (bf16 at 2048 tokens, 16 cores: 1.29x, before the
copies and the host sync this path adds).

Imports: torch and the standard library.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

_POOL: ThreadPoolExecutor | None = None  # one worker: torch's CPU matmuls use every core themselves


class CpuRows:
    """The rows of `experts` (ascending) in a piece's slots sorted by expert, computed on the CPU in the background.

    x [T, H] the piece's hidden states (any device), order [T*k] the slots sorted by expert (slot t*k + j: token t's
    j-th expert), end [E] each expert's group end in that order (on the host), master: the layer's ExpertWeights in
    host memory, act_fn the experts' activation. One host sync (the copies of x and order)."""

    def __init__(self, x: torch.Tensor, order: torch.Tensor, end: list[int], k: int, experts, master, act_fn):
        global _POOL
        self.spans = [(e, end[e - 1] if e else 0, end[e]) for e in experts]
        self.spans = [(e, a, b) for e, a, b in self.spans if b > a]
        self.experts = len(self.spans)
        self.future: Future | None = None
        if not self.spans:
            return
        x_host, order_host = x.to("cpu"), order.to("cpu")
        if _POOL is None:
            _POOL = ThreadPoolExecutor(1, thread_name_prefix="localmoe-cpu-experts")
        self.future = _POOL.submit(self._run, x_host, order_host, k, master, act_fn)

    def _run(self, x: torch.Tensor, order: torch.Tensor, k: int, master, act_fn) -> torch.Tensor:
        outs = []
        with torch.inference_mode():
            for e, a, b in self.spans:
                xs = x[order[a:b] // k]  # [n, H]
                g = act_fn(xs @ master.w_gate[e].T)
                h = g * (xs @ master.w_up[e].T)
                outs.append(h @ master.w_down_t[e])
        return torch.cat(outs)

    def put(self, y: torch.Tensor) -> None:
        """y[their slots] = the rows (waits for the worker; y [T*k, H] on the piece's device)."""
        if self.future is None:
            return
        rows = self.future.result()
        at = torch.cat([torch.arange(a, b) for _, a, b in self.spans]).to(y.device, non_blocking=True)
        y[at] = rows.to(device=y.device, dtype=y.dtype, non_blocking=True)
