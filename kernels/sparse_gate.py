"""Sparse decode, step 1 of 2: dense gate projection + threshold mask + index compaction.

Owns `sparse_gate` (Triton launcher), its torch reference `sparse_gate_ref`, and one Triton kernel
`_sparse_gate_kernel`, grid (T*k, ceil(I / BLOCK_I)):

* each program computes g[t, j, n] = silu(x[t] . W_gate[e, n]) for BLOCK_I neurons (fp32 accumulation) with
  one full-width load of its BLOCK_I x H tile (no serial loop over H: a batch-1 step is latency bound), and
  stores g; many programs per expert so a batch-1 step still fills the GPU;
* then it takes a ticket (acq_rel atomic on a per-pair counter); the program that finishes last for pair
  (t, j) reads the whole g row back from L2 and compacts it: keep n where |g| >= tau[e], prefix sum
  (tl.cumsum) gives each kept neuron its slot, so `idx` lists kept neurons in ascending order, padding slots
  are written with 0, count = min(#kept, C); it resets the ticket to 0 for the next launch.

One launch, fixed grid and output sizes, no host sync: CUDA-graph capturable (pass `out=` buffers to keep
addresses fixed). The ticket workspace is cached per (device, stream).

Shape legend: T = tokens, k = experts per token, E = experts, I = expert width (neurons), H = hidden,
C = capacity (length of the kept-index list, <= I).
Weight layout (expert store contract): w_gate [E, I, H], rows contiguous (stride(2) == 1, stride(1) == H);
the expert stride may be anything (so a view of a fused [E, 2I, H] gate_up tensor works too).
"""

from __future__ import annotations

import torch

from localmoe.kernels.checks import expert_weights, tokens_and_experts

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
# Triton kernel
# ----------------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _sparse_gate_kernel(
        x_ptr,  # [T, H] any float dtype, row stride stride_xt
        w_ptr,  # [E, I, H] rows contiguous, expert stride stride_we
        eid_ptr,  # [T*k] int32/int64
        tau_ptr,  # [E] fp32
        g_ptr,  # [T*k, I] fp32 out
        idx_ptr,  # [T*k, C] int32 out
        cnt_ptr,  # [T*k] int32 out
        ticket_ptr,  # [T*k] int32 workspace, zero between launches (the last program resets it)
        zero_ptr,  # [T, H] fp32 buffer to clear (the next sparse_updown's y), used when ZERO_OUT
        I,
        C,
        K,  # experts per token
        stride_xt,
        stride_we,
        H: tl.constexpr,
        H_P2: tl.constexpr,  # next power of two >= H: one full-width load per program, no serial H loop
        BLOCK_I: tl.constexpr,
        I_P2: tl.constexpr,  # next power of two >= I
        C_P2: tl.constexpr,  # next power of two >= C
        ZERO_OUT: tl.constexpr,
    ):
        pid_tj = tl.program_id(0)  # one (token, slot) pair
        pid_i = tl.program_id(1)  # one block of BLOCK_I neurons
        t = pid_tj // K
        e = tl.load(eid_ptr + pid_tj).to(tl.int64)
        # ---- gate GEMV for BLOCK_I neurons: g = silu(x . W_gate[e, n]) ----
        rows = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)  # [BLOCK_I]
        rmask = rows < I
        cols = tl.arange(0, H_P2)  # [H_P2]
        cmask = cols < H
        xv = tl.load(x_ptr + t.to(tl.int64) * stride_xt + cols, mask=cmask, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + e * stride_we + rows.to(tl.int64)[:, None] * H + cols[None, :],
                     mask=rmask[:, None] & cmask[None, :], other=0.0)  # [BLOCK_I, H_P2]
        z = tl.sum(wv.to(tl.float32) * xv[None, :], axis=1)  # [BLOCK_I]
        g = z / (1.0 + tl.exp(-z))  # silu
        g_row = g_ptr + pid_tj.to(tl.int64) * I
        tl.store(g_row + rows, g, mask=rmask)
        if ZERO_OUT:  # saves the memset node before sparse_updown(..., accumulate=True)
            if (pid_tj % K == 0) & (pid_i == 0):
                tl.store(zero_ptr + t.to(tl.int64) * H + cols, tl.zeros([H_P2], dtype=tl.float32), mask=cmask)
        # ---- the last program of this pair to finish compacts the mask (ascending, prefix sum) ----
        tl.debug_barrier()  # all of this program's g stores precede the release below
        done = tl.atomic_add(ticket_ptr + pid_tj, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(1) - 1:
            tau = tl.load(tau_ptr + e)
            n = tl.arange(0, I_P2)
            nmask = n < I
            gall = tl.load(g_row + n, mask=nmask, other=0.0, cache_modifier=".cg")  # other programs' g: via L2
            keep = (tl.abs(gall) >= tau) & nmask
            keep_i = keep.to(tl.int32)
            pos = tl.cumsum(keep_i, axis=0) - 1  # slot of each kept neuron
            cnt = tl.minimum(tl.sum(keep_i, axis=0), C)
            out_row = idx_ptr + pid_tj.to(tl.int64) * C
            tl.store(out_row + pos, n, mask=keep & (pos < C))
            p = tl.arange(0, C_P2)
            tl.store(out_row + p, tl.zeros([C_P2], dtype=tl.int32), mask=(p >= cnt) & (p < C))
            tl.store(cnt_ptr + pid_tj, cnt)
            tl.store(ticket_ptr + pid_tj, 0)  # ready for the next launch / graph replay


_TICKETS: dict = {}


def _tickets(device, n: int):
    """Zeroed int32 workspace of >= n tickets, one per (device, stream); kernels leave it zeroed."""
    key = (str(device), torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    buf = _TICKETS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 256), dtype=torch.int32, device=device)
        _TICKETS[key] = buf
    return buf


