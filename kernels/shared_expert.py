"""Shared expert (Qwen3.5 `Qwen3_5MoeMLP` + sigmoid `shared_expert_gate`; DeepSeek-V2's `shared_experts`, no gate)
for a few tokens in two Triton launches.

What transformers does in `Qwen3_5MoeSparseMoeBlock.forward` for the shared expert (each step rounds to x.dtype):

    s   = down( silu(x·W_gateᵀ) * (x·W_upᵀ) )               Qwen3_5MoeMLP, hidden_act silu
    out = routed + sigmoid(x·w_sgᵀ) * s                       shared_expert_gate: Linear(H, 1, bias=False)

Two launches (the split follows the data dependence: down needs every intermediate neuron of the token):

1. `_gate_up_kernel`, grid (T, cdiv(I, BLOCK_I)): program (t, j) computes neurons [j·BLOCK_I, (j+1)·BLOCK_I) of
   gate and up (two GEMV tiles over H in BLOCK_H chunks, fp32 accumulation), a = silu(g)·u with transformers'
   roundings, and stores a [T, I]. Program (t, 0) also computes the scalar gate sigmoid(x·w_sg) -> sg [T].
   gate_proj.weight and up_proj.weight are read in place (no concatenated copy).
2. `_down_add_kernel`, grid (T, cdiv(H, BLOCK_H)): program (t, j) computes outputs [j·BLOCK_H, ...) of
   s = a·W_downᵀ (rows of down_proj.weight [H, I], contiguous), then out = routed + round(sg·round(s)).
   `out` may alias `routed` (in place: each element is read, then written, by one program). With `residual`,
   out = residual + round(routed + round(sg·round(s))): the decoder layer's closing residual add, fused.

Every dtype round trip transformers makes (each linear's output, silu, the product, the gate's sigmoid, the scale,
the add) is reproduced with `round_to`, so the only difference from transformers is the GEMV accumulation order.

Why not one launch: down needs all I activations of the token; one launch would need either a grid-wide exchange
(ticket + one program doing the whole [H, I] down GEMV: serial over 2 MB, far slower on a GPU) or recomputing gate/up
per output block. Why not fold launch 1 into the router's launch: possible (both only read x) and would save one node
per layer; kept separate so each kernel has one job and its own test.

Shape legend: T tokens, H hidden, I shared-expert intermediate size.
  x [T, H] · w_gate, w_up [I, H] · w_down [H, I] · w_sg [1, H] (or [H]) · routed, out [T, H] · a [T, I] · sg [T]
"""

from __future__ import annotations

import torch

try:  # Triton is optional at import time; the launcher needs it.
    import triton
    import triton.language as tl

    from localmoe.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_kw
    from localmoe.kernels.rounding import round_to
except ImportError:  # pragma: no cover
    triton = None
    tl = None

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------------------------
# torch reference (transformers' formulas, written out)
# ----------------------------------------------------------------------------------------------------------
def shared_expert_ref(x, w_gate, w_up, w_down, w_sg, routed):
    """w_sg None: no gate (DeepSeek-V2's shared experts: routed + s)."""
    F = torch.nn.functional
    s = F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)
    return routed + (s if w_sg is None else torch.sigmoid(F.linear(x, w_sg.reshape(1, -1))) * s)


# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _gate_up_kernel(
        x_ptr,  # [T, H] row stride stride_x
        wg_ptr,  # [I, H] contiguous
        wu_ptr,  # [I, H] contiguous
        wsg_ptr,  # [H]
        a_ptr,  # [T, I] out (x.dtype)
        sg_ptr,  # [T] out sigmoid gate (x.dtype)
        H,
        I,
        stride_x,
        BLOCK_I: tl.constexpr,
        BLOCK_H: tl.constexpr,
        PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
        GATED: tl.constexpr = True,  # False: no shared_expert_gate (wsg_ptr unused, sg not written)
    ):
        t = tl.program_id(0).to(tl.int64)
        pid = tl.program_id(1)
        rows = pid * BLOCK_I + tl.arange(0, BLOCK_I)
        rmask = rows < I
        cols = tl.arange(0, BLOCK_H)
        x_row = x_ptr + t * stride_x
        roff = rows.to(tl.int64)[:, None] * H
        acc_g = tl.zeros([BLOCK_I, BLOCK_H], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_I, BLOCK_H], dtype=tl.float32)
        acc_s = tl.zeros([BLOCK_H], dtype=tl.float32)
        cm = cols < H
        m2 = rmask[:, None] & cm[None, :]
        wg = tl.load(wg_ptr + roff + cols[None, :], mask=m2, other=0.0)  # the first tile's weights: before the wait
        wu = tl.load(wu_ptr + roff + cols[None, :], mask=m2, other=0.0)
        first = ((tl.zeros([BLOCK_H], dtype=tl.int32) + pid) == 0) & GATED  # program 0 also computes the gate
        ws = tl.load(wsg_ptr + cols, mask=cm & first, other=0.0).to(tl.float32)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        for h0 in range(0, H, BLOCK_H):
            if h0 > 0:
                cm = (h0 + cols) < H
                m2 = rmask[:, None] & cm[None, :]
                wg = tl.load(wg_ptr + roff + h0 + cols[None, :], mask=m2, other=0.0)
                wu = tl.load(wu_ptr + roff + h0 + cols[None, :], mask=m2, other=0.0)
                ws = tl.load(wsg_ptr + h0 + cols, mask=cm & first, other=0.0).to(tl.float32)
            xv = tl.load(x_row + h0 + cols, mask=cm, other=0.0).to(tl.float32)
            acc_g += wg.to(tl.float32) * xv[None, :]
            acc_u += wu.to(tl.float32) * xv[None, :]
            acc_s += ws * xv
        DT = a_ptr.dtype.element_ty
        g = round_to(tl.sum(acc_g, axis=1), DT)
        u = round_to(tl.sum(acc_u, axis=1), DT)
        act = round_to(g / (1.0 + tl.exp(-g)), DT)  # silu, rounded as torch's silu on x.dtype
        a = round_to(act * u, DT)
        tl.store(a_ptr + t * I + rows, a.to(DT), mask=rmask)
        if GATED and pid == 0:
            z = round_to(tl.sum(acc_s, axis=0), DT)
            sg = round_to(1.0 / (1.0 + tl.exp(-z)), DT)
            tl.store(sg_ptr + t, sg.to(DT))

    @triton.jit
    def _down_add_kernel(
        a_ptr,  # [T, I] (x.dtype)
        wd_ptr,  # [H, I] contiguous
        sg_ptr,  # [T]
        r_ptr,  # [T, H] routed experts' output, row stride stride_r
        o_ptr,  # [T, H] out, row stride stride_o (may alias r)
        res_ptr,  # [T, H] residual, row stride stride_res (HAS_RES only)
        H,
        I,
        stride_r,
        stride_o,
        stride_res,
        HAS_RES: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_I: tl.constexpr,
        PDL: tl.constexpr,
        GATED: tl.constexpr = True,
    ):
        t = tl.program_id(0).to(tl.int64)
        pid = tl.program_id(1)
        rows = pid * BLOCK_H + tl.arange(0, BLOCK_H)  # output features
        rmask = rows < H
        cols = tl.arange(0, BLOCK_I)
        roff = rows.to(tl.int64)[:, None] * I
        acc = tl.zeros([BLOCK_H, BLOCK_I], dtype=tl.float32)
        cm = cols < I
        wd = tl.load(wd_ptr + roff + cols[None, :], mask=rmask[:, None] & cm[None, :], other=0.0)  # before the wait
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        for i0 in range(0, I, BLOCK_I):
            if i0 > 0:
                cm = (i0 + cols) < I
                wd = tl.load(wd_ptr + roff + i0 + cols[None, :], mask=rmask[:, None] & cm[None, :], other=0.0)
            av = tl.load(a_ptr + t * I + i0 + cols, mask=cm, other=0.0).to(tl.float32)
            acc += wd.to(tl.float32) * av[None, :]
        DT = o_ptr.dtype.element_ty
        s = round_to(tl.sum(acc, axis=1), DT)
        if GATED:
            sg = tl.load(sg_ptr + t).to(tl.float32)
            s = round_to(sg * s, DT)
        r = tl.load(r_ptr + t * stride_r + rows, mask=rmask, other=0.0).to(tl.float32)
        v = round_to(r + s, DT)
        if HAS_RES:
            v = round_to(tl.load(res_ptr + t * stride_res + rows, mask=rmask, other=0.0).to(tl.float32) + v, DT)
        tl.store(o_ptr + t * stride_o + rows, v.to(DT), mask=rmask)


