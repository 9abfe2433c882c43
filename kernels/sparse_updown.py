"""Sparse decode, step 2 of 2: up and down projections over the kept neurons only.

Owns `sparse_updown` (Triton launcher), its torch reference `sparse_updown_ref`, and the Triton kernel
`_sparse_updown_kernel`:

    grid (T*k, ceil(C / BLOCK_N)); program (tj, b) takes kept slots [b*BLOCK_N, (b+1)*BLOCK_N) of pair tj
    (exits at once when b*BLOCK_N >= count[tj]), loads those neurons' full W_up and W_down_t rows in one go
    (full-width tiles, no serial loop over H: batch-1 decode is latency bound), computes
    h_n = w[tj] * g[tj, n] * (x[t] . W_up[e, n]) in fp32 and atomically adds sum_n h_n * W_down_t[e, n, :]
    into y[t, :] (fp32, zeroed by the launcher).

Each kept weight row is read exactly once; dropped rows are never touched. Grid and output size are fixed, no
host sync: CUDA-graph capturable (the zeroing of y is a memset inside the launcher, so a graph captures it).

Shape legend: T = tokens, k = experts per token, E = experts, I = expert width (neurons), H = hidden,
C = capacity (length of the kept-index list).
Weight layout (expert store contract): w_up [E, I, H], w_down_t [E, I, H] (W_down transposed: one neuron's
down weights are contiguous); rows contiguous, any expert stride.
"""

from __future__ import annotations

import torch

from localmoe.kernels.checks import expert_weights, tokens_and_experts

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------------------------
# torch reference
# ----------------------------------------------------------------------------------------------------------
def sparse_updown_ref(x, w_up, w_down_t, expert_ids, weights, g, idx, count):
    """Reference in fp32 torch: y [T,H] = sum_j w[t,j] sum_{n in kept} g[t,j,n] (x[t].W_up[e,n]) W_down_t[e,n]."""
    T, k = expert_ids.shape
    H = x.shape[1]
    y = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    for t in range(T):
        for j in range(k):
            e = int(expert_ids[t, j])
            rows = idx[t, j, : int(count[t, j])].long()
            if rows.numel() == 0:
                continue
            u = w_up[e, rows].float() @ x[t].float()  # [n_kept]
            h = float(weights[t, j]) * g[t, j, rows].float() * u
            y[t] += h @ w_down_t[e, rows].float()
    return y


# ----------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _sparse_updown_kernel(
        x_ptr,  # [T, H], row stride stride_xt
        wu_ptr,  # [E, I, H]
        wd_ptr,  # [E, I, H] (W_down transposed)
        eid_ptr,  # [T*k]
        rw_ptr,  # [T*k] routing weights
        g_ptr,  # [T*k, I] fp32
        idx_ptr,  # [T*k, C] int32
        cnt_ptr,  # [T*k] int32
        y_ptr,  # [T, H] fp32, zeroed
        I,
        C,
        K,
        stride_xt,
        stride_ue,
        stride_de,
        H: tl.constexpr,
        H_P2: tl.constexpr,  # next power of two >= H: full-width tiles, no serial H loop
        BLOCK_N: tl.constexpr,
    ):
        pid_tj = tl.program_id(0)
        pid_n = tl.program_id(1)
        # count and the index slots are read together (slots past count hold 0, a valid row): one round trip
        slots = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        rows = tl.load(idx_ptr + pid_tj.to(tl.int64) * C + slots, mask=slots < C, other=0)
        cnt = tl.load(cnt_ptr + pid_tj)
        if pid_n * BLOCK_N >= cnt:
            return
        t = pid_tj // K
        e = tl.load(eid_ptr + pid_tj).to(tl.int64)
        rw = tl.load(rw_ptr + pid_tj).to(tl.float32)
        valid = slots < cnt
        gv = tl.load(g_ptr + pid_tj.to(tl.int64) * I + rows, mask=valid, other=0.0)
        roff = rows.to(tl.int64)[:, None] * H  # [BLOCK_N, 1]
        cols = tl.arange(0, H_P2)
        cmask = cols < H
        m2 = valid[:, None] & cmask[None, :]
        # both tiles are issued before any arithmetic: one memory round trip for all kept bytes
        wu = tl.load(wu_ptr + e * stride_ue + roff + cols[None, :], mask=m2, other=0.0)  # [BLOCK_N, H_P2]
        wd = tl.load(wd_ptr + e * stride_de + roff + cols[None, :], mask=m2, other=0.0)  # [BLOCK_N, H_P2]
        xv = tl.load(x_ptr + t.to(tl.int64) * stride_xt + cols, mask=cmask, other=0.0).to(tl.float32)
        h = tl.sum(wu.to(tl.float32) * xv[None, :], axis=1) * gv * rw  # [BLOCK_N], 0 on invalid slots
        contrib = tl.sum(wd.to(tl.float32) * h[:, None], axis=0)  # [H_P2]
        tl.atomic_add(y_ptr + t.to(tl.int64) * H + cols, contrib, mask=cmask, sem="relaxed")


