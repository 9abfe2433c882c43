"""The argument checks of a `decode_attention` launch (kernels/decode_attention.py), top to bottom in the order the
launcher calls them: q, k and v, the mask (as the kernel's int8), the output buffer, then the optional output gate,
sinks and window. kernels/decode_attention_qk.py's launcher takes the mask's and the output's too.

Each check raises ValueError naming the argument and what it must be; the launcher stays the dispatcher, and the
launch parameters' checks (chunk, block_l, prefetch, max_splits, scale) stay in its `_launch`, which sizes the grid.

Shape legend (kernels/decode_attention.py's): Hq query heads, Hkv KV heads, L cache length (keys), Dk query/key head
dim, Dv value head dim.
"""

from __future__ import annotations

import torch

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int]:
    """q [Hq, Dk], k [Hkv, L, Dk], v [Hkv, L, Dv] of one float dtype on one device, last dims contiguous, Hq a
    multiple of Hkv -> (Hq, Dk, Hkv, L, Dv)."""
    if q.dim() != 2 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q must be [Hq, Dk], k [Hkv, L, Dk], v [Hkv, L, Dv]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    Hq, Dk = q.shape
    Hkv, L, _ = k.shape
    Dv = v.shape[2]
    if k.shape[2] != Dk or v.shape[:2] != (Hkv, L):
        raise ValueError(
            f"k must be [Hkv, L, {Dk}] and v [Hkv, L, Dv] with k's Hkv and L; got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    if q.dtype not in _FLOAT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.stride(1) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("q, k and v need a contiguous last dim")
    if len({q.device, k.device, v.device}) != 1:
        raise ValueError("q, k and v must be on one device")
    return Hq, Dk, Hkv, L, Dv


def _mask_int8(mask, L: int, device):
    """A bool [L] mask (or None) checked, as the kernel's int8."""
    if mask is None:
        return None
    if mask.dtype != torch.bool or mask.shape != (L,) or mask.device != device:
        raise ValueError(f"mask must be a bool [L] = [{L}] tensor on {device}, got {mask.dtype} {tuple(mask.shape)}")
    return mask.contiguous().view(torch.int8)


def _out(out, Hq: int, Dv: int, q):
    """The caller's out [Hq, Dv] checked, or a new one in q's dtype."""
    if out is None:
        return torch.empty(Hq, Dv, dtype=q.dtype, device=q.device)
    if tuple(out.shape) != (Hq, Dv) or out.dtype != q.dtype or out.stride(1) != 1 or out.device != q.device:
        raise ValueError(f"out must be [Hq, Dv] = {(Hq, Dv)} of {q.dtype} with a contiguous last dim")
    return out


def check_extras(gate, sinks, window, Hq: int, Dv: int, q: torch.Tensor) -> None:
    """The optional output gate [Hq, Dv] (q's dtype, last dim contiguous), sinks [Hq] (contiguous, any float dtype)
    on q's device, and window (an int >= 1)."""
    if gate is not None and (
        tuple(gate.shape) != (Hq, Dv) or gate.dtype != q.dtype or gate.stride(1) != 1 or gate.device != q.device
    ):
        raise ValueError(f"gate must be [Hq, Dv] = {(Hq, Dv)} of {q.dtype} with a contiguous last dim")
    if sinks is not None and (
        tuple(sinks.shape) != (Hq,)
        or sinks.dtype not in _FLOAT_DTYPES
        or sinks.stride(0) != 1
        or sinks.device != q.device
    ):
        raise ValueError(f"sinks must be a contiguous float [Hq] = [{Hq}] tensor on {q.device}")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"window must be a positive int, got {window!r}")