def _rows(t: torch.Tensor, N: int) -> torch.Tensor:
    v = t.reshape(-1, N)
    return v if v.stride(-1) == 1 else v.contiguous()


def shared_expert(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    w_sg: torch.Tensor,
    routed: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    block_i: int = 16,
    block_h: int = 256,
    down_block_h: int = 32,
    down_block_i: int = 128,
    num_warps: int = 4,
):
    """routed + sigmoid(x·w_sgᵀ) · down(silu(x·w_gateᵀ) · x·w_upᵀ) in two launches (module docstring), plus
    `residual` when given (added last, after the sum is rounded). x, routed, residual [T, H] (or [..., H]); returns
    out with routed's shape; `out=routed` works in place. `w_sg` None: no gate, routed + down(...) (DeepSeek-V2's
    shared experts)."""
    if triton is None:
        raise RuntimeError("shared_expert needs triton")
    H = x.shape[-1]
    I = w_gate.shape[0]
    gated = w_sg is not None
    if w_gate.shape != (I, H) or w_up.shape != (I, H) or w_down.shape != (H, I) or (gated and w_sg.numel() != H):
        raise ValueError(
            f"shapes do not match H={H}, I={I}: gate {tuple(w_gate.shape)}, up {tuple(w_up.shape)}, "
            f"down {tuple(w_down.shape)}, shared_expert_gate {tuple(w_sg.shape) if gated else None}"
        )
    if routed.shape != x.shape:
        raise ValueError(f"routed shape {tuple(routed.shape)} != x shape {tuple(x.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    tensors = (
        (x, w_gate, w_up, w_down, routed) + ((w_sg,) if gated else ()) + ((residual,) if residual is not None else ())
    )
    dts = {t.dtype for t in tensors}
    if len(dts) != 1 or x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"all tensors must share one float dtype, got {sorted(map(str, dts))}")
    if len({t.device for t in tensors}) != 1:
        raise ValueError("all tensors must be on one device")
    for b in (block_i, block_h, down_block_h, down_block_i):
        if b & (b - 1):
            raise ValueError("block sizes must be powers of two")
    w_gate, w_up, w_down = (w if w.is_contiguous() else w.contiguous() for w in (w_gate, w_up, w_down))
    w_sg = w_sg.reshape(H) if gated else x  # (not read without a gate)
    w_sg = w_sg if w_sg.stride(-1) == 1 else w_sg.contiguous()
    x2 = _rows(x, H)
    r2 = _rows(routed, H)
    res2 = _rows(residual, H) if residual is not None else r2
    if out is None:
        out = torch.empty(routed.shape, dtype=routed.dtype, device=routed.device)
    elif out.shape != routed.shape or out.dtype != routed.dtype:
        raise ValueError(f"out must be {tuple(routed.shape)} {routed.dtype}")
    o2 = out.view(-1, H)  # raises if out has no such view
    if o2.stride(-1) != 1:
        raise ValueError("out's last dim must be contiguous")
    T = x2.shape[0]
    if T == 0:
        return out
    a = torch.empty((T, I), dtype=x.dtype, device=x.device)
    sg = torch.empty((T,), dtype=x.dtype, device=x.device)
    bi = min(block_i, triton.next_power_of_2(I))
    bh = min(block_h, triton.next_power_of_2(H))
    _gate_up_kernel[(T, triton.cdiv(I, bi))](
        x2, w_gate, w_up, w_sg, a, sg, H, I, x2.stride(0), BLOCK_I=bi, BLOCK_H=bh, num_warps=num_warps,
        GATED=gated, **pdl_kw(x),
    )  # fmt: skip
    dbh = min(down_block_h, triton.next_power_of_2(H))
    dbi = min(down_block_i, triton.next_power_of_2(I))
    _down_add_kernel[(T, triton.cdiv(H, dbh))](
        a,
        w_down,
        sg,
        r2,
        o2,
        res2,
        H,
        I,
        r2.stride(0),
        o2.stride(0),
        res2.stride(0),
        HAS_RES=residual is not None,
        BLOCK_H=dbh,
        BLOCK_I=dbi,
        num_warps=num_warps,
        GATED=gated,
        **pdl_kw(x),
    )
    return out
