"""L2 prefetch for the decode kernels: start reading weights a later phase of the same step needs into the GPU's L2
cache, so that phase finds them there instead of waiting on HBM.

A kernel whose programs must wait on each other (DeaMoE's down projection needs every up program's share of z,
kernels/department_experts.py) leaves HBM idle while it waits: its up phase is latency-bound, its down phase starts
late. `bulk_prefetch_l2(ptr, nbytes)` has one thread of the program issue `cp.async.bulk.prefetch.L2` for a
contiguous range (Hopper's bulk copy engine fetches it; nothing waits for it and it changes no value, so a kernel
computes the same with or without it). One prefetch instruction a 128-byte line (`prefetch.global.L2`) was slower:
its requests queue with the program's own loads (bench/RESULTS.md, "Tried").

`l2_prefetch_ok(t, *ranges)`: whether kernels launched for tensor `t` may prefetch: a CUDA device of compute
capability >= 9 (the bulk instruction), not the interpreter (which runs no inline PTX), and every (tensor, bytes)
in `ranges` 16-byte aligned (the instruction's rule: address and size multiples of 16). Launchers pass the result as
a `tl.constexpr`, so the `if PREFETCH` branches are compiled out elsewhere.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None


@functools.cache
def _hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def l2_prefetch_ok(t: torch.Tensor, *ranges: tuple[torch.Tensor, int]) -> bool:
    """Whether kernels launched for `t`'s device may issue bulk L2 prefetches, of `ranges` ((tensor, a range's byte
    stride)...: each tensor's address and the stride must be multiples of 16)."""
    if not t.is_cuda or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") or not _hopper(t.device.index or 0):
        return False
    return all(w.data_ptr() % 16 == 0 and int(step) % 16 == 0 for w, step in ranges)


if triton is not None:

    @triton.jit
    def bulk_prefetch_l2(ptr, nbytes):
        """Thread 0 of the program asks the bulk copy engine to bring [ptr, ptr + nbytes) into L2 (ptr and nbytes
        multiples of 16, nbytes > 0; fire and forget: the value returned is 0)."""
        return tl.inline_asm_elementwise(
            """{
            .reg .pred p;
            .reg .b32 t;
            mov.u32 t, %tid.x;
            setp.eq.u32 p, t, 0;
            @p cp.async.bulk.prefetch.L2.global [$1], $2;
            mov.u32 $0, 0;
            }""",
            "=r,l,r",
            [ptr, nbytes],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
