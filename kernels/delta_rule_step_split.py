"""The split grid of the Gated DeltaNet decode step: `_gdn_split_kernel`, with its workspace and tickets.

`gated_deltanet_step(..., block_v=N)` (kernels/delta_rule_step.py: the checks, the torch references, the default grid
`_gdn_step_kernel`) launches it through `_launch_split` instead of the default grid: grid (B * H_v, d_v / N), one
program per value head and N-column slice of its state (the delta rule is column-wise independent), 8x the programs at
the real shape. Two self-cleaning ticket arrays order the shared writes: the last program of a key head writes the q/k
conv window (after every program of it read the old one), and the last slice of a value head applies the gated
RMSNorm over the whole d_v row from an fp32 workspace. By default (`one_ticket`) both counts live in one int64 word
per key head (a field for the key head's programs, one per value head of it), so each program takes one atomic, not
two; the key head's last program re-zeroes the word. Which grid is faster is data (`bench/tune_decode.py`).
The conv update is kernels/causal_conv_update.py's; every dtype round trip is the default grid's (`round_to`).

Shape legend (kernels/delta_rule_step.py's): B batch, H_k key heads, H_v value heads, d_k key head dim, d_v value
head dim, K conv kernel width, C = conv channels = 2·H_k·d_k + H_v·d_v (q | k | v, head-major), N = block_v.
"""

from __future__ import annotations

import torch

from localmoe.kernels.workspace import zeroed_int32

try:  # Triton is optional at import time; the launcher needs it.
    import triton
    import triton.language as tl

    from localmoe.kernels.causal_conv_update import _conv_apply, _conv_window
    from localmoe.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_kw
    from localmoe.kernels.rounding import round_to
except ImportError:  # pragma: no cover
    triton = None
    tl = None

