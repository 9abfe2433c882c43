"""DeaMoE's department-grouped sparse decode (a step of T <= 8 tokens, T = 1 the usual case).

Owns `department_experts` (launcher), its torch reference `department_experts_ref`, and two kernels. The step's
departments sit in S fixed slots (`dept` [S], -1 = unused: the grid never depends on the routing, so the step can be
captured in a CUDA graph); `weights` [S, T, n] holds token t's routing weight for expert j of the slot's department
(0 = not chosen). For a slot s with department d, token t, a = silu(x_t W_gate_d^T), kept neurons K = {i : |a_i| >=
tau[d]} (only tokens with a chosen expert in d):

    u[s,t,i] = a_i (x_t . W_up_d[i])                            i in K, else 0             `_dept_up_private_kernel`
    z[s,t,:] = sum_j weights[s,t,j] sum_{i in K} u[s,t,i] P_{d,j}[i, :]                    (the same launch)
    y[t, :] += sum_i z[s,t,i] W_down_t_d[i, :]                                             `_dept_down_kernel`

(with `tau_z` [D], z entries with |z| < tau_z[d] are dropped first, and a W_down_t row no token keeps is not read).

Grids: up/private (S, h / BLOCK_N): a program reads a block of gate rows once for all T tokens, up rows only where
kept, computes u for its neurons in registers and adds their share of z (z is linear in u: the product is split over
neurons), reading the kept rows of each chosen expert's P once for all T tokens (experts no token chose are skipped);
down (H / BLOCK_O, S, row splits) reads the department's W_down_t once (z is dense unless tau_z) and adds into y
atomically. z and the down kernel's tickets live in a zeroed workspace (kernels/workspace.py): the last down program
of each slot re-zeroes the slot's z, and the first kernel zeroes y (unless accumulating): no memset launch. With
`residual` the last slot to finish publishes residual + y and zeroes y (a fused decoder layer's tail). Both kernels
use programmatic dependent launch (kernels/pdl.py). The kept count (tokens x kept neurons) is added into
`kept_total`. One launch (`_dept_one_kernel`, the default for one token read from VRAM: 1.3-2.4% faster decode steps of
the Qwen3.5-35B twin on an H100): the same programs in one grid, roles taken by ticket in the order programs start
(up/private first), each down program loading its W_down rows before it waits on a counter of finished up programs.

Shape legend: T tokens, D departments, n experts per department, h department width, H hidden, S slots.
Weight layout: w_gate, w_up, w_down_t [D, h, H] and private [D, n, h, h] (row i = input neuron i), rows contiguous.
"""

from __future__ import annotations

import torch

from localmoe.kernels.checks import FLOAT_DTYPES, expert_weights
from localmoe.kernels.workspace import zeroed_int32

try:
    import triton
    import triton.language as tl

    from localmoe.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_kw
    from localmoe.kernels.residual_publish import residual_publish
    from localmoe.kernels.rounding import round_to
except ImportError:  # pragma: no cover
    triton = None
    tl = None

MAX_TOKENS = 8


def _unpack_pools(pools) -> tuple:
    """`pools` (gate, up, down, private pools, dept_map, private_map[, up_slots[, down_slots]]) -> the same with
    up_slots and down_slots (the department slots whose up / down projection is in its pool: slots [0, up_slots) and
    [0, down_slots); defaults: the up and down pools' sizes). A slot >= 0 always has its gate in the gate pool."""
    gp, upp, dp, pp, dmap, pmap, *rest = pools
    up_slots = int(rest[0]) if rest else upp.shape[0]
    return gp, upp, dp, pp, dmap, pmap, up_slots, int(rest[1]) if len(rest) > 1 else dp.shape[0]


