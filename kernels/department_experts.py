"""DeaMoE's department-grouped sparse decode (a step of T <= 8 tokens, T = 1 the usual case).

Owns `department_experts` (launcher), its torch reference `department_experts_ref`, and three kernels. The step's
departments sit in S fixed slots (`dept` [S], -1 = unused: the grid never depends on the routing, so the step can be
captured in a CUDA graph); `weights` [S, T, n] holds token t's routing weight for expert j of the slot's department
(0 = not chosen). For a slot s with department d, token t, a = silu(x_t W_gate_d^T), kept neurons K = {i : |a_i| >=
tau[d]} (only tokens with a chosen expert in d):

    u[s,t,i] = a_i (x_t . W_up_d[i])                            i in K, else 0             `_dept_up_kernel`
    z[s,t,:] = sum_j weights[s,t,j] sum_{i in K} u[s,t,i] P_{d,j}[i, :]                    `_dept_private_kernel`
    y[t, :] += sum_i z[s,t,i] W_down_t_d[i, :]                                             `_dept_down_kernel`

Grids: up (S, h / BLOCK_N) reads a block of gate rows once for all T tokens, and up rows only where kept;
private (S, h / BLOCK_Z) reads each chosen expert's P rows of kept neurons once for all T tokens; down
(H / BLOCK_O, S) reads the department's W_down_t in full once (z is dense) and adds into y (fp32, zeroed) atomically.
u and z live in fp32 workspaces [S, T, h]. The kept count (tokens x kept neurons) is added into `kept_total`.

Shape legend: T tokens, D departments, n experts per department, h department width, H hidden, S slots.
Weight layout: w_gate, w_up, w_down_t [D, h, H] and private [D, n, h, h] (row i = input neuron i), rows contiguous.
"""

from __future__ import annotations

import torch

from localmoe.kernels.checks import FLOAT_DTYPES, expert_weights

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

MAX_TOKENS = 8


def department_experts_ref(x, w_gate, w_up, w_down_t, private, dept, weights, tau, private_slots=None):
    """Torch reference reading only kept rows of W_up and P: -> (y [T, H] fp32, kept count as a 0-d int64).
    With `private_slots` [S, n], private is a pool [P, h, h] and expert j of slot s is private[private_slots[s, j]]."""
    ps = private_slots.tolist() if private_slots is not None else None
    T, H = x.shape
    y = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    kept = torch.zeros((), dtype=torch.int64, device=x.device)
    for s, d in enumerate(dept.tolist()):
        if d < 0:
            continue
        for t in range(T):
            w = weights[s, t].float()
            if not bool((w != 0).any()):
                continue
            xt = x[t].float()
            a = torch.nn.functional.silu(w_gate[d].float() @ xt)  # [h]
            keep = (a.abs() >= tau[d].float()).nonzero().squeeze(1)
            kept += keep.numel()
            u = a[keep] * (w_up[d].index_select(0, keep).float() @ xt)  # [kept]
            z = torch.zeros(w_gate.shape[1], dtype=torch.float32, device=x.device)
            for j in (w != 0).nonzero().squeeze(1).tolist():
                pj = private[d, j] if ps is None else private[ps[s][j]]
                z += w[j] * (u @ pj.index_select(0, keep).float())
            y[t] += z @ w_down_t[d].float()
    return y, kept


