"""GPT-OSS's sparse decode over MXFP4 experts in ONE launch: gate + bias + clamped SwiGLU + threshold, then the kept
up / down rows, optionally offload-aware.

Owns `sparse_mxfp4` (Triton launcher), its torch reference `sparse_mxfp4_ref` and the kernel `_sparse_mxfp4_kernel`,
grid (T*k, I / BLOCK_I); the MXFP4 row helpers it reads its weights with are kernels/mxfp4_rows.py's. The structure
and modes are kernels/sparse_fused.py's (the ticket tail `last_of_token` / `publish_token` and the workspace split
`tail_buffers` of kernels/token_tail.py are shared); the weights are `Mxfp4Tensor`s (kernels/mxfp4.py): gate / up
blocks [E, I, H/2] + scales [E, I, H/32] along rows, the transposed down blocks [E, I, H/2] + scales [E, I/32, H].

Program (tj, b), neurons n of [b*BLOCK_I, (b+1)*BLOCK_I) of expert e = expert_ids[tj]:
* gate: z_n = sum_blocks 2**(s - 127) * sum_{j in block} v_j x_j + b_gate[e, n] over the codes + scales of the
  BLOCK_I rows (the only dense read); a_n = min(z, limit) * sigmoid(alpha * min(z, limit)); keep |a_n| >= tau[e];
* nothing kept: done (the block-0 program still adds w * b_down[e]); else the kept up rows (codes + scales + bias,
  clamped to +-limit), h_n = w * (u_n + 1) * a_n in fp32, and the kept down_t rows summed into y: sum_n h_n W[n, :]
  with W[n, h] = v * 2**(scales[e, n // 32, h] - 127); the program with b = 0 adds w * b_down[e] (always: the bias
  is exact, never thresholded);
* codes are read as int32 words (8 codes each; the launcher passes the uint8 blocks viewed as int32, so every
  expert must start on a 4-byte boundary); H goes as two power-of-two parts of 32-blocks (NB = 90 at H 2880: 64 + 32,
  6.7 % padding), each one [BLOCK_I, blocks, 4] word tile, every part's loads issued before any is used; the kept
  up and down rows are loaded together, before the up dot;
* the rows are read and decoded by kernels/mxfp4_rows.py's helpers (`part_words`, `part_x`, `part_dot`,
  `part_down`): two codes a word at a time with no conversion instructions (`fp4_pair`), x (gate, up) or h (down)
  scaled by 2**63 so no product is subnormal;
* BLOCK_I divides 32, so a program's neurons share one down scale row (H bytes), loaded once.
Launch parameters (bench/mxfp4_kernel.py, H200, Triton 3.6, gpt-oss-20b experts, k 4, one bf16 token; RESULTS.md,
session 31): BLOCK_I 4, 4 warps: 69.1 / 64.4 / 56.7 / 47.1 µs at 0 / 50 / 70 / 85 %, the gate pass alone 29.4 µs;
8 / 8 (the default before x was loaded once a program) 93.4 / 91.0 / 88.0 / 77.7; 8 / 4 and 16 / 8 are slower at
every sparsity. Before x was loaded once (eight strided loads a part and projection) the best launch was 8 / 8:
66.9 / 64.5 / 63.5 / 56.7, gate pass 26.4. 0.79 TB/s dense against a 4.2 TB/s copy: ncu (before the pair decode and
the single x load) put the launch on the SM's L1 / shared-memory pipe (74 %) and instruction issue (~28M
warp-instructions a call), with DRAM at 7 % and occupancy register-bound at 37.5 %. A row-loop layout (x in
registers for the whole program, rows R at a time, down rows summed in registers: f608325) was slower.
Output modes, offload addressing, stats and the CUDA-graph contract are sparse_fused's: default a self-cleaning fp32
workspace with per-token tickets (the last program writes y[t] (+ residual) and the counts and re-zeroes it),
`accumulate=True` adds into the caller's fp32 `out` / int32 `count`; with `slot_table` (+ `gate_table`) each program
picks every part's base (blocks, scales) from its device pool slot or the host master copy. Biases are always read
at the expert id (kept on the device). One launch, fixed grid, no host sync: capturable.

Shape legend: T tokens, k experts per token, E experts, I expert width, H hidden, S pool slots, NB = H / 32.
"""

