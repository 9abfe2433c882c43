"""int4 experts back to the model's dtype on the device, for the dense (prefill, calibration) path.

Owns `dequant_int4(packed, scale, minimum, dtype)` (Triton launcher), its torch reference `dequant_int4_ref`
(the int4 format's definition; `localmoe.kernels.int4` holds the format) and the kernel `_dequant_kernel`. The dense
path runs
torch's grouped GEMMs on spans of dequantized experts (localmoe/experts/local_experts.py `_grouped`); in torch the
unpacking goes
through several fp32 temporaries of the span's size, this kernel reads each byte and scale once and writes the
output once. Grid: cdiv(R, BLOCK_R) programs over the R = n * I rows; each unpacks BLOCK_R rows of H/2 bytes into
w[2j] = lo * scale + minimum, w[2j+1] = hi * scale + minimum (fp32, rounded once to `dtype`, as the reference).

NF4 (`code=`, kernels/nf4.py): the same launch reads bitsandbytes' NF4 bytes, w[2j] = code[hi] * absmax,
w[2j+1] = code[lo] * absmax (high nibble first, no minimum); `dequant_nf4_ref` is that format's definition.

Shape legend: n experts, I expert width, H hidden, G group size, NG = H / G. packed [n, I, H/2] uint8, scale and
minimum [n, I, NG] bf16 (any float), each contiguous -> [n, I, H] in `dtype`.
"""

from __future__ import annotations

import torch

try:  # Triton is optional at import time; the launcher needs it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
__all__ = ["dequant_bytes", "dequant_int4", "dequant_int4_ref", "dequant_nf4_ref"]


