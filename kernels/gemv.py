"""Batch-1 GEMV y = x W^T for one token: the lm_head and other wide projections of a decode step.

Owns `gemv` (Triton launcher) and its torch reference `gemv_ref`, and one kernel `_gemv_kernel`, grid
(ceil(N / BLOCK_N),): program b reads rows [b*BLOCK_N, (b+1)*BLOCK_N) of W in BLOCK_K-wide column chunks (one chunk
when BLOCK_K >= K: the whole tile is loaded before any arithmetic, so each program has all of its bytes in flight
at once) and writes BLOCK_N outputs, accumulated in fp32. At batch 1 the time is the bytes of W over memory
bandwidth; cuBLAS's GEMV for Qwen3.5's lm_head (248320 x 2048 bf16, 1.02 GB) ran at 2.1 TB/s on the H200, half of
the copy bandwidth, which is why this kernel exists. Launch parameters per shape are data (kernels/tuned/).

Shape legend: T = tokens (rows of x, 1 at decode; a few allowed), K = input features, N = output features.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    from localmoe.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_kw
    from localmoe.kernels.rounding import round_to
except ImportError:  # pragma: no cover
    triton = None
    tl = None

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_NORM_KINDS = {"standard": 1, "zero_centred": 2}


# ----------------------------------------------------------------------------------------------------------
# torch reference
# ----------------------------------------------------------------------------------------------------------
def gemv_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    norm_kind: str = "zero_centred",
) -> torch.Tensor:
    """x [T, K], weight [N, K] -> y [T, N] in x's dtype (fp32 accumulation); with `norm_weight` [K], x is first
    RMS-normalised per row as transformers' RMSNorm does (zero_centred x̂·(1+w), or standard w·x̂)."""
    if norm_weight is not None:
        v = x.float()
        n = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
        w = norm_weight.float()
        x = (n * (1.0 + w)).to(x.dtype) if norm_kind == "zero_centred" else (w * n.to(x.dtype).float()).to(x.dtype)
    return (x.float() @ weight.float().T).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _gemv_kernel(
        x_ptr,  # [T, K], row stride stride_xt, last dim contiguous
        w_ptr,  # [N, K], row stride stride_wn, last dim contiguous
        y_ptr,  # [T, N] contiguous
        nw_ptr,  # [K] RMSNorm weight applied to x first (NORM > 0 only)
        N,
        K,
        stride_xt,
        stride_wn,
        eps,
        T: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        ONE_TILE: tl.constexpr,  # BLOCK_K >= K: the whole [BLOCK_N, K] tile in one load, issued before the PDL wait
        NORM: tl.constexpr,  # 0 none, 1 standard, 2 zero_centred RMSNorm of x first (ONE_TILE only)
        PDL: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        rmask = rows < N
        cols = tl.arange(0, BLOCK_K)  # [BLOCK_K]
        wrow = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
        DT = y_ptr.dtype.element_ty
        if ONE_TILE:
            kmask = cols < K
            w = tl.load(wrow + cols[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            if NORM > 0:
                nw = tl.load(nw_ptr + cols, mask=kmask, other=0.0).to(tl.float32)
            if PDL:  # the weights are constants of the step: loaded while the kernel before finishes
                gdc_wait()
                gdc_launch_dependents()
            for t in tl.static_range(T):
                xv = tl.load(x_ptr + t * stride_xt + cols, mask=kmask, other=0.0).to(tl.float32)
                if NORM > 0:  # every program normalises the row itself: K values from L2, no extra launch
                    XT = x_ptr.dtype.element_ty
                    n = xv * tl.math.rsqrt(tl.sum(xv * xv, axis=0) / K + eps)
                    if NORM == 2:
                        xv = round_to(n * (1.0 + nw), XT)
                    else:
                        xv = round_to(round_to(n, XT) * nw, XT)
                acc = tl.sum(w.to(tl.float32) * xv[None, :], axis=1)
                tl.store(y_ptr + t * N + rows, round_to(acc, DT).to(DT), mask=rmask)  # RTNE (also interpreted)
        else:
            if PDL:
                gdc_wait()
                gdc_launch_dependents()
            for t in tl.static_range(T):
                acc = tl.zeros([BLOCK_N], dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    kk = k0 + cols
                    kmask = kk < K
                    w = tl.load(wrow + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
                    xv = tl.load(x_ptr + t * stride_xt + kk, mask=kmask, other=0.0).to(tl.float32)
                    acc += tl.sum(w.to(tl.float32) * xv[None, :], axis=1)
                tl.store(y_ptr + t * N + rows, round_to(acc, DT).to(DT), mask=rmask)


# ----------------------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------------------
def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    norm_weight=None,
    eps: float = 1e-6,
    norm_kind: str = "zero_centred",
    BLOCK_N: int = 2,
    BLOCK_K: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """y = x W^T. x [T, K] (T <= 8; bf16/fp16/fp32, last dim contiguous); weight [N, K] of x's dtype, last dim
    contiguous. Returns y [T, N] in x's dtype (into `out` when given: contiguous [T, N], x's dtype). BLOCK_K
    defaults to next_pow2(K) capped at 4096 (a whole row per tile for K up to 4096). No host sync: capturable.
    With `norm_weight` [K] (any float dtype), y = RMSNorm(x) W^T: the decoder layer's input norm inside the GEMV
    (norm_kind "zero_centred" x̂·(1+w) or "standard" w·x̂, rounded to x's dtype as the module does; K <= 4096)."""
    if triton is None:
        raise RuntimeError("gemv needs triton")
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x must be [T, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    T, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"weight is [{N}, {weight.shape[1]}] but x has K = {K}")
    if not 1 <= T <= 8:
        raise ValueError(f"gemv is for decode: 1..8 rows of x, got {T}")
    if x.dtype not in _FLOAT_DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share a float dtype (bf16/fp16/fp32), got {x.dtype} and {weight.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need a contiguous last dim")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x is on {x.device}")
    if out is None:
        out = torch.empty(T, N, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (T, N) or out.dtype != x.dtype or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"out must be a contiguous {x.dtype} [T, N] = {(T, N)} tensor on {x.device}")
    bk = BLOCK_K or min(4096, triton.next_power_of_2(K))
    norm = _NORM_KINDS.get(norm_kind) if norm_weight is not None else 0
    if norm is None:
        raise ValueError(f"norm_kind must be one of {sorted(_NORM_KINDS)}, got {norm_kind!r}")
    if norm and (bk < K or norm_weight.numel() != K or norm_weight.device != x.device):
        raise ValueError(f"norm_weight must hold K = {K} values on {x.device}, with K <= 4096 (one tile per row)")
    nw = norm_weight.reshape(K).contiguous() if norm else x
    _gemv_kernel[(triton.cdiv(N, BLOCK_N),)](
        x,
        weight,
        out,
        nw,
        N,
        K,
        x.stride(0),
        weight.stride(0),
        float(eps),
        T=T,
        BLOCK_N=BLOCK_N,
        BLOCK_K=bk,
        ONE_TILE=bk >= K,
        NORM=norm,
        num_warps=num_warps,
        **pdl_kw(x),
    )
    return out
