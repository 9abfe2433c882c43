"""The NF4 expert format (`--experts nf4`): `Nf4Tensor`, bitsandbytes' 4-bit NormalFloat layout read in place.

An `Nf4Tensor` is an `Int4Tensor` (kernels/int4.py) whose 4-bit values index a 16-entry codebook instead of an affine
map, so every int4 path (the sparse decode kernel's QUANT mode, the dequantizing kernel, the expert cache's slots and
host copies, copied part by part) takes it with one switch: w = code[q] * absmax, no minimum.

Layout (what `bitsandbytes.functional.quantize_4bit(w, blocksize=G, quant_type="nf4")` returns for a row-major
[I, H] matrix with H a multiple of G, viewed per row):
* packed [E, I, H/2] uint8: byte j of a row holds q[2j] in its HIGH nibble and q[2j + 1] in its low nibble
  (bitsandbytes' order; localmoe's int4 is the other way round);
* scale [E, I, H/G] fp32: bitsandbytes' absmax of each block of G weights along H (double-quantized statistics of a
  checkpoint are expanded to fp32 once, at load);
* the code: bitsandbytes' NF4 codebook (16 values in [-1, 1], `nf4_code`), the same for every tensor (a checkpoint
  whose `quant_map` differs is refused at load), so the kernels take it from the device they run on.

Bytes per weight: 0.5 + 4 / G (0.5625 at G = 64, bitsandbytes' default block).

Shape legend: E experts, I expert width (neurons), H hidden, G block size, NG = H / G blocks per row.
"""

from __future__ import annotations

import functools

import torch

from localmoe.kernels.dequant_int4 import dequant_int4, dequant_nf4_ref
from localmoe.kernels.int4 import Int4Tensor, empty_parts, group_for

BLOCK = 64  # bitsandbytes' default 4-bit block; smaller powers of two when H is not a multiple of it
MIN_BLOCK = 32  # the smallest block bitsandbytes quantizes 4-bit weights with

# bitsandbytes' NF4 codebook (bitsandbytes.functional.get_4bit_type("nf4")), as its checkpoints' quant_map holds it
NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
_CODES: dict[torch.device, torch.Tensor] = {}


def nf4_code(device) -> torch.Tensor:
    """The NF4 codebook [16] fp32 on `device`, one tensor per device (every Nf4Tensor there shares it)."""
    device = torch.device(device)
    if device not in _CODES:
        _CODES[device] = torch.tensor(NF4_CODE, dtype=torch.float32, device=device)
    return _CODES[device]


@functools.cache
def bnb_functional():
    """bitsandbytes.functional, its CPU backend's notice about an optional hub kernel (logged at import on CPUs with
    AVX512-BF16, irrelevant here: localmoe reads NF4 with its own kernels) kept off stderr. Imported once: a logger's
    setLevel clears every logger's cache, and a per-expert call of it cost a load seconds."""
    import logging

    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        import bitsandbytes.functional as bnb_f
    finally:
        log.setLevel(level)
    return bnb_f


def block_for(hidden: int) -> int:
    """The largest power of two <= BLOCK dividing `hidden` (>= MIN_BLOCK); ValueError when none does."""
    return group_for(hidden, BLOCK, MIN_BLOCK, "nf4")


def row_bytes(hidden: int) -> int:
    """Bytes of one neuron's NF4 row of one projection, its fp32 absmax included."""
    return hidden // 2 + 4 * (hidden // block_for(hidden))


class Nf4Tensor(Int4Tensor):
    """NF4 weights, logically [E, I, H] in `dtype`: packed [E, I, H/2] uint8 (high nibble first), scale = absmax
    [E, I, H/G] fp32, minimum None. Indexing dequantizes, as an Int4Tensor's does."""

    def element_size(self) -> float:
        return 0.5 + 4.0 / self.group

    @classmethod
    def empty(cls, shape: tuple[int, int, int], dtype: torch.dtype, device, alloc=None, block=None) -> Nf4Tensor:
        """As Int4Tensor.empty; `block` the block size G (default `block_for(H)`)."""
        E, I, H = shape
        specs = [((I, H // 2), torch.uint8), ((I, H // (block or block_for(H))), torch.float32)]
        packed, scale, held = empty_parts(E, specs, device, alloc)  # with `alloc`: one block, expert-major
        nf4_code(packed.device)  # made now, before any CUDA graph capture reads it
        return cls(packed, scale, None, dtype, held)

    def parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.packed, self.scale

    def put(self, e: int, w: torch.Tensor, work_device=None) -> None:
        """Quantize expert e's weights w [I, H] with bitsandbytes on `work_device` (default: where this lives)."""
        q = quantize_nf4(w.unsqueeze(0), block=self.group, device=work_device or self.device)
        for dst, src in zip(self.parts(), q.parts()):
            dst[e].copy_(src[0])

    def put_packed(self, e: int, packed: torch.Tensor, absmax: torch.Tensor) -> None:
        """Expert e from bitsandbytes' own bytes (a pre-quantized checkpoint's): packed [I*H/2] and absmax
        [I*H/G] fp32 of a row-major [I, H] matrix quantized in blocks of this tensor's G."""
        self.packed[e].copy_(packed.reshape(self.packed.shape[1:]))
        self.scale[e].copy_(absmax.reshape(self.scale.shape[1:]))

    def expert_on(self, e: int, device) -> torch.Tensor:
        return _dequantize(self.packed[e].to(device, non_blocking=True), self.scale[e].to(device), self.dtype)

    def __getitem__(self, index) -> torch.Tensor:
        return _dequantize(self.packed[index], self.scale[index], self.dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return _dequantize(self.packed, self.scale, dtype or self.dtype)


def _dequantize(packed, absmax, dtype) -> torch.Tensor:
    """`dequant_nf4_ref`, in one Triton launch on CUDA (kernels/dequant_int4.py's NF4 mode)."""
    code = nf4_code(packed.device)
    if packed.is_cuda:
        return dequant_int4(packed.contiguous(), absmax.contiguous(), None, dtype, code=code)
    return dequant_nf4_ref(packed, absmax, code, dtype)


def quantize_nf4(w: torch.Tensor, block: int | None = None, chunk: int = 16, device=None) -> Nf4Tensor:
    """[E, I, H] float -> Nf4Tensor on `device` (default w's), quantized by bitsandbytes (`quantize_4bit`, NF4, blocks
    of `block` along H), `chunk` experts at a time."""
    bnb_f = bnb_functional()
    E, I, H = w.shape
    G = block or block_for(H)
    if H % G:
        raise ValueError(f"block {G} does not divide hidden {H}")
    device = w.device if device is None else torch.device(device)
    out = Nf4Tensor.empty((E, I, H), w.dtype, device, block=G)
    for a in range(0, E, chunk):
        b = min(E, a + chunk)
        x = w[a:b].to(device).contiguous()
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            x = x.float()
        q, st = bnb_f.quantize_4bit(x, blocksize=G, quant_type="nf4")
        out.packed[a:b] = q.view(b - a, I, H // 2)
        out.scale[a:b] = st.absmax.view(b - a, I, H // G).float()
    return out
