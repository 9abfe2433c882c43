"""A decoder layer's last step for one decode token when its MoE output was summed in fp32: y = residual + acc,
rounded once to the residual's dtype, and acc zeroed for the next user, in one launch.

DeaMoE's fused front (localmoe/experts/departments.py `tail=`): kernels/moe_front.py adds the shared expert into an
fp32 row of the experts' workspace, kernels/department_experts.py adds the departments' output into the same row
(`accumulate=True`) and publishes the layer's output from its down kernel's last program; this kernel is the same
publish for a step with no department slot (and the reference of that tail): the layer's output written and the row
left zeroed, as sparse_fused's tail does for the vanilla experts (the workspace is shared by every layer).

Grid (T, cdiv(H, BLOCK)). Shapes: acc [T, H] fp32 contiguous, residual [T, H] any float dtype, last dim contiguous.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    from localmoe.kernels.rounding import round_to
except ImportError:  # pragma: no cover
    triton = None
    tl = None

BLOCK = 1024


def residual_publish_ref(acc: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """(residual + acc) in fp32, rounded to residual's dtype; acc zeroed in place."""
    y = (residual.float() + acc).to(residual.dtype)
    acc.zero_()
    return y


if triton is not None:

    @triton.jit
    def _residual_publish_kernel(acc_ptr, r_ptr, y_ptr, H, stride_r, stride_y, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = cols < H
        a = tl.load(acc_ptr + t * H + cols, mask=m, other=0.0)
        r = tl.load(r_ptr + t * stride_r + cols, mask=m, other=0.0)
        DT = y_ptr.dtype.element_ty
        tl.store(y_ptr + t * stride_y + cols, round_to(r.to(tl.float32) + a, DT).to(DT), mask=m)
        tl.store(acc_ptr + t * H + cols, tl.zeros((BLOCK,), dtype=tl.float32), mask=m)


def residual_publish(acc: torch.Tensor, residual: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """y [T, H] = residual + acc in residual's dtype (into `out` when given), acc [T, H] fp32 zeroed; one launch."""
    if triton is None:
        raise RuntimeError("residual_publish needs triton")
    if residual.dim() != 2 or residual.stride(1) != 1 or not residual.dtype.is_floating_point:
        raise ValueError(
            f"residual must be a float [T, H] tensor with a contiguous last dim, got {tuple(residual.shape)}"
        )
    T, H = residual.shape
    if tuple(acc.shape) != (T, H) or acc.dtype != torch.float32 or not acc.is_contiguous():
        raise ValueError(f"acc must be a contiguous fp32 [T, H] = {(T, H)} tensor, got {acc.dtype} {tuple(acc.shape)}")
    if acc.device != residual.device:
        raise ValueError(f"acc is on {acc.device}, residual on {residual.device}")
    if out is None:
        out = torch.empty_like(residual)
    elif tuple(out.shape) != (T, H) or out.dtype != residual.dtype or out.stride(1) != 1 or out.device != acc.device:
        raise ValueError(f"out must be a [T, H] = {(T, H)} tensor of {residual.dtype} with a contiguous last dim")
    _residual_publish_kernel[(T, triton.cdiv(H, BLOCK))](
        acc, residual, out, H, residual.stride(0), out.stride(0), BLOCK=BLOCK, num_warps=4
    )
    return out