if triton is not None:

    @triton.jit
    def _dept_up_kernel(
        x_ptr, wg_ptr, wu_ptr, dept_ptr, w_ptr, tau_ptr, u_ptr, kept_ptr,
        T, h, n, stride_xt, stride_gd, stride_ud,
        H: tl.constexpr, H_P2: tl.constexpr, N_P2: tl.constexpr, T_P2: tl.constexpr, BLOCK_N: tl.constexpr,
        COUNT: tl.constexpr,
    ):  # fmt: skip
        s = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        d = tl.load(dept_ptr + s)
        valid = (rows < h) & ((rows * 0 + d) >= 0)
        dd = tl.maximum(d, 0).to(tl.int64)
        cols = tl.arange(0, H_P2)
        cmask = cols < H
        roff = rows.to(tl.int64)[:, None] * H + cols[None, :]
        m2 = valid[:, None] & cmask[None, :]
        wg = tl.load(wg_ptr + dd * stride_gd + roff, mask=m2, other=0.0).to(tl.float32)
        tau = tl.load(tau_ptr + dd)
        jj = tl.arange(0, N_P2)
        total = 0
        for t in tl.static_range(T_P2):
            live_t = (jj * 0 + t) < T  # token t exists (a block, not a scalar: masks must be blocks)
            wt = tl.load(w_ptr + (s * T + t) * n + jj, mask=(jj < n) & live_t, other=0.0)
            used = (tl.zeros((BLOCK_N,), dtype=tl.float32) + tl.sum(tl.abs(wt), axis=0)) > 0  # token t uses d
            xv = tl.load(x_ptr + t * stride_xt + cols, mask=cmask & ((cols * 0 + t) < T), other=0.0).to(tl.float32)
            g = tl.sum(wg * xv[None, :], axis=1)
            a = g / (1.0 + tl.exp(-g))
            keep = (tl.abs(a) >= tau) & valid & used
            wu = tl.load(wu_ptr + dd * stride_ud + roff, mask=keep[:, None] & cmask[None, :], other=0.0)
            u = tl.where(keep, a * tl.sum(wu.to(tl.float32) * xv[None, :], axis=1), 0.0)
            tl.store(u_ptr + (s * T + t) * h + rows, u, mask=(rows < h) & ((rows * 0 + t) < T))
            total += tl.sum(keep.to(tl.int64), axis=0)
        if COUNT:
            tl.atomic_add(kept_ptr, total, sem="relaxed")

    @triton.jit
    def _dept_private_kernel(
        p_ptr, dept_ptr, w_ptr, u_ptr, z_ptr, ps_ptr, T, h, n, stride_pd, stride_pe,
        T_P2: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_Z: tl.constexpr, INDEXED: tl.constexpr,
    ):  # fmt: skip
        s = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_Z + tl.arange(0, BLOCK_Z)
        cmask = cols < h
        d = tl.load(dept_ptr + s)
        dd = tl.maximum(d, 0).to(tl.int64)
        tt = tl.arange(0, T_P2)
        tmask = tt < T
        acc = tl.zeros((T_P2, BLOCK_Z), dtype=tl.float32)
        if d >= 0:
            for j in range(n):
                wj = tl.load(w_ptr + (s * T + tt) * n + j, mask=tmask, other=0.0)  # [T_P2]
                if tl.sum(tl.abs(wj), axis=0) > 0:
                    if INDEXED:  # a pool of private parts: expert j of slot s sits at private_slots[s, j]
                        pbase = tl.load(ps_ptr + s * n + j).to(tl.int64) * stride_pe
                    else:
                        pbase = dd * stride_pd + j * stride_pe
                    for i0 in range(0, h, BLOCK_I):
                        ii = i0 + tl.arange(0, BLOCK_I)
                        u = tl.load(
                            u_ptr + (s * T + tt[:, None]) * h + ii[None, :],
                            mask=tmask[:, None] & (ii < h)[None, :],
                            other=0.0,
                        )  # [T_P2, BLOCK_I]
                        live = tl.sum(tl.abs(u) * (wj[:, None] != 0), axis=0) > 0  # a kept neuron of a chosen token
                        p = tl.load(
                            p_ptr + pbase + ii.to(tl.int64)[:, None] * h + cols[None, :],
                            mask=live[:, None] & cmask[None, :],
                            other=0.0,
                        ).to(tl.float32)  # [BLOCK_I, BLOCK_Z]
                        acc += tl.sum((u * wj[:, None])[:, :, None] * p[None, :, :], axis=1)
        tl.store(z_ptr + (s * T + tt[:, None]) * h + cols[None, :], acc, mask=tmask[:, None] & cmask[None, :])

    @triton.jit
    def _dept_down_kernel(
        wd_ptr, dept_ptr, z_ptr, y_ptr, T, h, stride_dd,
        H: tl.constexpr, T_P2: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_O: tl.constexpr,
    ):  # fmt: skip
        cols = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)
        s = tl.program_id(1)
        cmask = cols < H
        d = tl.load(dept_ptr + s)
        dd = tl.maximum(d, 0).to(tl.int64)
        tt = tl.arange(0, T_P2)
        tmask = tt < T
        if d >= 0:
            acc = tl.zeros((T_P2, BLOCK_O), dtype=tl.float32)
            for i0 in range(0, h, BLOCK_I):
                ii = i0 + tl.arange(0, BLOCK_I)
                imask = ii < h
                z = tl.load(
                    z_ptr + (s * T + tt[:, None]) * h + ii[None, :], mask=tmask[:, None] & imask[None, :], other=0.0
                )
                wd = tl.load(
                    wd_ptr + dd * stride_dd + ii.to(tl.int64)[:, None] * H + cols[None, :],
                    mask=imask[:, None] & cmask[None, :],
                    other=0.0,
                ).to(tl.float32)
                acc += tl.sum(z[:, :, None] * wd[None, :, :], axis=1)
            tl.atomic_add(
                y_ptr + tt[:, None] * H + cols[None, :], acc, mask=tmask[:, None] & cmask[None, :], sem="relaxed"
            )


