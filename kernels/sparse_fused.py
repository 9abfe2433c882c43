"""Sparse decode in ONE launch: dense gate + threshold + up/down over the kept neurons, optionally offload-aware.

Owns `sparse_fused` (Triton launcher), its torch reference `sparse_fused_ref` and one Triton kernel
`_sparse_fused_kernel`, grid (T*k, ceil(I / BLOCK_I)); the per-token tail it shares with kernels/mxfp4_sparse.py (the
workspace, tickets, publishing, the shared expert's and the decoder layer's handles) is kernels/token_tail.py, its
4-bit row helpers kernels/int4_rows.py, its argument checks kernels/sparse_fused_args.py:

* program (tj, b) takes neurons [b*BLOCK_I, (b+1)*BLOCK_I) of expert e = expert_ids[tj]: one full-width load
  of its BLOCK_I x H gate tile (no serial loop over H: a batch-1 step is latency bound), g = silu(x . W_gate),
  keep n where |g_n| >= tau[e] (no sort, no index list: the mask stays in registers);
* if nothing is kept (at 85 % sparsity ~0.85^BLOCK_I of the programs) it skips the rest: no up/down loads, no
  atomics on y. Otherwise it loads W_up and W_down_t rows under the keep mask (a masked-off row issues no memory
  traffic, so only kept rows are read), h_n = w[tj] * g_n * (x . W_up[e, n]) in fp32, and atomically adds
  sum_n h_n W_down_t[e, n, :] (one [H] vector) and its kept count;
* reduction / output, two modes:
  - default (`accumulate=False`): the atomics go into a self-cleaning fp32 workspace (the launch before may have
    added into its sums row: moe_front's shared expert does); each program then takes a per-token ticket (acq_rel
    atomic, as in sparse_gate) and the last program of token t copies the workspace row into y[t] (in y's dtype:
    fp32, or bf16/fp16 to save the caller a cast), copies the k counts, and zeroes its workspace row and ticket
    for the next launch. Nobody has to clear y or count: no memset node.
  - `accumulate=True`: the atomics go straight into the caller's fp32 `out` and int32 `count`, which the caller
    zeroed (or pre-filled: e.g. out = the shared expert's output, count = a running total). No ticket, no tail.

Offload-aware addressing (optional): with `slot_table` [E] (expert -> slot in a device pool, -1 when absent),
`pool_gate/pool_up/pool_down_t` [S, I, H] on the device, and w_gate/w_up/w_down_t the host master copies [E, I, H]
(pinned host memory on CUDA, read through unified addressing), each program picks its base pointer once
(`tl.where` on two scalar pointers): the pool slot when resident, else the host copy directly, so for an absent
expert only its gate rows and its kept up/down rows cross PCIe. tau stays indexed by expert id.

Decoder-layer tail (optional, default mode only): with `shared=SharedExpert(...)` T more programs per neuron
block run a dense expert added to every token (Qwen3.5's shared expert: threshold 0, its weight the sigmoid gate
from kernels/moe_front.py) beside the routed ones, and with `residual=` the tail writes y = residual + moe output:
the shared expert's two launches and the residual add go into this one.

int4 experts (optional, `QUANT`): w_gate, w_up and w_down_t given as `Int4Tensor`s (kernels/int4.py: packed
[E, I, H/2] uint8, two 4-bit q per byte, and per-group bf16 scale / minimum [E, I, H/G], w = q * scale + minimum).
The program reads its BLOCK_I packed gate rows (one full-width load) and their scales; z_n = sum_g scale[n,g]
(sum_{j in g} q x) + minimum[n,g] (sum_{j in g} x), so the gate has no per-element scale multiply. Kept up rows the
same way; kept down rows are dequantized per element, weighted by h and summed into y as in the bf16 path (masked-off
rows still issue no loads). Offload works as above with Int4Tensor pools beside Int4Tensor master copies: each program
picks the packed base, the scale base and the minimum base of each projection together (pool slot or host master;
the gate table for gates), each tensor with its own expert stride, so an absent expert's gate bytes + scales and its
kept rows' bytes + scales cross PCIe. No `shared=` (the caller runs the shared expert in kernels/moe_front.py);
every other mode (accumulate, workspace, residual, stats) is the same.

Gate predictor (optional, `predictor=GatePredictor(...)` from kernels/gate_predictor.py, issue #23; a constexpr mode,
compiled out without it): stages 2 + 3 of the department-shared predictor inside the same program. Program (tj, b)
of expert e (the predictor's id: `predictor.experts[tj]` in copy mode, else expert_ids[tj]) loads z[t, dept_of[e],
:r] (written by `department_basis`, the launch before) and C_e's BLOCK_I x r int8 rows with their scales and fp16
thresholds, and makes its candidates cand = |silu(sC * (qC_e . z))| >= tau'_e (a threshold a neuron). The gate
tile (bf16 or int4: packed bytes and scales alike) is loaded under the candidates' row mask, so a non-candidate's
gate row issues no memory traffic, keep = cand & (|g| >= tau[e]), and a block without candidates stops after stage
2. Everything else is as above; the shared expert's programs stay dense (no C rows). The row stats count the gate
rows actually read (the candidates): the count words of the workspace then carry kept + (candidates << 16) (I <
2^15), so the workspace keeps its size. tau' = 0 everywhere makes every neuron a candidate: the launch without a
predictor. C and z are not counted as weight rows.

One launch, fixed grid and output sizes, no host sync: CUDA-graph capturable (pass `out=`, `count=` and
`workspace=` to keep every address fixed across replays).

Launch parameters: the BLOCK_I x next_pow2(H) tiles live in registers. sm_90 builds (ptxas, bf16) stay spill-free
and at >= 127 registers only up to 64 tile elements per thread (BLOCK_I * H_P2 / (32 * num_warps) <= 64), e.g.
H 2048: BLOCK_I 8 / 8 warps (127 regs), 4 / 8 (64 regs); H 3072: 8 / 16, 4 / 8. BLOCK_I 8 / 4 warps at H 2048
already needs 248 registers; 16 / 4 spills. int4 tiles hold as many elements (NG_P2 * G = H_P2 per row) but need
more registers (H200, Triton 3.6, H 2048: 8 / 8 warps 128 vs 64 for bf16, 4 / 8 64; 16 / 8 spills), so int4
wants its own tuned BLOCK_I / num_warps. The predictor's BLOCK_I x next_pow2(r) C tile is small beside it (r 64, 8 / 8
warps: 2 elements a thread): Triton 3.9's sm_90 build of H 2048 bf16 8 / 8 is spill-free with and without it (178
registers without, 188 with, 117 with copy-mode ids and row stats; cuobjdump --dump-resource-usage).

Shape legend: T = tokens, k = experts per token, E = experts, I = expert width (neurons), H = hidden, S = slots,
G = int4 group size along H, NG = H / G groups per row, NG_P2 = next_pow2(NG).
Weight layout (expert store contract): [E, I, H] (pools [S, I, H]) with rows contiguous (stride(2) == 1,
stride(1) == H), any expert stride; w_down_t is W_down transposed (one neuron's down weights contiguous). int4: packed
[E, I, H/2] and scale / minimum [E, I, NG] (pools [S, I, H/2], [S, I, NG]), each with contiguous rows, any expert
stride.
"""

