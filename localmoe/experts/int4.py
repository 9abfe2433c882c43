"""4-bit routed experts (`--experts int4`) at the app level: sizes, copies between weight stacks, the formats a user
picks.

The format itself (`Int4Tensor`, `quantize`, the reference dequantizer) lives beside its kernels in
`localmoe.kernels.int4`; it is re-exported here for the engine's modules.

Qwen3.5-35B-A3B's routed experts are 32.2 B parameters: 64 GB in bf16, ~17 GB in this format, so the whole model fits
a 24 GB card with no expert offloaded. Only the routed experts are quantized; attention, the router, the shared
expert and lm_head stay in the model's dtype.

Format (one `Int4Tensor` per projection of a layer: gate, up, transposed down, each logically [E, I, H]):
* along H, groups of G weights (G a power of two, 128 when H allows) share an asymmetric affine map
  w ~= q * scale + minimum, q in 0..15, scale = (max - min) / 15, both stored in bfloat16 (the quantizer rounds them
  first, then picks q against the rounded values, so dequantizing is exact arithmetic on what is stored);
* two weights per byte: byte j of a row holds q[2j] in its low nibble and q[2j + 1] in its high nibble.

Offloaded (budgets that cannot hold even int4), the expert cache's slots and the host master copies are Int4Tensors
too, copied part by part (`copy_expert`).

Bytes per weight: 0.5 + 4 / G (0.531 at G = 128).

`--experts nf4` is bitsandbytes' NF4 (kernels/nf4.py `Nf4Tensor`, an Int4Tensor whose 4-bit values index a codebook,
blocks of 64 with an fp32 absmax, 0.5625 bytes per weight): quantized by bitsandbytes at load, or read as they are
from a pre-quantized bnb-4bit checkpoint; every int4 path below takes it unchanged.

`mxfp4` is the MXFP4 of gpt-oss checkpoints (kernels/mxfp4.py `Mxfp4Tensor`: e2m1 codes with a power-of-two scale per
32 weights, 0.53 bytes per weight), read in place from the checkpoint, never quantized by localmoe; its transposed
down keeps its scales across rows (`along_rows=False`), so stacks of it are made per projection (`empty_stack`).

The decode kernel (`kernels/sparse_fused.py`, given Int4Tensors)
reads the packed rows and their scales; every other path dequantizes (`Int4Tensor[...]`) and runs the model dtype's
math.

Shape legend: E experts, I expert width (neurons), H hidden, G group size, NG = H / G groups per row.
"""

from __future__ import annotations

import torch

from localmoe.kernels.dequant_int4 import dequant_int4_ref as dequantize  # noqa: F401
from localmoe.kernels.int4 import GROUP, MIN_GROUP, Int4Tensor, group_for, quantize, row_bytes  # noqa: F401
from localmoe.kernels.mxfp4 import BLOCK as MXFP4_BLOCK
from localmoe.kernels.mxfp4 import Mxfp4Tensor, quantize_mxfp4
from localmoe.kernels.nf4 import Nf4Tensor, quantize_nf4
from localmoe.kernels.nf4 import row_bytes as nf4_row_bytes

EXPERT_FORMATS = ("full", "int4", "nf4", "mxfp4")
STORAGE = {"int4": Int4Tensor, "nf4": Nf4Tensor}  # the formats localmoe quantizes experts into as they load
QUANTIZED = (Int4Tensor, Mxfp4Tensor)  # stacks whose indexing dequantizes (Nf4Tensor is an Int4Tensor)
PROJECTIONS = ("w_gate", "w_up", "w_down_t")  # ExpertWeights' fields, in order


def mxfp4_row_bytes(hidden: int) -> int:
    """Bytes of one neuron's MXFP4 row of one projection, its scales included; ValueError unless 32 divides H."""
    if hidden % MXFP4_BLOCK:
        raise ValueError(f"mxfp4 experts need a hidden size divisible by {MXFP4_BLOCK}, this model's is {hidden}")
    return hidden // 2 + hidden // MXFP4_BLOCK


def expert_bytes(intermediate: int, hidden: int, fmt: str = "int4") -> int:
    """Bytes of one expert (gate, up, down) in the 4-bit format `fmt` ("int4", "nf4" or "mxfp4")."""
    rows = {"nf4": nf4_row_bytes, "mxfp4": mxfp4_row_bytes}.get(fmt, row_bytes)
    return 3 * intermediate * rows(hidden)


def format_of(w) -> str:
    """The expert format of a weight stack: "nf4", "int4", "mxfp4" or "full"."""
    if isinstance(w, Mxfp4Tensor):
        return "mxfp4"
    return "nf4" if isinstance(w, Nf4Tensor) else "int4" if isinstance(w, Int4Tensor) else "full"


def quantize_as(w, fmt: str, projection: str = "w_gate"):
    """[E, I, H] float -> the 4-bit stack of format `fmt` on w's device (`projection`: which of ExpertWeights'
    stacks it is; MXFP4's transposed down has its blocks across rows)."""
    if fmt == "mxfp4":
        return quantize_mxfp4(w, along_rows=projection != "w_down_t")
    return quantize_nf4(w) if fmt == "nf4" else quantize(w)


def empty_stack(fmt: str, shape: tuple[int, int, int], dtype: torch.dtype, device, projection: str, alloc=None):
    """An uninitialised [E, I, H] stack of format `fmt` for `projection` ("w_gate", "w_up" or "w_down_t"): a plain
    tensor ("full"), an Int4Tensor / Nf4Tensor, or an Mxfp4Tensor; `alloc(shape, dtype)` makes its tensors instead
    of torch.empty on `device` (pinned host memory)."""
    if fmt == "mxfp4":
        return Mxfp4Tensor.empty(shape, dtype, device, along_rows=projection != "w_down_t", alloc=alloc)
    if fmt in STORAGE:
        return STORAGE[fmt].empty(shape, dtype, device, alloc=alloc)
    return alloc(shape, dtype) if alloc is not None else torch.empty(shape, dtype=dtype, device=device)


def parts(w) -> tuple[torch.Tensor, ...]:
    """The tensors of a weight stack of any format: a plain tensor, or an int4 / NF4 / MXFP4 stack's parts."""
    return w.parts() if isinstance(w, QUANTIZED) else (w,)


def copy_expert(dst, i: int, src, j: int, non_blocking: bool = False) -> None:
    """dst[i] = src[j] for weight stacks of one format: plain tensors, or 4-bit stacks part by part (indexing a
    4-bit stack dequantizes, so a copy must not go through it)."""
    for d, s in zip(parts(dst), parts(src)):
        d[i].copy_(s[j], non_blocking=non_blocking)
