"""Sparse decode in TWO launches behind a programmatic-dependent-launch boundary: a gate pass, then the kept rows.

Owns `sparse_split` (Triton launcher) and its two kernels; the reference is kernels/sparse_fused.py's
`sparse_fused_ref` (the same function of the same inputs), and the per-token tail (workspace, tickets, publishing)
is kernels/token_tail.py's, as sparse_fused's:

* `_gate_act_kernel`, grid (T*k, ceil(I / BLOCK_G)): program (tj, b) loads its BLOCK_G x H gate tile of expert
  e = expert_ids[tj] in one full-width load and writes g = silu(x . W_gate[e, n]) (fp32) for its neurons into an
  [T*k, I] activation buffer. Nothing else: no up/down tiles in its registers, so more of its programs fit on an SM
  than sparse_fused's (whose gate pass runs at ~2.2 TB/s on the H200 against ~3.1 for a plain GEMV of that size).
* `_kept_rows_kernel`, grid (T*k, ceil(I / BLOCK_I)), launched with PDL: program (tj, b) reads its BLOCK_I
  activations back (from L2), keeps n where |g_n| >= tau[e], and if any is kept loads the kept rows of W_up and
  W_down_t (masked rows issue no traffic), h_n = w[tj] g_n (x . W_up[e, n]) and atomically adds sum_n h_n
  W_down_t[e, n, :] and its kept count into the self-cleaning fp32 workspace; the last program of token t
  publishes y[t] (+ residual) and the counts (kernels/token_tail.py), and adds the kept total for the stats.

What the split buys against sparse_fused's one launch: the gate pass runs without the kept phase's registers and
every kept-row load of the step is issued at once instead of after each program's own gate round trip; what it costs:
one more launch a layer (~1-2 µs in a graph with PDL) and the activations' round trip through L2 (4 bytes a neuron).

Resident weights only ([E, I, H] bf16/fp16/fp32 on x's device): offloaded, int4 and predictor modes, and the shared
expert in the tail, stay with sparse_fused. One pair of launches, fixed grids and sizes, no host sync:
CUDA-graph capturable.

Shape legend: T = tokens, k = experts per token, E = experts, I = expert width (neurons), H = hidden.
Weight layout: sparse_fused's ([E, I, H], rows contiguous, any expert stride; w_down_t is W_down transposed).
"""

from __future__ import annotations

import torch

from localmoe.kernels.checks import expert_weights, tokens_and_experts
from localmoe.kernels.sparse_fused import sparse_fused_ref
from localmoe.kernels.token_tail import tail_buffers

try:  # Triton is optional at import time; the launcher needs it.
    import triton
    import triton.language as tl

    from localmoe.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_kw
    from localmoe.kernels.token_tail import last_of_token, publish_token, publish_totals
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INT_DTYPES = (torch.int32, torch.int64)

sparse_split_ref = sparse_fused_ref  # the same function: y [T, H] fp32, count [T, k] int32


# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _gate_act_kernel(
        x_ptr,  # [T, H] any float dtype, row stride stride_xt
        wg_ptr,  # [E, I, H] rows contiguous, expert stride stride_ge
        eid_ptr,  # [T*k] int32/int64
        act_ptr,  # [T*k, I] fp32 out: silu(x . W_gate[e, n])
        I,
        K,  # experts per token
        stride_xt,
        stride_ge,
        H: tl.constexpr,
        H_P2: tl.constexpr,  # next power of two >= H: one full-width tile per program
        BLOCK_G: tl.constexpr,
        PDL: tl.constexpr,
    ):
        if PDL:  # the expert ids and x come from the launches before: nothing to load ahead of the wait
            gdc_wait()
            gdc_launch_dependents()
        tj = tl.program_id(0)
        t = tj // K
        e = tl.load(eid_ptr + tj).to(tl.int64)
        rows = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
        rmask = rows < I
        cols = tl.arange(0, H_P2)
        cmask = cols < H
        xv = tl.load(x_ptr + t.to(tl.int64) * stride_xt + cols, mask=cmask, other=0.0).to(tl.float32)
        w = tl.load(
            wg_ptr + e * stride_ge + rows.to(tl.int64)[:, None] * H + cols[None, :],
            mask=rmask[:, None] & cmask[None, :],
            other=0.0,
        )
        z = tl.sum(w.to(tl.float32) * xv[None, :], axis=1)
        tl.store(act_ptr + tj.to(tl.int64) * I + rows, z / (1.0 + tl.exp(-z)), mask=rmask)

    @triton.jit
    def _kept_rows_kernel(
        x_ptr,  # [T, H] any float dtype, row stride stride_xt
        wu_ptr,  # [E, I, H] rows contiguous
        wd_ptr,  # [E, I, H] W_down transposed, rows contiguous
        eid_ptr,  # [T*k] int32/int64
        rw_ptr,  # [T*k] routing weights, any float
        tau_ptr,  # [E] fp32
        act_ptr,  # [T*k, I] fp32: the gate activations (the launch before)
        y_ptr,  # [T, H] out, any float dtype
        cnt_ptr,  # [T*k] int32 out
        acc_ptr,  # [T, H] fp32 workspace, zero between launches
        cws_ptr,  # [T*k] int32 workspace, zero between launches
        tick_ptr,  # [T] int32 tickets, zero between launches
        kept_ptr,  # int64 running total of kept neurons (KEPT_TOTAL only)
        res_ptr,  # [T, H] residual, contiguous, y's dtype (HAS_RES only)
        I,
        K,
        stride_xt,
        stride_ue,
        stride_de,
        H: tl.constexpr,
        H_P2: tl.constexpr,
        BLOCK_I: tl.constexpr,
        K_P2: tl.constexpr,
        KEPT_TOTAL: tl.constexpr,
        HAS_RES: tl.constexpr,
        PDL: tl.constexpr,
    ):
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        tj = tl.program_id(0)
        t = tj // K
        e = tl.load(eid_ptr + tj).to(tl.int64)
        rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        rmask = rows < I
        cols = tl.arange(0, H_P2)
        cmask = cols < H
        g = tl.load(act_ptr + tj.to(tl.int64) * I + rows, mask=rmask, other=0.0, cache_modifier=".cg")
        keep = (tl.abs(g) >= tl.load(tau_ptr + e)) & rmask
        nk = tl.sum(keep.to(tl.int32), axis=0)
        if nk > 0:  # a block with nothing kept reads no weights
            roff = rows.to(tl.int64)[:, None] * H + cols[None, :]
            mk = keep[:, None] & cmask[None, :]
            # both tiles issued before any arithmetic: one memory round trip for the kept bytes
            wu = tl.load(wu_ptr + e * stride_ue + roff, mask=mk, other=0.0)
            wd = tl.load(wd_ptr + e * stride_de + roff, mask=mk, other=0.0)
            xv = tl.load(x_ptr + t.to(tl.int64) * stride_xt + cols, mask=cmask, other=0.0).to(tl.float32)
            rw = tl.load(rw_ptr + tj).to(tl.float32)
            h = tl.where(keep, tl.sum(wu.to(tl.float32) * xv[None, :], axis=1) * g * rw, 0.0)
            contrib = tl.sum(wd.to(tl.float32) * h[:, None], axis=0)
            tl.atomic_add(acc_ptr + t.to(tl.int64) * H + cols, contrib, mask=cmask, sem="relaxed")
            tl.atomic_add(cws_ptr + tj, nk, sem="relaxed")
        tl.debug_barrier()  # this program's atomics precede the release below
        if last_of_token(tick_ptr, t, K * tl.num_programs(1)):
            c = publish_token(
                acc_ptr, y_ptr, res_ptr, cnt_ptr, cws_ptr, tick_ptr, t, K, cols, cmask,
                H=H, H_P2=H_P2, K_P2=K_P2, HAS_RES=HAS_RES,
            )  # fmt: skip
            publish_totals(
                c, t, K, I, eid_ptr, eid_ptr, eid_ptr, kept_ptr, kept_ptr, kept_ptr,
                K_P2, KEPT_TOTAL, False, False, False,
            )  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------------------