def department_experts_ref(
    x, w_gate, w_up, w_down_t, private, dept, weights, tau, private_slots=None, pools=None, host_elems=None, tau_z=None
):
    """Torch reference reading only kept rows of W_up and P: -> (y [T, H] fp32, kept count as a 0-d int64).
    With `private_slots` [S, n], private is a pool [P, h, h] and expert j of slot s is private[private_slots[s, j]].
    With `pools` (direct offloading, module doc), a department / expert the maps place in a pool is read there, any
    other from the host master copies (w_gate... / private); `host_elems` (0-d int64) gets the elements read from
    the host added (gate rows, kept up rows, down rows, kept private rows). `tau_z` [D]: z entries under it are
    dropped, and W_down rows no token keeps are not read."""
    ps = private_slots.tolist() if private_slots is not None else None
    if pools is not None:
        gp, upp, dp, pp, dmap, pmap, up_slots, down_slots = _unpack_pools(pools)
        dmap, pmap = dmap.tolist(), pmap.tolist()
    T, H = x.shape
    h = w_gate.shape[1]
    n = weights.shape[2]
    y = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    kept = torch.zeros((), dtype=torch.int64, device=x.device)
    from_host = 0
    for s, d in enumerate(dept.tolist()):
        if d < 0:
            continue
        g_w, u_w, d_w = w_gate[d], w_up[d], w_down_t[d]
        on_host = pools is not None and dmap[d] < 0
        up_host = pools is not None and not 0 <= dmap[d] < up_slots
        down_host = pools is not None and not 0 <= dmap[d] < down_slots
        if pools is not None and not on_host:
            g_w = gp[dmap[d]]
            if not up_host:
                u_w = upp[dmap[d]]
            if not down_host:
                d_w = dp[dmap[d]]
        if on_host:
            from_host += h * H  # the gate, read once for the slot
        z_rows: set = set()  # W_down rows some token keeps (read once for the slot)
        live: dict[int, set] = {}  # expert j -> kept neurons of the tokens that chose it (its P rows read once)
        for t in range(T):
            w = weights[s, t].float()
            if not bool((w != 0).any()):
                continue
            xt = x[t].float()
            a = torch.nn.functional.silu(g_w.float() @ xt)  # [h]
            keep = (a.abs() >= tau[d].float()).nonzero().squeeze(1)
            kept += keep.numel()
            if up_host:
                from_host += keep.numel() * H  # kept up rows (for this token)
            u = a[keep] * (u_w.index_select(0, keep).float() @ xt)  # [kept]
            z = torch.zeros(h, dtype=torch.float32, device=x.device)
            for j in (w != 0).nonzero().squeeze(1).tolist():
                if ps is not None:
                    pj = private[ps[s][j]]
                elif pools is not None and pmap[d * n + j] >= 0:
                    pj = pp[pmap[d * n + j]]
                else:
                    pj = private[d, j]
                    if pools is not None:
                        live.setdefault(j, set()).update(keep[u != 0].tolist())
                z += w[j] * (u @ pj.index_select(0, keep).float())
            if tau_z is not None:
                z = torch.where(z.abs() >= tau_z[d].float(), z, torch.zeros_like(z))
                z_rows.update(z.nonzero().squeeze(1).tolist())
            else:
                z_rows.update(range(h))
            y[t] += z @ d_w.float()
        from_host += sum(len(rows) for rows in live.values()) * h
        if down_host:
            from_host += len(z_rows) * H
    if host_elems is not None:
        host_elems += from_host
    return y, kept