from __future__ import annotations

import torch

from localmoe.kernels.checks import HostPointer, _on_device, check_routing
from localmoe.kernels.mxfp4 import BLOCK, Mxfp4Tensor, dequant_mxfp4_ref
from localmoe.kernels.token_tail import tail_buffers

try:  # Triton is optional at import time; the launcher needs it.
    import triton
    import triton.language as tl

    from localmoe.kernels.mxfp4_rows import row_dot, row_down, row_words, row_x
    from localmoe.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_kw
    from localmoe.kernels.token_tail import last_of_token, publish_token, publish_totals
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None

ALPHA = 1.702  # gpt-oss config.swiglu_alpha
LIMIT = 7.0  # gpt-oss config.swiglu_limit
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INT_DTYPES = (torch.int32, torch.int64)
__all__ = ["ALPHA", "LIMIT", "sparse_mxfp4", "sparse_mxfp4_ref"]


# ----------------------------------------------------------------------------------------------------------
# torch reference
# ----------------------------------------------------------------------------------------------------------
def _routed(w: Mxfp4Tensor, eid) -> torch.Tensor:
    return dequant_mxfp4_ref(w.blocks[eid], w.scales[eid], w.along_rows, torch.float32)  # [T, k, I, H]


def sparse_mxfp4_ref(
    x, w_gate, w_up, w_down_t, b_gate, b_up, b_down, expert_ids, weights, tau, alpha=ALPHA, limit=LIMIT
):
    """Reference in fp32 torch. Returns (y [T, H] fp32, count [T, k] int32 kept neurons per routed expert).

    z = x . W_gate[e, n] + b_gate[e, n], g = min(z, limit), a = g * sigmoid(alpha * g), kept where |a| >= tau[e];
    u = clamp(x . W_up[e, n] + b_up[e, n], -limit, limit); y[t] = sum_j w[t, j] (sum_{kept n} (u + 1) a W_down_t[e, n]
    + b_down[e]), e = expert_ids[t, j]; the weights dequantized exactly (fp32)."""
    eid = expert_ids.long()
    xf = x.float()
    z = torch.einsum("th,tkih->tki", xf, _routed(w_gate, eid)) + b_gate.float()[eid]
    g = z.clamp(max=limit)
    a = g * torch.sigmoid(alpha * g)
    keep = a.abs() >= tau.float()[eid].unsqueeze(-1)
    u = (torch.einsum("th,tkih->tki", xf, _routed(w_up, eid)) + b_up.float()[eid]).clamp(-limit, limit)
    rw = weights.float()
    h = torch.where(keep, (u + 1) * a, torch.zeros((), device=x.device)) * rw.unsqueeze(-1)
    y = torch.einsum("tki,tkih->th", h, _routed(w_down_t, eid)) + torch.einsum("tk,tkh->th", rw, b_down.float()[eid])
    return y, keep.sum(-1).to(torch.int32)