def department_experts(
    x, w_gate, w_up, w_down_t, private, dept, weights, tau, out=None, *, kept_total=None, private_slots=None,
    BLOCK_N: int = 4, BLOCK_I: int = 16, BLOCK_Z: int = 64, BLOCK_O: int = 64, num_warps: int = 4,
):  # fmt: skip
    """y [T, H] fp32 = the department-grouped DeaMoE experts of a step (module doc); `out` is zeroed and filled.

    x [T, H] (T <= MAX_TOKENS), w_gate/w_up/w_down_t [D, h, H], private [D, n, h, h] (bf16/fp16/fp32, rows
    contiguous), dept [S] int32 (-1 = unused slot), weights [S, T, n] fp32, tau [D] fp32; `kept_total` (0-d int64)
    gets the kept (token, neuron) count added. With `private_slots` [S, n] int32, private is a pool [P, h, h] and
    expert j of slot s reads private[private_slots[s, j]] (an expert cache's slots; entries of unchosen experts are
    never read)."""
    if triton is None:
        raise RuntimeError("department_experts needs triton")
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES or x.stride(1) != 1:
        raise ValueError(f"x must be a float [T, H] tensor with a contiguous last dim, got {x.dtype} {tuple(x.shape)}")
    T, H = x.shape
    if not 0 < T <= MAX_TOKENS:
        raise ValueError(f"department_experts takes 1 to {MAX_TOKENS} tokens, got {T}")
    if w_gate.dim() != 3:
        raise ValueError(f"w_gate must be [D, h, H], got shape {tuple(w_gate.shape)}")
    D, h = w_gate.shape[0], w_gate.shape[1]
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down_t", w_down_t)):
        expert_weights(name, w, D, h, H, x.device)
    indexed = private_slots is not None
    if indexed:
        if private.dim() != 3 or tuple(private.shape[1:]) != (h, h):
            raise ValueError(
                f"with private_slots, private must be a pool [P, h, h] with h={h}, got {tuple(private.shape)}"
            )
        if private_slots.dim() != 2 or private_slots.dtype != torch.int32 or not private_slots.is_contiguous():
            raise ValueError("private_slots must be a contiguous int32 [S, n] tensor")
        if private_slots.device != x.device:
            raise ValueError(f"private_slots must be on {x.device}")
        n = private_slots.shape[1]
    elif private.dim() != 4 or private.shape[0] != D or tuple(private.shape[2:]) != (h, h):
        raise ValueError(f"private must be [D, n, h, h] with D={D}, h={h}, got {tuple(private.shape)}")
    else:
        n = private.shape[1]
    if private.dtype not in FLOAT_DTYPES or not private.is_contiguous() or private.device != x.device:
        raise ValueError(f"private must be a contiguous bf16/fp16/fp32 tensor on {x.device}")
    if dept.dim() != 1 or dept.dtype != torch.int32 or not dept.is_contiguous() or dept.device != x.device:
        raise ValueError(
            f"dept must be a contiguous int32 [S] tensor on {x.device}, got {dept.dtype} {tuple(dept.shape)}"
        )
    S = dept.shape[0]
    if tuple(weights.shape) != (S, T, n) or weights.dtype != torch.float32 or not weights.is_contiguous():
        raise ValueError(
            f"weights must be a contiguous fp32 [S, T, n] = {(S, T, n)} tensor, got {tuple(weights.shape)}"
        )
    if tuple(tau.shape) != (D,) or tau.dtype != torch.float32 or tau.device != x.device:
        raise ValueError(f"tau must be an fp32 [D] = ({D},) tensor on {x.device}")
    if weights.device != x.device:
        raise ValueError("weights must be on x's device")
    if kept_total is not None and (kept_total.dtype != torch.int64 or kept_total.numel() != 1):
        raise ValueError("kept_total must be a one-element int64 tensor")
    if out is None:
        out = torch.empty(T, H, dtype=torch.float32, device=x.device)
    elif tuple(out.shape) != (T, H) or out.dtype != torch.float32 or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"out must be a contiguous fp32 [T, H] = {(T, H)} tensor on {x.device}")
    out.zero_()
    if S == 0:
        return out
    ws = torch.empty(2, S, T, h, dtype=torch.float32, device=x.device)  # u, z
    t_p2 = triton.next_power_of_2(T)
    bn = max(1, min(triton.next_power_of_2(BLOCK_N), triton.next_power_of_2(h)))
    bz = min(triton.next_power_of_2(BLOCK_Z), triton.next_power_of_2(h))
    bi = min(triton.next_power_of_2(BLOCK_I), triton.next_power_of_2(h))
    bo = min(triton.next_power_of_2(BLOCK_O), triton.next_power_of_2(H))
    count = kept_total is not None
    kept = kept_total if count else ws  # any pointer when not counting
    _dept_up_kernel[(S, triton.cdiv(h, bn))](
        x, w_gate, w_up, dept, weights, tau, ws[0], kept, T, h, n, x.stride(0), w_gate.stride(0), w_up.stride(0),
        H=H, H_P2=triton.next_power_of_2(H), N_P2=triton.next_power_of_2(n), T_P2=t_p2, BLOCK_N=bn, COUNT=count,
        num_warps=num_warps,
    )  # fmt: skip
    if indexed and tuple(private_slots.shape) != (S, n):
        raise ValueError(f"private_slots must be [S, n] = {(S, n)}, got {tuple(private_slots.shape)}")
    pstride_d, pstride_e = (0, private.stride(0)) if indexed else (private.stride(0), private.stride(1))
    _dept_private_kernel[(S, triton.cdiv(h, bz))](
        private, dept, weights, ws[0], ws[1], private_slots if indexed else dept, T, h, n, pstride_d, pstride_e,
        T_P2=t_p2, BLOCK_I=bi, BLOCK_Z=bz, INDEXED=indexed, num_warps=num_warps,
    )  # fmt: skip
    _dept_down_kernel[(triton.cdiv(H, bo), S)](
        w_down_t, dept, ws[1], out, T, h, w_down_t.stride(0), H=H, T_P2=t_p2, BLOCK_I=bi, BLOCK_O=bo,
        num_warps=num_warps,
    )  # fmt: skip
    return out
