"""Gather whole experts into a staging stack in one launch: dst[i] = pool[table[ids[i]]] where that slot is >= 0,
else host[ids[i]] (offloaded prefill's staging buffers, localmoe/experts/staging.py; `table` is an expert cache's
device slot table, expert -> pool slot or -1).

The three stacks hold one tensor of an expert format each (a plain [n, I, H] weight, or one part of an int4 / NF4
stack: packed bytes, scales, minima) with the same trailing shape and dtype; `pool` and `dst` live on the device,
`host` on the device or in pinned host memory, which the kernel reads through unified virtual addressing (as
sparse_fused reads absent experts): one launch per part replaces a cudaMemcpyAsync per expert and part, whose host-side
issue cost (~5 µs each, ~770 per layer for bf16 experts, three times that for int4) bounded prefill, not PCIe.

Each expert's block (t[e]) must be contiguous; experts may sit at any stride. The launcher copies 32-bit words when
every block's byte size and stride allow it, else elements of the stack's own dtype.

Grid: PROGRAMS programs striding over the n experts' tiles of BLOCK words (0: one program a tile, which queues
thousands of programs whose host reads wait on PCIe ahead of the grouped GEMMs the gather should overlap). On the
H200 (one engine, alternating settings, Qwen3.5-35B-A3B shapes at 85%): bf16 at --vram 24 prefills 2048 tokens at
1896.5 / 1920.3 tok/s with 64 programs against 1863.8 / 1806.9 with one a tile, 8192 tokens at 1958.9 against
1840.9; int4 at --vram 16 is within its noise at 2048 (3919.9 / 4336.8 against 4179.8 / 4421.2; 16 programs
4414.7 / 4063.9) and 4773.1 against 4204.5 at 8192. Shapes: S pool slots, E experts in `host` and `table`,
n <= len(dst).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from localmoe.kernels.checks import HostPointer, gather_ids

BLOCK = 4096  # words per tile: 16 KiB of int32
PROGRAMS = 64  # programs a launch (grid-stride over the tiles); 0: one program a tile


def gather_experts_ref(dst: torch.Tensor, pool: torch.Tensor, host: torch.Tensor, table, ids) -> torch.Tensor:
    """Reference: the same gather one expert at a time with torch copies."""
    slots = [int(s) for s in table]
    for i, e in enumerate(int(e) for e in ids):
        dst[i].copy_(pool[slots[e]] if slots[e] >= 0 else host[e])
    return dst


@triton.jit
def _gather_experts_kernel(
    dst_ptr, pool_ptr, host_ptr, table_ptr, id_ptr, numel, dst_stride, pool_stride, host_stride, tiles, per_expert,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # grid-stride over the n * per_expert tiles: tile t is block t % per_expert of the t // per_expert-th expert
    for t in range(tl.program_id(0), tiles, tl.num_programs(0)):
        i = t // per_expert
        expert = tl.load(id_ptr + i).to(tl.int64)
        slot = tl.load(table_ptr + expert).to(tl.int64)
        offs = (t % per_expert) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        if slot >= 0:
            v = tl.load(pool_ptr + slot * pool_stride + offs, mask=mask)
        else:
            v = tl.load(host_ptr + expert * host_stride + offs, mask=mask)
        tl.store(dst_ptr + i.to(tl.int64) * dst_stride + offs, v, mask=mask)


def _flat(name: str, t: torch.Tensor) -> torch.Tensor:
    """t [N, ...] as [N, numel] (each expert's block contiguous; any expert stride)."""
    if t.dim() < 2:
        raise ValueError(f"{name} must be a stack [N, ...], got shape {tuple(t.shape)}")
    want = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size > 1 and stride != want:
            raise ValueError(f"{name}'s experts must each be contiguous; got strides {t.stride()}")
        want *= size
    return t.as_strided((t.shape[0], want), (t.stride(0), 1))


def _words(flat: torch.Tensor) -> bool:
    """Whether a flat stack can be read as 32-bit words: block size, expert stride and address all 4-byte aligned."""
    size = flat.element_size()
    return (flat.shape[1] * size) % 4 == 0 and (flat.stride(0) * size) % 4 == 0 and flat.data_ptr() % 4 == 0


def gather_experts(dst: torch.Tensor, pool: torch.Tensor, host: torch.Tensor, table: torch.Tensor, ids: torch.Tensor):
    """dst[i] = pool[table[ids[i]]] if that slot is >= 0 else host[ids[i]], for i < n = len(ids), in one launch on
    the current stream (module doc). table [E], ids [n]: int32/int64 on dst's device; host on dst's device or in
    pinned host memory."""
    for name, t in (("pool", pool), ("host", host)):
        if t.dtype != dst.dtype or t.shape[1:] != dst.shape[1:]:
            raise ValueError(
                f"{name} must match dst's dtype {dst.dtype} and expert shape {tuple(dst.shape[1:])}; got {t.dtype} "
                f"{tuple(t.shape[1:])}"
            )
    if pool.device != dst.device:
        raise ValueError(f"pool is on {pool.device}, dst on {dst.device}: the pool must be on dst's device")
    cuda = dst.device.type == "cuda"
    if host.device != dst.device and not (cuda and host.device.type == "cpu" and host.is_pinned()):
        raise ValueError(f"host is on {host.device}, dst on {dst.device}: it must be there or in pinned host memory")
    n = gather_ids(ids, table, host.shape[0], dst.shape[0], dst.device)
    if n == 0:
        return dst
    d, p, h = _flat("dst", dst), _flat("pool", pool), _flat("host", host)
    if all(map(_words, (d, p, h))):
        d, p, h = (t.view(torch.int32) for t in (d, p, h))
    numel = d.shape[1]
    host_arg = HostPointer(h) if cuda and h.device.type == "cpu" else h
    per_expert = triton.cdiv(numel, BLOCK)
    tiles = n * per_expert
    grid = (min(tiles, PROGRAMS) if PROGRAMS > 0 else tiles,)
    _gather_experts_kernel[grid](
        d, p, host_arg, table, ids, numel, d.stride(0), p.stride(0), h.stride(0), tiles, per_expert,
        BLOCK=BLOCK, num_warps=4,
    )  # fmt: skip
    return dst
