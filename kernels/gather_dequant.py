"""Gather 4-bit experts and dequantize them in one launch: dst[i] = dequant(pool[table[ids[i]]]) where that slot is
>= 0, else dequant(host[ids[i]]) (offloaded prefill's staging of int4 / NF4 experts, localmoe/experts/staging.py;
`table` is an expert cache's device slot table, expert -> pool slot or -1).

`pool` and `host` are stacks of one 4-bit format (kernels/int4.py `Int4Tensor`: packed bytes, bf16 scale and minimum
per group; kernels/nf4.py `Nf4Tensor`: packed bytes and an fp32 absmax, the codebook `code`), `pool` on the device and
`host` there or in pinned host memory, read through unified virtual addressing. `dst` is a plain [n, I, H] stack in
the model's dtype, ready for the grouped GEMMs. One launch per projection replaces three gathers of packed parts into
a 4-bit staging buffer and three dequantizing launches on the compute stream (kernels/gather_experts.py then
kernels/dequant_int4.py): the dequantization moves to the side stream that overlaps the GEMMs, the 4-bit bytes are
read once, and the launches a span costs (each ~40-100 µs of host time in a prefill that is launch bound between its
host syncs) fall from 18 to 3. The arithmetic is dequant_int4's (`dequant_bytes`): fp32, rounded once to dst's dtype
to nearest even (kernels/rounding.py, so the interpreter's result is the GPU's).

`host_rows` lets `host` be a device stage of the absent experts only (experts/layer_stage.py: a layer's absent
experts staged packed ahead, then dequantized with the resident ones from device memory): expert e's row there.

Grid: PROGRAMS programs striding over the n * cdiv(I, BLOCK_R) tiles (a tile: BLOCK_R rows of one expert): a fixed
number of programs keeps a few host reads in flight each without queueing thousands of programs ahead of the GEMMs
(gather_experts.py). Shapes: I expert width, H hidden, NG groups per row (G = H / NG a power of two), S pool slots, E
experts in `host` and `table`, n <= len(dst).
"""

from __future__ import annotations

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
    dst_ptr, pp_ptr, ps_ptr, pm_ptr, hp_ptr, hs_ptr, hm_ptr, c_ptr, table_ptr, id_ptr, row_ptr, tiles, per_expert, I,
    pool_p, pool_s, pool_m, host_p, host_s, host_m, dst_stride,
    H2: tl.constexpr, NG: tl.constexpr, HALF_G: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_J: tl.constexpr,
    NF4: tl.constexpr, HOST_ROWS: tl.constexpr,
):  # fmt: skip
    j = tl.arange(0, BLOCK_J)  # byte index in a row
    cols = tl.arange(0, 2 * BLOCK_J)
    for t in range(tl.program_id(0), tiles, tl.num_programs(0)):
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


def gather_dequant(
    dst: torch.Tensor, pool, host, table: torch.Tensor, ids: torch.Tensor, code=None, host_rows=None
) -> torch.Tensor:
    """dst[i] = pool[table[ids[i]]] dequantized if that slot is >= 0 else host[ids[i]] dequantized, for i < n =
    len(ids), in one launch on the current stream (module doc). `pool`, `host`: Int4Tensor stacks (NF4: Nf4Tensor
    and its `code` [16] fp32 on dst's device); dst [>= n, I, H] bf16 / fp16 / fp32, contiguous; table [E], ids [n]:
    int32 / int64 on dst's device. `host_rows` [E] int32 / int64 on dst's device: `host` holds only the absent
    experts (a stage), expert e's in row host_rows[e] (not row e)."""
    nf4 = code is not None
    if dst.dim() != 3 or not dst.is_contiguous() or dst.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dst must be a contiguous float [n, I, H] stack; got {dst.dtype} {tuple(dst.shape)}")
    _, I, H = dst.shape
    if H % 2:
        raise ValueError(f"H must be even, got {H}")
    H2 = H // 2
    NG = pool.scale.shape[-1]
    if NG < 1 or H % NG or (H // NG) & (H // NG - 1) or H // NG < 2:
        raise ValueError(f"H = {H} must split into {NG} groups of a power-of-two size >= 2")
    for name, w in (("pool", pool), ("host", host)):
        parts = w.parts()
        if len(parts) != (2 if nf4 else 3):
            raise ValueError(f"{name} must be an Int4Tensor (packed, scale, minimum), or an Nf4Tensor with code=")
        _check_part(f"{name}.packed", parts[0], (I, H2), torch.uint8)
        for t in parts[1:]:
            _check_part(f"{name}'s scales", t, (I, NG))
            if not t.dtype.is_floating_point:
                raise ValueError(f"{name}'s scales must be float; got {t.dtype}")
    cuda = dst.device.type == "cuda"
    if any(t.device != dst.device for t in pool.parts()):
        raise ValueError(f"the pool must be on dst's device {dst.device}")
    if any(t.device != dst.device and not (cuda and t.device.type == "cpu" and t.is_pinned()) for t in host.parts()):
        raise ValueError(f"host must be on {dst.device} or in pinned host memory")
    if nf4 and (code.shape != (16,) or code.dtype != torch.float32 or code.device != dst.device):
        raise ValueError(f"code must be [16] fp32 on {dst.device}")
    n_host = host.packed.shape[0]
    if host_rows is not None:
        if host_rows.dim() != 1 or host_rows.dtype not in (torch.int32, torch.int64) or host_rows.device != dst.device:
            raise ValueError(f"host_rows must be [E] int32/int64 on {dst.device}; got {host_rows.dtype} "
                             f"{tuple(host_rows.shape)} on {host_rows.device}")  # fmt: skip
        n_host = host_rows.shape[0]
    n = gather_ids(ids, table, n_host, dst.shape[0], dst.device)
    if n == 0:
        return dst

    def arg(t):
        return HostPointer(t) if cuda and t.device.type == "cpu" else t

    pp, ps, pm = (*pool.parts(), pool.scale)[:3]
    hp, hs, hm = (*host.parts(), host.scale)[:3]
    per_expert = triton.cdiv(I, BLOCK_R)
    tiles = n * per_expert
    programs = PROGRAMS if any(t.device != dst.device for t in host.parts()) else DEVICE_PROGRAMS
    _gather_dequant_kernel[(min(tiles, programs),)](
        dst, pp, ps, pm, arg(hp), arg(hs), arg(hm), code if nf4 else ps, table, ids,
        host_rows if host_rows is not None else ids, tiles, per_expert, I,
        pp.stride(0), ps.stride(0), pm.stride(0), hp.stride(0), hs.stride(0), hm.stride(0), dst.stride(0),
        H2=H2, NG=NG, HALF_G=H2 // NG, BLOCK_R=BLOCK_R, BLOCK_J=triton.next_power_of_2(H2), NF4=nf4,
        HOST_ROWS=host_rows is not None, num_warps=NUM_WARPS,
    )  # fmt: skip
    return dst
