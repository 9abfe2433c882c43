"""MXFP4 experts back to the model's dtype: the format's definition (`dequant_mxfp4_ref`) and its Triton launch.

Owns `FP4_VALUES`, `BLOCK`, the torch reference `dequant_mxfp4_ref` (the MXFP4 format's definition; the format's
dataclass is `localmoe.kernels.mxfp4.Mxfp4Tensor`, which re-exports it) and `dequant_mxfp4` (one Triton launch over a
span of experts, for the prefill's grouped GEMMs on CUDA).

Format (OCP microscaling MXFP4, as gpt-oss stores it): e2m1 codes two per byte, byte j of a row holding element 2j in
its LOW nibble and 2j + 1 in its HIGH nibble; value = FP4_VALUES[code] * 2**(scale - 127), scale a uint8 biased
exponent (e8m0) shared by a block of 32 weights:
* `along_rows=True` (gate, up): blocks [..., I, H/2], scales [..., I, H/32]: weight (n, h) uses scales[n, h // 32];
* `along_rows=False` (transposed down): blocks [..., I, H/2], scales [..., I/32, H]: weight (n, h) uses
  scales[n // 32, h] (the 32 neurons of a group share one scale per column).
Products FP4 * 2**k are exact in fp32 (2**-127 is an fp32 subnormal), rounded once to `dtype`, as transformers'
`_convert_moe_packed_tensors` (ldexp) does. (The kernel may flush results below fp32's normal range, scales 0 and 1
only, to zero.)

Shape legend: n experts, I expert width, H hidden.
"""

from __future__ import annotations

import torch

try:  # Triton is optional at import time; the launcher needs it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None