# ----------------------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------------------


def sparse_updown(
    x,
    w_up,
    w_down_t,
    expert_ids,
    weights,
    g,
    idx,
    count,
    out=None,
    *,
    accumulate: bool = False,
    BLOCK_N: int = 4,
    num_warps: int = 4,
):
    """y [T,H] fp32 = sum_j weights[t,j] sum_{n in idx[t,j,:count[t,j]]} g[t,j,n] (x[t].w_up[e,n]) w_down_t[e,n,:].

    x [T,H], w_up/w_down_t [E,I,H] (bf16/fp16/fp32), expert_ids [T,k] int32/int64, weights [T,k] any float,
    g [T,k,I] fp32, idx [T,k,C] int32, count [T,k] int32 (as returned by `sparse_gate`). `out` [T,H] fp32 is
    zeroed and filled in place; with `accumulate=True` it is not zeroed and the result is added to it (e.g.
    after `sparse_gate(..., zero_out=out)` cleared it, or onto a shared expert's output). No host sync, fixed grid.
    """
    if triton is None:
        raise RuntimeError("sparse_updown needs triton")
    T, H, E, I = tokens_and_experts(x, w_up, "w_up")
    expert_weights("w_up", w_up, E, I, H)
    expert_weights("w_down_t", w_down_t, E, I, H)
    if expert_ids.dim() != 2 or expert_ids.shape[0] != T:
        raise ValueError(f"expert_ids must be [T, k] with T = {T}, got shape {tuple(expert_ids.shape)}")
    k = expert_ids.shape[1]
    if expert_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert_ids must be int32 or int64, got {expert_ids.dtype}")
    if tuple(weights.shape) != (T, k) or not weights.dtype.is_floating_point:
        raise ValueError(f"weights must be a float [T, k] = {(T, k)} tensor, got {weights.dtype} {tuple(weights.shape)}")
    if tuple(g.shape) != (T, k, I) or g.dtype != torch.float32:
        raise ValueError(f"g must be fp32 [T, k, I] = {(T, k, I)}, got {g.dtype} {tuple(g.shape)}")
    if idx.dim() != 3 or tuple(idx.shape[:2]) != (T, k) or idx.dtype != torch.int32:
        raise ValueError(f"idx must be int32 [T, k, C], got {idx.dtype} {tuple(idx.shape)}")
    C = idx.shape[2]
    if not 1 <= C <= I:
        raise ValueError(f"idx capacity C = {C} must be in [1, I = {I}]")
    if tuple(count.shape) != (T, k) or count.dtype != torch.int32:
        raise ValueError(f"count must be int32 [T, k] = {(T, k)}, got {count.dtype} {tuple(count.shape)}")
    for name, dt in (("x", x.dtype), ("w_up", w_up.dtype), ("w_down_t", w_down_t.dtype)):
        if dt not in _FLOAT_DTYPES:
            raise ValueError(f"{name} must be bf16/fp16/fp32, got {dt}")
    if x.stride(1) != 1:
        raise ValueError("x must have a contiguous last dimension")
    dev = x.device
    for name, tns in (("w_up", w_up), ("w_down_t", w_down_t), ("expert_ids", expert_ids), ("weights", weights),
                      ("g", g), ("idx", idx), ("count", count)):
        if tns.device != dev:
            raise ValueError(f"{name} is on {tns.device}, x is on {dev}: all inputs must share a device")
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs an out= buffer")
        out = torch.empty(T, H, dtype=torch.float32, device=dev)
    elif tuple(out.shape) != (T, H) or out.dtype != torch.float32 or not out.is_contiguous() or out.device != dev:
        raise ValueError(f"out must be a contiguous fp32 [T, H] = {(T, H)} tensor on {dev}")
    if not accumulate:
        out.zero_()
    if T == 0 or k == 0:
        return out
    bn = max(1, min(triton.next_power_of_2(BLOCK_N), triton.next_power_of_2(C)))
    _sparse_updown_kernel[(T * k, triton.cdiv(C, bn))](
        x, w_up, w_down_t, expert_ids.contiguous(), weights.contiguous(), g.contiguous(), idx.contiguous(),
        count.contiguous(), out, I, C, k, x.stride(0), w_up.stride(0), w_down_t.stride(0),
        H=H, H_P2=triton.next_power_of_2(H), BLOCK_N=bn, num_warps=num_warps,
    )
    return out
