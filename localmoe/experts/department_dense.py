"""The dense path of a DeaMoE layer (prefill, calibration, training, evaluation): grouped GEMMs over departments.

Owns `grouped_dense` (the layer's formulas, experts/departments.py's module doc, for the tokens' (token, department)
pairs of a set of departments, given those departments' weights stacked), `dense_cached` (an offloaded layer: the
touched departments in groups of at most `STAGE_BYTES`, each group's weights staged on the device by the cache in
large copies, then `grouped_dense` on them; on CUDA the next group's copies run on a side stream while a group
computes) and `_mm_by_group` (torch's grouped GEMM, or a loop where it cannot run).
A resident layer calls `grouped_dense` once with its parameters. No per-token or per-expert host sync: a layer costs
one readback (the experts its tokens chose), a group three small ones (its pair and slot counts), whatever the prompt
length.

May import torch and experts/dense_path (torch's grouped GEMM); the module (`m`: a DepartmentExperts) is passed in,
never imported (it imports this).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from localmoe.experts.dense_path import _GROUPED_MM

# an offloaded layer's staging group: the departments whose weights fit (at least one); two groups in flight (CUDA:
# one computed while the next is copied on a side stream) inside the workspace the VRAM plan keeps free
# (experts/placement.WORKSPACE_RESERVE, 0.5 GiB) beside the piece's activations
STAGE_BYTES = 128 << 20


def stage_departments(unit_bytes: int, departments: int) -> int:
    """Departments in one staging group, each taking `unit_bytes` (its shared projections and n private parts)."""
    return min(departments, max(1, STAGE_BYTES // unit_bytes))


def _mm_by_group(a: torch.Tensor, w: torch.Tensor, ends: list[int], ends_t: torch.Tensor) -> torch.Tensor:
    """a [S, K] rows sorted by group, w [G, K, N] -> [S, N] (row r of group g: a[r] @ w[g]). torch's grouped GEMM
    where it runs (CUDA bf16 sm80+, or CPU without autograd, 16-byte aligned strides), else a loop over groups."""
    grad = torch.is_grad_enabled() and (a.requires_grad or w.requires_grad)
    if a.is_cuda and torch.is_autocast_enabled("cuda"):
        dt = torch.get_autocast_dtype("cuda")
        a, w = a.to(dt), w.to(dt)
    strides = (max(a.stride()), max(w.stride(1), w.stride(2)), w.stride(0))  # each matrix's leading stride
    aligned = all(s * a.element_size() % 16 == 0 for s in strides) and a.shape[0] > 0
    fits = (
        (a.dtype == torch.bfloat16 and torch.cuda.get_device_capability(a.device) >= (8, 0)) if a.is_cuda else not grad
    )
    if _GROUPED_MM is not None and aligned and fits and a.dtype == w.dtype:
        return _GROUPED_MM(a, w, offs=ends_t)
    out, start = [], 0
    for g, end in enumerate(ends):
        if end > start:
            out.append(a[start:end] @ w[g].to(a.dtype))
        start = end
    return torch.cat(out) if out else a.new_zeros(0, w.shape[-1])


def grouped_dense(
    m, x, top_k_index, top_k_weights, parts, dsel: torch.Tensor | None, masked: bool, acc: torch.Tensor | None = None
) -> torch.Tensor:
    """y [T, H] (x's dtype): what departments `dsel` (int64 [G] on x's device, department numbers; None = all D) add
    for the tokens routed into them. parts = (gate, up, down_t [G, h, H], private [G, n, h, h]): those departments'
    weights in dsel's order. `masked`: the thresholds apply (m.tau, m.tau_z, per department); m.recorder /
    m.z_recorder get |a| / |z| keyed by department number; m._count the kept neurons. A token's departments are
    summed in fp32 and rounded once, so staged groups (`dense_cached`: `acc`, an fp32 [T, H] the groups add into,
    returned as it is) give the resident layer's output whatever the grouping."""
    gate, up, down_t, private = parts
    T, k = top_k_index.shape
    G, n, h = gate.shape[0], m.per_department, m.width
    dep = top_k_index // n  # [T, k] department numbers
    if dsel is not None:  # department number -> its place in the group, -1 outside it
        local = torch.full((m.num_departments,), -1, dtype=torch.int64, device=x.device)
        local[dsel] = torch.arange(G, device=x.device)
        dep = local[dep]
    valid = dep >= 0  # [T, k]
    tok = torch.arange(T, device=x.device)[:, None].expand(T, k)
    touched = torch.zeros(G + 1, T, dtype=torch.bool, device=x.device)  # row G: the pairs outside the group
    touched[torch.where(valid, dep, G), tok] = True
    touched = touched[:G]  # [G, T]
    pair_of = touched.reshape(-1).long().cumsum(0).view(G, T) - 1  # pair number of (g, t), pairs sorted by g
    pg, pt = touched.nonzero(as_tuple=True)  # [P] group place and token of each pair
    ends_t = touched.sum(1).cumsum(0).to(torch.int32)
    ends = ends_t.tolist()
    number = pg if dsel is None else dsel[pg]  # [P] department numbers (thresholds, recorders)
    xs = x[pt]  # [P, H]
    a = F.silu(_mm_by_group(xs, gate.transpose(1, 2), ends, ends_t))  # [P, h]
    if m.recorder is not None:
        m.recorder.add_rows(a.abs(), number)
    if masked:
        keep = a.abs() >= m.tau.to(a.device)[number].unsqueeze(1)
        a = a * keep
        m._count(keep.sum(), a.numel())
    u = a * _mm_by_group(xs, up.transpose(1, 2), ends, ends_t)  # [P, h]
    # private parts: the group's (token, expert) slots sorted by expert, each reads its pair's u
    flat = torch.where(valid, dep * n + top_k_index % n, G * n).reshape(-1)  # G * n: a slot outside the group
    order = torch.argsort(flat, stable=True)
    if dsel is not None:  # the outside slots sort last: dropped (every slot is inside when dsel is None)
        order = order[: int(valid.sum())]
    slot_t = order // k
    slot_pair = pair_of[flat[order] // n, slot_t]  # [Q]
    e_ends_t = torch.bincount(flat[order], minlength=G * n).cumsum(0).to(torch.int32)
    zp = _mm_by_group(u[slot_pair], private.reshape(G * n, h, h), e_ends_t.tolist(), e_ends_t)  # [Q, h]
    zp = zp * top_k_weights.reshape(-1)[order, None].to(zp.dtype)
    z = torch.zeros(u.shape[0], h, dtype=zp.dtype, device=x.device).index_add(0, slot_pair, zp)  # [P, h]
    if m.z_recorder is not None:
        m.z_recorder.add_rows(z.abs(), number)
    if masked and m.tau_z is not None:
        z = z * (z.abs() >= m.tau_z.to(z.device)[number].unsqueeze(1))
    y = _mm_by_group(z, down_t, ends, ends_t)  # [P, H]
    if acc is not None:
        return acc.index_add_(0, pt, y.float())
    return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, pt, y.float()).to(x.dtype)


