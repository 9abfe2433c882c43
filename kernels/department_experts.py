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
private (S * n, h / BLOCK_Z, row splits) reads each chosen expert's P rows of kept neurons once for all T tokens (a
program per (slot, expert, column block, block of ROWS input rows); experts no token chose end at once) and adds into
z atomically; down (H / BLOCK_O, S, row splits) reads the department's W_down_t in full once (z is dense) and adds
into y atomically. The row splits (about SPLIT_ROWS rows each) give a step of a few departments enough programs to
fill the GPU: at the Qwen3.5-35B twin's shape (S = 4, n = 20, h = 768, H = 2048) the private kernel has ~8 x 6 x 8
live programs, the down kernel 16 x 4 x 8. u, z and y live in one fp32 workspace ([y | z | u]; y and z zeroed in
one memset). The kept count (tokens x kept neurons) is added into `kept_total`.

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
        x_ptr, wg_ptr, wu_ptr, dept_ptr, w_ptr, tau_ptr, u_ptr, kept_ptr, seen_ptr,
        T, h, n, stride_xt, stride_gd, stride_ud,
        H: tl.constexpr, H_P2: tl.constexpr, N_P2: tl.constexpr, T_P2: tl.constexpr, BLOCK_N: tl.constexpr,
        COUNT: tl.constexpr, SEEN: tl.constexpr,
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
        considered = 0
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
            considered += tl.sum((valid & used).to(tl.int64), axis=0)
        if COUNT:
            tl.atomic_add(kept_ptr, total, sem="relaxed")
        if SEEN:
            tl.atomic_add(seen_ptr, considered, sem="relaxed")

    @triton.jit
    def _dept_private_kernel(
        p_ptr, dept_ptr, w_ptr, u_ptr, z_ptr, ps_ptr, T, h, n, stride_pd, stride_pe,
        T_P2: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_Z: tl.constexpr, ROWS: tl.constexpr, INDEXED: tl.constexpr,
    ):  # fmt: skip
        # program (s * n + j, column block, row split): expert j of slot s, rows [split * ROWS, +ROWS) of its P;
        # experts no token chose (most programs) and unused slots end at once
        s = tl.program_id(0) // n
        j = tl.program_id(0) % n
        cols = tl.program_id(1) * BLOCK_Z + tl.arange(0, BLOCK_Z)
        cmask = cols < h
        d = tl.load(dept_ptr + s)
        dd = tl.maximum(d, 0).to(tl.int64)
        tt = tl.arange(0, T_P2)
        tmask = tt < T
        wj = tl.load(w_ptr + (s * T + tt) * n + j, mask=tmask & ((tt * 0 + d) >= 0), other=0.0)  # [T_P2]
        if tl.sum(tl.abs(wj), axis=0) > 0:
            if INDEXED:  # a pool of private parts: expert j of slot s sits at private_slots[s, j]
                pbase = tl.load(ps_ptr + s * n + j).to(tl.int64) * stride_pe
            else:
                pbase = dd * stride_pd + j * stride_pe
            acc = tl.zeros((T_P2, BLOCK_Z), dtype=tl.float32)
            r0 = tl.program_id(2) * ROWS
            for i0 in range(0, ROWS, BLOCK_I):
                ii = r0 + i0 + tl.arange(0, BLOCK_I)
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
            tl.atomic_add(
                z_ptr + (s * T + tt[:, None]) * h + cols[None, :],
                acc,
                mask=tmask[:, None] & cmask[None, :],
                sem="relaxed",
            )

    @triton.jit
    def _dept_down_kernel(
        wd_ptr, dept_ptr, z_ptr, y_ptr, T, h, stride_dd,
        H: tl.constexpr, T_P2: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_O: tl.constexpr, ROWS: tl.constexpr,
    ):  # fmt: skip
        # program (column block, slot, row split): rows [split * ROWS, +ROWS) of the slot's W_down_t, all T tokens
        cols = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)
        s = tl.program_id(1)
        cmask = cols < H
        d = tl.load(dept_ptr + s)
        dd = tl.maximum(d, 0).to(tl.int64)
        tt = tl.arange(0, T_P2)
        tmask = tt < T
        if d >= 0:
            acc = tl.zeros((T_P2, BLOCK_O), dtype=tl.float32)
            r0 = tl.program_id(2) * ROWS
            for i0 in range(0, ROWS, BLOCK_I):
                ii = r0 + i0 + tl.arange(0, BLOCK_I)
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


