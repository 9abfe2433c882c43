"""Fused RMSNorm for decode: one launch per norm, fp32 math, transformers' exact cast order.

Owns `rmsnorm` (checked Triton launcher), its torch reference `rmsnorm_ref`, and one Triton kernel
`_rmsnorm_kernel`, grid (R,): one program per row, one full-width load of the row (no loop: batch-1 rows are
short, N <= a few thousand). Three variants, selected by `kind`:

* "standard"    (Llama/Qwen3-MoE/OLMoE/Mixtral/DeepSeek/Granite `*RMSNorm`):
                 y = w * (x·rsqrt(mean(x²)+eps)).to(x.dtype)            -> dtype promote(w, x)
* "zero_centred" (Qwen3.5 `Qwen3_5MoeRMSNorm`):
                 y = (x·rsqrt(mean(x²)+eps) * (1 + w.float())).to(x.dtype)
* "gated"       (Qwen3.5 `Qwen3_5MoeRMSNormGated`, norm before gate):
                 y = ((w * (x·rsqrt(mean(x²)+eps)).to(x.dtype)) * silu(z.float())).to(x.dtype)

With `residual` (decoder layers' "h = residual + h; residual = h; h = norm(h)"), the kernel first forms
s = (x + residual) rounded to x's dtype, writes it to `sum_out` (the next residual) and normalises s: one launch
instead of an add and a norm.

Every rounding transformers does (to x.dtype, to promote(w, x)) is reproduced by a cast in the kernel, so fp32
results are bit-close and bf16 results differ only where exp/rsqrt differ by an ulp.

Shape legend: x [..., N] (rows R = prod(...)), w [N], z (gated only) same shape as x; output same shape as x.
A row stride other than N is fine (e.g. a view of q_proj's chunked output); the last dim must be contiguous.
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

KINDS = ("standard", "zero_centred", "gated")
_KIND_ID = {k: i for i, k in enumerate(KINDS)}
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def out_dtype(kind: str, x_dtype: torch.dtype, w_dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(w_dtype, x_dtype) if kind == "standard" else x_dtype


# ----------------------------------------------------------------------------------------------------------
# torch reference (transformers' formulas, written out)
# ----------------------------------------------------------------------------------------------------------
def rmsnorm_ref(x, w, eps, kind="standard", z=None):
    dt = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if kind == "standard":
        return w * h.to(dt)
    if kind == "zero_centred":
        return (h * (1.0 + w.float())).type_as(x)
    if kind == "gated":
        return ((w * h.to(dt)) * torch.nn.functional.silu(z.float())).to(dt)
    raise ValueError(kind)


# ----------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _rmsnorm_kernel(
        x_ptr,  # [R, N] rows with stride stride_x, any float dtype
        w_ptr,  # [N]
        z_ptr,  # [R, N] gate rows with stride stride_z (KIND == 2 only)
        y_ptr,  # [R, N] out, contiguous; dtype = out_dtype(kind, x, w)
        r_ptr,  # [R, N] residual rows with stride stride_r, x's dtype (HAS_RES only)
        s_ptr,  # [R, N] out: x + residual, contiguous, x's dtype (HAS_RES only)
        N,
        stride_x,
        stride_z,
        stride_r,
        eps,
        KIND: tl.constexpr,  # 0 standard, 1 zero_centred, 2 gated
        ROUND_PROD: tl.constexpr,  # gated: w * x̂ rounds to x's dtype (promote(w, x) == x.dtype != fp32)
        HAS_RES: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py): w is read before the wait
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_N)
        m = cols < N
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        xin = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
        x = xin.to(tl.float32)
        if HAS_RES:  # s = round(residual + x): the layer's residual add, stored for the next one
            r = tl.load(r_ptr + row * stride_r + cols, mask=m, other=0.0).to(tl.float32)
            x = round_to(x + r, xin.dtype)
            tl.store(s_ptr + row * N + cols, x.to(xin.dtype), mask=m)
        var = tl.sum(x * x, axis=0) / N
        h = x * tl.math.rsqrt(var + eps)
        if KIND == 0:
            y = round_to(h, xin.dtype) * w  # w * x̂.to(x.dtype), rounded once to the output dtype below
        elif KIND == 1:
            y = h * (1.0 + w)
        else:
            p = round_to(h, xin.dtype) * w
            if ROUND_PROD:
                p = round_to(p, xin.dtype)
            zz = tl.load(z_ptr + row * stride_z + cols, mask=m, other=0.0).to(tl.float32)
            y = p * (zz / (1.0 + tl.exp(-zz)))
        tl.store(y_ptr + row * N + cols, round_to(y, y_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty), mask=m)


def _rows(t: torch.Tensor, N: int) -> torch.Tensor:
    """[..., N] -> [R, N] view with a single row stride and stride(1) == 1 (copies only when no such view exists)."""
    try:
        v = t.view(-1, N)
    except RuntimeError:
        v = t.reshape(-1, N)
    if v.shape[0] > 1 and v.stride(1) != 1:
        v = v.contiguous()
    if v.shape[0] <= 1 and v.stride(-1) != 1:
        v = v.contiguous()
    return v


def rmsnorm(
    x: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    kind: str = "standard",
    z: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
):
    """One-launch RMSNorm over the last dim of x (see the module docstring for the three `kind`s). With `residual`
    (x's shape and dtype) it normalises s = x + residual and returns (norm(s), s); else norm(x)."""
    if triton is None:
        raise RuntimeError("rmsnorm needs triton")
    if kind not in _KIND_ID:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    N = x.shape[-1]
    if w.shape != (N,):
        raise ValueError(f"weight shape {tuple(w.shape)} does not match the last dim {N}")
    if x.dtype not in _FLOAT_DTYPES or w.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"unsupported dtypes x {x.dtype}, w {w.dtype}")
    if (kind == "gated") != (z is not None):
        raise ValueError("z (the gate) is required for kind 'gated' and only for it")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"gate shape {tuple(z.shape)} != input shape {tuple(x.shape)}")
    if w.device != x.device or (z is not None and z.device != x.device):
        raise ValueError("x, w and z must be on one device")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device):
        raise ValueError(
            f"residual must match x: {tuple(x.shape)} {x.dtype} on {x.device}, got "
            f"{tuple(residual.shape)} {residual.dtype} on {residual.device}"
        )
    odt = out_dtype(kind, x.dtype, w.dtype)
    x2 = _rows(x, N)
    r2 = _rows(residual, N) if residual is not None else x2
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    z2 = _rows(z, N) if z is not None else x2
    w = w if w.stride(0) == 1 else w.contiguous()
    if out is None:
        out = torch.empty(x.shape, dtype=odt, device=x.device)
    elif out.shape != x.shape or out.dtype != odt or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {tuple(x.shape)} {odt}")
    R = x2.shape[0]
    if R == 0:
        return out if residual is None else (out, total)
    block = triton.next_power_of_2(N)
    round_prod = torch.promote_types(w.dtype, x.dtype) == x.dtype and x.dtype != torch.float32
    warps = 4 if block <= 1024 else 8
    _rmsnorm_kernel[(R,)](
        x2,
        w,
        z2,
        out,
        r2,
        total if total is not None else out,
        N,
        x2.stride(0),
        z2.stride(0),
        r2.stride(0),
        float(eps),
        KIND=_KIND_ID[kind],
        ROUND_PROD=round_prod,
        HAS_RES=residual is not None,
        BLOCK_N=block,
        num_warps=warps,
        **pdl_kw(x),
    )
    return out if residual is None else (out, total)