def dense_cached(m, x: torch.Tensor, top_k_index, top_k_weights, mask: bool) -> torch.Tensor:
    """The dense path of an offloaded layer (`m.cache`: experts/department_cache.py): the touched departments in
    groups of at most STAGE_BYTES, each group's weights staged by the cache (only the experts some token chose), then
    `grouped_dense` on them. `mask`: the thresholds apply (evaluation's mask on every token, or a decode step too
    large for the pools: the decode path's function)."""
    n, cache = m.per_department, m.cache
    masked = mask and m.sparse_enabled and m.tau is not None and m.recorder is None
    chosen = torch.zeros(m.num_departments * n, dtype=torch.bool, device=x.device)
    chosen[top_k_index.reshape(-1)] = True
    chosen = chosen.view(m.num_departments, n).cpu()  # one readback: the touched departments and their experts
    departments = chosen.any(1).nonzero().squeeze(1).tolist()
    per = stage_departments(cache.department_stage_bytes(), m.num_departments)
    groups = [departments[i : i + per] for i in range(0, len(departments), per)]
    side = cache.stage_stream(x.device)  # CUDA: the next group's copies run while this group computes

    def issue(group: list[int]) -> tuple:
        if side is None:
            return cache.stage(m.layer_idx, group, chosen[group]), None
        side.wait_stream(torch.cuda.current_stream(x.device))  # the buffers it may reuse are computed
        with torch.cuda.stream(side):
            parts = cache.stage(m.layer_idx, group, chosen[group])
            done = torch.cuda.Event()
            done.record(side)
        return parts, done

    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # the groups' sums, rounded once
    pending = issue(groups[0]) if groups else None
    for i, group in enumerate(groups):
        parts, done = pending
        pending = issue(groups[i + 1]) if i + 1 < len(groups) else None
        if done is not None:
            torch.cuda.current_stream(x.device).wait_event(done)
            for t in parts:  # made on the side stream, read on this one: not reused before that
                t.record_stream(torch.cuda.current_stream(x.device))
        dsel = torch.tensor(group, dtype=torch.int64, device=x.device)
        grouped_dense(m, x, top_k_index, top_k_weights, parts, dsel, masked, acc)
    return acc.to(x.dtype)
