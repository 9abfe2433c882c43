"""A grouped GEMM whose group boundaries stay on the device: a span of experts' GEMM with no host sync.

Owns `grouped_gemm` (Triton launcher), its torch reference `grouped_gemm_ref` and the kernel `_grouped_gemm_kernel`:

    out[r] = x[r] @ w[g - g0].T    for each group g of the span [g0, g0 + G) and each of its rows r,
                                   rows [ends[g - 1], ends[g]) (ends[-1] read as 0)

x [M, K] holds the rows sorted by group (the dense path's (token, expert) slots sorted by expert), w [G, N, K] the
span's weights (a staging buffer's or a dequantized span's [n, I, H] gate or up stack; the down projection's [n, I,
H] stack transposed, any strides), `ends` [E] int32 the cumulative group
ends over all E groups, on the device. Only the span's rows of `out` [M, N] are written (fp32 accumulation, stored
in out's dtype); every other row is left as it was, so the spans of a layer fill one output between them.

Why: torch's grouped_mm takes the span's rows as a host slice (x[s0:s1]) and its offsets relative to it, so the dense
path reads the layer's routing back to the host once a layer (`ends.tolist()` in experts/dense_path.py) and the GPU
drains there: an offloaded 2048-token int4 piece at Qwen3.5-35B-A3B shapes idles 112.6 of 374.6 profiled ms, bound by
the host issuing its ~4,500 launches (bench/RESULTS.md, session 32). This kernel needs only M, the host's bound on the
rows (T·k), and the span's first group: grid (cdiv(M, BLOCK_M) + G, cdiv(N, BLOCK_N)), the sum over the span's groups
of cdiv(rows, BLOCK_M) row tiles being at most cdiv(M, BLOCK_M) + G. Program (t, n) finds its group and rows from
one vector load of the span's G group ends and their tiles' running sum (`span_tile`); a program past the span's
tiles returns at once. Fixed grid, no host sync: capturable. On the dense path behind `DensePath.device_spans` (off),
not yet timed against torch's grouped_mm on a GPU (`python bench/grouped_gemm.py`).

int4 weights in place (`w` an `Int4Tensor` [G, K, N], packed along N: the down projection's w_down_t stack as the
int4 format stores it, kernels/int4.py): each program loads a [BLOCK_K, BLOCK_N / 2] tile of packed bytes and their
groups' scales and minimums, dequantizes it in registers exactly as kernels/dequant_int4.py does (fp32 q * scale +
minimum, rounded once to x's dtype), and runs two dots over the same K steps, the even columns (low nibbles) and the
odd ones, interleaved at the store: the same weights and products as a dequantized stack with no [G, K, N] copy of
the model's dtype written and read again (issue #29: a 2048-token int4 piece dequantized ~64 GB through HBM).

Under TRITON_INTERPRET=1 bf16 / fp16 tiles are multiplied in fp32 (`DOT_F32`: the interpreter's low-precision
tl.dot is wrong in triton 3.x, as kernels/mla_decode.py notes); fp32 inputs use full fp32 dots ("ieee"), like torch's
fp32 matmuls.

Shape legend: M rows (slots), K input width (H), N output width (I), E groups (experts) of the layer, G groups of the
span, g0 the span's first group.
"""

from __future__ import annotations

import os

import torch

from localmoe.kernels.checks import grouped_span
from localmoe.kernels.int4 import Int4Tensor

try:  # Triton is optional at import time; the launcher needs it.
    import triton
    import triton.language as tl

    from localmoe.kernels.rounding import round_to
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None

__all__ = ["grouped_gemm", "grouped_gemm_ref"]


