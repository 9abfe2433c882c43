"""DeepSeek-V2's absorbed MLA projections for one decode token: per head, a GEMV against a slice of kv_b_proj's weight.

localmoe/decode/mla.py (module docstring there) absorbs W_UK into the query with this kernel and W_UV behind the
attention core, inside kernels/mla_decode.py's second launch (this kernel computes the same product: its reference):

    q_lat[h, :] = q_nope[h, :] · W_UK[h]        [Hq, Dn] x [Hq, Dn, C] -> [Hq, C]
    o[h, :]     = o_lat[h, :] · W_UV[h]ᵀ        [Hq, C] x [Hq, Dv, C]  -> [Hq, Dv]

Both are `y[b, n] = Σ_k x[b, k] · W[b, k, n]` over the heads b, with W a strided view of kv_b_proj's weight
[Hq·(Dn + Dv), C] (no copy): W_UK with k along its rows (stride C) and n along C (stride 1); W_UVᵀ with k along C
(stride 1) and n along its rows (stride C). Owns `absorb` (launcher), its torch reference `absorb_ref` and one
kernel `_absorb_kernel`, grid (B, cdiv(N, BLOCK_N)): program (b, j) loads its [K, BLOCK_N] weight tile (in BLOCK_K
chunks; the first chunk before the PDL wait: weights do not depend on the kernel before), then x[b], and sums in
fp32, rounding once to x's dtype (as torch.bmm). At V2-Lite's shapes (Hq 16, Dn = Dv 128, C 512) 128 programs of
16 KB each, where cuBLAS's batched GEMM took 3.4 µs a call on the H200 (bench/RESULTS.md, session 28's breakdown).

Shapes: B heads, K the reduced dim, N the output dim; x [B, K] rows contiguous (any row stride: q_nope is a view of
the query), w any strides, out [B, N].
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    from localmoe.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_kw
except ImportError:  # pragma: no cover
    triton = None
    tl = None

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def absorb_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y [B, N] = x [B, K] · w [B, K, N] per b, fp32 sums rounded once to x's dtype."""
    return torch.einsum("bk,bkn->bn", x.float(), w.float()).to(x.dtype)


if triton is not None:

    @triton.jit
    def _absorb_kernel(
        x_ptr, w_ptr, y_ptr, K, N, stride_xb, stride_wb, stride_wk, stride_wn,
        BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)
        nn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = nn < N
        kk = tl.arange(0, BLOCK_K)
        base = w_ptr + b * stride_wb + nn.to(tl.int64)[None, :] * stride_wn
        w = tl.load(base + kk.to(tl.int64)[:, None] * stride_wk, mask=(kk < K)[:, None] & nm[None, :], other=0.0)
        if PDL:  # x comes from the kernel before; the first weight tile is already in flight
            gdc_wait()
            gdc_launch_dependents()
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            if k0 > 0:
                w = tl.load(base + k.to(tl.int64)[:, None] * stride_wk, mask=(k < K)[:, None] & nm[None, :], other=0.0)
            xv = tl.load(x_ptr + b * stride_xb + k, mask=k < K, other=0.0).to(tl.float32)
            acc += tl.sum(w.to(tl.float32) * xv[:, None], axis=0)
        DT = y_ptr.dtype.element_ty
        tl.store(y_ptr + b * N + nn, acc.to(DT), mask=nm)


def absorb(x: torch.Tensor, w: torch.Tensor, *, out: torch.Tensor | None = None, BLOCK_K: int = 0, BLOCK_N: int = 0,
           num_warps: int = 4) -> torch.Tensor:  # fmt: skip
    """y [B, N] = x [B, K] · w [B, K, N] for each head b (module docstring), in x's dtype; x's rows contiguous (any
    row stride). w: any strides (views of
    kv_b_proj's weight), x's dtype, on x's device. BLOCK_K / BLOCK_N 0: a [BLOCK_K, BLOCK_N] tile of 8K elements,
    BLOCK_N 64 where N runs along the weight's contiguous dim, else 16 (a tile's rows along the contiguous one)."""
    if triton is None:
        raise RuntimeError("absorb needs triton")
    if x.dim() != 2 or x.stride(1) != 1 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be a float [B, K] tensor with contiguous rows, got {x.dtype} {tuple(x.shape)}")
    B, K = x.shape
    if w.dim() != 3 or w.shape[0] != B or w.shape[1] != K:
        raise ValueError(f"w must be [B, K, N] with B={B}, K={K}, got {tuple(w.shape)}")
    if w.dtype != x.dtype or w.device != x.device:
        raise ValueError(f"w must be {x.dtype} on {x.device}, got {w.dtype} on {w.device}")
    N = w.shape[2]
    if out is None:
        out = torch.empty((B, N), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (B, N) or out.dtype != x.dtype or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"out must be a contiguous {x.dtype} [B, N] = {(B, N)} tensor on {x.device}")
    n_contiguous = w.stride(2) == 1
    bn = BLOCK_N or (64 if n_contiguous else 16)
    bn = min(triton.next_power_of_2(bn), triton.next_power_of_2(N))
    bk = BLOCK_K or max(1, 8192 // bn)
    bk = min(triton.next_power_of_2(bk), triton.next_power_of_2(K))
    _absorb_kernel[(B, triton.cdiv(N, bn))](
        x, w, out, K, N, x.stride(0), w.stride(0), w.stride(1), w.stride(2),
        BLOCK_K=bk, BLOCK_N=bn, num_warps=num_warps, **pdl_kw(x),
    )  # fmt: skip
    return out
