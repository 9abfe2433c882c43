"""Gather 4-bit experts and dequantize them in one launch: dst[i] = dequant(pool[table[ids[i]]]) where that slot is
>= 0, else dequant(host[ids[i]]) (offloaded prefill's staging of int4 / NF4 experts, localmoe/experts/staging.py;
`table` is an expert cache's device slot table, expert -> pool slot or -1).

`pool` and `host` are stacks of one 4-bit format (kernels/int4.py `Int4Tensor`: packed bytes, bf16 scale and minimum
per group; kernels/nf4.py `Nf4Tensor`: packed bytes and an fp32 absmax, the codebook `code`), `pool` on the device and
`host` there or in pinned host memory, read through unified virtual addressing. `dst` is a plain [n, I, H] stack in
the model's dtype, ready for the grouped GEMMs. `gather_dequant_projections` takes a span's three projections (each
its own dst, pool, host and table) in one launch where their strides agree and `JOINED` is set, else one launch
each. One launch replaces three gathers of packed parts into a 4-bit staging buffer and three dequantizing launches
(kernels/gather_experts.py then kernels/dequant_int4.py): the 4-bit bytes are read once, and the launches a span
costs (each ~40-100 µs of host time) fall from 18 to 3, or to 1 joined: one a projection left a third of a
2048-token piece's host time in them (the layer stage, bound by its host: bench/RESULTS.md). The arithmetic is
dequant_int4's (`dequant_bytes`): fp32, rounded once to dst's dtype to nearest even (kernels/rounding.py, so the
interpreter's result is the GPU's).

`host_rows` lets `host` be a device stage of the absent experts only (experts/layer_stage.py: a layer's absent
experts staged packed ahead, then dequantized with the resident ones from device memory): expert e's row there.

Grid: PROGRAMS programs striding over the P * n * cdiv(I, BLOCK_R) tiles (a tile: BLOCK_R rows of one expert's
projection, P projections): a fixed number of programs keeps a few host reads in flight each without queueing
thousands of programs ahead of the GEMMs (gather_experts.py). Shapes: I expert width, H hidden, NG groups per row (G =
H / NG a power of two), S pool slots, E experts in `host` and `table`, n <= len(dst).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from localmoe.kernels.checks import HostPointer, gather_ids
from localmoe.kernels.dequant_int4 import dequant_bytes, dequant_int4_ref, dequant_nf4_ref
from localmoe.kernels.rounding import round_to

BLOCK_R = 4  # rows a tile: 4 KiB of packed bytes at H 2048, 16 KiB written in bf16
PROGRAMS = 128  # programs a launch (grid-stride over the tiles)
DEVICE_PROGRAMS = 1024  # programs a launch whose `host` is on the device too (a stage): no host reads to pace
NUM_WARPS = 4  # bench/staging_ab.py --dequant-grid PxRxW sweeps it
# A call's projections in one launch (`gather_dequant_projections`); off: one launch each. In-process on an H100
# (session 49, `bench/staging_ab.py --joined-dequant --decode-first 128`): 2048 tokens 0.290 -> 0.219 s, 8192 0.805
# -> 0.771 s.
JOINED = True


def gather_dequant_ref(dst: torch.Tensor, pool, host, table, ids, code=None, host_rows=None) -> torch.Tensor:
    """Reference: expert by expert, the 4-bit format's definition (dequant_int4_ref / dequant_nf4_ref)."""
    slots = [int(s) for s in table]
    rows = [int(r) for r in host_rows] if host_rows is not None else range(len(slots))
    for i, e in enumerate(int(e) for e in ids):
        src, j = (pool, slots[e]) if slots[e] >= 0 else (host, rows[e])
        parts = [t[j].cpu() for t in src.parts()]
        if code is None:
            w = dequant_int4_ref(*parts, torch.float32)
        else:
            w = dequant_nf4_ref(*parts, code.cpu(), torch.float32)
        dst[i].copy_(w)
    return dst