# ----------------------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------------------


def sparse_gate(
    x,
    w_gate,
    expert_ids,
    tau,
    capacity: int | None = None,
    *,
    out=None,
    zero_out=None,
    BLOCK_I: int = 8,
    num_warps: int = 4,
):
    """Dense gate + threshold + compaction for the k routed experts of each token.

    x [T,H] (bf16/fp16/fp32), w_gate [E,I,H], expert_ids [T,k] int32/int64, tau [E] fp32, capacity C <= I
    (default I). Returns (g [T,k,I] fp32, idx [T,k,C] int32, count [T,k] int32). `out=(g, idx, count)`
    reuses preallocated buffers (for CUDA-graph capture). `zero_out` (optional fp32 contiguous [T,H]) is
    cleared by the same launch, so a following `sparse_updown(..., out=zero_out, accumulate=True)` needs no
    memset of its own. No host sync, fixed grid.
    """
    if triton is None:
        raise RuntimeError("sparse_gate needs triton")
    T, H, E, I = tokens_and_experts(x, w_gate)
    expert_weights("w_gate", w_gate, E, I, H)
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
    if zero_out is not None:
        if (tuple(zero_out.shape) != (T, H) or zero_out.dtype != torch.float32 or not zero_out.is_contiguous()
                or zero_out.device != dev):
            raise ValueError(f"zero_out must be a contiguous fp32 [T, H] = {(T, H)} tensor on {dev}")
    if T == 0 or k == 0:
        if zero_out is not None:
            zero_out.zero_()
        return g, idx, count
    bi = max(1, min(triton.next_power_of_2(BLOCK_I), triton.next_power_of_2(I)))
    _sparse_gate_kernel[(T * k, triton.cdiv(I, bi))](
        x, w_gate, eid, tau, g, idx, count, _tickets(dev, T * k), g if zero_out is None else zero_out, I, C, k, x.stride(0), w_gate.stride(0),
        H=H, H_P2=triton.next_power_of_2(H), BLOCK_I=bi, I_P2=triton.next_power_of_2(I),
        C_P2=triton.next_power_of_2(C), ZERO_OUT=zero_out is not None, num_warps=num_warps,
    )
    return g, idx, count
