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

try:  # Triton is optional at import time; the launcher needs it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None

__all__ = ["grouped_gemm", "grouped_gemm_ref"]


def grouped_gemm_ref(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, g0: int, out: torch.Tensor) -> torch.Tensor:
    """Reference (fp32 products, reads `ends` on the host): out[r] = x[r] @ w[g - g0].T for the span's rows; returns
    out, its other rows untouched."""
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
        w_ptr,  # [G, N, K]
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
        stride_om,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        G_P2: tl.constexpr,  # the span's groups rounded up to a power of two
        DOT_F32: tl.constexpr,
        PREC: tl.constexpr,
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


def grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
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
    transposed) of one float dtype; `ends` int32
    [E] (E >= g0 + G, ends[-1] <= M) on x's device; `out` [M, N] float with a contiguous last dim. BLOCK_* (powers of
    two, >= 16), num_warps and num_stages are launch parameters. No host sync; CUDA-graph capturable."""
    if triton is None:
        raise RuntimeError("grouped_gemm needs triton")
    M, K, G, N = grouped_span(x, w, ends, g0, out, (BLOCK_M, BLOCK_N, BLOCK_K))
    if M == 0 or G == 0 or N == 0:
        return out
    grid, kw = span_launch(x, M, N, G, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
    _grouped_gemm_kernel[grid](
        x,
        w,
        ends,
        out,
        int(g0),
        G,
        N,
        K,
        x.stride(0),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        **kw,
    )
    return out


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