@triton.jit
def _gather_dequant_kernel(
    d0, pp0, ps0, pm0, hp0, hs0, hm0, tb0, rw0,
    d1, pp1, ps1, pm1, hp1, hs1, hm1, tb1, rw1,
    d2, pp2, ps2, pm2, hp2, hs2, hm2, tb2, rw2,
    c_ptr, id_ptr, tiles, per_expert, I, dst_stride, pool_p, pool_s, pool_m, host_p, host_s, host_m,
    H2: tl.constexpr, NG: tl.constexpr, HALF_G: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr,
    NF4: tl.constexpr, HOST_ROWS: tl.constexpr, PROJ: tl.constexpr,
):  # fmt: skip
    j = tl.arange(0, BLOCK_J)  # byte index in a row
    cols = tl.arange(0, 2 * BLOCK_J)
    for u in range(tl.program_id(0), PROJ * tiles, tl.num_programs(0)):
        # projection u // tiles's pointers (a scalar branch: one projection a tile; the strides are shared)
        dst_ptr, table_ptr, row_ptr, t = d0, tb0, rw0, u
        pp_ptr, ps_ptr, pm_ptr, hp_ptr, hs_ptr, hm_ptr = pp0, ps0, pm0, hp0, hs0, hm0
        if PROJ > 1:
            if u >= 2 * tiles:
                dst_ptr, table_ptr, row_ptr, t = d2, tb2, rw2, u - 2 * tiles
                pp_ptr, ps_ptr, pm_ptr, hp_ptr, hs_ptr, hm_ptr = pp2, ps2, pm2, hp2, hs2, hm2
            elif u >= tiles:
                dst_ptr, table_ptr, row_ptr, t = d1, tb1, rw1, u - tiles
                pp_ptr, ps_ptr, pm_ptr, hp_ptr, hs_ptr, hm_ptr = pp1, ps1, pm1, hp1, hs1, hm1
        i = t // per_expert
        rows = (t % per_expert) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < I
        mask = rmask[:, None] & (j < H2)[None, :]
        r64 = rows.to(tl.int64)[:, None]
        byte = r64 * H2 + j[None, :]
        grp = r64 * NG + (j // HALF_G)[None, :]  # the group of bytes j
        expert = tl.load(id_ptr + i).to(tl.int64)
        slot = tl.load(table_ptr + expert).to(tl.int64)
        if slot >= 0:
            p = tl.load(pp_ptr + slot * pool_p + byte, mask=mask, other=0)
            s = tl.load(ps_ptr + slot * pool_s + grp, mask=mask, other=0.0).to(tl.float32)
            m = s if NF4 else tl.load(pm_ptr + slot * pool_m + grp, mask=mask, other=0.0).to(tl.float32)
        else:
            if HOST_ROWS:  # a stage of the absent experts only: expert -> its row
                row = tl.load(row_ptr + expert).to(tl.int64)
            else:
                row = expert
            p = tl.load(hp_ptr + row * host_p + byte, mask=mask, other=0)
            s = tl.load(hs_ptr + row * host_s + grp, mask=mask, other=0.0).to(tl.float32)
            m = s if NF4 else tl.load(hm_ptr + row * host_m + grp, mask=mask, other=0.0).to(tl.float32)
        w = round_to(dequant_bytes(p, s, m, c_ptr, NF4), dst_ptr.dtype.element_ty)  # RTNE under the interpreter too
        omask = rmask[:, None] & (cols < 2 * H2)[None, :]
        out = dst_ptr + i.to(tl.int64) * dst_stride + r64 * (2 * H2) + cols[None, :]
        tl.store(out, w.to(dst_ptr.dtype.element_ty), mask=omask)


def _check_part(name: str, t: torch.Tensor, inner: tuple[int, ...], dtype=None) -> None:
    """A part [N, *inner] whose experts are each contiguous (any expert stride)."""
    if t.dim() != 1 + len(inner) or tuple(t.shape[1:]) != inner or (dtype is not None and t.dtype != dtype):
        want = f"{dtype} " if dtype is not None else ""
        raise ValueError(f"{name} must be {want}[N, {', '.join(map(str, inner))}]; got {t.dtype} {tuple(t.shape)}")
    if t.stride()[1:] != (inner[1], 1):
        raise ValueError(f"{name}'s experts must each be contiguous; got strides {t.stride()}")


_NAMES = {"pool": ("pool.packed", "pool's scales"), "host": ("host.packed", "host's scales")}


class _Stack(NamedTuple):
    """A checked stack as the kernel takes it: packed bytes, scale, minimum (NF4: the scale again), their expert
    strides, whether they are in the launch's device memory, and the three as launch arguments (pinned host memory
    read by a CUDA launch as a raw pointer)."""

    parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    strides: tuple[int, int, int]
    on_device: bool
    args: tuple


# Stacks already checked (the pools and host copies a model reuses at every call): key -> (weak ref, _Stack). A
# staged span's launch is host time in a host-bound prefill, and the checks of six stacks took most of it.
_CHECKED: dict[tuple, tuple[weakref.ref, _Stack]] = {}


def _parts(kind: str, w, I: int, H2: int, NG: int, nf4: bool, like, device: torch.device) -> _Stack:
    """The parts of `w` ("pool" or "host": an Int4Tensor, or an Nf4Tensor when `nf4`) checked against [N, I, H2]
    packed bytes and [N, I, NG] float scales, each scale of `like`'s dtype (the first projection's parts) if given,
    on `device` (a host stack on a CUDA device: there or in pinned host memory). A stack is checked once while it
    lives (its parts are fixed: the formats are frozen dataclasses)."""
    key = (id(w), kind, I, H2, NG, nf4, None if like is None else tuple(t.dtype for t in like.parts), device)
    hit = _CHECKED.get(key)
    if hit is not None and hit[0]() is w:
        return hit[1]
    parts = w.parts()
    if len(parts) != (2 if nf4 else 3):
        raise ValueError(f"{kind} must be an Int4Tensor (packed, scale, minimum), or an Nf4Tensor with code=")
    packed, scales = _NAMES[kind]
    _check_part(packed, parts[0], (I, H2), torch.uint8)
    for k in range(1, len(parts)):
        t = parts[k]
        _check_part(scales, t, (I, NG))
        if not t.dtype.is_floating_point or (like is not None and t.dtype != like.parts[k].dtype):
            raise ValueError(f"{scales} must be float, one dtype for every projection; got {t.dtype}")
    pinned_ok = kind == "host" and device.type == "cuda"
    for t in parts:
        if t.device != device and not (pinned_ok and t.device.type == "cpu" and t.is_pinned()):
            where = "on {} or in pinned host memory" if pinned_ok else "on dst's device {}"
            raise ValueError(f"{kind} must be {where.format(device)}")
    three = (*parts, parts[1])[:3]  # NF4: no minimum (the scale stands in)
    on_device = all(t.device == device for t in parts)
    args = tuple(HostPointer(t) if t.device != device else t for t in three)
    stack = _Stack(three, tuple(t.stride(0) for t in three), on_device, args)
    _CHECKED[key] = (weakref.ref(w, lambda _, k=key: _CHECKED.pop(k, None)), stack)
    return stack


def gather_dequant(
    dst: torch.Tensor, pool, host, table: torch.Tensor, ids: torch.Tensor, code=None, host_rows=None
) -> torch.Tensor:
    """dst[i] = pool[table[ids[i]]] dequantized if that slot is >= 0 else host[ids[i]] dequantized, for i < n =
    len(ids), in one launch on the current stream (module doc). `pool`, `host`: Int4Tensor stacks (NF4: Nf4Tensor
    and its `code` [16] fp32 on dst's device); dst [>= n, I, H] bf16 / fp16 / fp32, contiguous; table [E], ids [n]:
    int32 / int64 on dst's device. `host_rows` [E] int32 / int64 on dst's device: `host` holds only the absent
    experts (a stage), expert e's in row host_rows[e] (not row e)."""
    rows = None if host_rows is None else (host_rows,)
    return gather_dequant_projections((dst,), (pool,), (host,), (table,), ids, code, rows)[0]


def gather_dequant_projections(dsts, pools, hosts, tables, ids: torch.Tensor, code=None, host_rows=None):
    """`gather_dequant` of up to three projections of the same experts in one launch (the launches a staged span
    costs are host time in a host-bound prefill): dsts[q][i] from pools[q] by tables[q] or hosts[q] (host_rows[q]),
    each projection of one shape [I, H], format and dtype. -> dsts."""
    P = len(dsts)
    if not 1 <= P <= 3 or not len(pools) == len(hosts) == len(tables) == P:
        raise ValueError(f"one to three projections, as many pools, hosts and tables as dsts; got {P} dsts")
    if host_rows is not None and len(host_rows) != P:
        raise ValueError(f"host_rows: one per projection ({P}); got {len(host_rows)}")
    nf4 = code is not None
    dst = dsts[0]
    if dst.dim() != 3 or not dst.is_contiguous() or dst.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dst must be a contiguous float [n, I, H] stack; got {dst.dtype} {tuple(dst.shape)}")
    for d in dsts[1:]:
        if d.shape[1:] != dst.shape[1:] or d.dtype != dst.dtype or not d.is_contiguous() or d.device != dst.device:
            raise ValueError(f"every dst must be a contiguous {dst.dtype} [n, {dst.shape[1]}, {dst.shape[2]}] stack "
                             f"on {dst.device}; got {d.dtype} {tuple(d.shape)}")  # fmt: skip
    _, I, H = dst.shape
    if H % 2:
        raise ValueError(f"H must be even, got {H}")
    H2 = H // 2
    NG = pools[0].scale.shape[-1]
    if NG < 1 or H % NG or (H // NG) & (H // NG - 1) or H // NG < 2:
        raise ValueError(f"H = {H} must split into {NG} groups of a power-of-two size >= 2")
    device = dst.device
    pool_parts, host_parts = [], []
    for q in range(P):
        pool_parts.append(_parts("pool", pools[q], I, H2, NG, nf4, pool_parts[0] if q else None, device))
        host_parts.append(_parts("host", hosts[q], I, H2, NG, nf4, host_parts[0] if q else None, device))
    if nf4 and (code.shape != (16,) or code.dtype != torch.float32 or code.device != dst.device):
        raise ValueError(f"code must be [16] fp32 on {dst.device}")
    n_host = hosts[0].packed.shape[0]
    if host_rows is not None:
        for r in host_rows:
            if r.dim() != 1 or r.dtype not in (torch.int32, torch.int64) or r.device != dst.device:
                raise ValueError(f"host_rows must be [E] int32/int64 on {dst.device}; got {r.dtype} "
                                 f"{tuple(r.shape)} on {r.device}")  # fmt: skip
            if r.dtype != host_rows[0].dtype:
                raise ValueError(f"host_rows must share one dtype; got {host_rows[0].dtype} and {r.dtype}")
        n_host = host_rows[0].shape[0]
    capacity = min(d.shape[0] for d in dsts)
    for t in tables:
        gather_ids(ids, t, n_host, capacity, dst.device)
        if t.dtype != tables[0].dtype:
            raise ValueError(f"the tables must share one dtype; got {tables[0].dtype} and {t.dtype}")
    n = ids.shape[0]
    if n == 0:
        return dsts

    def pointers(q: int) -> list:
        row = host_rows[q] if host_rows is not None else ids
        return [dsts[q], *pool_parts[q].args, *host_parts[q].args, tables[q], row]

    def strides(q: int) -> tuple[int, ...]:
        """dst's, the pool's and (an empty host stack is never read: the first non-empty one's) the host's."""
        h = next((w for w in (host_parts[q], *host_parts) if w.parts[0].shape[0]), host_parts[q])
        return (dsts[q].stride(0), *pool_parts[q].strides, *h.strides)

    st = [strides(q) for q in range(P)]
    joined = JOINED and all(t == st[0] for t in st[1:])
    per_expert = triton.cdiv(I, BLOCK_R)
    tiles = n * per_expert
    for group in [list(range(P))] if joined else [[q] for q in range(P)]:  # one launch, or one a projection
        sets = [pointers(q) for q in group]
        sets += [sets[0]] * (3 - len(sets))  # unused
        on_host = not all(host_parts[q].on_device for q in group)
        programs = PROGRAMS if on_host else DEVICE_PROGRAMS
        _gather_dequant_kernel[(min(len(group) * tiles, programs),)](
            *sets[0], *sets[1], *sets[2], code if nf4 else sets[0][2], ids, tiles, per_expert, I, *st[group[0]],
            H2=H2, NG=NG, HALF_G=H2 // NG, BLOCK_R=BLOCK_R, BLOCK_J=triton.next_power_of_2(H2), NF4=nf4,
            HOST_ROWS=host_rows is not None, PROJ=len(group), num_warps=NUM_WARPS,
        )  # fmt: skip
    return dsts
