"""Gated DeltaNet decode step (T = 1) in one Triton launch.

Owns the Triton kernel `_gdn_step_kernel` (the default grid) and two checked launchers over it, plus torch references:

* `delta_rule_step(q, k, v, g, beta, state)`: exactly transformers' `torch_recurrent_gated_delta_rule` for one
  token with `use_qk_l2norm_in_kernel=True` (the only way Qwen3.5 calls it): fp32 math, l2norm of q and k
  (eps 1e-6), q / sqrt(d_k), state *= exp(g), delta rule update, out = q·S; state updated in place, out in q's
  dtype. Reference: `delta_rule_step_ref`.
* `gated_deltanet_step(mixed_qkv, z, a, b, ...)`: everything `Qwen3_5MoeGatedDeltaNet.forward` does for one
  cached decode token between its four input projections and `out_proj`, fused: causal conv1d update (conv state
  updated in place, SiLU), split into q/k/v heads, beta = sigmoid(b), g = -exp(A_log)·softplus(a + dt_bias), the
  delta rule above, and the gated RMSNorm (`Qwen3_5MoeRMSNormGated`) with z; with `count`, the cache layer's token
  count (transformers 5.25's `cumulative_length_linear`) advanced by 1 in the same launch. Reference:
  `gated_deltanet_step_ref`.

Default grid (B * H_k,): one program per key head; it owns that head's q/k conv channels and its R = H_v / H_k value
heads (value head h uses key head h // R, transformers' repeat_interleave), so the in-place conv-state update has no
cross-program race. Each value head's [d_k, d_v] state is one register tile (fp32), read once and written once.
`gated_deltanet_step(..., block_v=N)` launches the split grid instead (kernels/delta_rule_step_split.py,
`_gdn_split_kernel`: one program per value head and N-column slice of its state, tickets for the shared writes).
Which grid is faster is data (`bench/tune_decode.py`). The conv update is kernels/causal_conv_update.py's.
Every dtype round trip transformers makes (conv output to the weight dtype, SiLU, the core output to q's dtype,
the norm's casts) is reproduced with `round_to`.

Shape legend: B batch, H_k key heads, H_v value heads, d_k key head dim, d_v value head dim, K conv kernel width,
C = conv channels = 2·H_k·d_k + H_v·d_v (q | k | v, head-major).
  mixed_qkv [B, C] · z [B, H_v·d_v] · a, b [B, H_v] · conv_state [B, C, K] · conv_weight [C, K] · A_log, dt_bias [H_v]
  norm_weight [d_v] · state [B, H_v, d_k, d_v] · out [B, H_v·d_v]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from localmoe.kernels.delta_rule_step_split import _launch_split

try:  # Triton is optional at import time; the launchers need it.
    import triton
    import triton.language as tl

    from localmoe.kernels.causal_conv_update import _conv_silu
    from localmoe.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_kw
    from localmoe.kernels.rounding import round_to
except ImportError:  # pragma: no cover
    triton = None
    tl = None

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------------------------
# torch references (transformers' fallbacks, T = 1, written out)
# ----------------------------------------------------------------------------------------------------------
def _l2norm(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_rule_step_ref(q, k, v, g, beta, state):
    """q, k [B,1,H_k,d_k], v [B,1,H_v,d_v], g, beta [B,1,H_v], state [B,H_v,d_k,d_v] -> (out [B,1,H_v,d_v], new state
    fp32)."""
    dt = q.dtype
    r = v.shape[2] // k.shape[2]
    q, k = (x.repeat_interleave(r, dim=2) for x in (q, k))
    q, k, v, beta, g = (x[:, 0].float() for x in (q, k, v, beta, g))  # [B,H,d] / [B,H]
    q, k = _l2norm(q), _l2norm(k)
    q = q / (q.shape[-1] ** 0.5)
    s = state.float() * g.exp()[..., None, None]
    kv_mem = (s * k.unsqueeze(-1)).sum(dim=-2)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    out = (s * q.unsqueeze(-1)).sum(dim=-2)
    return out.unsqueeze(1).to(dt), s


def gated_deltanet_step_ref(
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
    num_k_heads,
    head_k_dim,
    num_v_heads,
    head_v_dim,
    count=None,
):
    """Reference for `gated_deltanet_step`; updates conv_state, state (and count) in place, returns out [B, H_v·d_v]."""
    B, C = mixed_qkv.shape
    K = conv_state.shape[-1]
    new = torch.cat([conv_state, mixed_qkv.unsqueeze(-1)], dim=-1).to(conv_weight.dtype)
    conv_state.copy_(new[:, :, -K:])
    x = F.conv1d(new, conv_weight.unsqueeze(1), conv_bias, padding=0, groups=C)[:, :, -1:]
    x = F.silu(x).to(mixed_qkv.dtype)[:, :, 0]  # [B, C]
    kd = num_k_heads * head_k_dim
    q = x[:, :kd].reshape(B, 1, num_k_heads, head_k_dim)
    k = x[:, kd : 2 * kd].reshape(B, 1, num_k_heads, head_k_dim)
    v = x[:, 2 * kd :].reshape(B, 1, num_v_heads, head_v_dim)
    beta = b.sigmoid().unsqueeze(1)
    g = (-A_log.float().exp() * F.softplus(a.float() + dt_bias)).unsqueeze(1)
    o, s = delta_rule_step_ref(q, k, v, g, beta, state)
    state.copy_(s)
    o = o.reshape(-1, head_v_dim)
    zz = z.reshape(-1, head_v_dim)
    dt = o.dtype
    h = o.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm_eps)
    h = (norm_weight * h.to(dt)) * F.silu(zz.float())
    if count is not None:
        count.add_(1)
    return h.to(dt).reshape(B, -1)


# ----------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _gdn_step_kernel(
        # CONV: raw projections; else q/k/v after the conv
        x_ptr,  # CONV: mixed_qkv [B, C]; else q [B, H_k, d_k] (row stride stride_xb, head stride stride_xh)
        k_ptr,  # not CONV: k [B, H_k, d_k] (strides stride_kb, stride_kh)
        v_ptr,  # not CONV: v [B, H_v, d_v] (strides stride_vb, stride_vh)
        cst_ptr,  # CONV: conv_state [B, C, KS] (strides stride_cb, stride_cc; last dim contiguous)
        cw_ptr,  # CONV: conv weight [C, KS] contiguous
        cb_ptr,  # CONV + HAS_BIAS: conv bias [C]
        a_ptr,  # GATES: a [B, H_v]; else g [B, H_v]
        b_ptr,  # GATES: b [B, H_v]; else beta [B, H_v]
        alog_ptr,  # GATES: A_log [H_v]
        dtb_ptr,  # GATES: dt_bias [H_v]
        z_ptr,  # NORM: z [B, H_v * d_v] (row stride stride_zb)
        nw_ptr,  # NORM: norm weight [d_v]
        s_ptr,  # state [B, H_v, d_k, d_v] any float dtype, strides (ss_b, ss_h, ss_k, 1), updated in place
        o_ptr,  # out [B, H_v, d_v] contiguous, q's dtype
        cnt_ptr,  # COUNT: the cache layer's int64 token count [] (one program adds 1)
        DK,
        DV,
        R,  # value heads per key head
        stride_xb,
        stride_xh,
        stride_kb,
        stride_kh,
        stride_vb,
        stride_vh,
        stride_cb,
        stride_cc,
        stride_ab,
        stride_bb,
        stride_zb,
        ss_b,
        ss_h,
        ss_k,
        scale_div,  # sqrt(d_k): transformers divides q by it
        norm_eps,
        HK: tl.constexpr,
        CONV: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        KS: tl.constexpr,
        KS_P2: tl.constexpr,
        GATES: tl.constexpr,
        NORM: tl.constexpr,
        ROUND_PROD: tl.constexpr,  # NORM: norm_weight * x̂ rounds to the core output dtype
        DK_P2: tl.constexpr,
        DV_P2: tl.constexpr,
        COUNT: tl.constexpr,
        PDL: tl.constexpr,
    ):
        if PDL:  # programmatic dependent launch (kernels/pdl.py): everything here follows the wait
            gdc_wait()
            gdc_launch_dependents()
        pid = tl.program_id(0)
        if COUNT:
            if pid == 0:
                tl.store(cnt_ptr, tl.load(cnt_ptr) + 1)
        bi = (pid // HK).to(tl.int64)
        hk = pid % HK
        ik = tl.arange(0, DK_P2)
        jv = tl.arange(0, DV_P2)
        km = ik < DK
        vm = jv < DV
        io_dt: tl.constexpr = o_ptr.dtype.element_ty  # q's dtype (transformers' initial_dtype)
        HV = HK * R
        # ---- q, k of this key head (fp32), conv'd when CONV ----
        if CONV:
            q, qnew, qsp, qsm = _conv_silu(
                x_ptr,
                cst_ptr,
                cw_ptr,
                cb_ptr,
                bi,
                hk * DK,
                DK,
                stride_xb,
                stride_cb,
                stride_cc,
                HAS_BIAS,
                KS,
                KS_P2,
                DK_P2,
            )
            k, knew, ksp, ksm = _conv_silu(
                x_ptr,
                cst_ptr,
                cw_ptr,
                cb_ptr,
                bi,
                HK * DK + hk * DK,
                DK,
                stride_xb,
                stride_cb,
                stride_cc,
                HAS_BIAS,
                KS,
                KS_P2,
                DK_P2,
            )
        else:
            q = tl.load(x_ptr + bi * stride_xb + hk * stride_xh + ik, mask=km, other=0.0).to(tl.float32)
            k = tl.load(k_ptr + bi * stride_kb + hk * stride_kh + ik, mask=km, other=0.0).to(tl.float32)
        q = q * tl.math.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
        k = k * tl.math.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        q = q / scale_div
        for r in range(R):
            h = hk * R + r
            if CONV:
                v, vnew, vsp, vsm = _conv_silu(
                    x_ptr,
                    cst_ptr,
                    cw_ptr,
                    cb_ptr,
                    bi,
                    2 * HK * DK + h * DV,
                    DV,
                    stride_xb,
                    stride_cb,
                    stride_cc,
                    HAS_BIAS,
                    KS,
                    KS_P2,
                    DV_P2,
                )
            else:
                v = tl.load(v_ptr + bi * stride_vb + h * stride_vh + jv, mask=vm, other=0.0).to(tl.float32)
            av = tl.load(a_ptr + bi * stride_ab + h)
            bv = tl.load(b_ptr + bi * stride_bb + h)
            if GATES:
                beta = round_to(1.0 / (1.0 + tl.exp(-bv.to(tl.float32))), bv.dtype)  # b.sigmoid() in b's dtype
                x = av.to(tl.float32) + tl.load(dtb_ptr + h).to(tl.float32)
                sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # softplus, threshold 20
                g = -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * sp
            else:
                g = av.to(tl.float32)
                beta = bv.to(tl.float32)
            sp_ = s_ptr + bi * ss_b + h * ss_h + ik[:, None] * ss_k + jv[None, :]
            sm = km[:, None] & vm[None, :]
            s = tl.load(sp_, mask=sm, other=0.0).to(tl.float32)  # [DK_P2, DV_P2]
            s = s * tl.exp(g)
            kv_mem = tl.sum(s * k[:, None], axis=0)  # [DV_P2]
            delta = (v - kv_mem) * beta
            s = s + k[:, None] * delta[None, :]
            o = tl.sum(s * q[:, None], axis=0)  # [DV_P2]
            tl.store(sp_, round_to(s, s_ptr.dtype.element_ty).to(s_ptr.dtype.element_ty), mask=sm)
            o = round_to(o, io_dt)  # core_attn_out.to(initial_dtype)
            if NORM:
                o = tl.where(vm, o, 0.0)
                hn = o * tl.math.rsqrt(tl.sum(o * o, axis=0) / DV + norm_eps)
                p = round_to(hn, io_dt) * tl.load(nw_ptr + jv, mask=vm, other=0.0).to(tl.float32)
                if ROUND_PROD:
                    p = round_to(p, io_dt)
                zz = tl.load(z_ptr + bi * stride_zb + h * DV + jv, mask=vm, other=0.0).to(tl.float32)
                o = round_to(p * (zz / (1.0 + tl.exp(-zz))), io_dt)
            tl.store(o_ptr + (bi * HV + h) * DV + jv, o.to(io_dt), mask=vm)
            if CONV:
                tl.debug_barrier()  # every lane has read the old conv window before any lane overwrites it
                tl.store(vsp, round_to(vnew, cst_ptr.dtype.element_ty).to(cst_ptr.dtype.element_ty), mask=vsm)
        if CONV:
            tl.debug_barrier()
            tl.store(qsp, round_to(qnew, cst_ptr.dtype.element_ty).to(cst_ptr.dtype.element_ty), mask=qsm)
            tl.store(ksp, round_to(knew, cst_ptr.dtype.element_ty).to(cst_ptr.dtype.element_ty), mask=ksm)


def _warps(dk_p2: int, dv_p2: int) -> int:
    n = dk_p2 * dv_p2
    return 4 if n <= 4096 else (8 if n <= 16384 else 16)


def _check_state(state, B, HV, DK, DV):
    if tuple(state.shape) != (B, HV, DK, DV):
        raise ValueError(f"state must be [B, H_v, d_k, d_v] = {(B, HV, DK, DV)}, got {tuple(state.shape)}")
    if state.stride(-1) != 1 or state.dtype not in _FLOAT_DTYPES:
        raise ValueError("state must be a float tensor with a contiguous last dim")


def delta_rule_step(q, k, v, g, beta, state, *, out=None):
    """transformers' `torch_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state,
    output_final_state=True, use_qk_l2norm_in_kernel=True)` for T = 1, in one launch. Updates `state` in place
    and returns out [B, 1, H_v, d_v] in q's dtype. q, k [B, 1, H_k, d_k]; v [B, 1, H_v, d_v]; g, beta [B, 1, H_v]."""
    if triton is None:
        raise RuntimeError("delta_rule_step needs triton")
    B, T, HK, DK = k.shape
    HV, DV = v.shape[-2:]
    if T != 1 or q.shape != k.shape or v.shape[:2] != (B, 1) or g.shape != (B, 1, HV) or beta.shape != (B, 1, HV):
        raise ValueError("delta_rule_step is the T = 1 step: q, k [B,1,H_k,d_k], v [B,1,H_v,d_v], g, beta [B,1,H_v]")
    if HV % HK:
        raise ValueError(f"H_v ({HV}) must be a multiple of H_k ({HK})")
    _check_state(state, B, HV, DK, DV)
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError("q, k, v need a contiguous last dim")
    if out is None:
        out = torch.empty((B, 1, HV, DV), dtype=q.dtype, device=q.device)
    dk2, dv2 = triton.next_power_of_2(DK), triton.next_power_of_2(DV)
    _gdn_step_kernel[(B * HK,)](
        q,
        k,
        v,
        state,
        state,
        state,
        g,
        beta,
        g,
        g,
        v,
        v,
        state,
        out,
        out,
        DK,
        DV,
        HV // HK,
        q.stride(0),
        q.stride(2),
        k.stride(0),
        k.stride(2),
        v.stride(0),
        v.stride(2),
        0,
        0,
        g.stride(0),
        beta.stride(0),
        0,
        state.stride(0),
        state.stride(1),
        state.stride(2),
        float(DK**0.5),
        0.0,
        HK=HK,
        CONV=False,
        HAS_BIAS=False,
        KS=1,
        KS_P2=1,
        GATES=False,
        NORM=False,
        ROUND_PROD=False,
        DK_P2=dk2,
        DV_P2=dv2,
        COUNT=False,
        num_warps=_warps(dk2, dv2),
        **pdl_kw(q),
    )
    return out


def gated_deltanet_step(
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
    num_k_heads,
    head_k_dim,
    num_v_heads,
    head_v_dim,
    out=None,
    count=None,
    num_warps: int | None = None,
    block_v: int | None = None,
    one_ticket: bool = True,
):
    """One cached decode token of `Qwen3_5MoeGatedDeltaNet` between the input projections and out_proj, one launch.
    mixed_qkv [B, C], z [B, H_v·d_v], a, b [B, H_v] (rows may be strided, last dim contiguous); conv_state
    [B, C, K] and state [B, H_v, d_k, d_v] are updated in place; `count` (optional, an int64 [] on the same device:
    the cache layer's token count of transformers 5.25) is advanced by 1 inside the launch. Returns out [B, H_v·d_v]
    in mixed_qkv's dtype."""
    if triton is None:
        raise RuntimeError("gated_deltanet_step needs triton")
    HK, DK, HV, DV = int(num_k_heads), int(head_k_dim), int(num_v_heads), int(head_v_dim)
    B, C = mixed_qkv.shape
    KS = conv_state.shape[-1]
    if C != 2 * HK * DK + HV * DV or HV % HK:
        raise ValueError(f"mixed_qkv has {C} channels, heads say {2 * HK * DK + HV * DV} (or H_v % H_k != 0)")
    if conv_state.shape != (B, C, KS) or conv_weight.shape != (C, KS) or conv_state.stride(-1) != 1:
        raise ValueError(
            f"conv_state [B, C, K] / conv_weight [C, K] mismatch: {tuple(conv_state.shape)}, {tuple(conv_weight.shape)}"
        )
    if z.shape != (B, HV * DV) or a.shape != (B, HV) or b.shape != (B, HV) or norm_weight.shape != (DV,):
        raise ValueError("z [B, H_v*d_v], a, b [B, H_v], norm_weight [d_v] expected")
    if A_log.shape != (HV,) or dt_bias.shape != (HV,):
        raise ValueError("A_log and dt_bias must be [H_v]")
    _check_state(state, B, HV, DK, DV)
    if count is not None and (count.dtype != torch.int64 or count.numel() != 1 or count.device != mixed_qkv.device):
        raise ValueError(f"count must be one int64 on {mixed_qkv.device}, got {count.dtype} {tuple(count.shape)}")
    if any(t.stride(-1) != 1 for t in (mixed_qkv, z, a, b)):
        raise ValueError("mixed_qkv, z, a, b need a contiguous last dim")
    cw = conv_weight if conv_weight.is_contiguous() else conv_weight.contiguous()
    dt = mixed_qkv.dtype
    if out is None:
        out = torch.empty((B, HV * DV), dtype=dt, device=mixed_qkv.device)
    round_prod = torch.promote_types(norm_weight.dtype, dt) == dt and dt != torch.float32
    dk2, dv2 = triton.next_power_of_2(DK), triton.next_power_of_2(DV)
    bias = conv_bias if conv_bias is not None else cw
    if block_v is not None:  # split grid: (batch x value head, d_v slices), tickets for the shared writes
        return _launch_split(
            mixed_qkv,
            z,
            a,
            b,
            conv_state=conv_state,
            conv_weight=cw,
            conv_bias=conv_bias,
            A_log=A_log,
            dt_bias=dt_bias,
            norm_weight=norm_weight,
            norm_eps=norm_eps,
            state=state,
            out=out,
            count=count,
            num_k_heads=HK,
            round_prod=round_prod,
            block_v=block_v,
            one_ticket=one_ticket,
            num_warps=num_warps,
        )
    _gdn_step_kernel[(B * HK,)](
        mixed_qkv,
        mixed_qkv,
        mixed_qkv,
        conv_state,
        cw,
        bias,
        a,
        b,
        A_log,
        dt_bias,
        z,
        norm_weight,
        state,
        out,
        count if count is not None else out,
        DK,
        DV,
        HV // HK,
        mixed_qkv.stride(0),
        0,
        0,
        0,
        0,
        0,
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
        CONV=True,
        HAS_BIAS=conv_bias is not None,
        KS=KS,
        KS_P2=triton.next_power_of_2(KS),
        GATES=True,
        NORM=True,
        ROUND_PROD=round_prod,
        DK_P2=dk2,
        DV_P2=dv2,
        COUNT=count is not None,
        num_warps=num_warps or _warps(dk2, dv2),
        **pdl_kw(mixed_qkv),
    )
    return out