if triton is not None:

    @triton.jit
    def _gdn_split_kernel(
        x_ptr,  # mixed_qkv [B, C] (row stride stride_xb)
        cst_ptr,  # conv_state [B, C, KS] (strides stride_cb, stride_cc; last dim contiguous)
        cw_ptr,  # conv weight [C, KS] contiguous
        cb_ptr,  # HAS_BIAS: conv bias [C]
        a_ptr,
        b_ptr,  # [B, H_v] (row strides stride_ab, stride_bb)
        alog_ptr,
        dtb_ptr,  # [H_v]
        z_ptr,  # [B, H_v * d_v] (row stride stride_zb)
        nw_ptr,  # norm weight [d_v]
        s_ptr,  # state [B, H_v, d_k, d_v], strides (ss_b, ss_h, ss_k, 1), updated in place
        o_ptr,  # out [B, H_v, d_v] contiguous
        cnt_ptr,  # COUNT: the cache layer's int64 token count [] (one program adds 1)
        ws_ptr,  # fp32 [B, H_v, d_v] workspace: core output before the gated norm (fully rewritten each launch)
        tk_ptr,  # int32 [B * H_k] tickets (zero between launches): q/k conv-state writers; ONE_TICKET: int64
        th_ptr,  # int32 [B * H_v] tickets (zero between launches): gated-norm finishers (unused with ONE_TICKET)
        DK,
        DV,
        R,
        NVB,  # NVB = ceil(d_v / BLOCK_V) programs per value head
        stride_xb,
        stride_cb,
        stride_cc,
        stride_ab,
        stride_bb,
        stride_zb,
        ss_b,
        ss_h,
        ss_k,
        scale_div,
        norm_eps,
        HK: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        KS: tl.constexpr,
        KS_P2: tl.constexpr,
        ROUND_PROD: tl.constexpr,
        DK_P2: tl.constexpr,
        DV_P2: tl.constexpr,
        BLOCK_V: tl.constexpr,
        ONE_TICKET: tl.constexpr,  # W > 0: both tickets in one int64 word per key head, W bits per count
        W: tl.constexpr,
        COUNT: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pid = tl.program_id(0)  # one (batch row, value head)
        vb = tl.program_id(1)  # one BLOCK_V slice of that head's d_v columns
        HV = HK * R
        bi = (pid // HV).to(tl.int64)
        h = pid % HV
        hk = h // R
        ik = tl.arange(0, DK_P2)
        km = ik < DK
        jv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        vm = jv < DV
        io_dt: tl.constexpr = o_ptr.dtype.element_ty
        # this program's slice of the recurrent state, read before the PDL wait: only this kernel writes it, one
        # decode step earlier, and every kernel since has completed by the time this one is launched
        sp_ = s_ptr + bi * ss_b + h * ss_h + ik[:, None] * ss_k + jv[None, :]
        sm = km[:, None] & vm[None, :]
        s = tl.load(sp_, mask=sm, other=0.0).to(tl.float32)  # [DK_P2, BLOCK_V]
        # likewise the conv windows (this kernel wrote them one step earlier), the conv weights and the gate constants
        vc0 = 2 * HK * DK + h * DV + vb * BLOCK_V
        vn = tl.minimum(DV - vb * BLOCK_V, BLOCK_V)
        qwin, qw, qb = _conv_window(
            cst_ptr, cw_ptr, cb_ptr, bi, hk * DK, DK, stride_cb, stride_cc, HAS_BIAS, KS, KS_P2, DK_P2
        )
        kwin, kw, kb = _conv_window(
            cst_ptr, cw_ptr, cb_ptr, bi, HK * DK + hk * DK, DK, stride_cb, stride_cc, HAS_BIAS, KS, KS_P2, DK_P2
        )
        vwin, vw, vbias = _conv_window(
            cst_ptr, cw_ptr, cb_ptr, bi, vc0, vn, stride_cb, stride_cc, HAS_BIAS, KS, KS_P2, BLOCK_V
        )
        dtb = tl.load(dtb_ptr + h).to(tl.float32)
        a_log = tl.load(alog_ptr + h).to(tl.float32)
        if PDL:  # programmatic dependent launch (kernels/pdl.py): the projections are read after the wait
            gdc_wait()
            gdc_launch_dependents()
        if COUNT:
            if (pid == 0) & (vb == 0):
                tl.store(cnt_ptr, tl.load(cnt_ptr) + 1)
        wdt: tl.constexpr = cw_ptr.dtype.element_ty
        # q, k of the key head: every program of it reads the OLD conv window; the last one writes the new
        q, qnew, qsp, qsm = _conv_apply(
            x_ptr, cst_ptr, wdt, qwin, qw, qb, bi, hk * DK, DK, stride_xb, stride_cb, stride_cc, KS, KS_P2, DK_P2
        )
        k, knew, ksp, ksm = _conv_apply(
            x_ptr,
            cst_ptr,
            wdt,
            kwin,
            kw,
            kb,
            bi,
            HK * DK + hk * DK,
            DK,
            stride_xb,
            stride_cb,
            stride_cc,
            KS,
            KS_P2,
            DK_P2,
        )
        q = q * tl.math.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
        k = k * tl.math.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        q = q / scale_div
        # this program's v channels: only it reads them, so it shifts their conv window itself
        v, vnew, vsp, vsm = _conv_apply(
            x_ptr, cst_ptr, wdt, vwin, vw, vbias, bi, vc0, vn, stride_xb, stride_cb, stride_cc, KS, KS_P2, BLOCK_V
        )
        av = tl.load(a_ptr + bi * stride_ab + h)
        bv = tl.load(b_ptr + bi * stride_bb + h)
        beta = round_to(1.0 / (1.0 + tl.exp(-bv.to(tl.float32))), bv.dtype)
        x = av.to(tl.float32) + dtb
        sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        g = -tl.exp(a_log) * sp
        # the delta rule on this slice of columns: every column's update is independent of the others
        s = s * tl.exp(g)
        kv_mem = tl.sum(s * k[:, None], axis=0)
        delta = (v - kv_mem) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)  # [BLOCK_V]
        tl.store(sp_, round_to(s, s_ptr.dtype.element_ty).to(s_ptr.dtype.element_ty), mask=sm)
        row = (bi * HV + h) * DV
        tl.store(ws_ptr + row + jv, round_to(o, io_dt), mask=vm)  # core_attn_out.to(initial_dtype), kept fp32
        tl.debug_barrier()  # every lane has read the old conv window and written its slice
        tl.store(vsp, round_to(vnew, cst_ptr.dtype.element_ty).to(cst_ptr.dtype.element_ty), mask=vsm)
        if ONE_TICKET:  # one atomic: field 0 counts the key head's programs, field 1 + r its value head r's
            shift = (W * (1 + h % R)).to(tl.int64)
            old = tl.atomic_add(
                tk_ptr + bi * HK + hk, 1 + (tl.full([], 1, tl.int64) << shift), sem="acq_rel", scope="gpu"
            )
            done_k = old & ((1 << W) - 1)
            done_h = (old >> shift) & ((1 << W) - 1)
        else:
            done_k = tl.atomic_add(tk_ptr + bi * HK + hk, 1, sem="acq_rel", scope="gpu")
        if done_k == R * NVB - 1:  # every program of this key head has read the old q/k window
            tl.store(qsp, round_to(qnew, cst_ptr.dtype.element_ty).to(cst_ptr.dtype.element_ty), mask=qsm)
            tl.store(ksp, round_to(knew, cst_ptr.dtype.element_ty).to(cst_ptr.dtype.element_ty), mask=ksm)
            tl.store(tk_ptr + bi * HK + hk, 0)  # with ONE_TICKET every program of the key head has counted
        if not ONE_TICKET:
            done_h = tl.atomic_add(th_ptr + bi * HV + h, 1, sem="acq_rel", scope="gpu")
        if done_h == NVB - 1:  # the last slice of this head: the gated RMSNorm over the whole d_v row
            jf = tl.arange(0, DV_P2)
            fm = jf < DV
            of = tl.load(ws_ptr + row + jf, mask=fm, other=0.0, cache_modifier=".cg")
            hn = of * tl.math.rsqrt(tl.sum(of * of, axis=0) / DV + norm_eps)
            pr = round_to(hn, io_dt) * tl.load(nw_ptr + jf, mask=fm, other=0.0).to(tl.float32)
            if ROUND_PROD:
                pr = round_to(pr, io_dt)
            zz = tl.load(z_ptr + bi * stride_zb + h * DV + jf, mask=fm, other=0.0).to(tl.float32)
            tl.store(o_ptr + row + jf, round_to(pr * (zz / (1.0 + tl.exp(-zz))), io_dt).to(io_dt), mask=fm)
            if not ONE_TICKET:
                tl.store(th_ptr + bi * HV + h, 0)


def _split_workspace(device, B: int, HK: int, HV: int, DV: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp32 [B*H_v*d_v] core outputs, int32 [B*H_k] and [B*H_v] tickets) per (device, stream). The tickets come
    from a buffer of their own (the kernel leaves them zeroed); the outputs are rewritten by every launch."""
    n_tk = B * HK
    tickets = zeroed_int32("gdn_split_tickets", device, n_tk + B * HV)
    out = zeroed_int32("gdn_split_out", device, B * HV * DV)[: B * HV * DV].view(torch.float32)
    return out, tickets[:n_tk], tickets[n_tk : n_tk + B * HV]


def _one_ticket_width(R: int, nvb: int) -> int:
    """Bits per count when a key head's R + 1 tickets share one int64 word (0: they do not fit, use two atomics)."""
    w = (R * nvb).bit_length()
    return w if w * (R + 1) <= 62 else 0


def _launch_split(
    mixed_qkv,
    z,
    a,
    b,
    *,
    conv_state,
    conv_weight,
    conv_bias,
    A_log,
    dt_bias,
    norm_weight,
    norm_eps,
    state,
    out,
    count,
    num_k_heads,
    round_prod,
    block_v,
    one_ticket,
    num_warps,
):
    """`gated_deltanet_step(..., block_v=N)`'s launch of `_gdn_split_kernel`, for the arguments it checked
    (conv_weight contiguous, out allocated, round_prod decided); returns out. The workspace and both ticket arrays
    are per (device, stream) buffers (`_split_workspace`); the kernel leaves the tickets zeroed."""
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two, got {block_v}")
    B, HV, DK, DV = state.shape
    HK = num_k_heads
    KS = conv_state.shape[-1]
    dk2, dv2 = triton.next_power_of_2(DK), triton.next_power_of_2(DV)
    bias = conv_bias if conv_bias is not None else conv_weight
    bv = min(block_v, dv2)
    nvb = triton.cdiv(DV, bv)
    ws, tk, th = _split_workspace(mixed_qkv.device, B, HK, HV, DV)
    width = _one_ticket_width(HV // HK, nvb) if one_ticket else 0
    if width:  # one int64 word per key head instead of two int32 tickets (one atomic per program, not two)
        tk = zeroed_int32("gdn_split_ticket64", mixed_qkv.device, 2 * B * HK)[: 2 * B * HK].view(torch.int64)
    _gdn_split_kernel[(B * HV, nvb)](
        mixed_qkv,
        conv_state,
        conv_weight,
        bias,
        a,
        b,
        A_log,
        dt_bias,
        z,
        norm_weight,
        state,
        out,
        count if count is not None else tk,
        ws,
        tk,
        th,
        DK,
        DV,
        HV // HK,
        nvb,
        mixed_qkv.stride(0),
        conv_state.stride(0),
        conv_state.stride(1),
        a.stride(0),
        b.stride(0),
        z.stride(0),
        state.stride(0),
        state.stride(1),
        state.stride(2),
        float(DK**0.5),
        float(norm_eps),
        HK=HK,
        HAS_BIAS=conv_bias is not None,
        KS=KS,
        KS_P2=triton.next_power_of_2(KS),
        ROUND_PROD=round_prod,
        DK_P2=dk2,
        DV_P2=dv2,
        BLOCK_V=bv,
        ONE_TICKET=width > 0,
        W=width,
        COUNT=count is not None,
        num_warps=num_warps or 4,
        **pdl_kw(mixed_qkv),
    )
    return out
