"""localmoe's dense decode path for routed experts (the "localmoe dense" baseline of the sparse kernels).

Owns `dense_experts` (Triton launcher), its torch reference `dense_experts_ref`, and one fused kernel
`_dense_experts_kernel`:

    grid (T*k, ceil(I / BLOCK_N)); program (tj, b) reads neurons [b*BLOCK_N, (b+1)*BLOCK_N) of expert
    e = expert_ids[tj]: gate and up rows in one sweep over H (h_n = w[tj] * silu(x.W_gate[e,n]) * (x.W_up[e,n]),
    fp32), then the same neurons' W_down_t rows, atomically adding sum_n h_n W_down_t[e, n, :] into y[t]
    (fp32, zeroed by the launcher).

One launch (plus a memset), every weight byte of the k routed experts read once, no host sync: graph
capturable. Meant for small T (decode); for prefill use a grouped GEMM.

Shape legend: T = tokens, k = experts per token, E = experts, I = expert width, H = hidden.
Weight layout (expert store contract): w_gate, w_up, w_down_t [E, I, H], rows contiguous, any expert stride.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def dense_experts_ref(x, w_gate, w_up, w_down_t, expert_ids, weights):
    """Reference in fp32 torch: y [T,H] = sum_j w[t,j] (silu(x W_gate[e]^T) * (x W_up[e]^T)) W_down_t[e]."""
    eid = expert_ids.long()
    xf = x.float()
    gz = torch.einsum("th,tkih->tki", xf, w_gate[eid].float())
    uz = torch.einsum("th,tkih->tki", xf, w_up[eid].float())
    h = torch.nn.functional.silu(gz) * uz * weights.float().unsqueeze(-1)
    return torch.einsum("tki,tkih->th", h, w_down_t[eid].float())


if triton is not None:

    @triton.jit
    def _dense_experts_kernel(
        x_ptr,  # [T, H]
        wg_ptr,  # [E, I, H]
        wu_ptr,  # [E, I, H]
        wd_ptr,  # [E, I, H]
        eid_ptr,  # [T*k]
        rw_ptr,  # [T*k]
        y_ptr,  # [T, H] fp32, zeroed
        H,
        I,
        K,
        stride_xt,
        stride_ge,
        stride_ue,
        stride_de,
        BLOCK_N: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        pid_tj = tl.program_id(0)
        pid_n = tl.program_id(1)
        t = pid_tj // K
        e = tl.load(eid_ptr + pid_tj).to(tl.int64)
        rw = tl.load(rw_ptr + pid_tj).to(tl.float32)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = rows < I
        rows64 = rows.to(tl.int64)[:, None] * H
        cols = tl.arange(0, BLOCK_H)
        x_base = x_ptr + t.to(tl.int64) * stride_xt
        acc_g = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_H], dtype=tl.float32)
        wg_base = wg_ptr + e * stride_ge + rows64
        wu_base = wu_ptr + e * stride_ue + rows64
        for h0 in range(0, H, BLOCK_H):
            c = h0 + cols
            cmask = c < H
            m2 = valid[:, None] & cmask[None, :]
            xv = tl.load(x_base + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
            acc_g += tl.load(wg_base + c[None, :], mask=m2, other=0.0).to(tl.float32) * xv
            acc_u += tl.load(wu_base + c[None, :], mask=m2, other=0.0).to(tl.float32) * xv
        z = tl.sum(acc_g, axis=1)
        h = z / (1.0 + tl.exp(-z)) * tl.sum(acc_u, axis=1) * rw  # [BLOCK_N]
        wd_base = wd_ptr + e * stride_de + rows64
        y_base = y_ptr + t.to(tl.int64) * H
        for h0 in range(0, H, BLOCK_H):
            c = h0 + cols
            cmask = c < H
            dv = tl.load(wd_base + c[None, :], mask=valid[:, None] & cmask[None, :], other=0.0)
            tl.atomic_add(y_base + c, tl.sum(dv.to(tl.float32) * h[:, None], axis=0), mask=cmask, sem="relaxed")


def dense_experts(
    x,
    w_gate,
    w_up,
    w_down_t,
    expert_ids,
    weights,
    out=None,
    *,
    BLOCK_N: int = 8,
    BLOCK_H: int = 512,
    num_warps: int = 4,
):
    """y [T,H] fp32 = sum_j weights[t,j] * expert_{expert_ids[t,j]}(x[t]) with SwiGLU experts, all neurons.

    x [T,H], w_gate/w_up/w_down_t [E,I,H] (bf16/fp16/fp32, rows contiguous), expert_ids [T,k] int32/int64,
    weights [T,k] any float. `out` [T,H] fp32 is zeroed and filled in place.
    """
    if triton is None:
        raise RuntimeError("dense_experts needs triton")
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got shape {tuple(x.shape)}")
    T, H = x.shape
    if w_gate.dim() != 3:
        raise ValueError(f"w_gate must be [E, I, H], got shape {tuple(w_gate.shape)}")
    E, I, _ = w_gate.shape
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down_t", w_down_t)):
        if w.dim() != 3 or tuple(w.shape) != (E, I, H):
            raise ValueError(f"{name} must have shape [E, I, H] = {(E, I, H)}, got {tuple(w.shape)}")
        if w.stride(2) != 1 or (I > 1 and w.stride(1) != H):
            raise ValueError(f"{name} rows must be contiguous (stride(2) == 1, stride(1) == H); got {w.stride()}")
        if w.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} must be bf16/fp16/fp32, got {w.dtype}")
        if w.device != x.device:
            raise ValueError(f"{name} is on {w.device}, x is on {x.device}")
    if x.dtype not in _FLOAT_DTYPES or x.stride(1) != 1:
        raise ValueError(f"x must be bf16/fp16/fp32 with a contiguous last dim, got {x.dtype} strides {x.stride()}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != T or expert_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert_ids must be int32/int64 [T, k], got {expert_ids.dtype} {tuple(expert_ids.shape)}")
    k = expert_ids.shape[1]
    if tuple(weights.shape) != (T, k) or not weights.dtype.is_floating_point:
        raise ValueError(f"weights must be a float [T, k] = {(T, k)} tensor, got {weights.dtype} {tuple(weights.shape)}")
    if expert_ids.device != x.device or weights.device != x.device:
        raise ValueError("expert_ids and weights must be on x's device")
    if out is None:
        out = torch.empty(T, H, dtype=torch.float32, device=x.device)
    elif tuple(out.shape) != (T, H) or out.dtype != torch.float32 or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"out must be a contiguous fp32 [T, H] = {(T, H)} tensor on {x.device}")
    out.zero_()
    if T == 0 or k == 0:
        return out
    bn = min(BLOCK_N, triton.next_power_of_2(I))
    bh = min(BLOCK_H, triton.next_power_of_2(H))
    _dense_experts_kernel[(T * k, triton.cdiv(I, bn))](
        x, w_gate, w_up, w_down_t, expert_ids.contiguous(), weights.contiguous(), out, H, I, k, x.stride(0),
        w_gate.stride(0), w_up.stride(0), w_down_t.stride(0),
        BLOCK_N=bn, BLOCK_H=bh, num_warps=num_warps,
    )
    return out
