"""Experiments on the decoder layer's expert launch (`sparse_fused` with the shared expert and the residual) at
Qwen3.5-35B-A3B shapes, 85 % sparsity, bf16 (GPU, not a test; the kernel here is a bench copy with knobs, the
product kernel is kernels/sparse_fused.py).

Knobs of `_variant_kernel` (grid (T*k + T, cdiv(I, BLOCK_I * NB))):
  NB        neuron blocks per program: a loop whose next gate tile is loaded before this block's up/down rows,
            the down sums kept in registers and added to the workspace once per program (fewer atomics)
  SH_FIRST  the shared expert's programs first in launch order (else last, as the product kernel)
  SH_PRE    the shared expert's programs load their first gate tile before the PDL wait (weights are constants)
  ATOM      0 atomics (correct); 1 plain stores instead (wrong sums: measures what the atomics cost)
  GATE_ONLY no up/down at all (wrong sums: measures the gate pass alone)
  TICKET    0 the per-token ticket as the product kernel (acq_rel); 1 release, the last program acquires; 2 no ticket
            and no finalising program (wrong output: what the 576 same-address atomics of a token cost). A two-level
            ticket (per neuron block, then per token) measured no faster (session 6) and left the product kernel

Timed as CUDA graphs over 12 weight sets (L2 cannot hold them), `graph_timing.graph_us`, two ways: the expert launch
alone (12 in a row) and the pair moe_front -> experts as the decoder layer runs them (PDL edges between them).

Usage: PYTHONUNBUFFERED=1 python bench/sparse_variants.py [--quick] [--variants] [--tickets]
  default: the product kernel's launch sweep with register caps (`maxnreg`); --variants: the knobs above too
"""

from __future__ import annotations

import itertools
import sys

import torch
import triton
import triton.language as tl

from graph_timing import graph_us
from localmoe.kernels.moe_front import moe_front
from localmoe.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_kw
from localmoe.kernels.sparse_fused import fused_workspace, last_of_token, publish_token, sparse_fused
from moe_inputs import moe_block_inputs, random_bf16


