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
tile). Only the span's rows of `h` are written. Fixed grid, no host sync: capturable. On the dense path behind
`DensePath.device_spans` (off), not yet timed (`python bench/grouped_gemm.py`).

Shape legend: M rows (slots), K input width (H), N expert width (I), E groups (experts) of the layer, G groups of
the span, g0 its first.
"""

from __future__ import annotations

import torch

from localmoe.kernels.checks import grouped_span
from localmoe.kernels.grouped_gemm import span_launch

try:  # Triton is optional at import time; the launcher needs it.
    import triton
    import triton.language as tl

    from localmoe.kernels.grouped_gemm import span_tile
    from localmoe.kernels.rounding import round_to
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None

__all__ = ["grouped_gate_up", "grouped_gate_up_ref"]


def grouped_gate_up_ref(x, w_gate, w_up, ends, g0: int, h, tau=None, kept=None, x_rows=None) -> torch.Tensor:
    """Reference (reads `ends` on the host): the span's rows of h as the dense path computes them in h's dtype (fp32
    products rounded once per op); returns h, its other rows untouched. `kept` (int64, one element) += kept neurons.
    `x_rows` [M]: row r's input is x[x_rows[r]]."""
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
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        G_P2: tl.constexpr,  # the span's groups rounded up to a power of two
        HAS_TAU: tl.constexpr,
        HAS_ROWS: tl.constexpr,
        DOT_F32: tl.constexpr,
        PREC: tl.constexpr,
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
            DT: tl.constexpr = h_ptr.dtype.element_ty
            z = round_to(acc_g, DT)
            act = round_to(z / (1.0 + tl.exp(-z)), DT)  # silu, rounded as torch's on h's dtype
            m2 = rmask[:, None] & cmask[None, :]
            if HAS_TAU:
                keep = (tl.abs(act) >= tl.load(tau_ptr + g0 + grp)) & m2
                act = tl.where(keep, act, 0.0)
                tl.atomic_add(kept_ptr, tl.sum(tl.sum(keep.to(tl.int64), axis=1), axis=0), sem="relaxed")
            h = round_to(act * round_to(acc_u, DT), DT)
            tl.store(h_ptr + rows.to(tl.int64)[:, None] * stride_hm + cols[None, :], h.to(DT), mask=m2)


def grouped_gate_up(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
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
    strides), h [M, N] of x's dtype; `ends` as kernels/grouped_gemm.py's `grouped_gemm`. With `x_rows` [M] int64
    (the sorted slots' tokens) x is [T, K] and row r reads x[x_rows[r]] in place (no gathered [M, K] copy). No host
    sync; capturable."""
    if triton is None:
        raise RuntimeError("grouped_gate_up needs triton")
    blocks = (BLOCK_M, BLOCK_N, BLOCK_K)
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
    _grouped_gate_up_kernel[grid](
        x,
        x_rows if x_rows is not None else ends,
        w_gate,
        w_up,
        ends,
        tau if tau is not None else ends,
        kept if kept is not None else ends,
        h,
        int(g0),
        G,
        N,
        K,
        x.stride(0),
        *w_gate.stride(),
        *w_up.stride(),
        h.stride(0),
        HAS_TAU=tau is not None,
        HAS_ROWS=x_rows is not None,
        **kw,
    )
    return h
