"""Token embedding rows gathered in one launch, from a table on the device or in pinned host memory: out[t] =
weight[ids[t]].

A large vocabulary's input embedding (gpt-oss-20b: 201088 x 2880 bf16, 1.16 GB; Qwen3.5-35B-A3B: 248320 x 2048,
1.0 GB) is read one row per token, so it can live in pinned host memory (as llama.cpp keeps it on the CPU) and
free its VRAM for the expert cache: on CUDA the kernel reads a host table in place through unified virtual
addressing (the pointer passed as `kernels.checks.HostPointer`, as sparse_fused reads offloaded experts), 5.8 KB
per token for gpt-oss over PCIe. No host sync and fixed shapes: the decode step's one token is gathered inside its
CUDA graph. Under TRITON_INTERPRET=1 on the CPU host and device memory are the same.

Owns `embedding_gather(ids, weight, out=None)` (checked launcher), its torch reference `embedding_gather_ref` and
the Triton kernel `_embedding_gather_kernel`. Grid: (T, cdiv(H, BLOCK_H)); each program copies BLOCK_H elements
of one row, in the table's dtype (no conversion).

Ids out of range: with ids on the CPU the launcher refuses them (a ValueError; checking costs no device sync);
with ids on the GPU it cannot look without a sync, so the kernel writes a row of zeros for an id outside [0, V)
(torch.nn.functional.embedding would stop the process on a device-side assert). Padding index: nn.Embedding's
`padding_idx` changes only gradients, so its row is gathered like any other (what F.embedding returns).

Shape legend: T tokens, V vocabulary, H hidden. ids [T] int32/int64 · weight [V, H] bf16/fp16/fp32, rows
contiguous (any row stride) · out [T, H] in weight's dtype on ids' device, rows contiguous.
"""

from __future__ import annotations

import torch

from localmoe.kernels.checks import FLOAT_DTYPES, HostPointer, _on_device

try:  # Triton is optional at import time; the launcher needs it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

MAX_BLOCK_H = 1024  # elements per program: a 2880-wide row is 3 programs


# ----------------------------------------------------------------------------------------------------------
# torch reference
# ----------------------------------------------------------------------------------------------------------
def embedding_gather_ref(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """weight[ids] as [T, H] on ids' device, rows of zeros for ids outside [0, V) (the kernel's rule)."""
    V = weight.shape[0]
    idx = ids.long().cpu()
    ok = (idx >= 0) & (idx < V)
    rows = weight.cpu()[idx.clamp(0, max(V - 1, 0))] * ok[:, None].to(weight.dtype)
    return rows.to(ids.device)


# ----------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _embedding_gather_kernel(
        ids_ptr,  # [T] int32/int64
        w_ptr,  # [V, H] table: device memory, or pinned host memory read through unified addressing
        out_ptr,  # [T, H]
        V,
        H,
        w_stride,  # elements between the table's rows
        out_stride,
        BLOCK_H: tl.constexpr,
    ):
        t = tl.program_id(0)
        j = tl.program_id(1)
        row = tl.load(ids_ptr + t).to(tl.int64)
        ok = (row >= 0) & (row < V)
        row = tl.where(ok, row, 0)  # never an address outside the table
        offs = j * BLOCK_H + tl.arange(0, BLOCK_H)
        width = tl.where(ok, H, 0)  # an id out of range reads nothing: a row of zeros
        v = tl.load(w_ptr + row * w_stride + offs, mask=offs < width, other=0.0)
        tl.store(out_ptr + t.to(tl.int64) * out_stride + offs, v, mask=offs < H)


# ----------------------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------------------
def embedding_gather(ids: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows weight[ids] -> out [T, H] in weight's dtype on ids' device (allocated when None), in one launch on the
    current stream. `weight` lives on ids' device or, when that is CUDA, in pinned host memory (read in place)."""
    if triton is None:
        raise RuntimeError("embedding_gather needs Triton")
    if ids.dim() != 1:
        raise ValueError(f"ids must be [T], got shape {tuple(ids.shape)}")
    if ids.dtype not in (torch.int32, torch.int64) or (ids.shape[0] > 1 and ids.stride(0) != 1):
        raise ValueError(f"ids must be contiguous int32/int64, got {ids.dtype} with stride {ids.stride()}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V, H], got shape {tuple(weight.shape)}")
    if weight.dtype not in FLOAT_DTYPES:
        raise ValueError(f"weight must be bf16/fp16/fp32, got {weight.dtype}")
    V, H = weight.shape
    if weight.stride(1) != 1 and H > 1:
        raise ValueError(f"weight rows must be contiguous (stride(1) == 1), got strides {weight.stride()}")
    dev = ids.device
    _on_device("weight", weight, dev, allow_host=True)  # on ids' device, or pinned host memory for CUDA ids
    T = ids.shape[0]
    if out is None:
        out = torch.empty((T, H), dtype=weight.dtype, device=dev)
    elif tuple(out.shape) != (T, H) or out.dtype != weight.dtype or out.device != dev:
        raise ValueError(
            f"out must be [{T}, {H}] {weight.dtype} on {dev}, got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    elif out.stride(1) != 1 and H > 1:
        raise ValueError(f"out rows must be contiguous (stride(1) == 1), got strides {out.stride()}")
    if T == 0 or H == 0:
        return out
    if dev.type == "cpu":  # host ids: the range check costs no device sync
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= V:
            raise ValueError(f"ids must be in [0, {V}) (the vocabulary), got values in [{lo}, {hi}]")
    table = HostPointer(weight) if dev.type == "cuda" and weight.device.type == "cpu" else weight
    block = min(triton.next_power_of_2(H), MAX_BLOCK_H)
    grid = (T, triton.cdiv(H, block))
    _embedding_gather_kernel[grid](
        ids, table, out, V, H, weight.stride(0), out.stride(0), BLOCK_H=block, num_warps=4 if block >= 512 else 1
    )
    return out
