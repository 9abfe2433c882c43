"""The MXFP4 expert format (gpt-oss): `Mxfp4Tensor`, the hub layout's conversions both ways, and a quantizer.

It lives beside its kernels (`mxfp4_dequant.py` holds the format's definition `dequant_mxfp4_ref` and the CUDA
dequantizing launch; `mxfp4_sparse.py` reads the codes in place, with `mxfp4_rows.py`'s row helpers), so kernels
import nothing from the app layer.

In-memory layout (one `Mxfp4Tensor` per projection of a layer, each logically [E, I, H] like every expert format):
* e2m1 codes two per byte, byte j of a row holding element 2j in its LOW nibble and 2j + 1 in its HIGH nibble (the
  checkpoint's order); value = FP4_VALUES[code] * 2**(scale - 127), scale a uint8 biased exponent (e8m0);
* gate and up (`along_rows=True`): blocks [E, I, H/2] uint8 (the checkpoint's gate_up rows de-interleaved: gate =
  rows 0::2, up = rows 1::2), scales [E, I, H/32] uint8 (each row's blocks of 32 along H);
* transposed down (`along_rows=False`): blocks [E, I, H/2] uint8 (neuron n's H down weights, the checkpoint's codes
  transposed nibble by nibble: lossless), scales [E, I/32, H] uint8: weight (n, h) is scaled by
  2**(scales[e, n // 32, h] - 127) (the checkpoint's [E, H, I/32] transposed).
Rows contiguous (stride(-1) == 1), any expert stride; H % 32 == 0 and I % 32 == 0 (along rows only H's is needed).

Hub layout (per layer): gate_up_proj_blocks [E, 2I, H/32, 16], gate_up_proj_scales [E, 2I, H/32] (gate rows at even
indices, up at odd), down_proj_blocks [E, H, I/32, 16], down_proj_scales [E, H, I/32].

Shape legend: E experts, I expert width (neurons), H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localmoe.kernels.mxfp4_dequant import (
    BLOCK,
    FP4_VALUES,
    dequant_mxfp4,
    dequant_mxfp4_ref,
    e8m0_to_float,
    pack_codes,
    unpack_codes,
)

__all__ = [
    "BLOCK",
    "FP4_VALUES",
    "Mxfp4Tensor",
    "dequant_mxfp4_ref",
    "down_t_from_hub",
    "down_t_to_hub",
    "gate_up_from_hub",
    "gate_up_to_hub",
    "quantize_mxfp4",
]

# FP4 magnitudes (codes 0..7) and the midpoints between neighbours, for round-to-nearest
_MAGNITUDES = FP4_VALUES[:8]
_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(_MAGNITUDES[:-1], _MAGNITUDES[1:]))


@dataclass(frozen=True)
class Mxfp4Tensor:
    """MXFP4 weights, logically [E, I, H] in `dtype`: blocks [E, I, H/2] uint8, scales [E, I, H/32] uint8
    (`along_rows`) or [E, I/32, H] (not). Indexing dequantizes: `w[e]` -> [I, H], `w[ids]` -> [n, I, H]."""

    blocks: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype
    along_rows: bool

    @property
    def shape(self) -> tuple[int, int, int]:
        E, I, half = self.blocks.shape
        return (E, I, 2 * half)

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def element_size(self) -> float:
        """Bytes per logical weight, scales included (the byte-floor arithmetic uses it)."""
        return 0.5 + 1.0 / BLOCK

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts())

    def parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.blocks, self.scales

    @classmethod
    def empty(
        cls, shape: tuple[int, int, int], dtype: torch.dtype, device, along_rows: bool, alloc=None
    ) -> Mxfp4Tensor:
        """Uninitialised storage for logical [E, I, H] weights; `alloc(shape, dtype)` makes each part instead of
        torch.empty on `device` (e.g. pinned host memory)."""
        E, I, H = shape
        if H % BLOCK or (I % BLOCK and not along_rows):
            raise ValueError(f"MXFP4 experts need I and H divisible by {BLOCK}, got I = {I}, H = {H}")
        alloc = alloc or (lambda s, dt: torch.empty(s, dtype=dt, device=device))
        scales = (E, I, H // BLOCK) if along_rows else (E, I // BLOCK, H)
        return cls(alloc((E, I, H // 2), torch.uint8), alloc(scales, torch.uint8), dtype, along_rows)

    def put(self, e: int, w: torch.Tensor, work_device=None) -> None:
        """Quantize expert e's weights w [I, H] (`quantize_mxfp4`, on `work_device`, default where this lives) into
        place."""
        q = quantize_mxfp4(w.unsqueeze(0), self.along_rows, device=work_device or self.device)
        for dst, src in zip(self.parts(), q.parts()):
            dst[e].copy_(src[0])

    def expert_on(self, e: int, device) -> torch.Tensor:
        """Expert e dequantized [I, H] on `device` (the codes cross, not the model-dtype weights)."""
        blocks, scales = (t[e].to(device, non_blocking=True) for t in self.parts())
        return _dequantize(blocks, scales, self.along_rows, self.dtype)

    def __getitem__(self, index) -> torch.Tensor:
        return _dequantize(self.blocks[index], self.scales[index], self.along_rows, self.dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return _dequantize(self.blocks, self.scales, self.along_rows, dtype or self.dtype)


def _dequantize(blocks, scales, along_rows, dtype) -> torch.Tensor:
    """`dequant_mxfp4_ref`, in one Triton launch on CUDA (kernels/mxfp4_dequant.py)."""
    if blocks.is_cuda:
        return dequant_mxfp4(blocks.contiguous(), scales.contiguous(), along_rows, dtype)
    return dequant_mxfp4_ref(blocks, scales, along_rows, dtype)


# ----------------------------------------------------------------------------------------------------------
# the hub layout, per expert (a loader fills preallocated storage expert by expert)
# ----------------------------------------------------------------------------------------------------------
def gate_up_from_hub(blocks_e: torch.Tensor, scales_e: torch.Tensor):
    """One expert's gate_up_proj_blocks [2I, H/32, 16] + scales [2I, H/32] -> (gate_blocks [I, H/2], gate_scales
    [I, H/32], up_blocks, up_scales): rows 0::2 are the gate's, 1::2 the up's; the bytes are unchanged."""
    R, G, B = blocks_e.shape
    flat = blocks_e.reshape(R, G * B)
    return (flat[0::2].contiguous(), scales_e[0::2].contiguous(), flat[1::2].contiguous(), scales_e[1::2].contiguous())


def down_t_from_hub(blocks_e: torch.Tensor, scales_e: torch.Tensor):
    """One expert's down_proj_blocks [H, I/32, 16] + scales [H, I/32] -> (blocks [I, H/2], scales [I/32, H]) of the
    transposed down: the codes transposed nibble by nibble (lossless), the scales transposed."""
    H, G, B = blocks_e.shape
    codes = unpack_codes(blocks_e.reshape(H, G * B))  # [H, I]
    return pack_codes(codes.t()).contiguous(), scales_e.t().contiguous()


def gate_up_to_hub(gate: Mxfp4Tensor, up: Mxfp4Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up (along rows, [E, I, H]) -> the hub's (blocks [E, 2I, H/32, 16], scales [E, 2I, H/32]),
    gate rows at even indices, up rows at odd."""
    E, I, H = gate.shape
    blocks = torch.stack((gate.blocks, up.blocks), dim=2).reshape(E, 2 * I, H // BLOCK, BLOCK // 2)
    scales = torch.stack((gate.scales, up.scales), dim=2).reshape(E, 2 * I, H // BLOCK)
    return blocks.contiguous(), scales.contiguous()


def down_t_to_hub(down_t: Mxfp4Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The transposed down ([E, I, H], scales across rows) -> the hub's (blocks [E, H, I/32, 16], scales
    [E, H, I/32])."""
    E, I, H = down_t.shape
    codes = unpack_codes(down_t.blocks).transpose(1, 2)  # [E, H, I]
    blocks = pack_codes(codes).reshape(E, H, I // BLOCK, BLOCK // 2)
    return blocks.contiguous(), down_t.scales.transpose(1, 2).contiguous()


# ----------------------------------------------------------------------------------------------------------
# quantizer (tests and random weights write checkpoints in the hub layout through it)
# ----------------------------------------------------------------------------------------------------------
def _fp4_codes(x: torch.Tensor) -> torch.Tensor:
    """fp32 values (|x| <= 6 expected; beyond saturates to +-6) -> e2m1 codes uint8: the nearest FP4 value, a tie
    going to the even code (round half to even on e2m1's mantissa, as IEEE rounding does); the sign bit only on a
    nonzero magnitude (no -0 codes)."""
    a = x.abs()
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=x.device)
    lo = torch.bucketize(a, mids, right=False)  # a tie lands on the smaller magnitude
    hi = torch.bucketize(a, mids, right=True)  # ... or the larger one
    mag = torch.where((lo != hi) & (lo % 2 == 1), hi, lo)
    sign = ((x < 0) & (mag > 0)).to(torch.uint8) << 3
    return mag.to(torch.uint8) | sign


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2**e exactly for integral fp32 e in [-127, 127]."""
    return e8m0_to_float((e + 127).to(torch.uint8))


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [..., N] -> (codes [..., N] uint8, scales [..., N/32] uint8) with blocks of 32 along the last dim.
    Per block: e = ceil(log2(amax / 6)) clamped to e8m0's [-127, 127] (an all-zero block gets -127), so |x| / 2**e
    <= 6; codes = `_fp4_codes(x / 2**e)`."""
    blocks = x.unflatten(-1, (-1, BLOCK))  # [..., N/32, 32]
    amax = blocks.abs().amax(-1)
    e = torch.ceil(torch.log2(amax / 6)).clamp(-127, 127)
    e = torch.where(amax > 0, e, torch.full_like(e, -127.0))
    e = torch.where(amax / _pow2(e) > 6, e + 1, e).clamp(-127, 127)  # log2's rounding, guarded
    scale = (e + 127).to(torch.uint8)
    codes = _fp4_codes(blocks / e8m0_to_float(scale).unsqueeze(-1)).flatten(-2)
    return codes, scale


def quantize_mxfp4(w: torch.Tensor, along_rows: bool = True, chunk: int = 8, device=None) -> Mxfp4Tensor:
    """[E, I, H] float -> Mxfp4Tensor on `device` (default w's), `chunk` experts at a time: blocks of 32 along H
    (`along_rows`, gate / up) or along I (the transposed down), rounding as `_quantize_rows` says."""
    E, I, H = w.shape
    device = w.device if device is None else torch.device(device)
    out = Mxfp4Tensor.empty((E, I, H), w.dtype, device, along_rows)
    for a in range(0, E, chunk):
        b = min(E, a + chunk)
        x = w[a:b].to(device).float()
        if along_rows:
            codes, scales = _quantize_rows(x)
        else:
            codes, scales = _quantize_rows(x.transpose(1, 2).contiguous())  # [n, H, I], [n, H, I/32]
            codes, scales = codes.transpose(1, 2), scales.transpose(1, 2)
        out.blocks[a:b] = pack_codes(codes)
        out.scales[a:b] = scales
    return out
