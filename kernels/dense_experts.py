"""localmoe's dense decode path for routed experts (the "localmoe dense" baseline of the sparse kernels).

Owns `dense_experts` (Triton launcher), its torch reference `dense_experts_ref`, and one fused kernel
`_dense_experts_kernel`:

    grid (T*k, ceil(I / BLOCK_N)); program (tj, b) reads neurons [b*BLOCK_N, (b+1)*BLOCK_N) of expert
    e = expert_ids[tj]: its gate, up and W_down_t rows are loaded in one go (full-width tiles, no serial loop
    over H: batch-1 decode is latency bound), h_n = w[tj] * silu(x.W_gate[e,n]) * (x.W_up[e,n]) in fp32, and
    sum_n h_n W_down_t[e, n, :] is atomically added into y[t] (fp32, zeroed by the launcher).

One launch (plus a memset), every weight byte of the k routed experts read once, no host sync: graph
capturable. Meant for small T (decode); for prefill use a grouped GEMM.

Shape legend: T = tokens, k = experts per token, E = experts, I = expert width, H = hidden.
Weight layout (expert store contract): w_gate, w_up, w_down_t [E, I, H], rows contiguous, any expert stride.
"""

from __future__ import annotations

import torch

from localmoe.kernels.checks import expert_weights, tokens_and_experts

try:
    import triton
    import triton.language as tl

    from localmoe.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_kw
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
        I,
        K,
        stride_xt,
        stride_ge,
        stride_ue,
        stride_de,
        H: tl.constexpr,
        H_P2: tl.constexpr,  # next power of two >= H: full-width tiles, no serial H loop
        BLOCK_N: tl.constexpr,
        PDL: tl.constexpr,
    ):
        if PDL:  # programmatic dependent launch (kernels/pdl.py): everything here follows the wait
            gdc_wait()
            gdc_launch_dependents()
        pid_tj = tl.program_id(0)
        pid_n = tl.program_id(1)
        t = pid_tj // K
        e = tl.load(eid_ptr + pid_tj).to(tl.int64)
        rw = tl.load(rw_ptr + pid_tj).to(tl.float32)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = rows < I
        roff = rows.to(tl.int64)[:, None] * H
        cols = tl.arange(0, H_P2)
        cmask = cols < H
        m2 = valid[:, None] & cmask[None, :]
        # all three tiles are issued before any arithmetic: one memory round trip
        wg = tl.load(wg_ptr + e * stride_ge + roff + cols[None, :], mask=m2, other=0.0)
        wu = tl.load(wu_ptr + e * stride_ue + roff + cols[None, :], mask=m2, other=0.0)
        wd = tl.load(wd_ptr + e * stride_de + roff + cols[None, :], mask=m2, other=0.0)
        xv = tl.load(x_ptr + t.to(tl.int64) * stride_xt + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        z = tl.sum(wg.to(tl.float32) * xv, axis=1)
        h = z / (1.0 + tl.exp(-z)) * tl.sum(wu.to(tl.float32) * xv, axis=1) * rw  # [BLOCK_N]
        contrib = tl.sum(wd.to(tl.float32) * h[:, None], axis=0)
        tl.atomic_add(y_ptr + t.to(tl.int64) * H + cols, contrib, mask=cmask, sem="relaxed")


def dense_experts(
    x,
    w_gate,
    w_up,
    w_down_t,
    expert_ids,
    weights,
    out=None,
    *,
    BLOCK_N: int = 4,
    num_warps: int = 8,
):
    """y [T,H] fp32 = sum_j weights[t,j] * expert_{expert_ids[t,j]}(x[t]) with SwiGLU experts, all neurons.

    x [T,H], w_gate/w_up/w_down_t [E,I,H] (bf16/fp16/fp32, rows contiguous), expert_ids [T,k] int32/int64,
    weights [T,k] any float. `out` [T,H] fp32 is zeroed and filled in place.
    """
    if triton is None:
        raise RuntimeError("dense_experts needs triton")
    T, H, E, I = tokens_and_experts(x, w_gate)
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down_t", w_down_t)):
        expert_weights(name, w, E, I, H, x.device)
    if x.dtype not in _FLOAT_DTYPES or x.stride(1) != 1:
        raise ValueError(f"x must be bf16/fp16/fp32 with a contiguous last dim, got {x.dtype} strides {x.stride()}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != T or expert_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert_ids must be int32/int64 [T, k], got {expert_ids.dtype} {tuple(expert_ids.shape)}")
    k = expert_ids.shape[1]
    if tuple(weights.shape) != (T, k) or not weights.dtype.is_floating_point:
        raise ValueError(
            f"weights must be a float [T, k] = {(T, k)} tensor, got {weights.dtype} {tuple(weights.shape)}"
        )
    if expert_ids.device != x.device or weights.device != x.device:
        raise ValueError("expert_ids and weights must be on x's device")
    if out is None:
        out = torch.empty(T, H, dtype=torch.float32, device=x.device)
    elif tuple(out.shape) != (T, H) or out.dtype != torch.float32 or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"out must be a contiguous fp32 [T, H] = {(T, H)} tensor on {x.device}")
    out.zero_()
    if T == 0 or k == 0:
        return out
    bn = max(1, min(triton.next_power_of_2(BLOCK_N), triton.next_power_of_2(I)))
    _dense_experts_kernel[(T * k, triton.cdiv(I, bn))](
        x,
        w_gate,
        w_up,
        w_down_t,
        expert_ids.contiguous(),
        weights.contiguous(),
        out,
        I,
        k,
        x.stride(0),
        w_gate.stride(0),
        w_up.stride(0),
        w_down_t.stride(0),
        H=H,
        H_P2=triton.next_power_of_2(H),
        BLOCK_N=bn,
        num_warps=num_warps,
        **pdl_kw(x),
    )
    return out
