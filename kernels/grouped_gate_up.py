"""A span of experts' gate and up projections with the SwiGLU and the sparse path's threshold as their epilogue, the
group ends read on the device: the dense path's first half of a layer with no host read and no elementwise launches.

Owns `grouped_gate_up` (Triton launcher), its torch reference `grouped_gate_up_ref` and `_grouped_gate_up_kernel`:

    for each group g of the span [g0, g0 + G) and each of its rows r (rows [ends[g - 1], ends[g])):
        z = x[r] @ w_gate[g - g0].T,  a = silu(z),  u = x[r] @ w_up[g - g0].T
        h[r] = a * u,  with a set to 0 where |a| < tau[g] (when `tau` is given; the kept count added to `kept`)

each intermediate rounded to h's dtype as torch's ops on that dtype round them (z, a, u and the product: the dense
path's `act_fn(grouped_mm(..)) * grouped_mm(..)` and its mask), accumulation in fp32. Rows, groups and the grid as
kernels/grouped_gemm.py's (its module docstring says why the ends stay on the device): grid (cdiv(M, BLOCK_M) + G,
cdiv(N, BLOCK_N)), one program a row tile and column tile of both projections (two accumulators over the same x
tile). Only the span's rows of `h` are written. int4 gate and up stacks (`Int4Tensor` [G, N, K], packed along K as
the int4 format stores them) are read in place: each K step loads [BLOCK_K / 2, BLOCK_N] packed bytes per projection
and their groups' scales and minimums, dequantizes them in registers as kernels/dequant_int4.py does, and runs two
dots, x's even columns against the low nibbles and its odd columns against the high ones (kernels/grouped_gemm.py's
module doc says what that saves). Fixed grid, no host sync: capturable. On the dense path behind
`DensePath.device_spans` (off), not yet timed (`python bench/grouped_gemm.py`).

Shape legend: M rows (slots), K input width (H), N expert width (I), E groups (experts) of the layer, G groups of
the span, g0 its first.
"""

from __future__ import annotations

import torch

from localmoe.kernels.checks import grouped_span
from localmoe.kernels.grouped_gemm import int4_parts, span_launch
from localmoe.kernels.int4 import Int4Tensor

try:  # Triton is optional at import time; the launcher needs it.
    import triton
    import triton.language as tl

    from localmoe.kernels.grouped_gemm import span_tile, w4_tile
    from localmoe.kernels.rounding import round_to
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None

__all__ = ["grouped_gate_up", "grouped_gate_up_ref"]


def grouped_gate_up_ref(x, w_gate, w_up, ends, g0: int, h, tau=None, kept=None, x_rows=None) -> torch.Tensor:
    """Reference (reads `ends` on the host): the span's rows of h as the dense path computes them in h's dtype (fp32
    products rounded once per op); returns h, its other rows untouched. `kept` (int64, one element) += kept neurons.
    `x_rows` [M]: row r's input is x[x_rows[r]]. Int4Tensor stacks are dequantized to x's dtype first."""
    if isinstance(w_gate, Int4Tensor):
        w_gate, w_up = w_gate.dequantize(x.dtype), w_up.dequantize(x.dtype)
    if x_rows is not None:
        x = x[x_rows]
    end = [0] + ends.tolist()
    dt = h.dtype
    for i in range(w_gate.shape[0]):
        a, b = end[g0 + i], end[g0 + i + 1]
        if b <= a:
            continue
        z = (x[a:b].float() @ w_gate[i].float().T).to(dt)
        act = torch.nn.functional.silu(z.float()).to(dt)
        if tau is not None:
            keep = act.float().abs() >= tau[g0 + i].float()
            act = act * keep
            if kept is not None:
                kept += keep.sum()
        u = (x[a:b].float() @ w_up[i].float().T).to(dt)
        h[a:b] = (act.float() * u.float()).to(dt)
    return h