def grouped_gemm_ref(x: torch.Tensor, w, ends: torch.Tensor, g0: int, out: torch.Tensor) -> torch.Tensor:
    """Reference (fp32 products, reads `ends` on the host): out[r] = x[r] @ w[g - g0].T for the span's rows; returns
    out, its other rows untouched. An Int4Tensor w [G, K, N] is dequantized to x's dtype first (its definition)."""
    if isinstance(w, Int4Tensor):
        w = w.dequantize(x.dtype).transpose(1, 2)
    end = [0] + ends.tolist()
    for i in range(w.shape[0]):
        a, b = end[g0 + i], end[g0 + i + 1]
        if b > a:
            out[a:b] = (x[a:b].float() @ w[i].float().T).to(out.dtype)
    return out


if triton is not None:

    @triton.jit
    def span_tile(ends_ptr, g0, G, pid_m, BLOCK_M: tl.constexpr, G_P2: tl.constexpr):
        """Row tile pid_m of the span [g0, g0 + G) of groups: (its group's index in the span, its first row, its
        group's end row), the group -1 past the span's tiles. One vector load of the span's group ends (G_P2 >= G, a
        power of two), each group's cdiv(rows, BLOCK_M) tiles and their running sum: no loop of dependent scalar
        loads before the program's first tile load."""
        i = tl.arange(0, G_P2)
        m = i < G
        end = tl.load(ends_ptr + g0 + i, mask=m, other=0)
        start = tl.load(ends_ptr + g0 + i - 1, mask=m & (g0 + i > 0), other=0)
        nt = tl.where(m, (end - start + BLOCK_M - 1) // BLOCK_M, 0)
        cum = tl.cumsum(nt, 0)  # tiles up to and with group i
        hit = (pid_m >= cum - nt) & (pid_m < cum)
        grp = tl.max(tl.where(hit, i, -1), 0)
        row0 = tl.sum(tl.where(hit, start + (pid_m - (cum - nt)) * BLOCK_M, 0), 0)
        rend = tl.sum(tl.where(hit, end, 0), 0)
        return grp, row0, rend

    @triton.jit
    def _grouped_gemm_kernel(
        x_ptr,  # [M, K], rows sorted by group
        w_ptr,  # [G, N, K]; W4: the packed bytes [G, K, N / 2]
        ws_ptr,  # W4: scales [G, K, NG]
        wm_ptr,  # W4: minimums [G, K, NG]
        ends_ptr,  # [E] int32 cumulative group ends
        out_ptr,  # [M, N]
        g0,
        G,
        N,
        K,
        stride_xm,
        stride_wg,
        stride_wn,
        stride_wk,
        stride_sg,
        stride_sk,
        stride_om,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        G_P2: tl.constexpr,  # the span's groups rounded up to a power of two
        DOT_F32: tl.constexpr,
        PREC: tl.constexpr,
        W4: tl.constexpr,  # int4 weights read in place (module doc)
        GS: tl.constexpr,  # W4: weights a scale group (along N)
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        grp, row0, rend = span_tile(ends_ptr, g0, G, pid_m, BLOCK_M, G_P2)
        if grp >= 0:
            rows = row0 + tl.arange(0, BLOCK_M)
            rmask = rows < rend
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            cmask = cols < N
            xrow = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
            if W4:
                acc = _w4_n_tiles(
                    xrow, rmask, w_ptr + grp.to(tl.int64) * stride_wg, ws_ptr + grp.to(tl.int64) * stride_sg,
                    wm_ptr + grp.to(tl.int64) * stride_sg, pid_n, N, K, stride_wk, stride_sk, x_ptr.dtype.element_ty,
                    BLOCK_M, BLOCK_N, BLOCK_K, DOT_F32, PREC, GS,
                )  # fmt: skip
            else:
                wcol = w_ptr + grp.to(tl.int64) * stride_wg + cols.to(tl.int64)[None, :] * stride_wn
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    ks = k0 + tl.arange(0, BLOCK_K)
                    km = ks < K
                    a = tl.load(xrow + ks[None, :], mask=rmask[:, None] & km[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
                    b = tl.load(
                        wcol + ks.to(tl.int64)[:, None] * stride_wk, mask=km[:, None] & cmask[None, :], other=0.0
                    )  # [BLOCK_K, BLOCK_N]
                    if DOT_F32:
                        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
                    else:
                        acc = tl.dot(a, b, acc, input_precision=PREC)
            optr = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
            tl.store(optr, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])

    @triton.jit
    def w4_tile(p_ptrs, s_ptrs, m_ptrs, mask, DT: tl.constexpr):
        """A tile of int4 bytes and, per byte, its group's scale and minimum -> (the low nibbles' weights, the high
        nibbles'), fp32 values of DT, dequantized as kernels/dequant_int4.py does (fp32 q * scale + minimum, rounded
        once). The span kernels' int4 mode (this file's down projection, kernels/grouped_gate_up.py's gate and up)."""
        p = tl.load(p_ptrs, mask=mask, other=0)
        sc = tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32)
        mn = tl.load(m_ptrs, mask=mask, other=0.0).to(tl.float32)
        return round_to((p & 15).to(tl.float32) * sc + mn, DT), round_to((p >> 4).to(tl.float32) * sc + mn, DT)

    @triton.jit
    def _w4_n_tiles(
        xrow, rmask, p_ptr, s_ptr, m_ptr, pid_n, N, K, stride_pk, stride_sk, DT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
        PREC: tl.constexpr, GS: tl.constexpr,
    ):  # fmt: skip
        """x rows [BLOCK_M, K] @ one expert's int4 weights [K, N] packed along N (byte j of a row: columns 2j, 2j + 1,
        low nibble first), columns [pid_n * BLOCK_N, +BLOCK_N): the even and the odd columns as two dots over the
        same K steps, each weight dequantized as kernels/dequant_int4.py does (fp32 q * scale + minimum, rounded to
        DT), interleaved back at the end. Returns the fp32 [BLOCK_M, BLOCK_N] tile."""
        HB: tl.constexpr = BLOCK_N // 2
        nb = pid_n * HB + tl.arange(0, HB)  # byte columns
        bmask = nb < N // 2
        grp = (2 * nb) // GS  # each byte column's scale group
        acc_lo = tl.zeros((BLOCK_M, HB), dtype=tl.float32)
        acc_hi = tl.zeros((BLOCK_M, HB), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            km = ks < K
            k64 = ks.to(tl.int64)[:, None]
            wm = km[:, None] & bmask[None, :]
            a = tl.load(xrow + ks[None, :], mask=rmask[:, None] & km[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            lo, hi = w4_tile(  # [BLOCK_K, HB] each
                p_ptr + k64 * stride_pk + nb[None, :], s_ptr + k64 * stride_sk + grp[None, :],
                m_ptr + k64 * stride_sk + grp[None, :], wm, DT,
            )  # fmt: skip
            if DOT_F32:
                af = a.to(tl.float32)
                acc_lo = tl.dot(af, lo, acc_lo, input_precision="ieee")
                acc_hi = tl.dot(af, hi, acc_hi, input_precision="ieee")
            else:
                acc_lo = tl.dot(a, lo.to(DT), acc_lo, input_precision=PREC)
                acc_hi = tl.dot(a, hi.to(DT), acc_hi, input_precision=PREC)
        return tl.reshape(tl.join(acc_lo, acc_hi), [BLOCK_M, BLOCK_N])


def grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor | Int4Tensor,
    ends: torch.Tensor,
    g0: int,
    out: torch.Tensor,
    *,
    BLOCK_M: int = 64,
    BLOCK_N: int = 64,
    BLOCK_K: int = 32,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """out[r] = x[r] @ w[g - g0].T for the rows r of each group g of the span [g0, g0 + G) (module docstring); returns
    out. x [M, K] (contiguous last dim) and w [G, N, K] (any strides: the down projection passes its [G, K, N] stack
    transposed) of one float dtype; or w an `Int4Tensor` [G, K, N] (the down projection's stack as stored: packed
    along N) read in place, out[r] = x[r] @ dequant(w[g - g0]) (module doc; BLOCK_N >= 32). `ends` int32
    [E] (E >= g0 + G, ends[-1] <= M) on x's device; `out` [M, N] float with a contiguous last dim. BLOCK_* (powers of
    two, >= 16), num_warps and num_stages are launch parameters. No host sync; CUDA-graph capturable."""
    if triton is None:
        raise RuntimeError("grouped_gemm needs triton")
    w4 = isinstance(w, Int4Tensor)
    if w4:
        G, K_w, N = w.shape
        parts = int4_parts(w, x, "w", BLOCK_N)
        w_meta = x.new_empty(()).expand(G, N, K_w)  # the shape grouped_span checks, no memory
    M, K, G, N = grouped_span(x, w_meta if w4 else w, ends, g0, out, (BLOCK_M, BLOCK_N, BLOCK_K))
    if M == 0 or G == 0 or N == 0:
        return out
    grid, kw = span_launch(x, M, N, G, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
    if w4:
        (p, sc, mn), gs = parts
        args = (p, sc, mn, p.stride(0), 0, p.stride(1), sc.stride(0), sc.stride(1))
    else:
        args = (w, w, w, *w.stride(), 0, 0)
    _grouped_gemm_kernel[grid](
        x, args[0], args[1], args[2], ends, out, int(g0), G, N, K, x.stride(0), *args[3:], out.stride(0),
        W4=w4, GS=gs if w4 else 1, **kw,
    )  # fmt: skip
    return out


def int4_parts(w: Int4Tensor, x: torch.Tensor, name: str, block: int):
    """((packed, scale, minimum), group size) of an Int4Tensor stack [G, R, C] read in place by a span kernel: on
    x's device, each row's bytes and groups contiguous (any expert and row strides), the scale and the minimum at the
    same strides, groups of a power-of-two size >= 2, and `block` (the tile along C) >= 32 (two dots of >= 16)."""
    if w.minimum is None:
        raise ValueError(f"{name}: only int4 stacks are read in place (NF4's codebook is not; dequantize it first)")
    p, sc, mn = w.parts()
    G, R, C = w.shape
    if p.dtype != torch.uint8 or p.stride(2) != 1 or sc.stride() != mn.stride() or sc.stride(2) != 1:
        raise ValueError(f"{name} must be an int4 stack with contiguous rows and the scale and minimum at one stride")
    if not sc.dtype.is_floating_point or sc.dtype != mn.dtype or tuple(sc.shape[:2]) != (G, R):
        raise ValueError(f"{name}'s scale and minimum must be float [G, R, NG] = [{G}, {R}, NG]")
    gs = C // sc.shape[2]
    if gs < 2 or gs & (gs - 1) or gs * sc.shape[2] != C:
        raise ValueError(f"{name}'s rows of {C} must split into groups of a power-of-two size >= 2")
    if any(t.device != x.device for t in (p, sc, mn)):
        raise ValueError(f"{name} must be on x's device {x.device}")
    if block < 32:
        raise ValueError(f"int4 {name} needs a tile of >= 32 along its packed dim, got {block}")
    return (p, sc, mn), gs


def span_launch(x, M: int, N: int, G: int, BLOCK_M: int, BLOCK_N: int, BLOCK_K: int, num_warps: int, num_stages: int):
    """(grid, launch keywords) shared by the span kernels (this one and kernels/grouped_gate_up.py): a row tile per
    program over the host's bound on the span's tiles, cdiv(M, BLOCK_M) + G; fp32 products under the interpreter for
    bf16 / fp16 (`DOT_F32`), full fp32 dots for fp32 inputs."""
    grid = (triton.cdiv(M, BLOCK_M) + G, triton.cdiv(N, BLOCK_N))
    kw = dict(
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        G_P2=triton.next_power_of_2(G),
        DOT_F32=os.environ.get("TRITON_INTERPRET") == "1" and x.dtype != torch.float32,
        PREC="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return grid, kw