BLOCK = 32  # weights per shared scale
FP4_VALUES = (+0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
__all__ = ["BLOCK", "FP4_VALUES", "dequant_mxfp4", "dequant_mxfp4_ref", "e8m0_to_float", "unpack_codes", "pack_codes"]


# ----------------------------------------------------------------------------------------------------------
# torch reference
# ----------------------------------------------------------------------------------------------------------
def unpack_codes(blocks: torch.Tensor) -> torch.Tensor:
    """[..., N/2] uint8 -> [..., N] uint8 codes (element 2j the low nibble of byte j, 2j + 1 the high)."""
    return torch.stack((blocks & 15, blocks >> 4), dim=-1).flatten(-2)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[..., N] uint8 codes (0..15) -> [..., N/2] uint8, the inverse of `unpack_codes`."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """uint8 biased exponents -> 2**(scale - 127) in fp32, exactly (built from the bits: 0 is the subnormal 2**-127;
    255, e8m0's NaN, comes out inf)."""
    s = scales.to(torch.int32)
    return torch.where(s > 0, s << 23, torch.full_like(s, 1 << 22)).view(torch.float32)


def dequant_mxfp4_ref(blocks: torch.Tensor, scales: torch.Tensor, along_rows: bool, dtype: torch.dtype) -> torch.Tensor:
    """The torch reference and the MXFP4 format's definition: blocks [..., I, H/2] uint8 + scales ([..., I, H/32]
    along rows, [..., I/32, H] across them) uint8 -> [..., I, H] in `dtype` (fp32, rounded once)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    w = lut[unpack_codes(blocks).long()]  # [..., I, H]
    s = e8m0_to_float(scales).repeat_interleave(BLOCK, dim=-1 if along_rows else -2)
    return (w * s).to(dtype)


# ----------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def fp4_value(code):
        """e2m1 code (int32 0..15) -> fp32 value: sign bit 3, exponent bits 2..1, mantissa bit 0 (bias 1)."""
        e = (code >> 1) & 3
        m = code & 1
        normal = (((e + 126) << 23) | (m << 22)).to(tl.float32, bitcast=True)  # 2**(e - 1) * (1 + m / 2)
        mag = tl.where(e == 0, m.to(tl.float32) * 0.5, normal)
        return tl.where((code & 8) != 0, -mag, mag)

    @triton.jit
    def e8m0_value(s):
        """uint8 biased exponent (int32) -> 2**(s - 127) in fp32, exactly (0 is the subnormal 2**-127)."""
        return tl.where(s > 0, s << 23, 1 << 22).to(tl.float32, bitcast=True)

    @triton.jit
    def _dequant_kernel(
        b_ptr,  # [R, H/2] uint8, contiguous (R = n * I rows)
        s_ptr,  # [R, H/32] (along rows) or [R/32, H] uint8, contiguous
        o_ptr,  # [R, H] output, contiguous
        R,
        H2: tl.constexpr,  # H / 2 bytes per row
        ALONG_ROWS: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_J: tl.constexpr,  # next power of two >= H2
    ):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
        j = tl.arange(0, BLOCK_J)  # [BLOCK_J] byte index in a row
        rmask = rows < R
        mask = rmask[:, None] & (j < H2)[None, :]
        r64 = rows.to(tl.int64)[:, None]
        p = tl.load(b_ptr + r64 * H2 + j[None, :], mask=mask, other=0).to(tl.int32)
        if ALONG_ROWS:  # weights 2j, 2j + 1 share the scale of their block of 32 along the row
            s = e8m0_value(tl.load(s_ptr + r64 * (H2 // 16) + (j // 16)[None, :], mask=mask, other=127).to(tl.int32))
            s_lo = s
            s_hi = s
        else:  # rows r of a group of 32 share the scale row r // 32, one scale per column
            srow = (r64 // 32) * (2 * H2)
            s_lo = e8m0_value(tl.load(s_ptr + srow + 2 * j[None, :], mask=mask, other=127).to(tl.int32))
            s_hi = e8m0_value(tl.load(s_ptr + srow + 2 * j[None, :] + 1, mask=mask, other=127).to(tl.int32))
        lo = fp4_value(p & 15) * s_lo  # w[2j]
        hi = fp4_value(p >> 4) * s_hi  # w[2j + 1]
        w = tl.reshape(tl.join(lo, hi), [BLOCK_R, 2 * BLOCK_J])  # interleaved back: [.., 2j], [.., 2j + 1]
        cols = tl.arange(0, 2 * BLOCK_J)
        omask = rmask[:, None] & (cols < 2 * H2)[None, :]
        tl.store(o_ptr + r64 * (2 * H2) + cols[None, :], w.to(o_ptr.dtype.element_ty), mask=omask)


# ----------------------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------------------
def dequant_mxfp4(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    along_rows: bool,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
    BLOCK_R: int = 4,
    num_warps: int = 4,
) -> torch.Tensor:
    """blocks [..., I, H/2] uint8 + scales ([..., I, H/32] along rows, [..., I/32, H] across) uint8 -> [..., I, H]
    in `dtype` (bf16/fp16/fp32), one launch; `out` (contiguous, that shape and dtype) to reuse a buffer."""
    if triton is None:
        raise RuntimeError("dequant_mxfp4 needs triton")
    if blocks.dtype != torch.uint8 or blocks.dim() < 2:
        raise ValueError(f"blocks must be uint8 [..., I, H/2], got {blocks.dtype} {tuple(blocks.shape)}")
    lead, (I, H2) = tuple(blocks.shape[:-2]), blocks.shape[-2:]
    H = 2 * H2
    if H % BLOCK or I % BLOCK:
        raise ValueError(f"MXFP4 needs I and H divisible by {BLOCK}, got I = {I}, H = {H}")
    want = lead + ((I, H // BLOCK) if along_rows else (I // BLOCK, H))
    if scales.dtype != torch.uint8 or tuple(scales.shape) != want:
        raise ValueError(f"scales must be uint8 {want}, got {scales.dtype} {tuple(scales.shape)}")
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype must be bf16/fp16/fp32, got {dtype}")
    if scales.device != blocks.device:
        raise ValueError("blocks and scales must share a device")
    if not (blocks.is_contiguous() and scales.is_contiguous()):
        raise ValueError("blocks and scales must be contiguous")
    shape = lead + (I, H)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=blocks.device)
    elif tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous() or out.device != blocks.device:
        raise ValueError(f"out must be contiguous {dtype} {shape} on {blocks.device}")
    R = blocks.numel() // H2
    if R == 0:
        return out
    grid = (triton.cdiv(R, BLOCK_R),)
    _dequant_kernel[grid](
        blocks,
        scales,
        out,
        R,
        H2=H2,
        ALONG_ROWS=along_rows,
        BLOCK_R=BLOCK_R,
        BLOCK_J=triton.next_power_of_2(H2),
        num_warps=num_warps,
    )
    return out