if triton is not None:

    @triton.jit
    def _up_private_program(
        s, blk, NB, x_ptr, wg_ptr, wu_ptr, p_ptr, dept_ptr, w_ptr, tau_ptr, z_ptr, y_ptr, y_chunk, kept_ptr,
        seen_ptr, ps_ptr, gp_ptr, up_ptr, pp_ptr, dmap_ptr, pmap_ptr, hc_ptr,
        T, h, n, stride_xt, stride_gd, stride_ud, stride_pd, stride_pe, stride_pool, stride_pp, up_slots,
        H: tl.constexpr, H_P2: tl.constexpr, N_P2: tl.constexpr, T_P2: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_Z: tl.constexpr, COUNT: tl.constexpr, SEEN: tl.constexpr, DIRECT: tl.constexpr,
        INDEXED: tl.constexpr,
    ):  # fmt: skip
        # program (slot s, block blk of BLOCK_N neurons; NB blocks a slot): u of its neurons for every token, then
        # their share of z for each expert of the slot's department some token chose (the product split over
        # neurons: z is added atomically)
        rows = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        y0 = (s * NB + blk) * y_chunk  # y zeroed here (a chunk per program)
        for o in range(y0, tl.minimum(y0 + y_chunk, T * H), 256):
            zo = o + tl.arange(0, 256)
            tl.store(y_ptr + zo, tl.zeros((256,), dtype=tl.float32), mask=zo < tl.minimum(y0 + y_chunk, T * H))
        d = tl.load(dept_ptr + s)
        if d >= 0:
            dd = d.to(tl.int64)
            valid = rows < h
            cols = tl.arange(0, H_P2)
            cmask = cols < H
            roff = rows.to(tl.int64)[:, None] * H + cols[None, :]
            m2 = valid[:, None] & cmask[None, :]
            host_elems = 0
            if DIRECT:  # the department's pool slot, or -1: read from the host master copy
                slot = tl.load(dmap_ptr + dd)
                pool = tl.maximum(slot, 0).to(tl.int64) * stride_pool
                res = ((rows * 0 + slot) >= 0)[:, None]  # masks are blocks, not scalars
                host = ((rows * 0 + slot) < 0)[:, None]
                up_res = ((rows * 0 + slot) >= 0)[:, None] & ((rows * 0 + slot) < up_slots)[:, None]
                up_on_host = ((slot < 0) | (slot >= up_slots)).to(tl.int64)
                wg = tl.load(gp_ptr + pool + roff, mask=m2 & res, other=0.0).to(tl.float32)
                wg += tl.load(wg_ptr + dd * stride_gd + roff, mask=m2 & host, other=0.0).to(tl.float32)
                host_elems += (slot < 0).to(tl.int64) * tl.sum(valid.to(tl.int64), axis=0) * H
            else:
                wg = tl.load(wg_ptr + dd * stride_gd + roff, mask=m2, other=0.0).to(tl.float32)
            tau = tl.load(tau_ptr + dd)
            jj = tl.arange(0, N_P2)
            tt = tl.arange(0, T_P2)
            tmask = tt < T
            # the slot's routing weights [token, expert] in one load (no load per token or expert below)
            wall = tl.load(
                w_ptr + (s * T + tt[:, None]) * n + jj[None, :], mask=tmask[:, None] & (jj < n)[None, :], other=0.0
            )
            uses = tl.sum(tl.abs(wall), axis=1)  # [T_P2] > 0: token t chose an expert of d
            u = tl.zeros((T_P2, BLOCK_N), dtype=tl.float32)  # [token, neuron], 0 where not kept
            total = 0
            considered = 0
            for t in tl.static_range(T_P2):
                used_t = tl.sum(tl.where(tt == t, uses, 0.0), axis=0)
                used = (tl.zeros((BLOCK_N,), dtype=tl.float32) + used_t) > 0  # token t uses d (a block: masks are)
                xv = tl.load(x_ptr + t * stride_xt + cols, mask=cmask & ((cols * 0 + t) < T), other=0.0)
                xv = xv.to(tl.float32)
                g = tl.sum(wg * xv[None, :], axis=1)
                a = g / (1.0 + tl.exp(-g))
                keep = (tl.abs(a) >= tau) & valid & used
                km = keep[:, None] & cmask[None, :]
                if DIRECT:
                    wu = tl.load(up_ptr + pool + roff, mask=km & up_res, other=0.0).to(tl.float32)
                    wu += tl.load(wu_ptr + dd * stride_ud + roff, mask=km & (up_res == 0), other=0.0).to(tl.float32)
                    host_elems += up_on_host * tl.sum(keep.to(tl.int64), axis=0) * H
                else:
                    wu = tl.load(wu_ptr + dd * stride_ud + roff, mask=km, other=0.0).to(tl.float32)
                ut = tl.where(keep, a * tl.sum(wu * xv[None, :], axis=1), 0.0)
                u = tl.where(tt[:, None] == t, ut[None, :], u)
                total += tl.sum(keep.to(tl.int64), axis=0)
                considered += tl.sum((valid & used).to(tl.int64), axis=0)
            if COUNT:
                tl.atomic_add(kept_ptr, total, sem="relaxed")
            if SEEN:
                tl.atomic_add(seen_ptr, considered, sem="relaxed")
            # z[s, t, :] += sum_j weights[s, t, j] sum_{i in block} u[t, i] P_j[i, :]: P rows of kept neurons only
            if total > 0:  # a block with no kept neuron adds nothing to z: no P reads, no atomics
                chosen = tl.sum(tl.abs(wall), axis=0) > 0  # [N_P2]: experts some token chose (most are not)
                first = tl.min(tl.where(chosen, jj, N_P2), axis=0)
                for c0 in range(0, h, BLOCK_Z):
                    zc = c0 + tl.arange(0, BLOCK_Z)
                    zmask = zc < h
                    poff = rows.to(tl.int64)[:, None] * h + zc[None, :]
                    acc = tl.zeros((T_P2, BLOCK_Z), dtype=tl.float32)
                    j = first
                    while j < n:  # the chosen experts only, in order
                        wj = tl.sum(tl.where(jj[None, :] == j, wall, 0.0), axis=1)  # [T_P2]
                        if INDEXED:  # a pool of private parts: expert j of slot s sits at private_slots[s, j]
                            pbase = tl.load(ps_ptr + s * n + j).to(tl.int64) * stride_pe
                        else:
                            pbase = dd * stride_pd + j * stride_pe
                        live = tl.sum(tl.abs(u) * (wj[:, None] != 0), axis=0) > 0  # kept by a token choosing j
                        pm = live[:, None] & zmask[None, :]
                        if DIRECT:  # the expert's private pool slot, or -1: read from the host master copy
                            pslot = tl.load(pmap_ptr + dd * n + j)
                            pres = ((rows * 0 + pslot) >= 0)[:, None]
                            ppool = tl.maximum(pslot, 0).to(tl.int64) * stride_pp
                            p = tl.load(pp_ptr + ppool + poff, mask=pm & pres, other=0.0).to(tl.float32)
                            p += tl.load(p_ptr + pbase + poff, mask=pm & (pres == 0), other=0.0).to(tl.float32)
                            read = tl.sum(live.to(tl.int64), axis=0) * tl.sum(zmask.to(tl.int64), axis=0)
                            host_elems += (pslot < 0).to(tl.int64) * read
                        else:
                            p = tl.load(p_ptr + pbase + poff, mask=pm, other=0.0).to(tl.float32)
                        acc += tl.sum((u * wj[:, None])[:, :, None] * p[None, :, :], axis=1)
                        j = tl.min(tl.where(chosen & (jj > j), jj, N_P2), axis=0)
                    tl.atomic_add(
                        z_ptr + (s * T + tt[:, None]) * h + zc[None, :],
                        acc,
                        mask=tmask[:, None] & zmask[None, :],
                        sem="relaxed",
                    )
            if DIRECT:
                tl.atomic_add(hc_ptr, host_elems, sem="relaxed")

    @triton.jit
    def _dept_up_private_kernel(
        x_ptr, wg_ptr, wu_ptr, p_ptr, dept_ptr, w_ptr, tau_ptr, z_ptr, y_ptr, y_chunk, kept_ptr, seen_ptr,
        ps_ptr, gp_ptr, up_ptr, pp_ptr, dmap_ptr, pmap_ptr, hc_ptr,
        T, h, n, stride_xt, stride_gd, stride_ud, stride_pd, stride_pe, stride_pool, stride_pp, up_slots,
        H: tl.constexpr, H_P2: tl.constexpr, N_P2: tl.constexpr, T_P2: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_Z: tl.constexpr, COUNT: tl.constexpr, SEEN: tl.constexpr, DIRECT: tl.constexpr,
        INDEXED: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:  # the slot's department comes from the step's routing: nothing is read before the wait
            gdc_wait()
            gdc_launch_dependents()
        _up_private_program(
            tl.program_id(0), tl.program_id(1), tl.num_programs(1), x_ptr, wg_ptr, wu_ptr, p_ptr, dept_ptr, w_ptr,
            tau_ptr, z_ptr, y_ptr, y_chunk, kept_ptr, seen_ptr, ps_ptr, gp_ptr, up_ptr, pp_ptr, dmap_ptr, pmap_ptr,
            hc_ptr, T, h, n, stride_xt, stride_gd, stride_ud, stride_pd, stride_pe, stride_pool, stride_pp, up_slots,
            H, H_P2, N_P2, T_P2, BLOCK_N, BLOCK_Z, COUNT, SEEN, DIRECT, INDEXED,
        )  # fmt: skip

    @triton.jit
    def _down_program(
        cb, s, split, per_slot, wd_ptr, dept_ptr, z_ptr, y_ptr, dp_ptr, dmap_ptr, hc_ptr, tz_ptr, tick_ptr,
        res_ptr, out_ptr, T, h, S, stride_dd, stride_pool, stride_res, stride_out, down_slots, wd_pre, done_ptr,
        H: tl.constexpr, H_P2: tl.constexpr, T_P2: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_O: tl.constexpr,
        ROWS: tl.constexpr, DIRECT: tl.constexpr, ZMASK: tl.constexpr, TAIL: tl.constexpr, PRE: tl.constexpr,
        ONE: tl.constexpr,
    ):  # fmt: skip
        # program (column block cb, slot s, row split): rows [split * ROWS, +ROWS) of the slot's W_down_t, all T
        # tokens; per_slot programs a slot. PRE: wd_pre holds the block's rows (ROWS = BLOCK_I, loaded by the caller)
        cols = cb * BLOCK_O + tl.arange(0, BLOCK_O)
        cmask = cols < H
        d = tl.load(dept_ptr + s)
        dd = tl.maximum(d, 0).to(tl.int64)
        tt = tl.arange(0, T_P2)
        tmask = tt < T
        if d >= 0:
            if DIRECT:
                slot = tl.load(dmap_ptr + dd)  # its down projection in the pool when 0 <= slot < down_slots
                pool = tl.maximum(slot, 0).to(tl.int64) * stride_pool
                in_pool = (slot >= 0) & (slot < down_slots)
                res = ((tl.arange(0, BLOCK_I) * 0 + in_pool.to(tl.int32)) > 0)[:, None]  # masks are blocks
                host = ((tl.arange(0, BLOCK_I) * 0 + in_pool.to(tl.int32)) == 0)[:, None]
                on_host = (in_pool == 0).to(tl.int64)
            read = tl.zeros((BLOCK_I,), dtype=tl.int64)  # W_down rows read, by row position in the block
            acc = tl.zeros((T_P2, BLOCK_O), dtype=tl.float32)
            if ZMASK:
                tz = tl.load(tz_ptr + dd)
            r0 = split * ROWS
            for i0 in range(0, ROWS, BLOCK_I):
                ii = r0 + i0 + tl.arange(0, BLOCK_I)
                imask = ii < h
                z = tl.load(
                    z_ptr + (s * T + tt[:, None]) * h + ii[None, :],
                    mask=tmask[:, None] & imask[None, :],
                    other=0.0,
                    cache_modifier=".cg",  # the up programs' atomic sums: via L2
                )
                doff = ii.to(tl.int64)[:, None] * H + cols[None, :]
                rmask = imask
                if ZMASK:  # z entries under tau_z dropped; a row no token keeps is not read
                    z = tl.where(tl.abs(z) >= tz, z, 0.0)
                    rmask = imask & (tl.sum((z != 0).to(tl.int32), axis=0) > 0)
                dm = rmask[:, None] & cmask[None, :]
                if PRE:
                    wd = wd_pre.to(tl.float32)
                elif DIRECT:
                    wd = tl.load(dp_ptr + pool + doff, mask=dm & res, other=0.0).to(tl.float32)
                    wd += tl.load(wd_ptr + dd * stride_dd + doff, mask=dm & host, other=0.0).to(tl.float32)
                    read += rmask.to(tl.int64)
                else:
                    wd = tl.load(wd_ptr + dd * stride_dd + doff, mask=dm, other=0.0).to(tl.float32)
                acc += tl.sum(z[:, :, None] * wd[None, :, :], axis=1)
            tl.atomic_add(
                y_ptr + tt[:, None] * H + cols[None, :], acc, mask=tmask[:, None] & cmask[None, :], sem="relaxed"
            )
            if DIRECT:
                elems = tl.sum(read, axis=0) * tl.sum(cmask.to(tl.int64), axis=0)
                tl.atomic_add(hc_ptr, on_host * elems, sem="relaxed")
        # the last program of a slot (acq_rel ticket: the others' z reads and y adds are visible to it) re-zeroes the
        # slot's z and its ticket for the next launch; the last of those (a second ticket, after the S slot tickets)
        # publishes out = residual + y and zeroes y with TAIL, and re-zeroes the one-launch counter with ONE
        if tl.atomic_add(tick_ptr + s, 1, sem="acq_rel", scope="gpu") == per_slot - 1:
            z0 = s * T * h
            for o in range(z0, z0 + T * h, 1024):
                zo = o + tl.arange(0, 1024)
                tl.store(z_ptr + zo, tl.zeros((1024,), dtype=tl.float32), mask=zo < z0 + T * h)
            tl.store(tick_ptr + s, 0)
            if TAIL or ONE:
                if tl.atomic_add(tick_ptr + S, 1, sem="acq_rel", scope="gpu") == S - 1:
                    if TAIL:
                        hh = tl.arange(0, H_P2)
                        hm = hh < H
                        DT = out_ptr.dtype.element_ty
                        for t in range(0, T):
                            a = tl.load(y_ptr + t * H + hh, mask=hm, other=0.0, cache_modifier=".cg")
                            r = tl.load(res_ptr + t * stride_res + hh, mask=hm, other=0.0).to(tl.float32)
                            tl.store(out_ptr + t * stride_out + hh, round_to(r + a, DT).to(DT), mask=hm)
                            tl.store(y_ptr + t * H + hh, tl.zeros((H_P2,), dtype=tl.float32), mask=hm)
                    if ONE:
                        tl.store(done_ptr, 0)
                    tl.store(tick_ptr + S, 0)

    @triton.jit
    def _dept_down_kernel(
        wd_ptr, dept_ptr, z_ptr, y_ptr, dp_ptr, dmap_ptr, hc_ptr, tz_ptr, tick_ptr, res_ptr, out_ptr,
        T, h, S, stride_dd, stride_pool, stride_res, stride_out, down_slots,
        H: tl.constexpr, H_P2: tl.constexpr, T_P2: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_O: tl.constexpr,
        ROWS: tl.constexpr, DIRECT: tl.constexpr, ZMASK: tl.constexpr, TAIL: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        _down_program(
            tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(0) * tl.num_programs(2), wd_ptr,
            dept_ptr, z_ptr, y_ptr, dp_ptr, dmap_ptr, hc_ptr, tz_ptr, tick_ptr, res_ptr, out_ptr, T, h, S, stride_dd,
            stride_pool, stride_res, stride_out, down_slots, 0.0, tick_ptr,
            H, H_P2, T_P2, BLOCK_I, BLOCK_O, ROWS, DIRECT, ZMASK, TAIL, False, False,
        )  # fmt: skip

    @triton.jit
    def _dept_one_kernel(
        x_ptr, wg_ptr, wu_ptr, p_ptr, dept_ptr, w_ptr, tau_ptr, z_ptr, y_ptr, y_chunk, kept_ptr, seen_ptr,
        ps_ptr, gp_ptr, up_ptr, pp_ptr, dmap_ptr, pmap_ptr, hc_ptr,
        wd_ptr, dp_ptr, tz_ptr, tick_ptr, res_ptr, out_ptr, role_ptr, done_ptr, NB, NCB, NSPLIT,
        T, h, n, S, stride_xt, stride_gd, stride_ud, stride_pd, stride_pe, stride_pool, stride_pp, up_slots,
        stride_dd, stride_res, stride_out, down_slots,
        H: tl.constexpr, H_P2: tl.constexpr, N_P2: tl.constexpr, T_P2: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_Z: tl.constexpr, BLOCK_O: tl.constexpr, ROWS: tl.constexpr, COUNT: tl.constexpr, SEEN: tl.constexpr,
        DIRECT: tl.constexpr, INDEXED: tl.constexpr, ZMASK: tl.constexpr, TAIL: tl.constexpr, PRE: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        # both phases in one launch: a program takes a ticket (the order programs start in) and is an up/private
        # program for tickets [0, S * NB), a down program after; a down program loads its W_down rows first, then
        # waits until every up program has added its share of z. A waiting program's ticket is higher than every up
        # program's, and those started before it (they took their tickets): the wait always ends. The program with
        # the last ticket re-zeroes the ticket counter (every program has read it), the down phase's last program
        # the done counter.
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        n_up = S * NB
        ticket = tl.atomic_add(role_ptr, 1, sem="relaxed")
        if ticket == n_up + NCB * S * NSPLIT - 1:
            tl.store(role_ptr, 0)
        if ticket < n_up:
            _up_private_program(
                ticket // NB, ticket % NB, NB, x_ptr, wg_ptr, wu_ptr, p_ptr, dept_ptr, w_ptr, tau_ptr, z_ptr, y_ptr,
                y_chunk, kept_ptr, seen_ptr, ps_ptr, gp_ptr, up_ptr, pp_ptr, dmap_ptr, pmap_ptr, hc_ptr,
                T, h, n, stride_xt, stride_gd, stride_ud, stride_pd, stride_pe, stride_pool, stride_pp, up_slots,
                H, H_P2, N_P2, T_P2, BLOCK_N, BLOCK_Z, COUNT, SEEN, DIRECT, INDEXED,
            )  # fmt: skip
            tl.atomic_add(done_ptr, 1, sem="release", scope="gpu")  # after this program's z and y writes
        else:
            r = ticket - n_up
            cb = r % NCB
            s = (r // NCB) % S
            split = r // (NCB * S)
            wd = 0.0
            if PRE:  # (neither DIRECT nor ZMASK) the rows this program multiplies, loaded while the up programs run
                d = tl.load(dept_ptr + s)
                cols = cb * BLOCK_O + tl.arange(0, BLOCK_O)
                ii = split * ROWS + tl.arange(0, ROWS)
                dm = ((ii < h) & ((ii * 0 + d) >= 0))[:, None] & (cols < H)[None, :]  # masks are blocks
                doff = ii.to(tl.int64)[:, None] * H + cols[None, :]
                wd = tl.load(wd_ptr + tl.maximum(d, 0).to(tl.int64) * stride_dd + doff, mask=dm, other=0.0)
            done = tl.atomic_add(done_ptr, 0, sem="acquire", scope="gpu")
            while done < n_up:
                done = tl.atomic_add(done_ptr, 0, sem="acquire", scope="gpu")
            _down_program(
                cb, s, split, NCB * NSPLIT, wd_ptr, dept_ptr, z_ptr, y_ptr, dp_ptr, dmap_ptr, hc_ptr, tz_ptr,
                tick_ptr, res_ptr, out_ptr, T, h, S, stride_dd, stride_pool, stride_res, stride_out, down_slots, wd,
                done_ptr, H, H_P2, T_P2, ROWS, BLOCK_O, ROWS, DIRECT, ZMASK, TAIL, PRE, True,
            )  # fmt: skip


def _split(rows: int, block: int, target: int) -> tuple[int, int]:
    """(rows per program, programs) splitting `rows` into chunks of about `target` rows, multiples of `block`."""
    per = max(block, (min(rows, target) + block - 1) // block * block)
    return per, (rows + per - 1) // per


def department_experts(
    x, w_gate, w_up, w_down_t, private, dept, weights, tau, out=None, *, accumulate=False, kept_total=None,
    seen_total=None, private_slots=None, pools=None, host_elems=None, tau_z=None, residual=None,
    BLOCK_N: int = 8, BLOCK_I: int = 0, BLOCK_Z: int = 1024, BLOCK_O: int = 128, SPLIT_ROWS: int = 96,
    ONE_LAUNCH: bool | None = None, ONE_ROWS: int = 0, num_warps: int = 4,
):  # fmt: skip
    """y [T, H] fp32 = the department-grouped DeaMoE experts of a step (module doc); `out` is zeroed and filled, or
    with `accumulate=True` added into (what it held stays: e.g. the shared expert's output from kernels/moe_front.py).

    x [T, H] (T <= MAX_TOKENS), w_gate/w_up/w_down_t [D, h, H], private [D, n, h, h] (bf16/fp16/fp32, rows
    contiguous), dept [S] int32 (-1 = unused slot), weights [S, T, n] fp32, tau [D] fp32; `kept_total` (0-d int64)
    gets the kept (token, neuron) count added, `seen_total` (0-d int64) the (token, neuron) count considered (the
    step's (token, department) pairs x h): a module's sparsity counters, added in place with no launch of their own.
    With `private_slots` [S, n] int32, private is a pool [P, h, h] and
    expert j of slot s reads private[private_slots[s, j]] (an expert cache's slots; entries of unchosen experts are
    never read).

    Direct offloading, `pools` = (gate_pool, up_pool, down_pool [P, h, H], private_pool [Q, h, h], dept_map [D] int32,
    private_map [D * n] int32[, up_slots[, down_slots]]): w_gate... and private are the host master copies (pinned when
    x is on CUDA: read through unified addressing), dept holds department numbers, and a department / expert whose map
    entry is a slot >= 0 is read from that pool slot (its up projection only when the slot is below up_slots, its down
    projection only below down_slots, defaults the up and down pools' sizes: those pools may be shorter), any other
    straight from host memory (no copy, no host sync: graph capturable).
    `host_elems` (0-d int64 on x's device) gets the elements read from host memory added.

    `residual` [T, H] (with out= a workspace row and accumulate=True: a fused decoder layer's tail): the launch
    returns residual + out in residual's dtype, rounded once, and leaves out zeroed (as kernels/residual_publish.py
    does, in the down kernel's last program: no launch of its own).

    `ONE_LAUNCH` (default: one token read from VRAM, not `pools`): both phases in one launch (`_dept_one_kernel`,
    module doc), each down program's W_down rows (`ONE_ROWS` a program, default 128 / T) loaded while the up programs
    run; else the up/private and down kernels."""
    if triton is None:
        raise RuntimeError("department_experts needs triton")
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES or x.stride(1) != 1:
        raise ValueError(f"x must be a float [T, H] tensor with a contiguous last dim, got {x.dtype} {tuple(x.shape)}")
    T, H = x.shape
    if not 0 < T <= MAX_TOKENS:
        raise ValueError(f"department_experts takes 1 to {MAX_TOKENS} tokens, got {T}")
    if w_gate.dim() != 3:
        raise ValueError(f"w_gate must be [D, h, H], got shape {tuple(w_gate.shape)}")
    D, h = w_gate.shape[0], w_gate.shape[1]
    direct = pools is not None
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down_t", w_down_t)):
        expert_weights(name, w, D, h, H, x.device, allow_host=direct)
    indexed = private_slots is not None
    if indexed and direct:
        raise ValueError("private_slots (copied-in pools) and pools (direct reads) exclude each other")
    if indexed:
        if private.dim() != 3 or tuple(private.shape[1:]) != (h, h):
            raise ValueError(
                f"with private_slots, private must be a pool [P, h, h] with h={h}, got {tuple(private.shape)}"
            )
        if private_slots.dim() != 2 or private_slots.dtype != torch.int32 or not private_slots.is_contiguous():
            raise ValueError("private_slots must be a contiguous int32 [S, n] tensor")
        if private_slots.device != x.device:
            raise ValueError(f"private_slots must be on {x.device}")
        n = private_slots.shape[1]
    elif private.dim() != 4 or private.shape[0] != D or tuple(private.shape[2:]) != (h, h):
        raise ValueError(f"private must be [D, n, h, h] with D={D}, h={h}, got {tuple(private.shape)}")
    else:
        n = private.shape[1]
    if private.dtype not in FLOAT_DTYPES or not private.is_contiguous():
        raise ValueError("private must be a contiguous bf16/fp16/fp32 tensor")
    if private.device != x.device and not (direct and private.device.type == "cpu"):
        raise ValueError(f"private must be on {x.device}")
    if private.device != x.device and x.is_cuda and not private.is_pinned():
        raise ValueError("a host copy of private must be pinned (the GPU reads it through unified addressing)")
    if direct:
        gp, upp, dp, pp, dmap, pmap, up_slots, down_slots = _unpack_pools(pools)
        if not 0 <= up_slots <= upp.shape[0]:
            raise ValueError(f"up_slots must be within the up pool's {upp.shape[0]} slots, got {up_slots}")
        if not 0 <= down_slots <= dp.shape[0]:
            raise ValueError(f"down_slots must be within the down pool's {dp.shape[0]} slots, got {down_slots}")
        for name, w in (("gate_pool", gp), ("up_pool", upp), ("down_pool", dp)):
            expert_weights(name, w, w.shape[0], h, H, x.device)
        if pp.dim() != 3 or tuple(pp.shape[1:]) != (h, h) or not pp.is_contiguous() or pp.device != x.device:
            raise ValueError(f"private_pool must be a contiguous [Q, {h}, {h}] tensor on {x.device}")
        if gp.stride() != upp.stride() or gp.stride() != dp.stride():
            raise ValueError("the gate, up and down pools must share one layout")
        for name, m, size in (("dept_map", dmap, D), ("private_map", pmap, D * n)):
            if tuple(m.shape) != (size,) or m.dtype != torch.int32 or not m.is_contiguous() or m.device != x.device:
                raise ValueError(f"{name} must be a contiguous int32 [{size}] tensor on {x.device}")
        if host_elems is None or host_elems.dtype != torch.int64 or host_elems.numel() != 1:
            raise ValueError("direct offloading needs host_elems, a one-element int64 tensor")
    if dept.dim() != 1 or dept.dtype != torch.int32 or not dept.is_contiguous() or dept.device != x.device:
        raise ValueError(
            f"dept must be a contiguous int32 [S] tensor on {x.device}, got {dept.dtype} {tuple(dept.shape)}"
        )
    S = dept.shape[0]
    if tuple(weights.shape) != (S, T, n) or weights.dtype != torch.float32 or not weights.is_contiguous():
        raise ValueError(
            f"weights must be a contiguous fp32 [S, T, n] = {(S, T, n)} tensor, got {tuple(weights.shape)}"
        )
    if tuple(tau.shape) != (D,) or tau.dtype != torch.float32 or tau.device != x.device:
        raise ValueError(f"tau must be an fp32 [D] = ({D},) tensor on {x.device}")
    if tau_z is not None and (tuple(tau_z.shape) != (D,) or tau_z.dtype != torch.float32 or tau_z.device != x.device):
        raise ValueError(f"tau_z must be an fp32 [D] = ({D},) tensor on {x.device}")
    if weights.device != x.device:
        raise ValueError("weights must be on x's device")
    for name, c in (("kept_total", kept_total), ("seen_total", seen_total)):
        if c is not None and (c.dtype != torch.int64 or c.numel() != 1 or c.device != x.device):
            raise ValueError(f"{name} must be a one-element int64 tensor on {x.device}")
    if out is not None and (
        tuple(out.shape) != (T, H) or out.dtype != torch.float32 or not out.is_contiguous() or out.device != x.device
    ):
        raise ValueError(f"out must be a contiguous fp32 [T, H] = {(T, H)} tensor on {x.device}")
    if accumulate and out is None:
        raise ValueError("accumulate=True adds into out=: give the fp32 [T, H] tensor")
    residual_out = _check_residual(residual, accumulate, T, H, x)
    if out is None:
        out = torch.empty(T, H, dtype=torch.float32, device=x.device)
    if S == 0:
        if residual_out is not None:
            return residual_publish(out, residual.view(T, H), out=residual_out)
        return out if accumulate else out.zero_()
    # z (S*T*h fp32, added into atomically), the down programs' tickets (one per slot, one for the last slot: the tail
    # and the one-launch reset) and the one launch's role and done counters: a zeroed workspace the launch leaves zeroed
    ws = zeroed_int32("department_experts", x.device, S * T * h + S + 3)
    z_ws, tick = ws[: S * T * h].view(torch.float32), ws[S * T * h : S * T * h + S + 1]
    role, done = ws[S * T * h + S + 1 :], ws[S * T * h + S + 2 :]
    t_p2 = triton.next_power_of_2(T)
    bn = max(1, min(triton.next_power_of_2(BLOCK_N), triton.next_power_of_2(h)))
    bz = min(triton.next_power_of_2(BLOCK_Z), triton.next_power_of_2(h))
    block_i = BLOCK_I or (64 if t_p2 == 1 else 32 if t_p2 == 2 else 16)  # the [T, BLOCK_I, BLOCK_O] product's size
    bi = min(triton.next_power_of_2(block_i), triton.next_power_of_2(h))
    bo = min(triton.next_power_of_2(BLOCK_O), triton.next_power_of_2(H))
    rows, splits = _split(h, bi, SPLIT_ROWS)
    count, see = kept_total is not None, seen_total is not None
    kept = kept_total if count else ws  # any pointer when not counting
    seen = seen_total if see else ws
    if direct:
        gp, upp, dp, pp, dmap, pmap, up_slots, down_slots = _unpack_pools(pools)
        hc, pool_stride, pp_stride = host_elems, gp.stride(0), pp.stride(0)
    else:  # any tensors of the right kind: never read
        gp = upp = dp = w_gate
        pp, dmap, pmap, hc, pool_stride, pp_stride, up_slots, down_slots = private, dept, dept, ws, 0, 0, 0, 0
    if indexed and tuple(private_slots.shape) != (S, n):
        raise ValueError(f"private_slots must be [S, n] = {(S, n)}, got {tuple(private_slots.shape)}")
    pstride_d, pstride_e = (0, private.stride(0)) if indexed else (private.stride(0), private.stride(1))
    nb = triton.cdiv(h, bn)
    y_chunk = 0 if accumulate else triton.cdiv(T * H, S * nb)
    tail = residual_out is not None
    res = residual.view(T, H) if tail else x
    ps = private_slots if indexed else dept
    consts = dict(H=H, H_P2=triton.next_power_of_2(H), T_P2=t_p2, DIRECT=direct, ZMASK=tau_z is not None, TAIL=tail)
    up_consts = dict(N_P2=triton.next_power_of_2(n), BLOCK_N=bn, BLOCK_Z=bz, COUNT=count, SEEN=see, INDEXED=indexed)
    if ONE_LAUNCH is None:  # measured faster for one token read from VRAM (bench/RESULTS.md, DeaMoE)
        ONE_LAUNCH = T == 1 and not direct
    if ONE_LAUNCH:
        one_rows = min(triton.next_power_of_2(ONE_ROWS or max(16, 128 // t_p2)), triton.next_power_of_2(h))
        ncb, nsplit = triton.cdiv(H, bo), triton.cdiv(h, one_rows)
        try:
            _dept_one_kernel[(S * nb + ncb * S * nsplit,)](
                x, w_gate, w_up, private, dept, weights, tau, z_ws, out, y_chunk, kept, seen, ps, gp, upp, pp, dmap,
                pmap, hc, w_down_t, dp, tau if tau_z is None else tau_z, tick, res, residual_out if tail else x, role,
                done, nb, ncb, nsplit, T, h, n, S, x.stride(0), w_gate.stride(0), w_up.stride(0), pstride_d,
                pstride_e, pool_stride, pp_stride, up_slots, w_down_t.stride(0), res.stride(0),
                residual_out.stride(0) if tail else 0, down_slots,
                BLOCK_O=bo, ROWS=one_rows, PRE=not direct and tau_z is None, **consts, **up_consts,
                num_warps=num_warps, **pdl_kw(x),
            )  # fmt: skip
        except Exception:  # a launch stopped part-way (the interpreter) must leave no ticket for the next to wait on
            ws.zero_()
            raise
        return residual_out if tail else out
    _dept_up_private_kernel[(S, nb)](
        x, w_gate, w_up, private, dept, weights, tau, z_ws, out, y_chunk, kept, seen, ps, gp, upp, pp, dmap, pmap, hc,
        T, h, n, x.stride(0), w_gate.stride(0), w_up.stride(0), pstride_d, pstride_e, pool_stride, pp_stride,
        up_slots, H=H, H_P2=consts["H_P2"], T_P2=t_p2, DIRECT=direct, **up_consts, num_warps=num_warps, **pdl_kw(x),
    )  # fmt: skip
    _dept_down_kernel[(triton.cdiv(H, bo), S, splits)](
        w_down_t, dept, z_ws, out, dp, dmap, hc, tau if tau_z is None else tau_z, tick, res,
        residual_out if tail else x, T, h, S, w_down_t.stride(0), pool_stride, res.stride(0),
        residual_out.stride(0) if tail else 0, down_slots,
        BLOCK_I=bi, BLOCK_O=bo, ROWS=rows, **consts, num_warps=num_warps, **pdl_kw(x),
    )  # fmt: skip
    return residual_out if tail else out


def _check_residual(residual, accumulate: bool, T: int, H: int, x) -> torch.Tensor | None:
    """With `residual` [T, H] (accumulate=True into a workspace row): the tensor the tail publishes into."""
    if residual is None:
        return None
    if not accumulate:
        raise ValueError("residual= publishes the row accumulate=True added into: give out= and accumulate=True")
    if residual.numel() != T * H or residual.stride(-1) != 1 or not residual.dtype.is_floating_point:
        raise ValueError(f"residual must be a float [T, H] = {(T, H)} tensor with a contiguous last dim")
    if residual.device != x.device:
        raise ValueError(f"residual must be on {x.device}")
    return torch.empty((T, H), dtype=residual.dtype, device=x.device)
