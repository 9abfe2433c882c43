"""What one kernel boundary of the decode step costs (GPU, not a test): a CUDA graph of kernels that do nothing but
the step's pattern (load, `gdc_wait()`, `gdc_launch_dependents()`, one store), timed per kernel, with and without
programmatic dependent launch, at grids of 1, 132 (one per SM on the H200) and 1056 programs; and a chain whose
kernels start on a flag the kernel before's last program sets (ticket) instead of on its grid's retirement: polled
with volatile loads then one acquire atomic per program (session 5: 11-13 µs at 132-1056 programs), or with
ld.acquire and a release-only ticket (no atomic per program but the ticket).

The decode step is ~225 launches in a chain; the time a kernel with no work takes in that chain is what each
boundary costs however fast the kernels themselves are.
Last, one launch of many phases with an in-kernel grid barrier between them (release add, ld.acquire poll; the
building block of a persistent decoder-layer kernel): the µs one such barrier costs.
Usage: PYTHONUNBUFFERED=1 python bench/boundary_cost.py [--barrier]   (--barrier: the last table only)
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from graph_timing import graph_us
from localmoe.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_kw, set_enabled


@triton.jit
def _empty_kernel(x_ptr, y_ptr, PDL: tl.constexpr):
    v = tl.load(x_ptr + tl.program_id(0))  # a "weight": before the wait
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    tl.store(y_ptr + tl.program_id(0), v + 1.0)


@triton.jit
def _ld_acquire(ptr):
    """One ld.acquire.gpu of an int32 flag (no read-modify-write: pollers do not serialise on the address)."""
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr.to(tl.int64, bitcast=True)],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _flag_kernel_lean(x_ptr, y_ptr, prev_flag, flag, tick_ptr, PROGS: tl.constexpr):
    """As _flag_kernel, with the flag polled by ld.acquire (no atomic per program) and a release-only ticket whose
    last taker acquires once."""
    v = tl.load(x_ptr + tl.program_id(0))
    gdc_launch_dependents()
    f = _ld_acquire(prev_flag)
    while f == 0:
        f = _ld_acquire(prev_flag)
    tl.store(y_ptr + tl.program_id(0), v + 1.0)
    tl.debug_barrier()
    done = tl.atomic_add(tick_ptr, 1, sem="release", scope="gpu")
    if done == PROGS - 1:
        tl.atomic_add(tick_ptr, 0, sem="acquire", scope="gpu")
        tl.store(tick_ptr, 0)
        tl.store(prev_flag, 0)
        tl.atomic_xchg(flag, 1, sem="release", scope="gpu")
    gdc_wait()


@triton.jit
def _flag_kernel(x_ptr, y_ptr, prev_flag, flag, tick_ptr, PROGS: tl.constexpr):
    """Starts on the kernel before's flag instead of its grid's retirement: spin (volatile load) until the flag is
    set, acquire; work; the last program (ticket) resets the flag it waited on and sets its own (release); every
    program then waits for the kernel before (PDL) so completion stays ordered for what follows."""
    v = tl.load(x_ptr + tl.program_id(0))
    gdc_launch_dependents()
    f = tl.load(prev_flag, volatile=True)
    while f == 0:
        f = tl.load(prev_flag, volatile=True)
    tl.atomic_add(prev_flag, 0, sem="acquire", scope="gpu")
    tl.store(y_ptr + tl.program_id(0), v + 1.0)
    tl.debug_barrier()
    done = tl.atomic_add(tick_ptr, 1, sem="acq_rel", scope="gpu")
    if done == PROGS - 1:
        tl.store(tick_ptr, 0)
        tl.store(prev_flag, 0)
        tl.atomic_xchg(flag, 1, sem="release", scope="gpu")
    gdc_wait()


@triton.jit
def _barrier_kernel(x_ptr, y_ptr, cnt_ptr, PHASES: tl.constexpr, PROGS: tl.constexpr):
    """PHASES phases in one launch, each ended by a grid-wide barrier: a release add on one counter, then an
    ld.acquire poll until every program of the phase has added (all PROGS programs must be co-resident). The counter
    is zeroed before each launch; the slope over PHASES is what one in-kernel barrier costs."""
    v = tl.load(x_ptr + tl.program_id(0))
    for p in tl.static_range(PHASES):
        tl.store(y_ptr + tl.program_id(0), v + p)
        tl.debug_barrier()
        tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
        f = _ld_acquire(cnt_ptr)
        while f < (p + 1) * PROGS:
            f = _ld_acquire(cnt_ptr)


def barrier_slope() -> None:
    """µs per in-kernel grid barrier (programs all resident): PHASES 33 against 1, in the same kind of graph."""
    x = torch.zeros(4096, device="cuda")
    y = torch.zeros(4096, device="cuda")
    cnt = torch.zeros(1, dtype=torch.int32, device="cuda")
    print("\n| programs | in-kernel barrier µs (slope over 32 phases) |\n|---:|---:|")
    for progs in (32, 132, 264):
        t = {}
        for phases in (1, 33):
            calls = [lambda: cnt.zero_(),
                     lambda ph=phases: _barrier_kernel[(progs,)](x, y, cnt, PHASES=ph, PROGS=progs, num_warps=4)]
            t[phases] = graph_us(calls * 4) * 2  # per (zero + launch)
        print(f"| {progs} | {(t[33] - t[1]) / 32:.2f} |", flush=True)


def main() -> None:
    if "--barrier" in sys.argv:
        barrier_slope()
        return
    x = torch.zeros(4096, device="cuda")
    ys = [torch.zeros(4096, device="cuda") for _ in range(12)]
    print("| programs | PDL | µs per kernel |\n|---:|---|---:|")
    for progs in (1, 132, 1056):
        for pdl in (False, True):
            set_enabled(pdl)
            us = graph_us([lambda y=y: _empty_kernel[(progs,)](x, y, num_warps=4, **pdl_kw(x)) for y in ys] * 4)
            print(f"| {progs} | {'on' if pdl else 'off'} | {us:.2f} |", flush=True)
    set_enabled(None)
    # starting on a flag set by the kernel before's last program (chains of 48; flag 0 is set before each replay)
    n = 48
    flags = torch.zeros(n + 1, dtype=torch.int32, device="cuda")
    ticks = torch.zeros(n, dtype=torch.int32, device="cuda")
    for kern, label in ((_flag_kernel, "flag"), (_flag_kernel_lean, "flag, ld.acquire poll")):
        for progs in (1, 132, 1056):
            calls = [lambda: flags[0].fill_(1)]
            calls += [lambda i=i: kern[(progs,)](x, ys[i % 12], flags[i], flags[i + 1], ticks[i], PROGS=progs,
                                                 num_warps=4, launch_pdl=True) for i in range(n)]
            calls += [lambda: flags[n].fill_(0)]
            us = graph_us(calls) * len(calls) / n
            print(f"| {progs} | {label} | {us:.2f} |", flush=True)
    barrier_slope()


if __name__ == "__main__":
    main()
