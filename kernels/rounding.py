"""Round-to-nearest-even casts for Triton kernels that must reproduce torch's dtype round trips exactly.

`round_to(x, DT)` returns fp32 x rounded to dtype DT's precision (still fp32). For bf16 it rounds with integer
bit arithmetic: on the GPU this equals `x.to(tl.bfloat16)` (RTNE), and under TRITON_INTERPRET=1 it avoids the
interpreter's fp32 -> bf16 cast, which truncates. Store the result with `.to(DT)` (exact, so truncation is moot).

`add_moe_sum(r, a, DT)` is a decoder layer's output from its residual stream r and its MoE block's fp32 sum a
(shared + routed experts), each add rounded as transformers' adds round: round(r + round(a)). The experts' launch
(kernels/sparse_fused.py) applies it in its tail, or leaves the sum open for the next layer's first kernels
(kernels/gemv.py, kernels/moe_front.py, kernels/rmsnorm.py `moe_sum=`) to apply as they load their input.
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

    @triton.jit
    def add_moe_sum(r, a, DT: tl.constexpr):
        """round(r + round(a)) in DT's precision (fp32 value): r the residual stream, a the MoE block's fp32 sum."""
        return round_to(r + round_to(a, DT), DT)
