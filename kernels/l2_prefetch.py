"""L2 prefetch for the decode kernels: start reading weights a later phase of the same step needs into the GPU's L2
cache, so that phase finds them there instead of waiting on HBM.

A kernel whose programs must wait on each other (DeaMoE's down projection needs every up program's share of z,
kernels/department_experts.py) leaves HBM idle while it waits: its up phase is latency-bound, its down phase starts
late. `prefetch_l2(ptrs)` issues one `prefetch.global.L2` per pointer (a 128-byte line each: give one pointer a
line); nothing waits for it and it changes no value, so a kernel computes the same with or without it.

`l2_prefetch_ok(t)`: whether kernels launched for tensor `t` may prefetch (a CUDA device, not the interpreter, which
runs no inline PTX). Launchers pass the result as a `tl.constexpr`, so the `if PREFETCH` branches are compiled out
elsewhere. `line_elems(dtype)`: elements of that dtype in one 128-byte line.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

LINE_BYTES = 128


def l2_prefetch_ok(t: torch.Tensor) -> bool:
    """Whether kernels launched for `t`'s device may issue L2 prefetches (CUDA, not TRITON_INTERPRET=1)."""
    return t.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def line_elems(dtype: torch.dtype) -> int:
    """Elements of `dtype` in one 128-byte cache line."""
    return max(1, LINE_BYTES // torch.empty((), dtype=dtype).element_size())


if triton is not None:

    @triton.jit
    def prefetch_l2(ptrs):
        """One L2 prefetch per pointer of the block `ptrs` (fire and forget: the value returned is 0)."""
        return tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
        )
