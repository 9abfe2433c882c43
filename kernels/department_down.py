"""The down stage of DeaMoE's department-grouped sparse decode (kernels/department_experts.py): the program that
multiplies a slot's z by its department's W_down_t into y, and the slot's and the step's tail.

Owns `down_program`, the @triton.jit body of `_dept_down_kernel` (grid (H / BLOCK_O, S, row splits)) and of
`_dept_one_kernel`'s down programs:

    y[t, :] += sum_i z[s,t,i] W_down_t_d[i, :]                  d = dept[s]

Program (column block cb, slot s, row split): rows [split * ROWS, +ROWS) of the slot's W_down_t (read once for all T
tokens, BLOCK_I rows at a time; z is dense unless tau_z), added into y atomically; per_slot programs a slot. z is
read through L2 (the up programs' atomic sums). ZMASK (tau_z [D]): z entries with |z| < tau_z[d] are dropped first
and a W_down_t row no token keeps is not read. DIRECT: the rows come from the department's pool slot when
0 <= slot < down_slots, else from the host master copy (the host elements read added into hc_ptr). PRE: the caller
loaded the rows (wd_pre, ROWS = BLOCK_I: the one launch loads them while the up programs run).

Tail: the last program of a slot (an acq_rel ticket: the others' z reads and y adds are visible to it) re-zeroes the
slot's z and its ticket for the next launch; the last of those (a second ticket, after the S slot tickets) with TAIL
publishes out = residual + y (rounded once to out's dtype) and zeroes y, and with ONE re-zeroes the one launch's done
counter.

Shape legend (kernels/department_experts.py's): T tokens, D departments, h department width, H hidden, S slots.
"""

from __future__ import annotations

try:  # Triton is optional at import time; the kernels need it.
    import triton
    import triton.language as tl

    from localmoe.kernels.rounding import round_to
except ImportError:  # pragma: no cover
    triton = None
    tl = None

if triton is not None:

    @triton.jit
    def down_program(
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