# ----------------------------------------------------------------------------------------------------------
# torch reference
# ----------------------------------------------------------------------------------------------------------
def dequant_int4_ref(
    packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The torch reference and the int4 format's definition: [..., H/2] uint8 + [..., NG] scales -> [..., H] in
    `dtype` (computed in fp32, rounded once)."""
    lo = (packed & 15).float()
    hi = (packed >> 4).float()
    q = torch.stack((lo, hi), dim=-1).flatten(-2)  # [..., H]: q[2j] low nibble, q[2j+1] high
    NG = scale.shape[-1]
    q = q.unflatten(-1, (NG, -1))  # [..., NG, G]
    w = q * scale.float().unsqueeze(-1) + minimum.float().unsqueeze(-1)
    return w.flatten(-2).to(dtype)


def dequant_nf4_ref(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The torch reference and the NF4 format's definition (bitsandbytes' `dequantize_4bit` per row): [..., H/2]
    uint8 + [..., NG] absmax + code [16] -> [..., H] in `dtype`, w = code[q] * absmax (fp32, rounded once)."""
    c = code.float()
    q = torch.stack((c[(packed >> 4).long()], c[(packed & 15).long()]), dim=-1).flatten(-2)  # high nibble first
    NG = absmax.shape[-1]
    w = q.unflatten(-1, (NG, -1)) * absmax.float().unsqueeze(-1)
    return w.flatten(-2).to(dtype)


# ----------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def dequant_bytes(p, s, m, c_ptr, NF4: tl.constexpr):
        """Bytes p [R, J] uint8 with their group's scale s and minimum m [R, J] fp32 (NF4: s the absmax, m unused,
        c_ptr the [16] fp32 codebook) -> the weights [R, 2J] fp32, w[2j] and w[2j + 1] of byte j."""
        if NF4:
            lo = tl.load(c_ptr + (p >> 4)) * s  # w[2j]: high nibble first
            hi = tl.load(c_ptr + (p & 15)) * s  # w[2j + 1]
        else:
            lo = (p & 15).to(tl.float32) * s + m  # w[2j]
            hi = (p >> 4).to(tl.float32) * s + m  # w[2j + 1]
        R: tl.constexpr = p.shape[0]
        J: tl.constexpr = p.shape[1]
        return tl.reshape(tl.join(lo, hi), [R, 2 * J])  # interleaved back: [.., 2j], [.., 2j + 1]

    @triton.jit
    def _dequant_kernel(
        p_ptr,  # [R, H/2] uint8, contiguous
        s_ptr,  # [R, NG] scales, contiguous
        m_ptr,  # [R, NG] minimums (not NF4)
        o_ptr,  # [R, H] output, contiguous
        c_ptr,  # [16] fp32 codebook (NF4 only)
        R,
        H2: tl.constexpr,  # H / 2 bytes per row
        NG: tl.constexpr,
        HALF_G: tl.constexpr,  # G / 2 bytes per group
        BLOCK_R: tl.constexpr,
        BLOCK_J: tl.constexpr,  # next power of two >= H2
        NF4: tl.constexpr,  # bitsandbytes' NF4: w = code[q] * absmax, high nibble first, no minimum
    ):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
        j = tl.arange(0, BLOCK_J)  # [BLOCK_J] byte index in a row
        rmask = rows < R
        mask = rmask[:, None] & (j < H2)[None, :]
        r64 = rows.to(tl.int64)[:, None]
        p = tl.load(p_ptr + r64 * H2 + j[None, :], mask=mask, other=0)
        grp = r64 * NG + (j // HALF_G)[None, :]  # the group of bytes j (and of weights 2j, 2j+1)
        s = tl.load(s_ptr + grp, mask=mask, other=0.0).to(tl.float32)
        m = s if NF4 else tl.load(m_ptr + grp, mask=mask, other=0.0).to(tl.float32)
        w = dequant_bytes(p, s, m, c_ptr, NF4)
        cols = tl.arange(0, 2 * BLOCK_J)
        omask = rmask[:, None] & (cols < 2 * H2)[None, :]
        tl.store(o_ptr + r64 * (2 * H2) + cols[None, :], w.to(o_ptr.dtype.element_ty), mask=omask)


# ----------------------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------------------
def dequant_int4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    minimum: torch.Tensor | None,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    BLOCK_R: int = 4,
    num_warps: int = 4,
    code: torch.Tensor | None = None,
) -> torch.Tensor:
    """[..., H/2] uint8 + [..., NG] scale / minimum -> [..., H] in `dtype` (bf16/fp16/fp32), one launch; `out`
    (contiguous, that shape and dtype) to reuse a buffer. NF4: `code` [16] fp32 on the device, minimum None, scale
    the absmax."""
    if triton is None:
        raise RuntimeError("dequant_int4 needs triton")
    if packed.dtype != torch.uint8 or packed.dim() < 1:
        raise ValueError(f"packed must be uint8 [..., H/2], got {packed.dtype} {tuple(packed.shape)}")
    lead, H2 = tuple(packed.shape[:-1]), packed.shape[-1]
    NG = scale.shape[-1] if scale.dim() else 0
    nf4 = code is not None
    if nf4 and (minimum is not None or code.shape != (16,) or code.dtype != torch.float32):
        raise ValueError("NF4 (code=) takes a [16] fp32 codebook and no minimum (minimum=None)")
    if not nf4 and minimum is None:
        raise ValueError("minimum is required (None only with code=, NF4)")
    for name, t in (("scale", scale), ("minimum", minimum if not nf4 else scale)):
        if tuple(t.shape[:-1]) != lead or t.shape[-1] != NG or t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} must be float {lead + (NG,)}, got {t.dtype} {tuple(t.shape)}")
    if NG < 1 or (2 * H2) % NG or ((2 * H2 // NG) & (2 * H2 // NG - 1)) or 2 * H2 // NG < 2:
        raise ValueError(f"H = {2 * H2} must split into {NG} groups of a power-of-two size >= 2")
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype must be bf16/fp16/fp32, got {dtype}")
    tensors = (packed, scale, code) if nf4 else (packed, scale, minimum)
    if any(t.device != packed.device for t in tensors):
        raise ValueError("packed, scale and minimum (or code) must share a device")
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("packed, scale and minimum must be contiguous")
    shape = lead + (2 * H2,)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=packed.device)
    elif tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous() or out.device != packed.device:
        raise ValueError(f"out must be contiguous {dtype} {shape} on {packed.device}")
    R = packed.numel() // H2 if H2 else 0
    if R == 0:
        return out
    BLOCK_J = triton.next_power_of_2(H2)
    grid = (triton.cdiv(R, BLOCK_R),)
    _dequant_kernel[grid](
        packed,
        scale,
        scale if nf4 else minimum,
        out,
        code if nf4 else scale,
        R,
        H2=H2,
        NG=NG,
        HALF_G=H2 // NG,
        BLOCK_R=BLOCK_R,
        BLOCK_J=BLOCK_J,
        NF4=nf4,
        num_warps=num_warps,
    )
    return out
