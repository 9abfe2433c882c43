"""Argument checks the expert kernels' launchers share: expert weight stacks [n, I, H] (plain or int4), the sparse
decode launches' routing, the grouped GEMMs' span of groups, the staging gathers' ids and slot table.

Each launcher still checks its own inputs top to bottom; this is only the part that is the same in all of them.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INT_DTYPES = (torch.int32, torch.int64)


def tokens_and_experts(x: torch.Tensor, w: torch.Tensor, name: str = "w_gate") -> tuple[int, int, int, int]:
    """x must be [T, H] and the expert stack `name` [E, I, H] (checked in full by `expert_weights`); returns
    (T, H, E, I)."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got shape {tuple(x.shape)}")
    if w.dim() != 3:
        raise ValueError(f"{name} must be [E, I, H], got shape {tuple(w.shape)}")
    return x.shape[0], x.shape[1], w.shape[0], w.shape[1]


def check_routing(expert_ids, weights, tau, T: int, E: int, dev) -> int:
    """The sparse decode launches' routing: expert_ids [T, k] int, weights [T, k] float, tau [E] fp32, all on x's
    device; returns k."""
    if expert_ids.dim() != 2 or expert_ids.shape[0] != T or expert_ids.dtype not in INT_DTYPES:
        raise ValueError(
            f"expert_ids must be int32/int64 [T, k] with T = {T}, got {expert_ids.dtype} {tuple(expert_ids.shape)}"
        )
    k = expert_ids.shape[1]
    if tuple(weights.shape) != (T, k) or not weights.dtype.is_floating_point:
        raise ValueError(
            f"weights must be a float [T, k] = {(T, k)} tensor, got {weights.dtype} {tuple(weights.shape)}"
        )
    if tau.dim() != 1 or tau.shape[0] != E or tau.dtype != torch.float32:
        raise ValueError(f"tau must be a float32 [E] = [{E}] tensor, got {tau.dtype} {tuple(tau.shape)}")
    for name, tns in (("expert_ids", expert_ids), ("weights", weights), ("tau", tau)):
        if tns.device != dev:
            raise ValueError(f"{name} is on {tns.device}, x is on {dev}: all inputs must share a device")
    return k


def expert_weights(
    name: str, w: torch.Tensor, n: int, I: int, H: int, device: torch.device | None = None, *, allow_host: bool = False
) -> None:
    """w must be [n, I, H], bf16/fp16/fp32, rows contiguous (any expert stride), on `device` — or, with
    `allow_host`, a host copy (pinned when `device` is CUDA, since the GPU reads it through unified addressing)."""
    if w.dim() != 3 or tuple(w.shape) != (n, I, H):
        raise ValueError(f"{name} must have shape {(n, I, H)}, got {tuple(w.shape)}")
    if w.stride(2) != 1 or (I > 1 and w.stride(1) != H):
        raise ValueError(f"{name} rows must be contiguous (stride(2) == 1, stride(1) == H); got strides {w.stride()}")
    if w.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be bf16/fp16/fp32, got {w.dtype}")
    _on_device(name, w, device, allow_host)


def _on_device(name: str, t: torch.Tensor, device: torch.device | None, allow_host: bool) -> None:
    """t on `device`, or with `allow_host` a host copy (pinned when `device` is CUDA: read through unified
    addressing)."""
    if device is None or t.device == device:
        return
    if not (allow_host and t.device.type == "cpu"):
        raise ValueError(f"{name} is on {t.device}, x is on {device}: all inputs must share a device")
    if device.type == "cuda" and not t.is_pinned():
        raise ValueError(
            f"{name} is a host master copy in pageable memory: the GPU can read only pinned "
            f"host memory (torch.empty(..., pin_memory=True))"
        )


