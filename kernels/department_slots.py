"""A DeaMoE decode step's departments in fixed slots, in one Triton launch (was ~12 torch launches per layer).

Owns `department_slots` (checked launcher), its torch reference `department_slots_ref`, and `_slots_kernel`. For a
step's routing (top_k_index [T, k] flat expert ids e = d * n + j, top_k_weights [T, k]) it writes what
kernels/department_experts.py reads:

    dept    [S] int32       the distinct departments the step touches, ascending, then -1 (unused slots)
    weights [S, T, n] fp32  weights[s, t, j] = token t's routing weight for expert j of slot s's department, else 0

S = `slots` must be at least the number of distinct departments (min(D, T * min(k, topk_group)) always is). No
host synchronisation and a grid that never depends on the routing, so the step can be captured in a CUDA graph.

With `maps` = (dept_map [D] int32, private_map [D * n] int32, counts [4] int64) (direct offloading: a unit's pool
slot, or -1 in host memory) it also adds the step's department hits and misses (distinct departments) and private
hits and misses ((token, expert) pairs) into counts[0..3]: the offloaded figures, with no launch of their own.

The kernel is one program over the T * k (token, expert) pairs: pair p is its department's first when no earlier
pair has the same department, and the slot of a department is the number of distinct departments below it (a
[T*k, T*k] comparison, T * k <= 64). It zeroes `weights`, fills `dept` with -1, then (after a CTA barrier) writes
each first pair's department into its slot and each pair's weight into (slot, t, j). Programmatic dependent launch
(kernels/pdl.py) where the device has it.

The slotting itself is `write_slots`, which kernels/moe_front.py's last router program also runs (`slots=`, one
token): a fused decoder layer's DeaMoE step then has no slotting launch.

Shape legend: T tokens, k experts per token, n experts per department, S slots.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    from localmoe.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_kw
except ImportError:  # pragma: no cover
    triton = None
    tl = None

MAX_PAIRS = 64  # T * k


def department_slots_ref(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, n: int, slots: int, maps=None):
    """(dept [S] int32, weights [S, T, n] fp32) as the module doc says, in torch ops (no host sync)."""
    T, k = top_k_index.shape
    dev = top_k_index.device
    flat = (top_k_index // n).reshape(-1).long()  # department of each (t, j)
    srt, _ = flat.sort()
    first = torch.ones_like(srt, dtype=torch.bool)
    first[1:] = srt[1:] != srt[:-1]
    rank = first.long().cumsum(0) - 1  # slot of each sorted entry
    buf = torch.full((slots + 1,), -1, dtype=torch.int64, device=dev)  # the last entry takes the repeats
    buf.scatter_(0, torch.where(first, rank, slots).clamp(max=slots), torch.where(first, srt, -1))
    dept = buf[:slots]
    slot_of = (dept[None, :] == flat[:, None]).long().argmax(1).view(T, k)  # [T, k]
    w = torch.zeros(slots, T, n, dtype=torch.float32, device=dev)
    t_idx = torch.arange(T, device=dev)[:, None].expand(T, k)
    w.index_put_((slot_of, t_idx, (top_k_index % n).long()), top_k_weights.float(), accumulate=True)
    if maps is not None:
        dmap, pmap, counts = maps
        dres = dmap[dept.clamp(min=0).long()] >= 0
        pres = pmap[top_k_index.reshape(-1).long()] >= 0
        used = dept >= 0
        counts += torch.stack([(used & dres).sum(), (used & ~dres).sum(), pres.sum(), (~pres).sum()])
    return dept.to(torch.int32), w


if triton is not None:

    @triton.jit
    def write_slots(
        idx_ptr, w_ptr, dept_ptr, out_ptr, dmap_ptr, pmap_ptr, cnt_ptr, TK, K, T, n, S,
        TK_P2: tl.constexpr, S_P2: tl.constexpr, Z_P2: tl.constexpr, MAPS: tl.constexpr,
    ):  # fmt: skip
        """The slotting of one step by one program (module doc), from the routing at idx_ptr / w_ptr (already
        visible to this program): also the tail of kernels/moe_front.py's last router program (`slots=`)."""
        p = tl.arange(0, TK_P2)
        pm = p < TK
        e = tl.load(idx_ptr + p, mask=pm, other=0).to(tl.int32)
        dep = tl.where(pm, e // n, 2147483647)  # padding sorts last and matches no real department
        wv = tl.load(w_ptr + p, mask=pm, other=0.0).to(tl.float32)
        q = tl.arange(0, TK_P2)
        earlier = (dep[:, None] == dep[None, :]) & (q[None, :] < p[:, None])  # [p, q]: q before p, same department
        first = (tl.sum(earlier.to(tl.int32), axis=1) == 0) & pm
        below = (dep[None, :] < dep[:, None]) & first[None, :]  # [p, q]: q a first pair of a lower department
        slot = tl.sum(below.to(tl.int32), axis=1)  # [TK_P2] the slot of p's department
        zz = tl.arange(0, Z_P2)
        tl.store(out_ptr + zz, tl.zeros((Z_P2,), dtype=tl.float32), mask=zz < S * T * n)
        ss = tl.arange(0, S_P2)
        tl.store(dept_ptr + ss, tl.full((S_P2,), -1, dtype=tl.int32), mask=ss < S)
        tl.debug_barrier()  # the zeroes and -1s land before the writes below
        tl.store(dept_ptr + slot, dep, mask=first & (slot < S))
        t = p // K
        tl.store(out_ptr + (slot * T + t) * n + e % n, wv, mask=pm & (slot < S))
        if MAPS:  # hits and misses of the step against the pools' maps
            dres = tl.load(dmap_ptr + tl.where(first, dep, 0), mask=first, other=-1) >= 0
            pres = tl.load(pmap_ptr + e, mask=pm, other=-1) >= 0
            tl.atomic_add(cnt_ptr + 0, tl.sum((first & dres).to(tl.int64), axis=0), sem="relaxed")
            tl.atomic_add(cnt_ptr + 1, tl.sum((first & (dres == 0)).to(tl.int64), axis=0), sem="relaxed")
            tl.atomic_add(cnt_ptr + 2, tl.sum((pm & pres).to(tl.int64), axis=0), sem="relaxed")
            tl.atomic_add(cnt_ptr + 3, tl.sum((pm & (pres == 0)).to(tl.int64), axis=0), sem="relaxed")

    @triton.jit
    def _slots_kernel(
        idx_ptr, w_ptr, dept_ptr, out_ptr, dmap_ptr, pmap_ptr, cnt_ptr, TK, K, T, n, S,
        TK_P2: tl.constexpr, S_P2: tl.constexpr, Z_P2: tl.constexpr, MAPS: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:  # the routing is the kernel before's output: nothing is read before the wait
            gdc_wait()
            gdc_launch_dependents()
        write_slots(
            idx_ptr, w_ptr, dept_ptr, out_ptr, dmap_ptr, pmap_ptr, cnt_ptr, TK, K, T, n, S, TK_P2, S_P2, Z_P2, MAPS
        )  # fmt: skip


def department_slots(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, n: int, slots: int, maps=None):
    """One-launch `department_slots_ref` (module doc). top_k_index [T, k] int32/int64, top_k_weights [T, k] float,
    T * k <= MAX_PAIRS; `maps` as in the module doc."""
    if triton is None:
        raise RuntimeError("department_slots needs triton")
    if top_k_index.dim() != 2 or top_k_index.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"top_k_index must be an int [T, k] tensor, got {top_k_index.dtype} {tuple(top_k_index.shape)}"
        )
    T, k = top_k_index.shape
    if tuple(top_k_weights.shape) != (T, k) or not top_k_weights.is_floating_point():
        raise ValueError(f"top_k_weights must be a float [T, k] = {(T, k)} tensor, got {tuple(top_k_weights.shape)}")
    if top_k_weights.device != top_k_index.device:
        raise ValueError("top_k_index and top_k_weights must be on one device")
    if not 0 < T * k <= MAX_PAIRS:
        raise ValueError(f"department_slots takes 1 to {MAX_PAIRS} (token, expert) pairs, got {T * k}")
    if n < 1 or slots < 1:
        raise ValueError(f"n and slots must be positive, got {n} and {slots}")
    dev = top_k_index.device
    idx, wts = top_k_index.contiguous(), top_k_weights.contiguous()
    dept = torch.empty(slots, dtype=torch.int32, device=dev)
    w = torch.empty(slots, T, n, dtype=torch.float32, device=dev)
    if maps is not None:
        dmap, pmap, counts = maps
        for name, t, dtype in (("dept_map", dmap, torch.int32), ("private_map", pmap, torch.int32)):
            if t.dtype != dtype or t.dim() != 1 or not t.is_contiguous() or t.device != dev:
                raise ValueError(f"{name} must be a contiguous int32 vector on {dev}")
        if counts.dtype != torch.int64 or counts.numel() != 4 or counts.device != dev:
            raise ValueError(f"counts must be an int64 [4] tensor on {dev}")
    else:
        dmap = pmap = dept
        counts = w
    _slots_kernel[(1,)](
        idx, wts, dept, w, dmap, pmap, counts, T * k, k, T, n, slots,
        TK_P2=triton.next_power_of_2(T * k), S_P2=triton.next_power_of_2(slots),
        Z_P2=triton.next_power_of_2(slots * T * n), MAPS=maps is not None, num_warps=4, **pdl_kw(idx),
    )  # fmt: skip
    return dept, w
