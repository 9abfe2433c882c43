"""Reading 4-bit expert rows (int4 `Int4Tensor`, or its NF4 kind `Nf4Tensor`): the Triton helpers the sparse decode
kernel (kernels/sparse_fused.py, QUANT mode) reads packed rows with, and their torch side.

Owns the @triton.jit helpers `int4_values` (packed bytes -> the even / odd elements' values), `int4_group_dots` (the
per-group sums of q * x that the gate and up rows need: scale and minimum are applied per group by the caller, so
there is no per-element scale multiply) and `int4_weighted_rows` (sum_n h_n W[n] over dequantized rows: the down
projection), plus the launcher's and the reference's torch helpers: `int4_mode` (whether a launch's three projections
are 4-bit, all of one kind), `scale_min` and `routed_fp32` (the routed experts' rows dequantized exactly in fp32).

Layout (kernels/int4.py): packed [E, I, H/2] uint8, two 4-bit q per byte (int4: low nibble first; NF4, as
bitsandbytes stores it: high nibble first), scale / minimum [E, I, H/G]; int4 w = q * scale + minimum, NF4
w = code[q] * scale (no minimum). In a kernel a row block is viewed as [R, NG_P2, G/2] bytes: NG_P2 = next_pow2(H/G)
groups of G/2 bytes.
"""

from __future__ import annotations

import torch

from localmoe.kernels.dequant_int4 import dequant_int4_ref as dequantize
from localmoe.kernels.int4 import Int4Tensor
from localmoe.kernels.nf4 import Nf4Tensor, dequant_nf4_ref, nf4_code

try:  # Triton is optional at import time; the kernels need it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None


def routed_fp32(w, eid) -> torch.Tensor:
    """w[eid] in fp32 [T,k,I,H]; an Int4Tensor dequantized exactly (w[eid] would round to its logical dtype)."""
    if isinstance(w, Nf4Tensor):
        return dequant_nf4_ref(w.packed[eid], w.scale[eid], nf4_code(w.device), torch.float32)
    if isinstance(w, Int4Tensor):
        return dequantize(w.packed[eid], w.scale[eid], w.minimum[eid], torch.float32)
    return w[eid].float()


def int4_mode(w_gate, w_up, w_down_t) -> bool:
    """Whether the experts are 4-bit (Int4Tensor, or its NF4 kind Nf4Tensor): all three projections of one kind, or
    none."""
    kinds = [type(w).__name__ if isinstance(w, Int4Tensor) else "tensor" for w in (w_gate, w_up, w_down_t)]
    if len(set(kinds)) != 1:
        raise ValueError(
            f"w_gate, w_up and w_down_t must all be Int4Tensors, all Nf4Tensors or all plain tensors, got {kinds}"
        )
    return kinds[0] != "tensor"


def scale_min(w) -> tuple:
    """(scale, minimum) of a 4-bit stack; an Nf4Tensor has no minimum: its scale stands in (never read)."""
    return (w.scale, w.scale if w.minimum is None else w.minimum)


if triton is not None:

    @triton.jit
    def int4_values(p, code_ptr, NF4: tl.constexpr):
        """Packed bytes p (uint8, any shape) -> the values of their even and odd elements in fp32: int4 q[2j] (low
        nibble), q[2j + 1] (high); NF4 (bitsandbytes: high nibble first) code[hi], code[lo] from the 16-entry
        codebook at code_ptr."""
        if NF4:
            return tl.load(code_ptr + (p >> 4)), tl.load(code_ptr + (p & 15))
        return (p & 15).to(tl.float32), (p >> 4).to(tl.float32)

    @triton.jit
    def int4_group_dots(p, xe, xo, code_ptr, NF4: tl.constexpr):
        """Packed rows p [R, NG_P2, G/2] uint8 against x's even / odd elements xe, xo [NG_P2, G/2] (any float): the
        per-group sums of q * x, [R, NG_P2] fp32 (scale and minimum are applied per group by the caller)."""
        ve, vo = int4_values(p, code_ptr, NF4)
        return tl.sum(ve * xe[None, :, :].to(tl.float32) + vo * xo[None, :, :].to(tl.float32), axis=2)

    @triton.jit
    def int4_weighted_rows(p, sc, mn, h, code_ptr, NF4: tl.constexpr):
        """sum_n h_n W[n] over packed rows p [R, NG_P2, G/2] uint8, W = q * scale + minimum per element (sc, mn
        [R, NG_P2] fp32, broadcast over each group; NF4: W = code[q] * scale, mn unused): the even and odd halves
        of the [H] sum, each [NG_P2, G/2]."""
        ve, vo = int4_values(p, code_ptr, NF4)
        s3 = sc[:, :, None]
        h3 = h[:, None, None]
        if NF4:
            return tl.sum(ve * s3 * h3, axis=0), tl.sum(vo * s3 * h3, axis=0)
        m3 = mn[:, :, None]
        return tl.sum((ve * s3 + m3) * h3, axis=0), tl.sum((vo * s3 + m3) * h3, axis=0)
