"""4-bit routed experts (`--experts int4`): the storage format, its quantizer and its torch dequantizer.

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

Bytes per weight: 0.5 + 4 / G (0.531 at G = 128). The decode kernel (`kernels/sparse_fused.py`, given Int4Tensors)
reads the packed rows and their scales; every other path dequantizes (`Int4Tensor[...]`) and runs the model dtype's
math.

Shape legend: E experts, I expert width (neurons), H hidden, G group size, NG = H / G groups per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 128  # preferred group size; smaller powers of two when H is not a multiple of it
MIN_GROUP = 16
EXPERT_FORMATS = ("full", "int4")


def group_for(hidden: int) -> int:
    """The largest power of two <= GROUP dividing `hidden` (>= MIN_GROUP); ValueError when none does."""
    g = GROUP
    while g >= MIN_GROUP:
        if hidden % g == 0:
            return g
        g //= 2
    raise ValueError(f"int4 experts need a hidden size divisible by {MIN_GROUP}, this model's is {hidden}")


def expert_bytes(intermediate: int, hidden: int) -> int:
    """Bytes of one expert (gate, up, down) in this format."""
    return 3 * intermediate * row_bytes(hidden)


@dataclass(frozen=True)
class Int4Tensor:
    """Packed 4-bit weights, logically [E, I, H] in `dtype`. packed [E, I, H/2] uint8; scale and minimum
    [E, I, H/G] bfloat16. Indexing dequantizes: `w[e]` -> [I, H], `w[ids]` -> [n, I, H] in `dtype`."""

    packed: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    dtype: torch.dtype

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
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.minimum))

    @classmethod
    def empty(cls, shape: tuple[int, int, int], dtype: torch.dtype, device, alloc=None) -> "Int4Tensor":
        """Uninitialised storage for logical [E, I, H] weights (fill it with `put`); `alloc(shape, dtype)` makes
        each part instead of torch.empty on `device` (e.g. pinned host memory)."""
        E, I, H = shape
        NG = H // group_for(H)
        alloc = alloc or (lambda s, dt: torch.empty(s, dtype=dt, device=device))
        return cls(alloc((E, I, H // 2), torch.uint8), alloc((E, I, NG), torch.bfloat16),
                   alloc((E, I, NG), torch.bfloat16), dtype)

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


def copy_expert(dst, i: int, src, j: int, non_blocking: bool = False) -> None:
    """dst[i] = src[j] for weight stacks of one format: plain tensors, or Int4Tensors part by part (indexing an
    Int4Tensor dequantizes, so a copy must not go through it)."""
    if isinstance(dst, Int4Tensor):
        for d, s in zip(dst.parts(), src.parts()):
            d[i].copy_(s[j], non_blocking=non_blocking)
    else:
        dst[i].copy_(src[j], non_blocking=non_blocking)


def row_bytes(hidden: int) -> int:
    """Bytes of one neuron's int4 row of one projection, its scales and minimums included."""
    return hidden // 2 + 4 * (hidden // group_for(hidden))


def _dequantize(packed, scale, minimum, dtype) -> torch.Tensor:
    """`dequantize`, in one Triton launch on CUDA (kernels/dequant_int4.py: no fp32 temporaries of the span's size)."""
    if packed.is_cuda:
        from localmoe.kernels.dequant_int4 import dequant_int4

        return dequant_int4(packed.contiguous(), scale.contiguous(), minimum.contiguous(), dtype)
    return dequantize(packed, scale, minimum, dtype)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., H/2] uint8 + [..., NG] scales -> [..., H] in `dtype` (computed in fp32, rounded once)."""
    lo = (packed & 15).float()
    hi = (packed >> 4).float()
    q = torch.stack((lo, hi), dim=-1).flatten(-2)  # [..., H]: q[2j] low nibble, q[2j+1] high
    NG = scale.shape[-1]
    q = q.unflatten(-1, (NG, -1))  # [..., NG, G]
    w = q * scale.float().unsqueeze(-1) + minimum.float().unsqueeze(-1)
    return w.flatten(-2).to(dtype)


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
