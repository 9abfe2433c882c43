"""L2 prefetch of weights a later kernel of the decode step reads, issued while latency-bound kernels leave the
memory bandwidth idle.

Owns `l2_prefetch` (launcher), its reference `l2_prefetch_ref` (nothing observable: a prefetch only moves bytes
into the L2 cache) and one kernel `_l2_prefetch_kernel`, grid (cdiv(chunks, BLOCK),): each thread issues one
`cp.async.bulk.prefetch.L2` (Hopper's bulk copy engine, sm_90+) of up to CHUNK bytes of the tensor and moves on:
nothing waits for the bytes. Then the kernel waits for the kernel before it (PDL) so the chain of waits stays
transitive (kernels/pdl.py): the prefetch runs during the previous kernels, the wait costs the next one nothing.

At batch 1 much of the step is latency-bound (the DeltaNet step, the MoE front, the experts' gate pass): HBM is
idle for microseconds at a time. The projection after such a kernel (DeltaNet's out_proj, attention's o_proj) can
then read its weights from L2 instead of HBM.

No-op where it cannot run: not CUDA, compute capability < 9, the interpreter, or LOCALMOE_PREFETCH=0.
Shape legend: nbytes = bytes of the tensor prefetched (a prefix when `max_bytes` is given).
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl

    from localmoe.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_kw
except ImportError:  # pragma: no cover
    triton = None
    tl = None

def l2_prefetch_ref(t: torch.Tensor, max_bytes: int | None = None) -> None:
    """What a prefetch computes: nothing (it changes only what the L2 cache holds)."""
    return None


if triton is not None:

    @triton.jit
    def _l2_prefetch_kernel(base, nbytes, BLOCK: tl.constexpr, CHUNK_B: tl.constexpr, EVICT_LAST: tl.constexpr,
                            AFTER_WAIT: tl.constexpr, PDL: tl.constexpr):
        # base: the tensor's address as int64; nbytes: bytes from base to prefetch (16-byte multiple)
        if PDL:
            if AFTER_WAIT:  # issue once the kernel before is done (its bandwidth is free), then let the next run
                gdc_wait()
                gdc_launch_dependents()
        offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK_B  # [BLOCK] chunk starts
        on = (offs < nbytes).to(tl.int32)
        size = tl.minimum(nbytes - offs, CHUNK_B).to(tl.int32)
        if EVICT_LAST:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; .reg .b64 pol; setp.ne.b32 p, $3, 0; "
                "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
                "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }",
                "=r,l,r,r", [base + offs, size, on], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                "=r,l,r,r", [base + offs, size, on], dtype=tl.int32, is_pure=False, pack=1)
        if PDL:
            if not AFTER_WAIT:
                gdc_launch_dependents()
                gdc_wait()  # complete only after the kernel before: later kernels' waits stay transitive


@functools.lru_cache(maxsize=None)
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(t: torch.Tensor) -> bool:
    """Whether `l2_prefetch` does anything for tensor t's device."""
    return (triton is not None and t.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
            and os.environ.get("LOCALMOE_PREFETCH", "1") != "0" and _capable(t.device.index or 0))


def l2_prefetch(t: torch.Tensor, max_bytes: int | None = None, *, evict_last: bool = False, after_wait: bool = True,
                chunk: int = 4096, num_warps: int = 1) -> None:
    """Start moving t's bytes (or its first `max_bytes`) into L2; returns at once, nothing waits for the bytes.
    One bulk prefetch of `chunk` bytes per thread, 32 * num_warps per program, the programs spread over the SMs
    (one SM's bulk-copy unit alone moved ~0.4 TB/s). `after_wait`: issue once the kernel before has finished (its
    bandwidth is free), else before it. t must be contiguous (a weight). No host sync: capturable. A no-op where
    `enabled(t)` is False."""
    if not t.is_contiguous():
        raise ValueError("l2_prefetch needs a contiguous tensor")
    if not enabled(t):
        return
    nbytes = t.numel() * t.element_size()
    if max_bytes is not None:
        nbytes = min(nbytes, max(0, int(max_bytes)))
    nbytes -= nbytes % 16
    if nbytes == 0 or t.data_ptr() % 16:
        return
    block = 32 * num_warps
    chunks = triton.cdiv(nbytes, chunk)
    _l2_prefetch_kernel[(triton.cdiv(chunks, block),)](t.data_ptr(), nbytes, BLOCK=block, CHUNK_B=chunk,
                                                       EVICT_LAST=evict_last, AFTER_WAIT=after_wait,
                                                       num_warps=num_warps, **pdl_kw(t))
