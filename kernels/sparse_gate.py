"""Sparse decode, step 1 of 2: dense gate projection + threshold mask + index compaction.

Owns `sparse_gate` (Triton launcher), its torch reference `sparse_gate_ref`, and the two Triton kernels
behind it:

* `_gate_gemv_kernel`  - grid (T*k, ceil(I / BLOCK_I)): g[t, j, n] = silu(x[t] . W_gate[e, n]) for a block of
  BLOCK_I neurons, fp32 accumulation. Many programs per expert so a batch-1 step still fills the GPU.
* `_gate_compact_kernel` - grid (T*k,): keep neuron n where |g[t, j, n]| >= tau[e]; one pass, prefix sum
  (tl.cumsum) gives each kept neuron its slot, so `idx` lists kept neurons in ascending order; padding slots
  are written with 0; count = min(#kept, C).

Both grids and all output sizes are fixed by (T, k, I, C), nothing reads data back to the host, so the whole
thing can be captured in a CUDA graph (pass `out=` buffers to keep addresses fixed).

Shape legend: T = tokens, k = experts per token, E = experts, I = expert width (neurons), H = hidden,
C = capacity (length of the kept-index list, <= I).
Weight layout (expert store contract): w_gate [E, I, H], rows contiguous (stride(2) == 1, stride(1) == H);
the expert stride may be anything (so a view of a fused [E, 2I, H] gate_up tensor works too).
"""

from __future__ import annotations

import torch

try:  # Triton is optional at import time; the launcher needs it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------------------------
# torch reference
# ----------------------------------------------------------------------------------------------------------
def sparse_gate_ref(x, w_gate, expert_ids, tau, capacity):
    """Reference in fp32 torch. Returns (g [T,k,I] fp32, idx [T,k,C] int32, count [T,k] int32)."""
    # x [T,H], w_gate [E,I,H], expert_ids [T,k], tau [E]
    T, k = expert_ids.shape
    I = w_gate.shape[1]
    C = int(capacity)
    eid = expert_ids.long()
    w = w_gate[eid].float()  # [T,k,I,H]
    g = torch.nn.functional.silu(torch.einsum("th,tkih->tki", x.float(), w))  # [T,k,I]
    keep = g.abs() >= tau.float()[eid].unsqueeze(-1)  # [T,k,I]
    idx = torch.zeros(T, k, C, dtype=torch.int32, device=x.device)
    count = torch.zeros(T, k, dtype=torch.int32, device=x.device)
    for t in range(T):
        for j in range(k):
            kept = torch.nonzero(keep[t, j]).flatten()[:C]
            idx[t, j, : kept.numel()] = kept.to(torch.int32)
            count[t, j] = kept.numel()
    return g, idx, count


# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _gate_gemv_kernel(
        x_ptr,  # [T, H] any float dtype, row stride stride_xt
        w_ptr,  # [E, I, H] rows contiguous, expert stride stride_we
        eid_ptr,  # [T*k] int32/int64
        g_ptr,  # [T*k, I] fp32 out
        H,
        I,
        K,  # experts per token
        stride_xt,
        stride_we,
        BLOCK_I: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        pid_tj = tl.program_id(0)  # one (token, slot) pair
        pid_i = tl.program_id(1)  # one block of BLOCK_I neurons
        t = pid_tj // K
        e = tl.load(eid_ptr + pid_tj).to(tl.int64)
        rows = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)  # [BLOCK_I]
        rmask = rows < I
        cols = tl.arange(0, BLOCK_H)  # [BLOCK_H]
        w_base = w_ptr + e * stride_we + rows.to(tl.int64)[:, None] * H  # [BLOCK_I, 1]
        x_base = x_ptr + t.to(tl.int64) * stride_xt
        acc = tl.zeros([BLOCK_I, BLOCK_H], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            c = h0 + cols
            cmask = c < H
            xv = tl.load(x_base + c, mask=cmask, other=0.0).to(tl.float32)  # [BLOCK_H]
            wv = tl.load(w_base + c[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
            acc += wv.to(tl.float32) * xv[None, :]
        z = tl.sum(acc, axis=1)  # [BLOCK_I]
        g = z / (1.0 + tl.exp(-z))  # silu
        tl.store(g_ptr + pid_tj.to(tl.int64) * I + rows, g, mask=rmask)

    @triton.jit
    def _gate_compact_kernel(
        g_ptr,  # [T*k, I] fp32
        eid_ptr,  # [T*k]
        tau_ptr,  # [E] fp32
        idx_ptr,  # [T*k, C] int32 out
        cnt_ptr,  # [T*k] int32 out
        I,
        C,
        BLOCK_I: tl.constexpr,  # next power of two >= I
        BLOCK_C: tl.constexpr,  # next power of two >= C
    ):
        pid = tl.program_id(0)
        e = tl.load(eid_ptr + pid).to(tl.int64)
        tau = tl.load(tau_ptr + e)
        n = tl.arange(0, BLOCK_I)
        nmask = n < I
        g = tl.load(g_ptr + pid.to(tl.int64) * I + n, mask=nmask, other=0.0)
        keep = (tl.abs(g) >= tau) & nmask
        keep_i = keep.to(tl.int32)
        pos = tl.cumsum(keep_i, axis=0) - 1  # slot of each kept neuron, ascending
        total = tl.sum(keep_i, axis=0)
        cnt = tl.minimum(total, C)
        out_base = idx_ptr + pid.to(tl.int64) * C
        tl.store(out_base + pos, n, mask=keep & (pos < C))
        p = tl.arange(0, BLOCK_C)
        tl.store(out_base + p, tl.zeros([BLOCK_C], dtype=tl.int32), mask=(p >= cnt) & (p < C))
        tl.store(cnt_ptr + pid, cnt)


# ----------------------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------------------
def _check_rows_contiguous(name, w, E, I, H):
    if w.dim() != 3 or tuple(w.shape) != (E, I, H):
        raise ValueError(f"{name} must have shape [E, I, H] = {(E, I, H)}, got {tuple(w.shape)}")
    if w.stride(2) != 1 or (I > 1 and w.stride(1) != H):
        raise ValueError(f"{name} rows must be contiguous (stride(2) == 1, stride(1) == H); got strides {w.stride()}")


def sparse_gate(
    x,
    w_gate,
    expert_ids,
    tau,
    capacity: int | None = None,
    *,
    out=None,
    BLOCK_I: int = 16,
    BLOCK_H: int = 512,
    num_warps: int = 4,
):
    """Dense gate + threshold + compaction for the k routed experts of each token.

    x [T,H] (bf16/fp16/fp32), w_gate [E,I,H], expert_ids [T,k] int32/int64, tau [E] fp32, capacity C <= I
    (default I). Returns (g [T,k,I] fp32, idx [T,k,C] int32, count [T,k] int32). `out=(g, idx, count)`
    reuses preallocated buffers (for CUDA-graph capture). No host sync, fixed grid.
    """
    if triton is None:
        raise RuntimeError("sparse_gate needs triton")
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got shape {tuple(x.shape)}")
    T, H = x.shape
    if w_gate.dim() != 3:
        raise ValueError(f"w_gate must be [E, I, H], got shape {tuple(w_gate.shape)}")
    E, I, _ = w_gate.shape
    _check_rows_contiguous("w_gate", w_gate, E, I, H)
    if expert_ids.dim() != 2 or expert_ids.shape[0] != T:
        raise ValueError(f"expert_ids must be [T, k] with T = {T}, got shape {tuple(expert_ids.shape)}")
    k = expert_ids.shape[1]
    if expert_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"expert_ids must be int32 or int64, got {expert_ids.dtype}")
    if tau.dim() != 1 or tau.shape[0] != E or tau.dtype != torch.float32:
        raise ValueError(f"tau must be a float32 [E] = [{E}] tensor, got {tau.dtype} {tuple(tau.shape)}")
    if x.dtype not in _FLOAT_DTYPES or w_gate.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x and w_gate must be bf16/fp16/fp32, got {x.dtype} and {w_gate.dtype}")
    if x.stride(1) != 1:
        raise ValueError("x must have a contiguous last dimension")
    C = I if capacity is None else int(capacity)
    if not 1 <= C <= I:
        raise ValueError(f"capacity must be in [1, I = {I}], got {C}")
    dev = x.device
    for name, tns in (("w_gate", w_gate), ("expert_ids", expert_ids), ("tau", tau)):
        if tns.device != dev:
            raise ValueError(f"{name} is on {tns.device}, x is on {dev}: all inputs must share a device")
    eid = expert_ids.contiguous()
    if out is None:
        g = torch.empty(T, k, I, dtype=torch.float32, device=dev)
        idx = torch.empty(T, k, C, dtype=torch.int32, device=dev)
        count = torch.empty(T, k, dtype=torch.int32, device=dev)
    else:
        g, idx, count = out
        if tuple(g.shape) != (T, k, I) or g.dtype != torch.float32 or not g.is_contiguous():
            raise ValueError(f"out g must be contiguous fp32 [T,k,I] = {(T, k, I)}")
        if tuple(idx.shape) != (T, k, C) or idx.dtype != torch.int32 or not idx.is_contiguous():
            raise ValueError(f"out idx must be contiguous int32 [T,k,C] = {(T, k, C)}")
        if tuple(count.shape) != (T, k) or count.dtype != torch.int32 or not count.is_contiguous():
            raise ValueError(f"out count must be contiguous int32 [T,k] = {(T, k)}")
    if T == 0 or k == 0:
        return g, idx, count
    bi = min(BLOCK_I, triton.next_power_of_2(I))
    bh = min(BLOCK_H, triton.next_power_of_2(H))
    _gate_gemv_kernel[(T * k, triton.cdiv(I, bi))](
        x, w_gate, eid, g, H, I, k, x.stride(0), w_gate.stride(0),
        BLOCK_I=bi, BLOCK_H=bh, num_warps=num_warps,
    )
    _gate_compact_kernel[(T * k,)](
        g, eid, tau, idx, count, I, C,
        BLOCK_I=triton.next_power_of_2(I), BLOCK_C=triton.next_power_of_2(C), num_warps=4,
    )
    return g, idx, count
