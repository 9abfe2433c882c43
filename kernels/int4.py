"""The int4 expert format (`--experts int4`): `Int4Tensor`, its quantizer and the group arithmetic.

It lives beside its kernels (`dequant_int4.py` holds the torch reference `dequant_int4_ref`, the format's
definition, and the CUDA launch; `sparse_fused.py` reads the packed rows in place), so kernels import nothing from
the app layer; `localmoe.experts.int4` builds on it (sizes, copies between stacks, the expert formats a user can pick).

Format (one `Int4Tensor` per projection of a layer: gate, up, transposed down, each logically [E, I, H]):
* along H, groups of G weights (G a power of two, 128 when H allows) share an asymmetric affine map
  w ~= q * scale + minimum, q in 0..15, scale = (max - min) / 15, both stored in bfloat16 (the quantizer rounds them
  first, then picks q against the rounded values, so dequantizing is exact arithmetic on what is stored);
* two weights per byte: byte j of a row holds q[2j] in its low nibble and q[2j + 1] in its high nibble.

Shape legend: E experts, I expert width (neurons), H hidden, G group size, NG = H / G groups per row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from localmoe.kernels.dequant_int4 import dequant_int4
from localmoe.kernels.dequant_int4 import dequant_int4_ref as dequantize

ALIGN = 16  # bytes: each part of an expert in an expert-major block starts at a multiple (`expert_major`)
GROUP = 128  # preferred group size; smaller powers of two when H is not a multiple of it
MIN_GROUP = 16


def group_for(hidden: int, largest: int = GROUP, smallest: int = MIN_GROUP, fmt: str = "int4") -> int:
    """The largest power of two <= `largest` dividing `hidden` (>= `smallest`); ValueError when none does."""
    g = largest
    while g >= smallest:
        if hidden % g == 0:
            return g
        g //= 2
    raise ValueError(f"{fmt} experts need a hidden size divisible by {smallest}, this model's is {hidden}")


def row_bytes(hidden: int) -> int:
    """Bytes of one neuron's int4 row of one projection, its scales and minimums included."""
    return hidden // 2 + 4 * (hidden // group_for(hidden))


