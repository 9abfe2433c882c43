"""`ExpertWeights`: one MoE layer's routed experts as three stacks [E, I, H] (gate, up, and down transposed), plain
tensors or localmoe's 4-bit ones (`Int4Tensor` / NF4, `Mxfp4Tensor`), what the expert store, the cache, the staging
buffers and `LocalExperts` pass around.

Imports torch, experts/int4.py and the MXFP4 tensor only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localmoe.experts.int4 import PROJECTIONS, QUANTIZED, Int4Tensor, quantize_as
from localmoe.kernels.mxfp4 import Mxfp4Tensor


@dataclass
class ExpertWeights:
    """One MoE layer's routed experts; every tensor [E, I, H], a neuron's weights contiguous in each. With
    `--experts int4` each is an `Int4Tensor` (localmoe/experts/int4.py), a gpt-oss checkpoint's an `Mxfp4Tensor`:
    indexing either dequantizes."""

    w_gate: torch.Tensor | Int4Tensor | Mxfp4Tensor
    w_up: torch.Tensor | Int4Tensor | Mxfp4Tensor
    w_down_t: torch.Tensor | Int4Tensor | Mxfp4Tensor  # W_down transposed: row n is neuron n's output vector

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.w_gate.shape)  # (E, I, H)

    @property
    def int4(self) -> bool:
        """Int4 or NF4 stacks (sparse_fused's QUANT mode reads them)."""
        return isinstance(self.w_gate, Int4Tensor)

    @property
    def affine_int4(self) -> bool:
        """Int4 stacks proper (scale and minimum; not NF4's codebook): the dense path's grouped GEMMs read them in
        place (kernels/grouped_gemm.py)."""
        return isinstance(self.w_gate, Int4Tensor) and self.w_gate.minimum is not None

    def in_place(self, a: int, b: int) -> tuple:
        """(gate, up, down_t) of experts [a, b) as the dense path's grouped GEMMs read them in place: views of plain
        or int4 stacks (`affine_int4`; other 4-bit formats are dequantized: `dequantized`)."""
        if self.quantized and not self.affine_int4:
            raise ValueError("only plain and int4 experts are read in place")
        return tuple(
            Int4Tensor(t.packed[a:b], t.scale[a:b], t.minimum[a:b], t.dtype) if isinstance(t, Int4Tensor) else t[a:b]
            for t in (self.w_gate, self.w_up, self.w_down_t)
        )

    @property
    def mxfp4(self) -> bool:
        return isinstance(self.w_gate, Mxfp4Tensor)

    @property
    def quantized(self) -> bool:
        """Any 4-bit format: indexing dequantizes, so the dense path runs a span of experts at a time."""
        return isinstance(self.w_gate, QUANTIZED)

    def nbytes(self) -> int:
        return sum(
            t.nbytes() if isinstance(t, QUANTIZED) else t.numel() * t.element_size()
            for t in (self.w_gate, self.w_up, self.w_down_t)
        )

    def to_int4(self, fmt: str = "int4") -> ExpertWeights:
        """The same experts in the 4-bit format `fmt` ("int4", "nf4" or "mxfp4"; quantized on their device)."""
        return ExpertWeights(*(quantize_as(getattr(self, p), fmt, p) for p in PROJECTIONS))

    def dequantized(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate, up, down_t) of experts [a, b) as plain tensors [b - a, I, H] (a view when not quantized)."""
        return tuple(t[a:b] for t in (self.w_gate, self.w_up, self.w_down_t))
