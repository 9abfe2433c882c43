"""Argument checks the expert kernels' launchers share: expert weight stacks [n, I, H] with contiguous rows.

Each launcher still checks its own inputs top to bottom; this is only the part that is the same in all of them.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def tokens_and_experts(x: torch.Tensor, w: torch.Tensor, name: str = "w_gate") -> tuple[int, int, int, int]:
    """x must be [T, H] and the expert stack `name` [E, I, H] (checked in full by `expert_weights`); returns
    (T, H, E, I)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got shape {tuple(x.shape)}")
    if w.dim() != 3:
        raise ValueError(f"{name} must be [E, I, H], got shape {tuple(w.shape)}")
    return x.shape[0], x.shape[1], w.shape[0], w.shape[1]


def expert_weights(name: str, w: torch.Tensor, n: int, I: int, H: int, device: torch.device | None = None,
                   *, allow_host: bool = False) -> None:
    """w must be [n, I, H], bf16/fp16/fp32, rows contiguous (any expert stride), on `device` — or, with
    `allow_host`, a host copy (pinned when `device` is CUDA, since the GPU reads it through unified addressing)."""
    if w.dim() != 3 or tuple(w.shape) != (n, I, H):
        raise ValueError(f"{name} must have shape {(n, I, H)}, got {tuple(w.shape)}")
    if w.stride(2) != 1 or (I > 1 and w.stride(1) != H):
        raise ValueError(f"{name} rows must be contiguous (stride(2) == 1, stride(1) == H); got strides {w.stride()}")
    if w.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be bf16/fp16/fp32, got {w.dtype}")
    if device is None or w.device == device:
        return
    if not (allow_host and w.device.type == "cpu"):
        raise ValueError(f"{name} is on {w.device}, x is on {device}: all inputs must share a device")
    if device.type == "cuda" and not w.is_pinned():
        raise ValueError(f"{name} is a host master copy in pageable memory: the GPU can read only pinned "
                         f"host memory (torch.empty(..., pin_memory=True))")