def _split(rows: int, block: int, target: int) -> tuple[int, int]:
    """(rows per program, programs) splitting `rows` into chunks of about `target` rows, multiples of `block`."""
    per = max(block, (min(rows, target) + block - 1) // block * block)
    return per, (rows + per - 1) // per


def department_experts(
    x, w_gate, w_up, w_down_t, private, dept, weights, tau, out=None, *, kept_total=None, seen_total=None,
    private_slots=None,
    BLOCK_N: int = 4, BLOCK_I: int = 0, BLOCK_Z: int = 128, BLOCK_O: int = 128, SPLIT_ROWS: int = 96,
    num_warps: int = 4,
):  # fmt: skip
    """y [T, H] fp32 = the department-grouped DeaMoE experts of a step (module doc); `out` is zeroed and filled.

    x [T, H] (T <= MAX_TOKENS), w_gate/w_up/w_down_t [D, h, H], private [D, n, h, h] (bf16/fp16/fp32, rows
    contiguous), dept [S] int32 (-1 = unused slot), weights [S, T, n] fp32, tau [D] fp32; `kept_total` (0-d int64)
    gets the kept (token, neuron) count added, `seen_total` (0-d int64) the (token, neuron) count considered (the
    step's (token, department) pairs x h): a module's sparsity counters, added in place with no launch of their own.
    With `private_slots` [S, n] int32, private is a pool [P, h, h] and
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
    for name, c in (("kept_total", kept_total), ("seen_total", seen_total)):
        if c is not None and (c.dtype != torch.int64 or c.numel() != 1 or c.device != x.device):
            raise ValueError(f"{name} must be a one-element int64 tensor on {x.device}")
    if out is not None and (
        tuple(out.shape) != (T, H) or out.dtype != torch.float32 or not out.is_contiguous() or out.device != x.device
    ):
        raise ValueError(f"out must be a contiguous fp32 [T, H] = {(T, H)} tensor on {x.device}")
    # one fp32 workspace: [y (T*H, unless `out`) | z (S*T*h) | u (S*T*h)]; y and z accumulate atomically, so they
    # are zeroed, in one memset when `out` is not given
    own = 0 if out is not None else T * H
    buf = torch.empty(own + 2 * S * T * h, dtype=torch.float32, device=x.device)
    buf[: own + S * T * h].zero_()
    if out is None:
        out = buf[:own].view(T, H)
    else:
        out.zero_()
    if S == 0:
        return out
    z_ws = buf[own : own + S * T * h]
    u_ws = buf[own + S * T * h :]
    t_p2 = triton.next_power_of_2(T)
    bn = max(1, min(triton.next_power_of_2(BLOCK_N), triton.next_power_of_2(h)))
    bz = min(triton.next_power_of_2(BLOCK_Z), triton.next_power_of_2(h))
    block_i = BLOCK_I or (64 if t_p2 == 1 else 32 if t_p2 == 2 else 16)  # the [T, BLOCK_I, BLOCK_Z] product's size
    bi = min(triton.next_power_of_2(block_i), triton.next_power_of_2(h))
    bo = min(triton.next_power_of_2(BLOCK_O), triton.next_power_of_2(H))
    rows, splits = _split(h, bi, SPLIT_ROWS)
    count, see = kept_total is not None, seen_total is not None
    kept = kept_total if count else buf  # any pointer when not counting
    seen = seen_total if see else buf
    _dept_up_kernel[(S, triton.cdiv(h, bn))](
        x, w_gate, w_up, dept, weights, tau, u_ws, kept, seen, T, h, n, x.stride(0), w_gate.stride(0), w_up.stride(0),
        H=H, H_P2=triton.next_power_of_2(H), N_P2=triton.next_power_of_2(n), T_P2=t_p2, BLOCK_N=bn, COUNT=count,
        SEEN=see, num_warps=num_warps,
    )  # fmt: skip
    if indexed and tuple(private_slots.shape) != (S, n):
        raise ValueError(f"private_slots must be [S, n] = {(S, n)}, got {tuple(private_slots.shape)}")
    pstride_d, pstride_e = (0, private.stride(0)) if indexed else (private.stride(0), private.stride(1))
    _dept_private_kernel[(S * n, triton.cdiv(h, bz), splits)](
        private, dept, weights, u_ws, z_ws, private_slots if indexed else dept, T, h, n, pstride_d, pstride_e,
        T_P2=t_p2, BLOCK_I=bi, BLOCK_Z=bz, ROWS=rows, INDEXED=indexed, num_warps=num_warps,
    )  # fmt: skip
    _dept_down_kernel[(triton.cdiv(H, bo), S, splits)](
        w_down_t, dept, z_ws, out, T, h, w_down_t.stride(0), H=H, T_P2=t_p2, BLOCK_I=bi, BLOCK_O=bo, ROWS=rows,
        num_warps=num_warps,
    )  # fmt: skip
    return out
