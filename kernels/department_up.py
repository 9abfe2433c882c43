"""The up/private stage of DeaMoE's department-grouped sparse decode (kernels/department_experts.py): the program
that computes a slot's kept activations u for a block of neurons and adds their share of z.

Owns `up_private_program`, the @triton.jit body of `_dept_up_private_kernel` (grid (S, h / BLOCK_N)) and of
`_dept_one_kernel`'s up/private programs. Program (slot s, block blk of BLOCK_N neurons; NB blocks a slot), department
d = dept[s], for every token t with a chosen expert in d (a = silu(x_t W_gate_d^T), K = {i : |a_i| >= tau[d]}):

    u[s,t,i] = a_i (x_t . W_up_d[i])                            i in K (and in the block), else 0
    z[s,t,:] += sum_j weights[s,t,j] sum_{i in block, i in K} u[s,t,i] P_{d,j}[i, :]

It reads its block of gate rows once for all T tokens, up rows only where kept, computes u for its neurons in registers
and adds their share of z atomically (z is linear in u: the product is split over neurons), reading the kept rows of
each chosen expert's P once for all T tokens (experts no token chose are skipped; a block with no kept neuron reads
no P and adds nothing). It also zeroes its chunk of y (y_chunk elements; 0 when accumulating), adds the kept and the
considered (token, neuron) counts into kept_ptr / seen_ptr (COUNT, SEEN); INDEXED: expert j of slot s is
private[private_slots[s, j]]; DIRECT: a department's gate (and, below up_slots, up) rows and an expert's private part
come from their pool slots, others from the host master copies, the host elements read added into hc_ptr.

Shape legend (kernels/department_experts.py's): T tokens, n experts per department, h department width, H hidden,
S slots.
"""

from __future__ import annotations

try:  # Triton is optional at import time; the kernels need it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

if triton is not None:

    @triton.jit
    def up_private_program(
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