def sparse_split(
    x,
    w_gate,
    w_up,
    w_down_t,
    expert_ids,
    weights,
    tau,
    out=None,
    *,
    count=None,
    workspace=None,
    kept_total=None,
    residual=None,
    act=None,
    BLOCK_G: int = 8,
    warps_g: int = 4,
    BLOCK_I: int = 8,
    num_warps: int = 8,
):
    """sparse_fused's default mode (self-cleaning overwrite) in two launches. Returns (y [T,H], count [T,k]).

    x [T,H] (bf16/fp16/fp32, last dim contiguous); w_gate/w_up/w_down_t [E,I,H] on x's device (rows contiguous);
    expert_ids [T,k] int32/int64; weights [T,k] any float; tau [E] fp32. `out` (optional contiguous [T,H], default
    fp32) and `count` (optional int32 [T,k]) are overwritten; `workspace` as sparse_fused's (token_tail.
    fused_workspace); `kept_total` (int64 one-element) += the kept neurons; `residual` ([T,H] in out's dtype) makes
    y = residual + the experts' output; `act` (optional fp32 [T*k, I] contiguous) holds the gate activations between
    the two launches (pass it to keep every address fixed across graph replays). BLOCK_G / warps_g launch the gate
    pass, BLOCK_I / num_warps the kept rows."""
    if triton is None:
        raise RuntimeError("sparse_split needs triton")
    T, H, E, I = tokens_and_experts(x, w_gate)
    if x.dtype not in _FLOAT_DTYPES or x.stride(1) != 1:
        raise ValueError(f"x must be bf16/fp16/fp32 with a contiguous last dim, got {x.dtype} strides {x.stride()}")
    dev = x.device
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down_t", w_down_t)):
        expert_weights(name, w, E, I, H, dev, allow_host=False)
    if expert_ids.dim() != 2 or expert_ids.shape[0] != T or expert_ids.dtype not in _INT_DTYPES:
        raise ValueError(
            f"expert_ids must be int32/int64 [T, k] with T = {T}, got {expert_ids.dtype} {tuple(expert_ids.shape)}"
        )
    k = expert_ids.shape[1]
    if tuple(weights.shape) != (T, k) or not weights.dtype.is_floating_point:
        raise ValueError(
            f"weights must be a float [T, k] = {(T, k)} tensor, got {weights.dtype} {tuple(weights.shape)}"
        )
    if tau.dim() != 1 or tau.shape[0] != E or tau.dtype != torch.float32:
        raise ValueError(f"tau must be a float32 [E] = [{E}] tensor, got {tau.dtype} {tuple(tau.shape)}")
    for name, tns in (("expert_ids", expert_ids), ("weights", weights), ("tau", tau)):
        if tns.device != dev:
            raise ValueError(f"{name} is on {tns.device}, x is on {dev}: all inputs must share a device")
    if out is None:
        out = torch.empty(T, H, dtype=torch.float32, device=dev)
    elif tuple(out.shape) != (T, H) or out.dtype not in _FLOAT_DTYPES or not out.is_contiguous() or out.device != dev:
        raise ValueError(f"out must be a contiguous bf16/fp16/fp32 [T, H] = {(T, H)} tensor on {dev}")
    if count is None:
        count = torch.empty(T, k, dtype=torch.int32, device=dev)
    elif tuple(count.shape) != (T, k) or count.dtype != torch.int32 or not count.is_contiguous() or count.device != dev:
        raise ValueError(f"count must be a contiguous int32 [T, k] = {(T, k)} tensor on {dev}")
    if kept_total is not None and (
        kept_total.dtype != torch.int64 or kept_total.numel() != 1 or kept_total.device != dev
    ):
        raise ValueError(f"kept_total must be a one-element int64 tensor on {dev}")
    if residual is not None and (
        tuple(residual.shape) != (T, H) or residual.dtype != out.dtype or not residual.is_contiguous()
        or residual.device != dev
    ):  # fmt: skip
        raise ValueError(f"residual must be a contiguous {out.dtype} [T, H] = {(T, H)} tensor on {dev}")
    if act is None:
        act = torch.empty(T * k, I, dtype=torch.float32, device=dev)
    elif act.dtype != torch.float32 or act.numel() < T * k * I or not act.is_contiguous() or act.device != dev:
        raise ValueError(f"act must be a contiguous fp32 tensor of >= T*k*I = {T * k * I} elements on {dev}")
    if T == 0 or k == 0:
        if residual is not None:
            raise ValueError("residual= needs at least one token and one routed expert")
        out.zero_()
        count.zero_()
        return out, count
    acc, cws, tick = tail_buffers(out, count, workspace, False, dev, T, H, k)
    h_p2 = triton.next_power_of_2(H)
    ids = expert_ids.contiguous()
    bg = max(1, min(triton.next_power_of_2(BLOCK_G), triton.next_power_of_2(I)))
    bi = max(1, min(triton.next_power_of_2(BLOCK_I), triton.next_power_of_2(I)))
    pdl = pdl_kw(x)
    _gate_act_kernel[(T * k, triton.cdiv(I, bg))](
        x, w_gate, ids, act, I, k, x.stride(0), w_gate.stride(0),
        H=H, H_P2=h_p2, BLOCK_G=bg, num_warps=warps_g, **pdl,
    )  # fmt: skip
    _kept_rows_kernel[(T * k, triton.cdiv(I, bi))](
        x, w_up, w_down_t, ids, weights.contiguous(), tau, act, out, count, acc, cws, tick,
        kept_total if kept_total is not None else count, residual if residual is not None else out,
        I, k, x.stride(0), w_up.stride(0), w_down_t.stride(0),
        H=H, H_P2=h_p2, BLOCK_I=bi, K_P2=triton.next_power_of_2(k),
        KEPT_TOTAL=kept_total is not None, HAS_RES=residual is not None, num_warps=num_warps, **pdl,
    )  # fmt: skip
    return out, count
