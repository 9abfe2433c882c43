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

Up to three parts in one launch (an int4 / NF4 stack's packed bytes, scales and minimums: the offloaded prefill's
spans staged packed, experts/staging.py), each with its own shape, dtype and word or element copies: the tiles of part
0 first, then part 1's, then part 2's.

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


def gather_experts_ref(dst, pool, host, table, ids):
    """Reference: the same gather one expert at a time with torch copies (tuples of parts: part by part)."""
    if not isinstance(dst, torch.Tensor):
        for d, p, h in zip(dst, pool, host):
            gather_experts_ref(d, p, h, table, ids)
        return dst
    slots = [int(s) for s in table]
    for i, e in enumerate(int(e) for e in ids):
        dst[i].copy_(pool[slots[e]] if slots[e] >= 0 else host[e])
    return dst


@triton.jit
def _copy_tile(dst_ptr, pool_ptr, host_ptr, table_ptr, id_ptr, t, numel, dst_stride, pool_stride, host_stride,
               per_expert, BLOCK: tl.constexpr):  # fmt: skip
    """Tile t of one part: block t % per_expert of the t // per_expert-th expert, from its pool slot or the host."""
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


@triton.jit
def _gather_experts_kernel(
    d0, p0, h0, d1, p1, h1, d2, p2, h2, table_ptr, id_ptr,
    numel0, ds0, ps0, hs0, per0, numel1, ds1, ps1, hs1, per1, numel2, ds2, ps2, hs2, per2, n, tiles,
    BLOCK: tl.constexpr, PARTS: tl.constexpr,
):  # fmt: skip
    # grid-stride over the tiles of every part: part 0's n * per0 first, then part 1's, then part 2's
    for t in range(tl.program_id(0), tiles, tl.num_programs(0)):
        if t < n * per0:
            _copy_tile(d0, p0, h0, table_ptr, id_ptr, t, numel0, ds0, ps0, hs0, per0, BLOCK)
        elif PARTS >= 2:
            if t < n * (per0 + per1):
                _copy_tile(d1, p1, h1, table_ptr, id_ptr, t - n * per0, numel1, ds1, ps1, hs1, per1, BLOCK)
            elif PARTS == 3:
                _copy_tile(d2, p2, h2, table_ptr, id_ptr, t - n * (per0 + per1), numel2, ds2, ps2, hs2, per2, BLOCK)


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


def gather_experts(dst, pool, host, table: torch.Tensor, ids: torch.Tensor):
    """dst[i] = pool[table[ids[i]]] if that slot is >= 0 else host[ids[i]], for i < n = len(ids), in one launch on
    the current stream (module doc). dst, pool, host: stacks, or tuples of up to three (the parts of an int4 stack:
    packed bytes, scales, minimums; part j of each together), all copied in the one launch. table [E], ids [n]:
    int32/int64 on dst's device; host on dst's device or in pinned host memory."""
    dsts, pools, hosts = ((t,) if isinstance(t, torch.Tensor) else tuple(t) for t in (dst, pool, host))
    if not 1 <= len(dsts) <= 3 or len(pools) != len(dsts) or len(hosts) != len(dsts):
        raise ValueError(f"dst, pool and host must be stacks or tuples of one to three parts alike; got {len(dsts)}")
    cuda = dsts[0].device.type == "cuda"
    args, n = [], None
    for d, p, h in zip(dsts, pools, hosts):
        for name, t in (("pool", p), ("host", h)):
            if t.dtype != d.dtype or t.shape[1:] != d.shape[1:]:
                raise ValueError(
                    f"{name} must match dst's dtype {d.dtype} and expert shape {tuple(d.shape[1:])}; got {t.dtype} "
                    f"{tuple(t.shape[1:])}"
                )
        if p.device != d.device or d.device != dsts[0].device:
            raise ValueError(f"pool is on {p.device}, dst on {d.device}: the pool must be on dst's device")
        if h.device != d.device and not (cuda and h.device.type == "cpu" and h.is_pinned()):
            raise ValueError(f"host is on {h.device}, dst on {d.device}: it must be there or in pinned host memory")
        n = gather_ids(ids, table, h.shape[0], d.shape[0], d.device)
        fd, fp, fh = _flat("dst", d), _flat("pool", p), _flat("host", h)
        if all(map(_words, (fd, fp, fh))):
            fd, fp, fh = (t.view(torch.int32) for t in (fd, fp, fh))
        numel = fd.shape[1]
        host_arg = HostPointer(fh) if cuda and fh.device.type == "cpu" else fh
        args.append((fd, fp, host_arg, numel, fd.stride(0), fp.stride(0), fh.stride(0), triton.cdiv(numel, BLOCK)))
    if n == 0:
        return dst
    tiles = n * sum(a[-1] for a in args)
    parts = len(args)
    while len(args) < 3:  # unused slots: the first part again (never reached: PARTS)
        args.append(args[0])
    grid = (min(tiles, PROGRAMS) if PROGRAMS > 0 else tiles,)
    _gather_experts_kernel[grid](
        *args[0][:3], *args[1][:3], *args[2][:3], table, ids, *args[0][3:], *args[1][3:], *args[2][3:], n, tiles,
        BLOCK=BLOCK, PARTS=parts, num_warps=4,
    )  # fmt: skip
    return dst