# ----------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _sparse_mxfp4_kernel(
        x_ptr,  # [T, H] any float, row stride stride_xt
        gb_ptr,  # gate code words [E, I, H/8] int32 (OFFLOAD: the host masters)
        gs_ptr,  # gate scales [E, I, NB] uint8
        ub_ptr,  # up code words [E, I, H/8]
        us_ptr,  # up scales [E, I, NB]
        db_ptr,  # down_t code words [E, I, H/8]
        ds_ptr,  # down_t scales [E, I/32, H]
        pgb_ptr,  # the pools, same layouts with S (gate: Sg) slots (OFFLOAD only; else any valid pointer)
        pgs_ptr,
        pub_ptr,
        pus_ptr,
        pdb_ptr,
        pds_ptr,
        slot_ptr,  # [E] expert -> slot, -1 absent (OFFLOAD only)
        gslot_ptr,  # [E] expert -> gate slot, -1 absent (GATE_TABLE only)
        bg_ptr,  # [E, I] gate bias, contiguous, any float
        bu_ptr,  # [E, I] up bias
        bd_ptr,  # [E, H] down bias
        eid_ptr,  # [T*k] int32/int64
        rw_ptr,  # [T*k] routing weights, any float
        tau_ptr,  # [E] fp32
        y_ptr,  # [T, H]: FINALIZE: written (any float); else fp32, accumulated into
        cnt_ptr,  # [T*k] int32: FINALIZE: written; else accumulated into
        acc_ptr,  # [T, H] fp32 workspace (FINALIZE only)
        cws_ptr,  # [T*k] int32 workspace (FINALIZE only)
        tick_ptr,  # [T] int32 tickets (FINALIZE only)
        kept_ptr,  # int64 running totals (KEPT_TOTAL / HOST_ROWS / READ_ROWS only)
        host_ptr,
        rows_ptr,
        res_ptr,  # [T, H] residual, y's dtype (HAS_RES only)
        alpha,
        limit,
        I,
        K,
        stride_xt,
        s_gb,  # expert strides of the masters' parts (words for the codes), then slot strides of the pools'
        s_gs,
        s_ub,
        s_us,
        s_db,
        s_ds,
        s_pgb,
        s_pgs,
        s_pub,
        s_pus,
        s_pdb,
        s_pds,
        H: tl.constexpr,
        H_P2: tl.constexpr,  # the finalising tail's full-width row
        NB: tl.constexpr,  # H / 32 blocks per row
        NBP1: tl.constexpr,  # blocks of the first part (a power of two <= NB)
        NBP2: tl.constexpr,  # blocks of the second part (next power of two of NB - NBP1; 0: none)
        BLOCK_I: tl.constexpr,  # divides 32: the program's down rows share one scale row
        K_P2: tl.constexpr,
        OFFLOAD: tl.constexpr,
        GATE_TABLE: tl.constexpr,
        FINALIZE: tl.constexpr,
        KEPT_TOTAL: tl.constexpr,
        HOST_ROWS: tl.constexpr,
        READ_ROWS: tl.constexpr,
        HAS_RES: tl.constexpr,
        PDL: tl.constexpr,
        FLAT: tl.constexpr = 0,  # 0: [R, NBP, 4] word tiles; 1: gate / up as flat [R, 4 NBP] tiles; 2: the down too
    ):
        if PDL:  # programmatic dependent launch (kernels/pdl.py): everything here follows the wait
            gdc_wait()
            gdc_launch_dependents()
        tj = tl.program_id(0)
        pid_i = tl.program_id(1)
        t = tj // K
        e = tl.load(eid_ptr + tj).to(tl.int64)
        # ---- where each part of this expert lives: device pool slot, host master copy, or the resident stack ----
        if OFFLOAD:
            s = tl.load(slot_ptr + e).to(tl.int64)
            res = s >= 0
            s = tl.maximum(s, 0)
            if GATE_TABLE:
                gsl = tl.load(gslot_ptr + e).to(tl.int64)
                g_res = gsl >= 0
                g_s = tl.maximum(gsl, 0)
            else:
                g_res = res
                g_s = s
            g_b = tl.where(g_res, pgb_ptr + g_s * s_pgb, gb_ptr + e * s_gb)
            g_sc = tl.where(g_res, pgs_ptr + g_s * s_pgs, gs_ptr + e * s_gs)
            u_b = tl.where(res, pub_ptr + s * s_pub, ub_ptr + e * s_ub)
            u_sc = tl.where(res, pus_ptr + s * s_pus, us_ptr + e * s_us)
            d_b = tl.where(res, pdb_ptr + s * s_pdb, db_ptr + e * s_db)
            d_sc = tl.where(res, pds_ptr + s * s_pds, ds_ptr + e * s_ds)
        else:
            g_b = gb_ptr + e * s_gb
            g_sc = gs_ptr + e * s_gs
            u_b = ub_ptr + e * s_ub
            u_sc = us_ptr + e * s_us
            d_b = db_ptr + e * s_db
            d_sc = ds_ptr + e * s_ds
        rows = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
        rmask = rows < I
        x_row = x_ptr + t.to(tl.int64) * stride_xt
        # ---- gate for BLOCK_I neurons (the only dense read: every part's words in flight at once), bias, act ----
        FG: tl.constexpr = FLAT > 0  # gate / up as flat tiles (kernels/mxfp4_rows.py's flat helpers)
        FD: tl.constexpr = FLAT == 2  # the down too
        gw1 = row_words(g_b, rows, rmask, 0, NBP1, NB, FG)
        if NBP2 > 0:
            gw2 = row_words(g_b, rows, rmask, NBP1, NBP2, NB, FG)
        xs1 = row_x(x_row, 0, NBP1, NB, FG)
        z = row_dot(gw1, xs1, g_sc, rows, rmask, 0, NBP1, NB, FG)
        if NBP2 > 0:
            xs2 = row_x(x_row, NBP1, NBP2, NB, FG)
            z += row_dot(gw2, xs2, g_sc, rows, rmask, NBP1, NBP2, NB, FG)
        z += tl.load(bg_ptr + e * I + rows, mask=rmask, other=0.0).to(tl.float32)
        g = tl.minimum(z, limit)
        a = g / (1.0 + tl.exp(-alpha * g))
        keep = (tl.abs(a) >= tl.load(tau_ptr + e)) & rmask
        nk = tl.sum(keep.to(tl.int32), axis=0)
        rw = tl.load(rw_ptr + tj).to(tl.float32)
        if FINALIZE:
            ydst = acc_ptr + t.to(tl.int64) * H
            cdst = cws_ptr
        else:
            ydst = y_ptr + t.to(tl.int64) * H
            cdst = cnt_ptr
        if pid_i == 0:  # the down bias, always (exact): once per routed expert
            cols = tl.arange(0, H_P2)
            cm = cols < H
            bd = tl.load(bd_ptr + e * H + cols, mask=cm, other=0.0).to(tl.float32)
            tl.atomic_add(ydst + cols, rw * bd, mask=cm, sem="relaxed")
        # ---- up / down over the kept rows only, all issued before any is used (up parts first: fewer layout
        # conversions and barriers than up and down interleaved, sm_90 compile); nothing kept: no traffic ----
        if nk > 0:
            uw1 = row_words(u_b, rows, keep, 0, NBP1, NB, FG)
            if NBP2 > 0:
                uw2 = row_words(u_b, rows, keep, NBP1, NBP2, NB, FG)
            dw1 = row_words(d_b, rows, keep, 0, NBP1, NB, FD)
            if NBP2 > 0:
                dw2 = row_words(d_b, rows, keep, NBP1, NBP2, NB, FD)
            u = row_dot(uw1, xs1, u_sc, rows, keep, 0, NBP1, NB, FG)
            if NBP2 > 0:
                u += row_dot(uw2, xs2, u_sc, rows, keep, NBP1, NBP2, NB, FG)
            u += tl.load(bu_ptr + e * I + rows, mask=keep, other=0.0).to(tl.float32)
            u = tl.minimum(tl.maximum(u, -limit), limit)
            h = tl.where(keep, (u + 1.0) * a * rw, 0.0) * 9.223372036854775808e18  # 2**63 (and out per column)
            srow = d_sc + ((pid_i * BLOCK_I) // 32).to(tl.int64) * H  # the program's 32-neuron group's scale row
            row_down(dw1, h, ydst, srow, 0, NBP1, NB, FD)
            if NBP2 > 0:
                row_down(dw2, h, ydst, srow, NBP1, NBP2, NB, FD)
            tl.atomic_add(cdst + tj, nk, sem="relaxed")
        if FINALIZE:
            # ---- the last program of token t publishes y[t] and count[t, :] and cleans the workspace ----
            tl.debug_barrier()  # this program's atomics precede the release below
            if last_of_token(tick_ptr, t, K * tl.num_programs(1)):
                cols = tl.arange(0, H_P2)
                cmask = cols < H
                cnt = publish_token(
                    acc_ptr, y_ptr, res_ptr, cnt_ptr, cws_ptr, tick_ptr, t, K, cols, cmask, H, H_P2, K_P2, HAS_RES
                )
                publish_totals(
                    cnt, t, K, I, eid_ptr, slot_ptr, gslot_ptr, kept_ptr, host_ptr, rows_ptr,
                    K_P2, KEPT_TOTAL, HOST_ROWS, GATE_TABLE, READ_ROWS,
                )  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------------------
def sparse_mxfp4(
    x,
    w_gate: Mxfp4Tensor,
    w_up: Mxfp4Tensor,
    w_down_t: Mxfp4Tensor,
    b_gate,
    b_up,
    b_down,
    expert_ids,
    weights,
    tau,
    out=None,
    *,
    count=None,
    accumulate: bool = False,
    alpha: float = ALPHA,
    limit: float = LIMIT,
    slot_table=None,
    pool_gate: Mxfp4Tensor | None = None,
    pool_up: Mxfp4Tensor | None = None,
    pool_down_t: Mxfp4Tensor | None = None,
    gate_table=None,
    workspace=None,
    kept_total=None,
    host_rows=None,
    read_rows=None,
    residual=None,
    BLOCK_I: int = 4,
    num_warps: int = 4,
    maxnreg: int | None = None,
    flat: int = 0,
):
    """GPT-OSS's routed experts over MXFP4 weights, one launch. Returns (y [T, H], count [T, k]).

    x [T, H] bf16/fp16/fp32 (last dim contiguous); w_gate, w_up `Mxfp4Tensor`s along rows and w_down_t across
    (logically [E, I, H], I and H multiples of 32); b_gate, b_up [E, I] and b_down [E, H] float, contiguous, on x's
    device (read at the expert id, also when offloaded); expert_ids [T, k] int32/int64; weights [T, k] float (the
    routing weights); tau [E] fp32 (keep n where |a_n| >= tau[e]); alpha, limit: the clamped SwiGLU's constants.
    y and count as `sparse_mxfp4_ref`. Modes as kernels/sparse_fused.py's `sparse_fused`:
    * accumulate=False: `out` ([T, H] bf16/fp16/fp32 contiguous, default fp32) and `count` (int32 [T, k]) are
      overwritten through the self-cleaning `workspace` (`fused_workspace`); `residual` ([T, H], out's dtype) makes
      y = residual + the experts' output; `kept_total`, `read_rows` (and `host_rows` with offload) one-element int64
      running totals added in the tail.
    * accumulate=True: `out` (fp32) and `count` (int32) required, added to; no residual / totals.
    * offload: `slot_table` [E] (slot or -1), `pool_gate/pool_up/pool_down_t` Mxfp4Tensors [S, I, H] on x's device
      (pool_gate [Sg, I, H] with `gate_table` [E]); w_* are then the host master copies (pinned on CUDA) or on x's
      device. Each program reads every part of a resident expert from its slot, of an absent one from the master.
    BLOCK_I (a power of two <= 32: the program's neurons share one down scale row), num_warps, maxnreg and `flat` are
    launch parameters (defaults: the H200's best at gpt-oss shapes). `flat` 1 reads the gate and up rows as 2-D word
    tiles with x loaded per nibble position (no 3-D reshape of x or the words: kernels/mxfp4_rows.py's flat helpers;
    fewer layout conversions at gpt-oss shapes, bench/RESULTS.md), 2 the down rows too (eight strided atomic adds a
    part instead of the joined columns); 0 the 3-D tiles.
    Same sums in another order (fp32). CUDA-graph capturable.
    """
    if triton is None:
        raise RuntimeError("sparse_mxfp4 needs triton")
    masters = (("w_gate", w_gate, True), ("w_up", w_up, True), ("w_down_t", w_down_t, False))
    if not all(isinstance(w, Mxfp4Tensor) for _, w, _ in masters):
        raise ValueError("w_gate, w_up and w_down_t must be Mxfp4Tensors (localmoe.kernels.mxfp4)")
    if x.dim() != 2 or x.dtype not in _FLOAT_DTYPES or x.stride(1) != 1:
        raise ValueError(f"x must be bf16/fp16/fp32 [T, H] with a contiguous last dim, got {x.dtype} {tuple(x.shape)}")
    T, H = x.shape
    E, I = w_gate.shape[:2]
    dev = x.device
    offload = slot_table is not None
    pools = (pool_gate, pool_up, pool_down_t)
    if offload != all(p is not None for p in pools) or (not offload and any(p is not None for p in pools)):
        raise ValueError(
            "slot_table, pool_gate, pool_up and pool_down_t must be given together (offload) or not at all"
        )
    for name, w, rows in masters:
        _check_mx(name, w, E, I, H, rows, dev, allow_host=offload)
    for name, b, n in (("b_gate", b_gate, I), ("b_up", b_up, I), ("b_down", b_down, H)):
        if tuple(b.shape) != (E, n) or b.dtype not in _FLOAT_DTYPES or not b.is_contiguous() or b.device != dev:
            raise ValueError(
                f"{name} must be a contiguous float [E, {n}] = {(E, n)} tensor on {dev}, got {b.dtype} "
                f"{tuple(b.shape)} on {b.device}"
            )
    k = check_routing(expert_ids, weights, tau, T, E, dev)
    if offload:
        _check_pools(masters, pools, slot_table, gate_table, E, I, H, dev)
    elif gate_table is not None or host_rows is not None:
        raise ValueError("gate_table and host_rows belong to offloaded experts: they need slot_table")
    if accumulate and (out is None or count is None or out.dtype != torch.float32):
        raise ValueError("accumulate=True needs out= (fp32 [T, H]) and count= (int32 [T, k]) buffers")
    if accumulate and any(v is not None for v in (kept_total, host_rows, read_rows, residual)):
        raise ValueError(
            "kept_total, host_rows, read_rows and residual belong to the finalising tail: not with accumulate=True"
        )
    if out is None:
        out = torch.empty(T, H, dtype=torch.float32, device=dev)
    elif tuple(out.shape) != (T, H) or out.dtype not in _FLOAT_DTYPES or not out.is_contiguous() or out.device != dev:
        raise ValueError(f"out must be a contiguous bf16/fp16/fp32 [T, H] = {(T, H)} tensor on {dev}")
    if count is None:
        count = torch.empty(T, k, dtype=torch.int32, device=dev)
    elif tuple(count.shape) != (T, k) or count.dtype != torch.int32 or not count.is_contiguous() or count.device != dev:
        raise ValueError(f"count must be a contiguous int32 [T, k] = {(T, k)} tensor on {dev}")
    for name, tot in (("kept_total", kept_total), ("host_rows", host_rows), ("read_rows", read_rows)):
        if tot is not None and (tot.dtype != torch.int64 or tot.numel() != 1 or tot.device != dev):
            raise ValueError(f"{name} must be a one-element int64 tensor on {dev}")
    if residual is not None and (
        tuple(residual.shape) != (T, H)
        or residual.dtype != out.dtype
        or not residual.is_contiguous()
        or residual.device != dev
    ):
        raise ValueError(f"residual must be a contiguous {out.dtype} [T, H] = {(T, H)} tensor on {dev}")
    if BLOCK_I < 1 or BLOCK_I > BLOCK or BLOCK_I & (BLOCK_I - 1):
        raise ValueError(f"BLOCK_I must be a power of two <= {BLOCK}, got {BLOCK_I}")
    if int(flat) not in (0, 1, 2):
        raise ValueError(f"flat must be 0 (3-D word tiles), 1 (gate / up flat) or 2 (the down too), got {flat}")
    if T == 0 or k == 0:
        if not accumulate:
            out.copy_(residual) if residual is not None else out.zero_()
            count.zero_()
        return out, count
    acc, cws, tick = tail_buffers(out, count, workspace, accumulate, dev, T, H, k)
    cuda = dev.type == "cuda"

    def ptr(t):  # host master copies: the launcher gets their (unified) address
        return HostPointer(t) if cuda and t.device.type == "cpu" else t

    parts = [ptr(t) for _, w, _ in masters for t in _words(w)]
    strides = [t.stride(0) for _, w, _ in masters for t in _words(w)]
    if offload:
        pparts = [t for p in pools for t in _words(p)]
        pstrides = [t.stride(0) for t in pparts]
        st = slot_table
    else:  # dummies, never read
        pparts, pstrides, st = parts, [0] * 6, expert_ids
    NB = H // BLOCK
    nbp1 = 1 << (NB.bit_length() - 1)  # the largest power of two <= NB, then the rest rounded up
    nbp2 = triton.next_power_of_2(NB - nbp1) if NB > nbp1 else 0
    _sparse_mxfp4_kernel[(T * k, triton.cdiv(I, BLOCK_I))](
        x,
        *parts,
        *pparts,
        st,
        gate_table if gate_table is not None else st,
        b_gate,
        b_up,
        b_down,
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
        read_rows if read_rows is not None else count,
        residual if residual is not None else out,
        float(alpha),
        float(limit),
        I,
        k,
        x.stride(0),
        *strides,
        *pstrides,
        H=H,
        H_P2=triton.next_power_of_2(H),
        NB=NB,
        NBP1=nbp1,
        NBP2=nbp2,
        BLOCK_I=BLOCK_I,
        K_P2=triton.next_power_of_2(k),
        OFFLOAD=offload,
        GATE_TABLE=gate_table is not None,
        FINALIZE=not accumulate,
        KEPT_TOTAL=kept_total is not None,
        HOST_ROWS=host_rows is not None,
        READ_ROWS=read_rows is not None,
        HAS_RES=residual is not None,
        FLAT=int(flat),
        num_warps=num_warps,
        **pdl_kw(x),
        **({"maxnreg": int(maxnreg)} if maxnreg else {}),
    )
    return out, count


def _words(w: Mxfp4Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes as int32 words [E, I, H/8]: 8 codes each, the kernel's loads; scales as stored)."""
    return w.blocks.view(torch.int32), w.scales


def _check_mx(name, w, E, I, H, along_rows: bool, dev, allow_host: bool = False) -> None:
    """An Mxfp4Tensor logically [E, I, H] with `along_rows` as given: blocks [E, I, H/2] uint8 and scales ([E, I, H/32]
    along rows, [E, I/32, H] across) uint8, each with contiguous rows (any expert stride); on `dev`, or with
    `allow_host` host copies (pinned on CUDA)."""
    if w.along_rows != along_rows:
        raise ValueError(f"{name} must have along_rows={along_rows} (gate / up along rows, the down transposed across)")
    if I % BLOCK or H % BLOCK:
        raise ValueError(f"MXFP4 experts need I and H divisible by {BLOCK}, got I = {I}, H = {H}")
    sshape = (E, I, H // BLOCK) if along_rows else (E, I // BLOCK, H)
    for part, t, shape in (("blocks", w.blocks, (E, I, H // 2)), ("scales", w.scales, sshape)):
        if t.dim() != 3 or tuple(t.shape) != shape or t.dtype != torch.uint8:
            raise ValueError(
                f"{name}.{part} must be uint8 {shape} (logical [E, I, H] = {(E, I, H)}), got {t.dtype} {tuple(t.shape)}"
            )
        if t.stride(2) != 1 or t.stride(1) != shape[2]:
            raise ValueError(f"{name}.{part} rows must be contiguous, got strides {t.stride()}")
        if part == "blocks" and (t.stride(0) % 4 or t.storage_offset() % 4):
            raise ValueError(f"{name}.blocks must start each expert on a 4-byte boundary (read as int32 words)")
        _on_device(f"{name}.{part}", t, dev, allow_host)


def _check_pools(masters, pools, slot_table, gate_table, E: int, I: int, H: int, dev) -> None:
    """Slot tables [E] int32/int64 on x's device; pools Mxfp4Tensors [S, I, H] (pool_gate [Sg, I, H] with a
    gate_table) in their masters' layouts, on x's device."""
    for tname, tab in (("slot_table", slot_table), ("gate_table", gate_table)):
        if tab is not None and (
            tab.dim() != 1 or tab.shape[0] != E or tab.dtype not in _INT_DTYPES or tab.device != dev
        ):
            raise ValueError(f"{tname} must be int32/int64 [E] = [{E}] on {dev}, got {tab.dtype} {tuple(tab.shape)}")
    if not all(isinstance(p, Mxfp4Tensor) for p in pools):
        raise ValueError("pool_gate, pool_up and pool_down_t must be Mxfp4Tensors, as the master copies are")
    S = pools[1].shape[0]
    for (name, _, rows), pname, p in zip(masters, ("pool_gate", "pool_up", "pool_down_t"), pools):
        n = p.shape[0] if (pname == "pool_gate" and gate_table is not None) else S
        if n < 1:
            raise ValueError("the pools need at least one slot")
        _check_mx(pname, p, n, I, H, rows, dev)