from __future__ import annotations

import torch

from localmoe.kernels.checks import HostPointer, check_routing, tokens_and_experts
from localmoe.kernels.gate_predictor import GatePredictor, check_predictor
from localmoe.kernels.int4_rows import int4_mode, routed_fp32, scale_min
from localmoe.kernels.nf4 import Nf4Tensor, nf4_code
from localmoe.kernels.sparse_fused_args import check_offload, check_stats, check_weights, out_buffers
from localmoe.kernels.token_tail import SharedExpert, check_tail, tail_buffers

try:  # Triton is optional at import time; the launcher needs it.
    import triton
    import triton.language as tl

    from localmoe.kernels.int4_rows import int4_group_dots, int4_weighted_rows
    from localmoe.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_kw
    from localmoe.kernels.token_tail import last_of_token, publish_token, publish_totals
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------------------------
# torch reference
# ----------------------------------------------------------------------------------------------------------
def sparse_fused_ref(x, w_gate, w_up, w_down_t, expert_ids, weights, tau, candidates=None):
    """Reference in fp32 torch. Returns (y [T,H] fp32, count [T,k] int32 kept neurons per routed expert).

    y[t] = sum_j w[t,j] sum_{n: |g_n| >= tau[e]} g_n (x[t] . W_up[e,n]) W_down_t[e,n,:], g = silu(x[t] . W_gate[e]),
    e = expert_ids[t,j]; every tensor is read at its expert id (the resident layout). The weights are [E,I,H] tensors
    or Int4Tensors (dequantized to fp32: q * scale + minimum, what the kernel's QUANT mode computes with; an
    Nf4Tensor code[q] * absmax). `candidates` (bool [T,k,I], the gate predictor's: kernels/gate_predictor.py
    `candidates_ref`): only those neurons may be kept (the `predictor=` launch)."""
    eid = expert_ids.long()
    xf = x.float()
    g = torch.nn.functional.silu(torch.einsum("th,tkih->tki", xf, routed_fp32(w_gate, eid)))  # [T,k,I]
    keep = g.abs() >= tau.float()[eid].unsqueeze(-1)
    if candidates is not None:
        keep &= candidates
    u = torch.einsum("th,tkih->tki", xf, routed_fp32(w_up, eid))
    h = torch.where(keep, g * u, torch.zeros((), device=x.device)) * weights.float().unsqueeze(-1)
    y = torch.einsum("tki,tkih->th", h, routed_fp32(w_down_t, eid))
    return y, keep.sum(-1).to(torch.int32)