def int4_expert_weights(name: str, w, E: int, I: int, H: int, device, *, allow_host: bool = False) -> None:
    """An int4 stack w (localmoe.kernels.int4.Int4Tensor) must be logically [E, I, H]: packed [E, I, H/2] uint8 with
    contiguous rows, scale and minimum [E, I, NG] float with contiguous rows (any expert strides), NG = H / G for a
    power-of-two group G; on `device`, or with `allow_host` host copies as `expert_weights` allows."""
    p = w.packed
    if p.dim() != 3 or H % 2 or tuple(p.shape) != (E, I, H // 2):
        raise ValueError(
            f"{name}.packed must have shape {(E, I, H // 2)} (logical [E, I, H] = {(E, I, H)}), got {tuple(p.shape)}"
        )
    if p.dtype != torch.uint8:
        raise ValueError(f"{name}.packed must be uint8, got {p.dtype}")
    if p.stride(2) != 1 or (I > 1 and p.stride(1) != H // 2):
        raise ValueError(
            f"{name}.packed rows must be contiguous (stride(2) == 1, stride(1) == H/2); got strides {p.stride()}"
        )
    ng = w.scale.shape[-1] if w.scale.dim() == 3 else 0
    G = H // ng if ng else 0
    if not ng or G * ng != H or G < 2 or G & (G - 1):
        raise ValueError(
            f"{name}.scale must be [E, I, H/G] with G a power of two dividing H = {H}, got shape {tuple(w.scale.shape)}"
        )
    parts = (("scale", w.scale),) if w.minimum is None else (("scale", w.scale), ("minimum", w.minimum))  # NF4: none
    for part, s in parts:
        if tuple(s.shape) != (E, I, ng) or s.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name}.{part} must be a float {(E, I, ng)} tensor, got {s.dtype} {tuple(s.shape)}")
        if s.stride(2) != 1 or (I > 1 and s.stride(1) != ng):
            raise ValueError(
                f"{name}.{part} rows must be contiguous (stride(2) == 1, stride(1) == H/G); got strides {s.stride()}"
            )
    for part, t in (("packed", p), *parts):
        _on_device(f"{name}.{part}", t, device, allow_host)


def grouped_span(
    x, w, ends, g0: int, out, blocks, w_name: str = "w", out_name: str = "out", x_rows=None
) -> tuple[int, int, int, int]:
    """The grouped GEMMs over a span of groups (kernels/grouped_gemm.py, grouped_gate_up.py): x float [M, K] with a
    contiguous last dim (or, with `x_rows` [M] int64, any rows count: row r reads x[x_rows[r]]), `w_name` [G, N, K] of
    x's dtype (any strides), `ends` int32 [E] with E >= g0 + G, `out_name` float [M, N] with a contiguous last dim,
    all on x's device; the tiles (BLOCK_M, BLOCK_N, BLOCK_K) powers of two >= 16. Returns (M, K, G, N)."""
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES or x.stride(1) != 1:
        raise ValueError(f"x must be a float [M, K] tensor with a contiguous last dim, got {x.dtype} {tuple(x.shape)}")
    M, K = x.shape
    if x_rows is not None:
        if x_rows.dim() != 1 or x_rows.dtype != torch.int64 or x_rows.device != x.device:
            raise ValueError(f"x_rows must be an int64 [M] tensor on {x.device}")
        M = x_rows.shape[0]
    if w.dim() != 3 or w.dtype != x.dtype or w.shape[2] != K:
        raise ValueError(f"{w_name} must be {x.dtype} [G, N, K = {K}], got {w.dtype} {tuple(w.shape)}")
    G, N = w.shape[:2]
    if ends.dim() != 1 or ends.dtype != torch.int32 or ends.shape[0] < g0 + G or g0 < 0:
        raise ValueError(
            f"ends must be int32 [E] with E >= g0 + G = {g0 + G} (g0 >= 0), got {ends.dtype} {tuple(ends.shape)}, "
            f"g0 {g0}"
        )
    if out.dim() != 2 or tuple(out.shape) != (M, N) or out.dtype not in FLOAT_DTYPES or out.stride(1) != 1:
        raise ValueError(f"{out_name} must be a float [M, N] = {(M, N)} tensor with a contiguous last dim")
    for name, t in ((w_name, w), ("ends", ends), (out_name, out)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x is on {x.device}: all inputs must share a device")
    for name, b in zip(("BLOCK_M", "BLOCK_N", "BLOCK_K"), blocks):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot's smallest tile), got {b}")
    return M, K, G, N


def gather_ids(ids: torch.Tensor, table: torch.Tensor, n_host: int, capacity: int, device: torch.device) -> int:
    """The staging gathers' `ids` [n] (n <= the buffer's `capacity`) and `table` [n_host] (one pool slot per host
    expert, -1: absent), int32/int64 on `device`; returns n."""
    n = ids.shape[0]
    if ids.dim() != 1 or n > capacity or table.dim() != 1 or table.shape[0] != n_host:
        raise ValueError(
            f"ids must be [n] with n <= {capacity} and table [{n_host}] (one slot per host expert); got "
            f"{tuple(ids.shape)}, {tuple(table.shape)}"
        )
    for name, t in (("table", table), ("ids", ids)):
        if t.dtype not in (torch.int32, torch.int64) or t.device != device:
            raise ValueError(f"{name} must be int32/int64 on {device}; got {t.dtype} on {t.device}")
    return n


class HostPointer:
    """A pinned host tensor seen by the Triton launcher as a raw pointer (unified virtual addressing)."""

    def __init__(self, t: torch.Tensor):
        self.tensor = t  # keeps the memory alive for the launch
        self.dtype = t.dtype

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()