@dataclass(frozen=True)
class Int4Tensor:
    """Packed 4-bit weights, logically [E, I, H] in `dtype`. packed [E, I, H/2] uint8; scale and minimum
    [E, I, H/G] bfloat16. Indexing dequantizes: `w[e]` -> [I, H], `w[ids]` -> [n, I, H] in `dtype`. `block`: the
    [E, B] uint8 block the parts are views of when laid expert-major (`expert_major`: host master copies), else None."""

    packed: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    dtype: torch.dtype
    block: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        E, I, half = self.packed.shape
        return (E, I, 2 * half)

    @property
    def group(self) -> int:
        return self.shape[2] // self.scale.shape[-1]

    @property
    def device(self) -> torch.device:
        return self.packed.device

    def element_size(self) -> float:
        """Bytes per logical weight, scales included (the byte-floor arithmetic uses it)."""
        return 0.5 + 4.0 / self.group

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts())

    @classmethod
    def empty(cls, shape: tuple[int, int, int], dtype: torch.dtype, device, alloc=None) -> Int4Tensor:
        """Uninitialised storage for logical [E, I, H] weights (fill it with `put`); with `alloc(shape, dtype)` (e.g.
        pinned host memory) one block laid expert-major (`expert_major`), else each part by torch.empty on
        `device`."""
        E, I, H = shape
        specs = [((I, H // 2), torch.uint8), ((I, H // group_for(H)), torch.bfloat16)]
        *parts, block = empty_parts(E, specs + specs[1:], device, alloc)
        return cls(*parts, dtype, block)

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.packed, self.scale, self.minimum

    def put(self, e: int, w: torch.Tensor, work_device=None) -> None:
        """Quantize expert e's weights w [I, H] (any device) into place, on `work_device` (default: where this
        lives): a layer loads expert by expert without holding it in the model's dtype."""
        q = quantize(w.unsqueeze(0), group=self.group, device=work_device or self.device)
        for dst, src in zip(self.parts(), q.parts()):
            dst[e].copy_(src[0])

    def expert_on(self, e: int, device) -> torch.Tensor:
        """Expert e dequantized [I, H] on `device` (the packed bytes cross, not the model-dtype weights)."""
        return _dequantize(*(t[e].to(device, non_blocking=True) for t in self.parts()), self.dtype)

    def __getitem__(self, index) -> torch.Tensor:
        return _dequantize(self.packed[index], self.scale[index], self.minimum[index], self.dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return _dequantize(self.packed, self.scale, self.minimum, dtype or self.dtype)


def empty_parts(E: int, specs, device, alloc=None) -> list[torch.Tensor | None]:
    """[E, *shape] parts of `specs` [(shape, dtype)], then their block: each by torch.empty on `device` (block None),
    or with `alloc` one block laid expert-major (`expert_major`)."""
    if alloc is None:
        return [*(torch.empty((E, *s), dtype=dt, device=device) for s, dt in specs), None]
    return expert_major(alloc, E, specs)


def expert_major(alloc, E: int, specs) -> list[torch.Tensor]:
    """[E, *shape] parts of `specs` [(shape, dtype)] as views of one [E, B] uint8 block `alloc((E, B), torch.uint8)`
    makes, then the block: each expert's parts back to back (each at a multiple of ALIGN bytes), so one copy moves an
    expert's whole projection, or a run of experts' (experts/host_copies.py)."""
    sizes = [math.prod(s) * torch.empty((), dtype=dt).element_size() for s, dt in specs]
    steps = [-(-n // ALIGN) * ALIGN for n in sizes]
    block = alloc((E, sum(steps)), torch.uint8)
    out, at = [], 0
    for (s, dt), n, step in zip(specs, sizes, steps):
        out.append(block[:, at : at + n].view(dt).view(E, *s))
        at += step
    return [*out, block]


def _dequantize(packed, scale, minimum, dtype) -> torch.Tensor:
    """`dequantize`, in one Triton launch on CUDA (kernels/dequant_int4.py: no fp32 temporaries of the span's size)."""
    if packed.is_cuda:
        return dequant_int4(packed.contiguous(), scale.contiguous(), minimum.contiguous(), dtype)
    return dequantize(packed, scale, minimum, dtype)


def quantize(w: torch.Tensor, group: int | None = None, chunk: int = 16, device=None) -> Int4Tensor:
    """[E, I, H] float -> Int4Tensor on `device` (default w's), `chunk` experts at a time: the fp32 temporaries stay
    small, and a layer staged in host memory crosses to the device a chunk at a time."""
    E, I, H = w.shape
    G = group or group_for(H)
    if H % G or G % 2:
        raise ValueError(f"group {G} does not divide hidden {H}")
    device = w.device if device is None else torch.device(device)
    packed = torch.empty((E, I, H // 2), dtype=torch.uint8, device=device)
    scale = torch.empty((E, I, H // G), dtype=torch.bfloat16, device=device)
    minimum = torch.empty_like(scale)
    for a in range(0, E, chunk):
        b = min(E, a + chunk)
        x = w[a:b].to(device).float().unflatten(-1, (H // G, G))  # [n, I, NG, G]
        lo = x.amin(-1)
        m = lo.to(torch.bfloat16)
        s = ((x.amax(-1) - m.float()) / 15).to(torch.bfloat16)
        s = torch.where(s.float() > 0, s, torch.ones_like(s))  # a constant group: any scale, q = 0
        q = ((x - m.float().unsqueeze(-1)) / s.float().unsqueeze(-1)).round().clamp(0, 15).to(torch.uint8)
        q = q.flatten(-2)  # [n, I, H]
        packed[a:b] = q[..., 0::2] | (q[..., 1::2] << 4)
        scale[a:b] = s
        minimum[a:b] = m
    return Int4Tensor(packed, scale, minimum, w.dtype)
