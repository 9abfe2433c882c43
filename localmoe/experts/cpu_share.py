"""The CPU's share of an offloaded long prompt piece (issue #29's "use both"): while the GPU stages and computes a
layer's other experts, a worker thread computes some absent experts' SwiGLU MLPs on the CPU from their host master
copies, and their rows are copied into the piece's slot rows before the tokens' sums.

`Staging.cpu_share` (experts/staging.py `cpu_experts`) picks the experts: the last share of the layer's absent ones
by id, a choice that needs no routing, so the layer ahead is staged without them. `DensePath._grouped` starts the
job before its spans and puts the rows after them (`CpuRows`, after its host read of the routing; a piece with a
share takes that path, not the device path). Plain experts only: dequantizing 4-bit experts on the
CPU costs ~100x an expert's PCIe time.

How large a share (`CpuRates.share`, the default on CUDA): in a piece each expert gets m = T·k/E rows; an absent
expert costs the GPU at least its bytes over PCIe (t_pcie), the CPU its MLP on m rows (t_cpu(m) = fixed + m·row,
reading its weights from host memory and the three matmuls). The two finish together at f = t_pcie / (t_pcie +
t_cpu(m)) (`bench/cpu_misses.py`); below MIN_SHARE the host sync and the host read of the routing a share costs
take what it saves. `measure` times both once, on the machine: a pinned copy, and distinct experts' MLPs at two row
counts. Measured (H100s, 16 cores, Qwen3.5-35B-A3B bf16 at `--vram 24`, `python bench/staging_ab.py --vram 24
--cpu-share F|auto`, seven pairs on three machines): 512-token pieces (16 rows an expert) 0.99-1.05x, 1.03x on average;
1024 and 2048 (64 rows) 0.97-1.02x, 0.99x on average, the worker done before the GPU needed its rows (0.1 s waited
of 1.0 s of work): the bytes the share saves are not what bounds those pieces. So the share applies to pieces of at
most MAX_ROWS rows an expert.

Imports: torch, the standard library and localmoe.devices (the bandwidth).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from localmoe.devices import host_bandwidth

_POOL: ThreadPoolExecutor | None = None  # one worker: torch's CPU matmuls use every core themselves
MIN_SHARE = 0.08  # a balance below this takes no share
MAX_ROWS = 16  # nor does a piece with more rows an expert (module doc: 512 tokens gained, 1024 and 2048 did not)
MAX_SHARE = 0.5
MEASURED = 16  # distinct experts `measure` times at each row count (Qwen3.5-35B-A3B bf16: 96 MiB, past a CPU's caches)


def expert_mlp(xs: torch.Tensor, master, e: int, act_fn) -> torch.Tensor:
    """Expert e's SwiGLU MLP on rows xs [n, H] from the host master copy `master` (ExpertWeights): [n, H]."""
    return (act_fn(xs @ master.w_gate[e].T) * (xs @ master.w_up[e].T)) @ master.w_down_t[e]


@dataclass(frozen=True)
class CpuRates:
    """What an absent expert costs each side (seconds): PCIe for its stored bytes, and the CPU for its MLP on m rows,
    `fixed` + m·`row`."""

    pcie: float
    fixed: float
    row: float

    def share(self, rows: float) -> float:
        """The share of a layer's absent experts the CPU takes when each has `rows` rows (module doc)."""
        if rows > MAX_ROWS:
            return 0.0
        both = self.pcie + self.fixed + self.row * rows
        f = self.pcie / both if both > 0 else 0.0
        return min(MAX_SHARE, f) if f >= MIN_SHARE else 0.0


def measure(master, expert_bytes: int, device: torch.device, act_fn=F.silu) -> CpuRates:
    """The rates on this machine: pinned host-to-`device` bandwidth (64 MiB copies) for `expert_bytes` (off CUDA
    none: `pcie` 0, no share), and the MLP of MEASURED distinct experts of `master` at 8 rows, then of as many others
    at 64 (each expert read once from host memory, as a piece reads them: one expert timed again and again would run
    from the CPU's caches), after one expert to warm up."""
    bw = host_bandwidth(torch.device(device), 64 << 20, 4)
    E, H = master.w_gate.shape[0], master.w_gate.shape[-1]
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(0)).to(master.w_gate.dtype)
    n = max(1, min(MEASURED, (E - 1) // 2))

    def seconds(rows: int, first: int) -> float:
        t = time.perf_counter()
        for e in range(first, first + n):
            expert_mlp(x[:rows], master, e % E, act_fn)
        return (time.perf_counter() - t) / n

    with torch.inference_mode():
        expert_mlp(x, master, E - 1, act_fn)
        few, many = seconds(8, 0), seconds(64, n)
    row = max(0.0, (many - few) / 56)
    return CpuRates(expert_bytes / bw if bw else 0.0, max(0.0, few - 8 * row), row)  # no bandwidth: no share


def _submit(fn, *args) -> Future:
    """fn(*args) on the one CPU worker (made at first use)."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(1, thread_name_prefix="localmoe-cpu-experts")
    return _POOL.submit(fn, *args)


class CpuRows:
    """The rows of `experts` (ascending) in a piece's slots sorted by expert, computed on the CPU in the background.

    x [T, H] the piece's hidden states (any device), order [T*k] the slots sorted by expert (slot t*k + j: token t's
    j-th expert), end [E] each expert's group end in that order (on the host), master: the layer's ExpertWeights in
    host memory, act_fn the experts' activation. One host sync (the copies of x and order)."""

    def __init__(self, x: torch.Tensor, order: torch.Tensor, end: list[int], k: int, experts, master, act_fn):
        self.spans = [(e, end[e - 1] if e else 0, end[e]) for e in experts]
        self.spans = [(e, a, b) for e, a, b in self.spans if b > a]
        self.experts = len(self.spans)
        self.future: Future | None = None
        self.synced = self.busy = self.waited = 0.0  # seconds the host waited for x, the worker took, `put` waited
        if not self.spans:
            return
        t = time.perf_counter()
        x_host, order_host = x.to("cpu"), order.to("cpu")
        self.synced = time.perf_counter() - t
        self.future = _submit(self._run, x_host, order_host, k, master, act_fn)

    def _run(self, x: torch.Tensor, order: torch.Tensor, k: int, master, act_fn) -> torch.Tensor:
        t = time.perf_counter()
        with torch.inference_mode():
            rows = torch.cat([expert_mlp(x[order[a:b] // k], master, e, act_fn) for e, a, b in self.spans])
        self.busy = time.perf_counter() - t
        return rows

    def put(self, y: torch.Tensor) -> None:
        """y[their slots] = the rows (waits for the worker; y [T*k, H] on the piece's device)."""
        if self.future is None:
            return
        t = time.perf_counter()
        rows = self.future.result()
        self.waited = time.perf_counter() - t
        at = torch.cat([torch.arange(a, b) for _, a, b in self.spans]).to(y.device, non_blocking=True)
        y[at] = rows.to(device=y.device, dtype=y.dtype, non_blocking=True)