if triton is not None:

    @triton.jit
    def _grouped_gate_up_kernel(
        x_ptr,  # [M, K], rows sorted by group; HAS_ROWS: [T, K], row r is x[x_rows[r]]
        xr_ptr,  # [M] int64 (HAS_ROWS)
        wg_ptr,  # [G, N, K]
        wu_ptr,  # [G, N, K]
        ends_ptr,  # [E] int32 cumulative group ends
        tau_ptr,  # [E] fp32 (HAS_TAU)
        kept_ptr,  # [1] int64 (HAS_TAU)
        h_ptr,  # [M, N]
        g0,
        G,
        N,
        K,
        stride_xm,
        stride_gg,
        stride_gn,
        stride_gk,
        stride_ug,
        stride_un,
        stride_uk,
        stride_hm,
        gs_ptr,  # W4: the gate's scales [G, N, NG]
        gm_ptr,  # W4: the gate's minimums
        us_ptr,  # W4: the up projection's scales
        um_ptr,  # W4: the up projection's minimums
        stride_sg,  # W4: the four scale / minimum stacks' strides
        stride_sn,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        G_P2: tl.constexpr,  # the span's groups rounded up to a power of two
        HAS_TAU: tl.constexpr,
        HAS_ROWS: tl.constexpr,
        DOT_F32: tl.constexpr,
        PREC: tl.constexpr,
        W4: tl.constexpr,  # int4 weights read in place: wg_ptr / wu_ptr the packed bytes [G, N, K / 2] (module doc)
        GS: tl.constexpr,  # W4: weights a scale group (along K)
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        grp, row0, rend = span_tile(ends_ptr, g0, G, pid_m, BLOCK_M, G_P2)  # kernels/grouped_gemm.py
        if grp >= 0:
            rows = row0 + tl.arange(0, BLOCK_M)
            rmask = rows < rend
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            cmask = cols < N
            if HAS_ROWS:  # the slots' tokens: x read in place, no gathered copy
                src = tl.load(xr_ptr + rows, mask=rmask, other=0)
            else:
                src = rows.to(tl.int64)
            xrow = x_ptr + src[:, None] * stride_xm
            c64 = cols.to(tl.int64)[None, :]
            gcol = wg_ptr + grp.to(tl.int64) * stride_gg + c64 * stride_gn
            ucol = wu_ptr + grp.to(tl.int64) * stride_ug + c64 * stride_un
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            DT: tl.constexpr = h_ptr.dtype.element_ty
            if W4:
                srow = grp.to(tl.int64) * stride_sg + c64 * stride_sn  # [1, BLOCK_N] the columns' scale rows
                for k0 in range(0, K, BLOCK_K):
                    ks = k0 + tl.arange(0, BLOCK_K)
                    a = tl.load(xrow + ks[None, :], mask=rmask[:, None] & (ks < K)[None, :], other=0.0)
                    a_even, a_odd = tl.split(tl.reshape(a, [BLOCK_M, BLOCK_K // 2, 2]))  # x[2j], x[2j + 1]
                    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # byte rows: weights 2kb (low nibble), 2kb + 1
                    wm = (kb < K // 2)[:, None] & cmask[None, :]
                    kg = ((2 * kb) // GS)[:, None]  # each byte row's scale group
                    acc_g = _w4_k_step(
                        a_even, a_odd, gcol + kb[:, None], gs_ptr + srow + kg, gm_ptr + srow + kg, wm, acc_g, DT,
                        DOT_F32, PREC,
                    )  # fmt: skip
                    acc_u = _w4_k_step(
                        a_even, a_odd, ucol + kb[:, None], us_ptr + srow + kg, um_ptr + srow + kg, wm, acc_u, DT,
                        DOT_F32, PREC,
                    )  # fmt: skip
            else:
                for k0 in range(0, K, BLOCK_K):
                    ks = k0 + tl.arange(0, BLOCK_K)
                    km = ks < K
                    k64 = ks.to(tl.int64)[:, None]
                    wm = km[:, None] & cmask[None, :]
                    a = tl.load(xrow + ks[None, :], mask=rmask[:, None] & km[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
                    bg = tl.load(gcol + k64 * stride_gk, mask=wm, other=0.0)  # [BLOCK_K, BLOCK_N]
                    bu = tl.load(ucol + k64 * stride_uk, mask=wm, other=0.0)
                    if DOT_F32:
                        af = a.to(tl.float32)
                        acc_g = tl.dot(af, bg.to(tl.float32), acc_g, input_precision="ieee")
                        acc_u = tl.dot(af, bu.to(tl.float32), acc_u, input_precision="ieee")
                    else:
                        acc_g = tl.dot(a, bg, acc_g, input_precision=PREC)
                        acc_u = tl.dot(a, bu, acc_u, input_precision=PREC)
            z = round_to(acc_g, DT)
            act = round_to(z / (1.0 + tl.exp(-z)), DT)  # silu, rounded as torch's on h's dtype
            m2 = rmask[:, None] & cmask[None, :]
            if HAS_TAU:
                keep = (tl.abs(act) >= tl.load(tau_ptr + g0 + grp)) & m2
                act = tl.where(keep, act, 0.0)
                tl.atomic_add(kept_ptr, tl.sum(tl.sum(keep.to(tl.int64), axis=1), axis=0), sem="relaxed")
            h = round_to(act * round_to(acc_u, DT), DT)
            tl.store(h_ptr + rows.to(tl.int64)[:, None] * stride_hm + cols[None, :], h.to(DT), mask=m2)

    @triton.jit
    def _w4_k_step(a_even, a_odd, p_ptrs, s_ptrs, m_ptrs, wm, acc, DT: tl.constexpr, DOT_F32: tl.constexpr, PREC):
        """acc += x's K step against one projection's int4 weights packed along K: the bytes [BLOCK_K / 2, BLOCK_N]
        at p_ptrs, their groups' scales and minimums, each weight dequantized as kernels/dequant_int4.py does (fp32 q *
        scale + minimum, rounded to DT); the even K rows (low nibbles) against x's even columns, the odd against the
        odd."""
        lo, hi = w4_tile(p_ptrs, s_ptrs, m_ptrs, wm, DT)  # kernels/grouped_gemm.py
        if DOT_F32:
            acc = tl.dot(a_even.to(tl.float32), lo, acc, input_precision="ieee")
            return tl.dot(a_odd.to(tl.float32), hi, acc, input_precision="ieee")
        acc = tl.dot(a_even, lo.to(DT), acc, input_precision=PREC)
        return tl.dot(a_odd, hi.to(DT), acc, input_precision=PREC)


def grouped_gate_up(
    x: torch.Tensor,
    w_gate: torch.Tensor | Int4Tensor,
    w_up: torch.Tensor | Int4Tensor,
    ends: torch.Tensor,
    g0: int,
    h: torch.Tensor,
    *,
    tau: torch.Tensor | None = None,
    kept: torch.Tensor | None = None,
    x_rows: torch.Tensor | None = None,
    BLOCK_M: int = 64,
    BLOCK_N: int = 64,
    BLOCK_K: int = 32,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """h[r] = silu(x[r] @ w_gate[g - g0].T) * (x[r] @ w_up[g - g0].T) for the rows r of each group g of the span
    [g0, g0 + G), the activation zeroed where |silu| < tau[g] when `tau` ([E] fp32) is given, with the kept count
    added to `kept` (one-element int64, required with tau); returns h. x [M, K], w_gate / w_up [G, N, K] (any
    strides), or both `Int4Tensor` stacks [G, N, K] read in place (module doc; BLOCK_K >= 32), h [M, N] of x's dtype;
    `ends` as kernels/grouped_gemm.py's `grouped_gemm`. With `x_rows` [M] int64
    (the sorted slots' tokens) x is [T, K] and row r reads x[x_rows[r]] in place (no gathered [M, K] copy). No host
    sync; capturable."""
    if triton is None:
        raise RuntimeError("grouped_gate_up needs triton")
    blocks = (BLOCK_M, BLOCK_N, BLOCK_K)
    w4 = isinstance(w_gate, Int4Tensor)
    if w4:
        if not isinstance(w_up, Int4Tensor) or w_up.shape != w_gate.shape:
            raise ValueError(f"w_up must match w_gate: an int4 stack {tuple(w_gate.shape)}")
        (pg, gs, gm), group = int4_parts(w_gate, x, "w_gate", BLOCK_K)
        (pu, us, um), _ = int4_parts(w_up, x, "w_up", BLOCK_K)
        if us.stride() != gs.stride() or w_up.group != group:
            raise ValueError("w_up's scales must have w_gate's group size and strides")
        meta = x.new_empty(()).expand(*w_gate.shape)  # the shape grouped_span checks, no memory
        M, K, G, N = grouped_span(x, meta, ends, g0, h, blocks, "w_gate", "h", x_rows=x_rows)
    else:
        M, K, G, N = grouped_span(x, w_gate, ends, g0, h, blocks, "w_gate", "h", x_rows=x_rows)
        if tuple(w_up.shape) != tuple(w_gate.shape) or w_up.dtype != w_gate.dtype or w_up.device != x.device:
            raise ValueError(f"w_up must match w_gate: {w_gate.dtype} {tuple(w_gate.shape)} on {x.device}")
    if h.dtype != x.dtype:
        raise ValueError(f"h must have x's dtype {x.dtype} (the dense path's roundings), got {h.dtype}")
    if (tau is None) != (kept is None):
        raise ValueError("tau and kept go together: the threshold and the count of kept neurons")
    if tau is not None:
        if tau.dim() != 1 or tau.dtype != torch.float32 or tau.shape[0] < g0 + G or tau.device != x.device:
            raise ValueError(f"tau must be float32 [E] with E >= g0 + G = {g0 + G} on {x.device}")
        if kept.dtype != torch.int64 or kept.numel() != 1 or kept.device != x.device:
            raise ValueError(f"kept must be a one-element int64 tensor on {x.device}")
    if M == 0 or G == 0 or N == 0:
        return h
    grid, kw = span_launch(x, M, N, G, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
    if w4:  # the packed bytes' strides in the weights' places (their K stride: 1 byte), then the scales'
        weights = (pg, pu, *pg.stride()[:2], 1, *pu.stride()[:2], 1)
        scales = (gs, gm, us, um, gs.stride(0), gs.stride(1))
    else:
        weights = (w_gate, w_up, *w_gate.stride(), *w_up.stride())
        scales = (ends, ends, ends, ends, 0, 0)
    _grouped_gate_up_kernel[grid](
        x, x_rows if x_rows is not None else ends, weights[0], weights[1], ends, tau if tau is not None else ends,
        kept if kept is not None else ends, h, int(g0), G, N, K, x.stride(0), *weights[2:], h.stride(0), *scales,
        HAS_TAU=tau is not None, HAS_ROWS=x_rows is not None, W4=w4, GS=group if w4 else 1, **kw,
    )  # fmt: skip
    return h