# ----------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _sparse_fused_kernel(
        x_ptr,  # [T, H] any float dtype, row stride stride_xt
        wg_ptr,  # [E, I, H] resident weights, or the host master copies when OFFLOAD; QUANT: packed [E, I, H/2] uint8
        wu_ptr,  # [E, I, H]
        wd_ptr,  # [E, I, H] (W_down transposed)
        pg_ptr,  # [S, I, H] device pool (OFFLOAD only; else any valid pointer); QUANT: packed [S, I, H/2] uint8
        pu_ptr,  # [S, I, H]
        pd_ptr,  # [S, I, H]
        slot_ptr,  # [E] int32/int64 expert -> slot, -1 absent (OFFLOAD only)
        eid_ptr,  # [T*k] int32/int64
        rw_ptr,  # [T*k] routing weights, any float
        tau_ptr,  # [E] fp32
        y_ptr,  # [T, H]: FINALIZE: written (any float dtype); else fp32, accumulated into
        cnt_ptr,  # [T*k] int32: FINALIZE: written; else accumulated into
        acc_ptr,  # [T, H] fp32 workspace, zero (or pre-added into) between launches (FINALIZE only)
        cws_ptr,  # [T*k] int32 workspace, zero between launches (FINALIZE only)
        tick_ptr,  # [T] int32 tickets, zero between launches (FINALIZE only)
        kept_ptr,  # int64 running total of kept neurons (KEPT_TOTAL only)
        host_ptr,  # int64 running total of weight rows read from host memory (HOST_ROWS only)
        gslot_ptr,  # [E] int32/int64 expert -> gate slot in pg, -1 absent (GATE_TABLE only)
        rows_ptr,  # int64 running total of weight rows read, device and host (READ_ROWS only)
        swg_ptr,  # [I_S, H] shared expert gate (SHARED only)
        swu_ptr,  # [I_S, H] shared expert up
        swd_ptr,  # [I_S, H] shared expert down, transposed
        sw_ptr,  # [T] shared expert weight (sigmoid gate), any float
        res_ptr,  # [T, H] residual, contiguous, y's dtype (HAS_RES only)
        gsc_ptr,  # [E, I, NG] gate scales, rows contiguous (QUANT only; wg/wu/wd are then packed [E, I, H/2] uint8;
        #           OFFLOAD: the host masters' scales, like wg)
        gmn_ptr,  # [E, I, NG] gate minimums
        usc_ptr,  # [E, I, NG] up scales
        umn_ptr,  # [E, I, NG] up minimums
        dsc_ptr,  # [E, I, NG] down_t scales
        dmn_ptr,  # [E, I, NG] down_t minimums
        pgsc_ptr,  # [Sg, I, NG] gate pool scales, rows contiguous (QUANT and OFFLOAD only; pg is then packed)
        pgmn_ptr,  # [Sg, I, NG] gate pool minimums
        pusc_ptr,  # [S, I, NG] up pool scales
        pumn_ptr,  # [S, I, NG] up pool minimums
        pdsc_ptr,  # [S, I, NG] down_t pool scales
        pdmn_ptr,  # [S, I, NG] down_t pool minimums
        code_ptr,  # [16] fp32 NF4 codebook (NF4 only)
        z_ptr,  # [T, N, r] fp32: B_d x per (token, department) (PRED only)
        pc_ptr,  # [E_p, I, r] int8 the experts' private maps C, rows contiguous (PRED only)
        pcs_ptr,  # [E_p, I] fp32 C's row scales, contiguous (PRED only)
        ptau_ptr,  # [E_p, I] fp16 each neuron's predictor threshold tau', contiguous (PRED only)
        pdept_ptr,  # [E_p] int32/int64 each expert's department (PRED only)
        pexp_ptr,  # [T*k] int32/int64 the predictor's expert ids (PRED_IDS only: eid_ptr holds cache slots)
        I,
        I_S,  # shared expert width (SHARED only)
        TK,  # T * k: programs pid_tj >= TK are the shared expert's (one per token)
        K,  # experts per token
        stride_xt,
        stride_ge,
        stride_ue,
        stride_de,
        stride_pge,
        stride_pue,
        stride_pde,
        stride_gsc,  # expert strides of the six scale / minimum tensors (QUANT only)
        stride_gmn,
        stride_usc,
        stride_umn,
        stride_dsc,
        stride_dmn,
        stride_pgsc,  # expert (slot) strides of the six pool scale / minimum tensors (QUANT and OFFLOAD only)
        stride_pgmn,
        stride_pusc,
        stride_pumn,
        stride_pdsc,
        stride_pdmn,
        R,  # predictor rank r (PRED only)
        NDEPT,  # departments N (PRED only)
        stride_ce,  # C's expert stride (PRED only)
        H: tl.constexpr,
        H_P2: tl.constexpr,  # next power of two >= H: one full-width tile per program, no serial H loop
        BLOCK_I: tl.constexpr,
        K_P2: tl.constexpr,  # next power of two >= K
        OFFLOAD: tl.constexpr,
        FINALIZE: tl.constexpr,
        KEPT_TOTAL: tl.constexpr,
        HOST_ROWS: tl.constexpr,
        GATE_TABLE: tl.constexpr,  # gates have their own slot table (and pool size) apart from up/down
        READ_ROWS: tl.constexpr,
        SHARED: tl.constexpr,
        HAS_RES: tl.constexpr,
        QUANT: tl.constexpr,  # int4 weights: packed [E, I, H/2] bytes + per-group scale / minimum (no SHARED)
        G: tl.constexpr,  # QUANT: group size along H, a power of two
        NG_P2: tl.constexpr,  # QUANT: next power of two >= NG = H / G
        NF4: tl.constexpr,  # QUANT: bitsandbytes' NF4 bytes (w = code[q] * absmax; the minimums never read)
        PRED: tl.constexpr,  # gate predictor: only the candidates' gate rows are read
        PRED_IDS: tl.constexpr,  # PRED: the predictor's expert ids from pexp_ptr (else eid_ptr's)
        R_P2: tl.constexpr,  # PRED: next power of two >= r
        CAND_ROWS: tl.constexpr,  # PRED and FINALIZE with host/read row stats: count words carry candidates << 16
        PDL: tl.constexpr,
    ):
        if PDL:  # programmatic dependent launch (kernels/pdl.py): everything here follows the wait
            gdc_wait()
            gdc_launch_dependents()
        pid_tj = tl.program_id(0)  # one (token, routed expert) pair; SHARED: then one shared expert per token
        pid_i = tl.program_id(1)  # one block of BLOCK_I neurons
        if SHARED:
            is_sh = pid_tj >= TK
            tj = tl.minimum(pid_tj, TK - 1)  # shared programs read a valid (unused) routed slot
            t = tl.where(is_sh, pid_tj - TK, pid_tj // K)
        else:
            tj = pid_tj
            t = pid_tj // K
        e = tl.load(eid_ptr + tj).to(tl.int64)
        # ---- where this expert's rows live: device pool slot, host master copy, or the resident tensors ----
        if OFFLOAD:
            s = tl.load(slot_ptr + e).to(tl.int64)
            res = s >= 0
            s = tl.maximum(s, 0)
            if GATE_TABLE:
                gs = tl.load(gslot_ptr + e).to(tl.int64)
                g_base = tl.where(gs >= 0, pg_ptr + tl.maximum(gs, 0) * stride_pge, wg_ptr + e * stride_ge)
            else:
                g_base = tl.where(res, pg_ptr + s * stride_pge, wg_ptr + e * stride_ge)
            u_base = tl.where(res, pu_ptr + s * stride_pue, wu_ptr + e * stride_ue)
            d_base = tl.where(res, pd_ptr + s * stride_pde, wd_ptr + e * stride_de)
            if QUANT:  # int4: each row's scales and minimums live where its packed bytes do (same slot choice)
                if GATE_TABLE:
                    g_res = gs >= 0
                    g_s = tl.maximum(gs, 0)
                else:
                    g_res = res
                    g_s = s
                g_sc = tl.where(g_res, pgsc_ptr + g_s * stride_pgsc, gsc_ptr + e * stride_gsc)
                g_mn = tl.where(g_res, pgmn_ptr + g_s * stride_pgmn, gmn_ptr + e * stride_gmn)
                u_sc = tl.where(res, pusc_ptr + s * stride_pusc, usc_ptr + e * stride_usc)
                u_mn = tl.where(res, pumn_ptr + s * stride_pumn, umn_ptr + e * stride_umn)
                d_sc = tl.where(res, pdsc_ptr + s * stride_pdsc, dsc_ptr + e * stride_dsc)
                d_mn = tl.where(res, pdmn_ptr + s * stride_pdmn, dmn_ptr + e * stride_dmn)
        else:
            g_base = wg_ptr + e * stride_ge
            u_base = wu_ptr + e * stride_ue
            d_base = wd_ptr + e * stride_de
        rows = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)  # [BLOCK_I]
        if SHARED:
            g_base = tl.where(is_sh, swg_ptr, g_base)
            u_base = tl.where(is_sh, swu_ptr, u_base)
            d_base = tl.where(is_sh, swd_ptr, d_base)
            rmask = rows < tl.where(is_sh, I_S, I)
        else:
            rmask = rows < I
        cols = tl.arange(0, H_P2)  # [H_P2]
        cmask = cols < H
        if QUANT:
            tl.static_assert(not SHARED, "int4 weights: no shared expert")
            NG = H // G  # groups per row (constexpr)
            gi = tl.arange(0, NG_P2)  # [NG_P2] group
            ji = tl.arange(0, G // 2)  # [G/2] byte within the group
            gm = gi < NG
            gcol = gi[:, None] * G + tl.arange(0, G)[None, :]  # [NG_P2, G]: column h = g * G + i of x and y
            # byte (n, g, j) of a packed row: n * H/2 + g * G/2 + j  [BLOCK_I, NG_P2, G/2]
            poff = rows.to(tl.int64)[:, None, None] * (H // 2) + (gi[None, :, None] * (G // 2) + ji[None, None, :])
            soff = rows.to(tl.int64)[:, None] * NG + gi[None, :]  # [BLOCK_I, NG_P2] (scale, minimum)
        else:
            roff = rows.to(tl.int64)[:, None] * H + cols[None, :]  # [BLOCK_I, H_P2]
        # ---- stage 2 (PRED): candidates |silu(C_e . z_d(e))| >= tau'; only their gate rows are read ----
        if PRED:
            if PRED_IDS:  # eid_ptr holds cache slots (copy mode): C and dept_of are indexed by expert id
                pe = tl.load(pexp_ptr + tj).to(tl.int64)
            else:
                pe = e
            dpt = tl.load(pdept_ptr + pe).to(tl.int64)
            rr = tl.arange(0, R_P2)
            rrm = rr < R
            zd = tl.load(z_ptr + (t.to(tl.int64) * NDEPT + dpt) * R + rr, mask=rrm, other=0.0)  # [R_P2] fp32
            if SHARED:  # the shared expert's programs are dense: no predictor rows read
                crm = rows < tl.where(is_sh, 0, I)
            else:
                crm = rows < I
            cp = tl.load(
                pc_ptr + pe * stride_ce + rows.to(tl.int64)[:, None] * R + rr[None, :],
                mask=crm[:, None] & rrm[None, :],
                other=0.0,
            )  # [BLOCK_I, R_P2]
            csc = tl.load(pcs_ptr + pe * I + rows, mask=crm, other=0.0)  # [BLOCK_I] fp32
            ctp = tl.load(ptau_ptr + pe * I + rows, mask=crm, other=0.0).to(tl.float32)  # [BLOCK_I] tau' a neuron
            zp = tl.sum(cp.to(tl.float32) * zd[None, :], axis=1) * csc  # [BLOCK_I]
            grow = (tl.abs(zp / (1.0 + tl.exp(-zp))) >= ctp) & rmask  # |silu|
            if SHARED:
                grow = tl.where(is_sh, rmask, grow)
            nc = tl.sum(grow.to(tl.int32), axis=0)
        else:
            grow = rmask  # every row of the block: the gate tile is read whole
            nc = 1  # a constant: the test below is compiled out
        if nc > 0:  # a block without candidates reads nothing more
            if QUANT:
                # ---- gate GEMV for BLOCK_I neurons (the only dense read): packed bytes + per-group scale / min ----
                xg = tl.load(x_ptr + t.to(tl.int64) * stride_xt + gcol, mask=gm[:, None], other=0.0)  # [NG_P2, G]
                xe, xo = tl.split(tl.reshape(xg, [NG_P2, G // 2, 2]))  # x[2j], x[2j + 1] of each group: [NG_P2, G/2]
                pg = tl.load(g_base + poff, mask=grow[:, None, None] & gm[None, :, None], other=0)
                sm = grow[:, None] & gm[None, :]
                # scale / minimum bases: OFFLOAD's per-program choice above, else the resident tensors at e (a constexpr
                # choice: only the taken side is compiled)
                sg = tl.load((g_sc if OFFLOAD else gsc_ptr + e * stride_gsc) + soff, mask=sm, other=0.0)
                if not NF4:
                    mg = tl.load((g_mn if OFFLOAD else gmn_ptr + e * stride_gmn) + soff, mask=sm, other=0.0)
            else:
                # ---- gate GEMV for BLOCK_I neurons (the only dense read) ----
                xv = tl.load(x_ptr + t.to(tl.int64) * stride_xt + cols, mask=cmask, other=0.0).to(tl.float32)
                wg = tl.load(g_base + roff, mask=grow[:, None] & cmask[None, :], other=0.0)
            tau = tl.load(tau_ptr + e)
            rw = tl.load(rw_ptr + tj).to(tl.float32)
            if SHARED:  # the shared expert is dense (threshold 0) and weighted by its gate
                tau = tl.where(is_sh, 0.0, tau)
                rw = tl.where(is_sh, tl.load(sw_ptr + t).to(tl.float32), rw)
            if QUANT:  # z_n = sum_g scale[n,g] (sum_{j in g} q x) + minimum[n,g] (sum_{j in g} x)
                xs = tl.sum(xe.to(tl.float32) + xo.to(tl.float32), axis=1)  # [NG_P2] sum of x over each group
                if NF4:  # z_n = sum_g absmax[n,g] (sum_{j in g} code[q] x)
                    z = tl.sum(sg.to(tl.float32) * int4_group_dots(pg, xe, xo, code_ptr, NF4), axis=1)
                else:
                    z = tl.sum(
                        sg.to(tl.float32) * int4_group_dots(pg, xe, xo, code_ptr, NF4)
                        + mg.to(tl.float32) * xs[None, :],
                        axis=1,
                    )
            else:
                z = tl.sum(wg.to(tl.float32) * xv[None, :], axis=1)  # [BLOCK_I]
            g = z / (1.0 + tl.exp(-z))  # silu
            keep = (tl.abs(g) >= tau) & grow
            nk = tl.sum(keep.to(tl.int32), axis=0)
            if FINALIZE:
                ydst = acc_ptr
                cdst = cws_ptr
            else:
                ydst = y_ptr
                cdst = cnt_ptr
            # ---- up/down over the kept rows only; a program with nothing kept does no further traffic ----
            if nk > 0:
                if QUANT:
                    mk = keep[:, None, None] & gm[None, :, None]
                    ks = keep[:, None] & gm[None, :]
                    # every tile issued before any arithmetic: one memory round trip for the kept bytes and scales
                    pu = tl.load(u_base + poff, mask=mk, other=0)
                    pd = tl.load(d_base + poff, mask=mk, other=0)
                    su = tl.load((u_sc if OFFLOAD else usc_ptr + e * stride_usc) + soff, mask=ks, other=0.0)
                    sd = tl.load((d_sc if OFFLOAD else dsc_ptr + e * stride_dsc) + soff, mask=ks, other=0.0)
                    if NF4:  # no minimums
                        mu = su
                        md = sd
                    else:
                        mu = tl.load((u_mn if OFFLOAD else umn_ptr + e * stride_umn) + soff, mask=ks, other=0.0)
                        md = tl.load((d_mn if OFFLOAD else dmn_ptr + e * stride_dmn) + soff, mask=ks, other=0.0)
                    zu = su.to(tl.float32) * int4_group_dots(pu, xe, xo, code_ptr, NF4)  # [BLOCK_I, NG_P2]
                    if not NF4:
                        zu += mu.to(tl.float32) * xs[None, :]
                    h = tl.sum(zu, axis=1) * g * rw  # [BLOCK_I], 0 on dropped rows
                    # [NG_P2, G/2] each
                    ce, co = int4_weighted_rows(pd, sd.to(tl.float32), md.to(tl.float32), h, code_ptr, NF4)
                    # columns 2j and 2j + 1 interleaved back into [NG_P2, G]: contiguous, so the atomics vectorize as
                    # the bf16 path's do (two stride-2 atomic_adds measured 2-4x slower on an H200)
                    contrib = tl.reshape(tl.join(ce, co), [NG_P2, G])
                    # the mask spelled out at full [NG_P2, G] shape (gcol < H <=> gm): Triton 3.8's interpreter
                    # (TRITON_INTERPRET=1) applies a broadcast one-element mask to the first element only, so with
                    # one group per row (NG_P2 = 1: H <= 128) gm[:, None] dropped all of a row but its column 0
                    tl.atomic_add(ydst + t.to(tl.int64) * H + gcol, contrib, mask=gcol < H, sem="relaxed")
                else:
                    mk = keep[:, None] & cmask[None, :]
                    # both tiles issued before any arithmetic: one memory round trip for the kept bytes
                    wu = tl.load(u_base + roff, mask=mk, other=0.0)
                    wd = tl.load(d_base + roff, mask=mk, other=0.0)
                    h = tl.sum(wu.to(tl.float32) * xv[None, :], axis=1) * g * rw  # [BLOCK_I], 0 on dropped rows
                    contrib = tl.sum(wd.to(tl.float32) * h[:, None], axis=0)  # [H_P2]
                    tl.atomic_add(ydst + t.to(tl.int64) * H + cols, contrib, mask=cmask, sem="relaxed")
                if not PRED:
                    if SHARED:
                        nk = tl.where(is_sh, 0, nk)  # kept counts are the routed experts'
                    tl.atomic_add(cdst + tj, nk, sem="relaxed")
            if PRED:  # the count word: kept (+ candidates << 16 for the row stats), routed experts only
                cw = nk
                if CAND_ROWS:
                    cw += nc * 65536
                if SHARED:
                    cw = tl.where(is_sh, 0, cw)
                if cw != 0:
                    tl.atomic_add(cdst + tj, cw, sem="relaxed")
        if FINALIZE:
            # ---- the last program of token t publishes y[t] and count[t, :] and cleans the workspace ----
            tl.debug_barrier()  # this program's atomics precede the release below
            group = K + 1 if SHARED else K  # programs of token t per neuron block
            if last_of_token(tick_ptr, t, group * tl.num_programs(1)):
                c = publish_token(
                    acc_ptr, y_ptr, res_ptr, cnt_ptr, cws_ptr, tick_ptr, t, K, cols, cmask,
                    H=H, H_P2=H_P2, K_P2=K_P2, HAS_RES=HAS_RES, PACKED=CAND_ROWS,
                )  # fmt: skip
                if CAND_ROWS:  # the gate rows read: the candidates (kept in the count words' high half)
                    gate_rows = c >> 16
                    c = c & 0xFFFF
                else:
                    gate_rows = I
                # ---- running totals for stats, one atomic per token (no extra launch in the step) ----
                publish_totals(
                    c, t, K, gate_rows, eid_ptr, slot_ptr, gslot_ptr, kept_ptr, host_ptr, rows_ptr,
                    K_P2, KEPT_TOTAL, HOST_ROWS, GATE_TABLE, READ_ROWS,
                )  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------------------


def sparse_fused(
    x,
    w_gate,
    w_up,
    w_down_t,
    expert_ids,
    weights,
    tau,
    out=None,
    *,
    count=None,
    accumulate: bool = False,
    slot_table=None,
    pool_gate=None,
    pool_up=None,
    pool_down_t=None,
    workspace=None,
    kept_total=None,
    host_rows=None,
    gate_table=None,
    read_rows=None,
    shared: SharedExpert | None = None,
    residual=None,
    predictor: GatePredictor | None = None,
    BLOCK_I: int = 8,
    num_warps: int = 8,
    maxnreg: int | None = None,
):
    """Gate + threshold + up/down of the k routed experts of each token, one launch. Returns (y [T,H], count [T,k]).

    x [T,H] (bf16/fp16/fp32, last dim contiguous); w_gate/w_up/w_down_t [E,I,H] (rows contiguous);
    expert_ids [T,k] int32/int64; weights [T,k] any float (final routing weights, applied after down);
    tau [E] fp32 (keep neuron n of expert e where |silu(x . W_gate[e,n])| >= tau[e]).

    y[t] = sum_j weights[t,j] sum_{kept n} g_n (x[t] . W_up[e,n]) W_down_t[e,n,:]; count[t,j] = kept neurons.

    * accumulate=False (default): `out` (optional [T,H] bf16/fp16/fp32 contiguous, default fp32) and `count`
      (optional int32 [T,k]) are overwritten; nothing needs zeroing (self-cleaning `workspace`, see
      `fused_workspace`).
    * accumulate=True: `out` (fp32 [T,H]) and `count` (int32 [T,k]) are required and added to; the caller zeroes
      them (or pre-fills out, e.g. with the shared expert's output).
    * offload: `slot_table` [E] int32/int64 (slot in the pools, -1 when absent; values must be < S),
      `pool_gate/pool_up/pool_down_t` [S,I,H] on x's device, each with the dtype of the matching master; then
      w_gate/w_up/w_down_t are the master copies, on x's device or in host memory (pinned when x is on CUDA).
      Absent experts are read from the master copies in place (only gate rows and kept rows cross PCIe).
      With `gate_table` [E] (gate slot in pool_gate, -1 when absent) the gates have their own table and pool_gate
      its own slot count [Sg,I,H]: a gate can be resident while its expert's up/down rows are not (the gate is
      read whole for every routed expert, the up/down rows only where kept, so VRAM holds gates first).

    * stats (accumulate=False only): `kept_total` (int64 one-element tensor) += the launch's kept neurons;
      `host_rows` (int64 one-element, offload only) += the weight rows read from host memory (I gate rows + 2 per
      kept neuron of each absent routed expert); `read_rows` (int64 one-element) += all weight rows read (I + 2 per
      kept neuron of each routed expert, resident or not). Added in the kernel's tail: no extra launch in a
      captured step. With a predictor, the gate rows counted are its candidates' (instead of I).

    * decoder-layer tail (accumulate=False only): `shared` (SharedExpert) adds a dense expert to every token, run
      by T more programs; `residual` ([T,H] in out's dtype, contiguous) makes y = residual + the block's output.

    * int4 experts: w_gate, w_up and w_down_t all `Int4Tensor` (logically [E,I,H]; packed [E,I,H/2] uint8 and
      scale / minimum [E,I,H/G] float, rows contiguous, one power-of-two G for the three) on x's device. With
      offload the pools are Int4Tensors too (logically [S,I,H], pool_gate [Sg,I,H] with gate_table) on x's device,
      with their masters' group size and scale / minimum dtypes, any expert stride per part; the masters (each part)
      on x's device or in host memory (pinned when x is on CUDA). host_rows still counts rows (an int4 row: H/2
      bytes + its H/G scales and H/G minimums). Not with `shared=`; everything else as above.

    * gate predictor: `predictor` (kernels/gate_predictor.py `GatePredictor`): z [T,N,r] fp32 contiguous (from
      `department_basis` this step), C [E_p,I,r] int8 with contiguous rows and its fp32 row scales C_scale [E_p,I],
      tau_rows [E_p,I] fp16, dept_of [E_p] int32/int64, and in copy mode (expert_ids hold cache slots) experts
      [T,k], the expert ids C, C_scale, tau_rows and dept_of are indexed by (else E_p must be E). Only neurons with
      |silu(sC_e * (qC_e . z_d(e)))| >= tau_rows[e] are candidates: only their gate rows are read and only they can
      be kept. Any r (padded to a power of two with a mask), N >= 1; with host_rows / read_rows, I < 32768. Every
      mode above (int4 included).

    Fixed grid (T*k [+ T], ceil(max(I, I_s)/BLOCK_I)), no host sync: CUDA-graph capturable. `maxnreg` caps the
    registers per thread (more programs resident per SM; a tuned launch parameter like BLOCK_I and num_warps).
    """
    if triton is None:
        raise RuntimeError("sparse_fused needs triton")
    quant = int4_mode(w_gate, w_up, w_down_t)
    T, H, E, I = tokens_and_experts(x, w_gate.packed if quant else w_gate)
    if x.dtype not in _FLOAT_DTYPES or x.stride(1) != 1:
        raise ValueError(f"x must be bf16/fp16/fp32 with a contiguous last dim, got {x.dtype} strides {x.stride()}")
    dev = x.device
    offload = slot_table is not None
    pools = (pool_gate, pool_up, pool_down_t)
    masters = (("w_gate", w_gate), ("w_up", w_up), ("w_down_t", w_down_t))
    check_weights(masters, pools, quant, offload, shared is not None, E, I, H, dev)
    if offload:
        pt = check_offload(masters, pools, slot_table, gate_table, quant, E, I, H, dev)  # the pools' base tensors
    k = check_routing(expert_ids, weights, tau, T, E, dev)
    out, count = out_buffers(out, count, accumulate, T, H, k, dev)
    check_stats(kept_total, host_rows, read_rows, gate_table, accumulate, offload, dev)
    I_s = check_tail(shared, residual, accumulate, T, H, x, out)
    pred = check_predictor(predictor, x, T, k, E, I)
    cand_rows = predictor is not None and not accumulate and (host_rows is not None or read_rows is not None)
    if cand_rows and I >= 1 << 15:
        raise ValueError(f"the gate predictor counts rows for host_rows / read_rows up to I = 32767, got I = {I}")
    if T == 0 or k == 0:
        if shared is not None or residual is not None:
            raise ValueError("shared= and residual= need at least one token and one routed expert")
        if not accumulate:
            out.zero_()
            count.zero_()
        return out, count
    bi = max(1, min(triton.next_power_of_2(BLOCK_I), triton.next_power_of_2(max(I, I_s))))
    npi = triton.cdiv(max(I, I_s), bi)  # neuron blocks: the grid's second dimension
    acc, cws, tick = tail_buffers(out, count, workspace, accumulate, dev, T, H, k)
    cuda = dev.type == "cuda"

    def ptr(w):  # host master copies: the launcher gets their (unified) address
        return HostPointer(w) if cuda and w.device.type == "cpu" else w

    nf4 = isinstance(w_gate, Nf4Tensor)
    if quant:  # the packed bytes take the weights' place; scale / minimum pointers and expert strides beside them
        wg, wu, wd = (ptr(w.packed) for _, w in masters)
        es = [w.packed.stride(0) for _, w in masters]
        qt = [ptr(t) for _, w in masters for t in scale_min(w)]
        qs = [t.stride(0) for _, w in masters for t in scale_min(w)]
        G = w_gate.group
        ng_p2 = triton.next_power_of_2(H // G)
    else:
        wg, wu, wd = (ptr(w) for _, w in masters)
        es = [w.stride(0) for _, w in masters]
        qt, qs, G, ng_p2 = [wg, wg, wu, wu, wd, wd], [0] * 6, 2, 1  # dummies, never read
    if offload:
        pg, pu, pd = pt
        st = slot_table
        sp = [p.stride(0) for p in pt]
    else:  # dummies, never read
        pg, pu, pd, st = wg, wu, wd, expert_ids
        sp = (0, 0, 0)
    if quant and offload:  # the pools' scale / minimum pointers and slot strides
        pqt = [t for p in pools for t in scale_min(p)]
        pqs = [t.stride(0) for t in pqt]
    else:  # dummies, never read
        pqt, pqs = qt, [0] * 6
    sh = shared if shared is not None else SharedExpert(wg, wu, wd, weights)  # dummies, never read
    _sparse_fused_kernel[(T * k + (T if shared is not None else 0), npi)](
        x,
        wg,
        wu,
        wd,
        pg,
        pu,
        pd,
        st,
        expert_ids.contiguous(),
        weights.contiguous(),
        tau,
        out,
        count,
        acc,
        cws,
        tick,
        kept_total if kept_total is not None else count,
        host_rows if host_rows is not None else count,
        gate_table if gate_table is not None else st,
        read_rows if read_rows is not None else count,
        sh.w_gate,
        sh.w_up,
        sh.w_down_t,
        sh.weight,
        residual if residual is not None else out,
        *qt,
        *pqt,
        nf4_code(dev) if nf4 else x,
        *pred["tensors"],
        I,
        I_s,
        T * k,
        k,
        x.stride(0),
        *es,
        *sp,
        *qs,
        *pqs,
        *pred["scalars"],
        H=H,
        H_P2=triton.next_power_of_2(H),
        BLOCK_I=bi,
        K_P2=triton.next_power_of_2(k),
        OFFLOAD=offload,
        FINALIZE=not accumulate,
        KEPT_TOTAL=kept_total is not None,
        HOST_ROWS=host_rows is not None,
        GATE_TABLE=gate_table is not None,
        READ_ROWS=read_rows is not None,
        SHARED=shared is not None,
        HAS_RES=residual is not None,
        QUANT=quant,
        G=G,
        NG_P2=ng_p2,
        NF4=nf4,
        PRED=predictor is not None,
        PRED_IDS=predictor is not None and predictor.experts is not None,
        R_P2=pred["R_P2"],
        CAND_ROWS=cand_rows,
        num_warps=num_warps,
        **pdl_kw(x),
        **({"maxnreg": int(maxnreg)} if maxnreg else {}),
    )
    return out, count