@triton.jit
def _variant_kernel(x_ptr, wg_ptr, wu_ptr, wd_ptr, eid_ptr, rw_ptr, tau_ptr, y_ptr, cnt_ptr, acc_ptr, cws_ptr,
                    tick_ptr, swg_ptr, swu_ptr, swd_ptr, sw_ptr, res_ptr, I, I_S, T, TK, K, stride_xt, stride_ge,
                    stride_ue, stride_de, H: tl.constexpr, H_P2: tl.constexpr, BLOCK_I: tl.constexpr,
                    NB: tl.constexpr, K_P2: tl.constexpr, SH_FIRST: tl.constexpr, SH_PRE: tl.constexpr,
                    ATOM: tl.constexpr, GATE_ONLY: tl.constexpr, TICKET: tl.constexpr, PDL: tl.constexpr):
    pid_tj = tl.program_id(0)
    pid_i = tl.program_id(1)
    if SH_FIRST:
        is_sh = pid_tj < T
        tj = tl.maximum(pid_tj - T, 0)
        t = tl.where(is_sh, pid_tj, (pid_tj - T) // K)
    else:
        is_sh = pid_tj >= TK
        tj = tl.minimum(pid_tj, TK - 1)
        t = tl.where(is_sh, pid_tj - TK, pid_tj // K)
    lim = tl.where(is_sh, I_S, I)
    cols = tl.arange(0, H_P2)
    cmask = cols < H
    r0 = pid_i * (BLOCK_I * NB)
    rows = r0 + tl.arange(0, BLOCK_I)
    roff = rows.to(tl.int64)[:, None] * H + cols[None, :]
    if SH_PRE:
        pv = tl.zeros([BLOCK_I], dtype=tl.int32) + pid_tj  # tensor masks (the interpreter rejects scalar ones)
        shm = (rows < lim) & ((pv < T) if SH_FIRST else (pv >= TK))
        wg_sh = tl.load(swg_ptr + roff, mask=shm[:, None] & cmask[None, :], other=0.0)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    e = tl.load(eid_ptr + tj).to(tl.int64)
    g_base = tl.where(is_sh, swg_ptr, wg_ptr + e * stride_ge)
    u_base = tl.where(is_sh, swu_ptr, wu_ptr + e * stride_ue)
    d_base = tl.where(is_sh, swd_ptr, wd_ptr + e * stride_de)
    if SH_PRE:
        rtm = (rows < lim) & ((pv >= T) if SH_FIRST else (pv < TK))
        wg = tl.where(is_sh, wg_sh, tl.load(g_base + roff, mask=rtm[:, None] & cmask[None, :], other=0.0))
    else:
        wg = tl.load(g_base + roff, mask=(rows < lim)[:, None] & cmask[None, :], other=0.0)
    xv = tl.load(x_ptr + t.to(tl.int64) * stride_xt + cols, mask=cmask, other=0.0).to(tl.float32)
    tau = tl.where(is_sh, 0.0, tl.load(tau_ptr + e))
    rw = tl.where(is_sh, tl.load(sw_ptr + t).to(tl.float32), tl.load(rw_ptr + tj).to(tl.float32))
    acc = tl.zeros([H_P2], dtype=tl.float32)
    nkt = 0
    for i in tl.static_range(NB):
        rows = r0 + i * BLOCK_I + tl.arange(0, BLOCK_I)
        rmask = rows < lim
        roff = rows.to(tl.int64)[:, None] * H + cols[None, :]
        z = tl.sum(wg.to(tl.float32) * xv[None, :], axis=1)
        g = z / (1.0 + tl.exp(-z))
        keep = (tl.abs(g) >= tau) & rmask
        nk = tl.sum(keep.to(tl.int32), axis=0)
        if i + 1 < NB:  # the next gate tile is in flight while this block's up/down rows load
            nrows = rows + BLOCK_I
            wg = tl.load(g_base + nrows.to(tl.int64)[:, None] * H + cols[None, :],
                         mask=(nrows < lim)[:, None] & cmask[None, :], other=0.0)
        if not GATE_ONLY:
            if nk > 0:
                mk = keep[:, None] & cmask[None, :]
                wu = tl.load(u_base + roff, mask=mk, other=0.0)
                wd = tl.load(d_base + roff, mask=mk, other=0.0)
                h = tl.sum(wu.to(tl.float32) * xv[None, :], axis=1) * g * rw
                acc += tl.sum(wd.to(tl.float32) * h[:, None], axis=0)
        nkt += nk
    if not GATE_ONLY:
        if nkt > 0:
            if ATOM == 0:
                tl.atomic_add(acc_ptr + t.to(tl.int64) * H + cols, acc, mask=cmask, sem="relaxed")
            else:
                tl.store(acc_ptr + t.to(tl.int64) * H + cols, acc, mask=cmask)
    tl.atomic_add(cws_ptr + tj, tl.where(is_sh, 0, nkt), sem="relaxed")
    tl.debug_barrier()
    if TICKET == 1:  # release only; the last program acquires with a second atomic
        progs = (K + 1) * tl.num_programs(1)
        last = tl.atomic_add(tick_ptr + t, 1, sem="release", scope="gpu") == progs - 1
        if last:
            tl.atomic_add(tick_ptr + t, 0, sem="acquire", scope="gpu")
    elif TICKET == 2:  # no ticket and no finalising program (wrong output: what the ticket costs)
        last = False
    else:  # 0: the product kernel's token ticket
        last = last_of_token(tick_ptr, t, (K + 1) * tl.num_programs(1))
    if last:
        publish_token(acc_ptr, y_ptr, res_ptr, cnt_ptr, cws_ptr, tick_ptr, t, K, cols, cmask, H=H, H_P2=H_P2,
                      K_P2=K_P2, HAS_RES=True)

def variant(x, w_gate, w_up, w_down_t, ids, weights, tau, out, count, shared, residual, ws, *, BLOCK_I=8, NB=1,
            num_warps=8, SH_FIRST=False, SH_PRE=False, ATOM=0, GATE_ONLY=False, TICKET=0):
    T, H = x.shape
    k = ids.shape[1]
    I = w_gate.shape[1]
    acc = ws[: T * H].view(torch.float32)
    cws = ws[T * H: T * H + T * k]
    tick = ws[T * H + T * k: T * H + T * k + T]
    grid = (T * k + T, triton.cdiv(I, BLOCK_I * NB))
    _variant_kernel[grid](x, w_gate, w_up, w_down_t, ids, weights, tau, out, count, acc, cws, tick, shared.w_gate,
                          shared.w_up, shared.w_down_t, shared.weight, residual, I, shared.w_gate.shape[0], T, T * k,
                          k, x.stride(0), w_gate.stride(0), w_up.stride(0), w_down_t.stride(0), H=H,
                          H_P2=triton.next_power_of_2(H), BLOCK_I=BLOCK_I, NB=NB, K_P2=triton.next_power_of_2(k),
                          SH_FIRST=SH_FIRST, SH_PRE=SH_PRE, ATOM=ATOM, GATE_ONLY=GATE_ONLY, TICKET=TICKET,
                          num_warps=num_warps,
                          **pdl_kw(x))
    return out, count


def main():
    quick = "--quick" in sys.argv
    dev, dt, N = torch.device("cuda"), torch.bfloat16, 12
    H, I, K, EX = 2048, 512, 8, 64
    rnd = random_bf16(torch.Generator(device=dev).manual_seed(0), dev, dt)
    m = moe_block_inputs(rnd, N, H, I, K, EX, device=dev, dtype=dt)
    xs, res, nw, wr, wsg, ew, ticks, sh, taus = m.x, m.res, m.nw, m.wr, m.wsg, m.ew, m.ticks, m.sh, m.taus
    s_, h_, tw_, ti_ = m.s, m.h, m.tw, m.ti
    outs = [torch.empty(1, H, device=dev, dtype=dt) for _ in range(N)]
    cnts = [torch.empty(1, K, device=dev, dtype=torch.int32) for _ in range(N)]
    ws = [torch.zeros(H + 2 * K + 1088, dtype=torch.int32, device=dev) for _ in range(N)]
    fused_workspace(dev, H + K + 1)
    ref = [sparse_fused(h_[i], *ew[i], ti_[i], tw_[i], taus[i], outs[i].clone(), shared=sh[i], residual=s_[i])
           for i in range(N)]

    def product(i, kw):
        return sparse_fused(h_[i], *ew[i], ti_[i], tw_[i], taus[i], outs[i], count=cnts[i], shared=sh[i],
                            residual=s_[i], **kw)

    def var(i, kw):
        return variant(h_[i], *ew[i], ti_[i], tw_[i], taus[i], outs[i], cnts[i], sh[i], s_[i], ws[i], **kw)

    def fr(i):
        return moe_front(xs[i], res[i], nw[i], 1e-6, "zero_centred", wr[i], K, True, wsg[i], tickets=ticks[i])

    def check(fn, kw):
        err = 0.0
        for i in range(N):
            y, c = fn(i, kw)
            err = max(err, float((y.float() - ref[i][0].float()).abs().max()))
            if not torch.equal(c, ref[i][1]):
                err = max(err, 99.0)
        return err

    rows = []

    def measure(name, fn, kw, checked=True):
        try:
            err = check(fn, kw) if checked else float("nan")
            alone = graph_us([lambda i=i: fn(i, kw) for i in range(N)])
            pair = graph_us([c for i in range(N) for c in (lambda i=i: fr(i), lambda i=i: fn(i, kw))])
        except Exception as e:  # noqa: BLE001 - a config that does not compile is reported, not fatal
            print(f"  {name} {kw}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
            return
        rows.append((name, kw, alone, pair, err))
        print(f"  {name:9s} {str(kw):80s} alone {alone:6.2f} µs  front+experts {pair:6.2f} µs  err {err:.1e}",
              flush=True)

    front_us = graph_us([lambda i=i: fr(i) for i in range(N)])
    print(f"moe_front alone: {front_us:.2f} µs", flush=True)
    measure("product", product, {})
    if "--tickets" in sys.argv:  # what the per-token ticket costs (576 programs, one address)
        base = {"BLOCK_I": 8, "NB": 1, "num_warps": 8}
        measure("variant", var, base)
        measure("variant", var, {**base, "TICKET": 1})
        measure("no-ticket", var, {**base, "TICKET": 2}, checked=False)
    if "--variants" in sys.argv:  # session 5, first run: none beat the product kernel (bench/RESULTS.md)
        base = {"BLOCK_I": 8, "NB": 1, "num_warps": 8}
        measure("gate-only", var, {**base, "GATE_ONLY": True}, checked=False)
        measure("no-atomic", var, {**base, "ATOM": 1}, checked=False)
        space = [(8, 1, 8), (4, 2, 8), (4, 4, 8), (2, 4, 4), (2, 8, 4), (4, 2, 4), (8, 2, 8), (2, 4, 8), (4, 8, 8),
                 (1, 8, 4), (2, 16, 4), (8, 4, 8), (16, 1, 16), (4, 1, 4)]
        for (bi, nb, nw_), (first, pre) in itertools.product(space, [(False, False), (True, True)]):
            measure("variant", var, {"BLOCK_I": bi, "NB": nb, "num_warps": nw_, "SH_FIRST": first, "SH_PRE": pre})
    # registers per thread capped (`maxnreg`): ptxas takes up to ~175 for BLOCK_I 8 / 8 warps (one program per SM)
    # although 64 compile without spills; a cap lets 2-4 programs share an SM
    space = [(8, 8), (4, 8), (4, 4), (8, 16), (16, 16), (2, 8), (2, 4), (16, 8)]
    if quick:
        space = space[:2]
    for (bi, nw_), cap in itertools.product(space, (None, 128, 96, 80, 64)):
        measure("product", product, {"BLOCK_I": bi, "num_warps": nw_, **({"maxnreg": cap} if cap else {})})
    print(f"\nmoe_front alone {front_us:.2f} µs (H {H}, I {I}, k {K}, {EX} experts per set, 85 %, bf16)")
    print("| kernel | launch | experts alone µs | moe_front + experts µs | max abs err |")
    print("|---|---|---:|---:|---:|")
    for name, kw, alone, pair, err in sorted(rows, key=lambda r: r[3]):
        print(f"| {name} | {kw} | {alone:.2f} | {pair:.2f} | {err:.1e} |")


if __name__ == "__main__":
    main()
