"""Round-to-nearest-even casts for Triton kernels that must reproduce torch's dtype round trips exactly.

`round_to(x, DT)` returns fp32 x rounded to dtype DT's precision (still fp32). For bf16 it rounds with integer
bit arithmetic: on the GPU this equals `x.to(tl.bfloat16)` (RTNE), and under TRITON_INTERPRET=1 it avoids the
interpreter's fp32 -> bf16 cast, which truncates. Store the result with `.to(DT)` (exact, so truncation is moot).
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

if triton is not None:

    @triton.jit
    def round_to(x, DT: tl.constexpr):
        if DT == tl.bfloat16:
            b = x.to(tl.uint32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
            return b.to(tl.float32, bitcast=True)
        elif DT == tl.float32:
            return x
        else:
            return x.to(DT).to(tl.float32)
