"""DeepSeek-V2's MLA for one decode token, between its input projections and the absorbed core, in one launch: the
compressed KV's RMSNorm, the rotary embedding of the query's and the key's rope parts, and the write of the token's
latents into a transformers StaticLayer (advancing its position), as `DeepseekV2Attention` computes them.

    c     = kv_a_layernorm(ckv[:C])                        w · (x·rsqrt(mean(x²) + eps)).to(dtype), standard RMSNorm
    q_pe  = rope(q[h, Dn:])  for every head h              transformers' `apply_rotary_emb`: pairs (2i, 2i+1) as
    k_pe  = rope(ckv[C:])                                  complex numbers times freqs_cis[i], in fp32, cast back
    keys[pos] = c, values[pos] = k_pe, pos += 1            StaticLayer.update for one token

freqs_cis (complex64 [R/2], its magnitude carrying yarn's attention scaling) is read as (re, im) pairs. Every
rounding transformers makes is reproduced with `round_to`. Grid (1,): one program does it all (Hq·R + C + R values;
the position is advanced by the same program after its writes). A programmatic dependent launch (kernels/pdl.py):
the norm's weight, the frequencies and the position are loaded before the wait, q and ckv (the GEMV's) after it.

Shapes: q [Hq, Dn + R] (rows contiguous, any row stride: the q projection's output) · ckv [C + R] · norm_w [C] ·
freqs [R/2, 2] fp32 · keys [L, C], values [L, R] (rows contiguous: a StaticLayer's [1, 1, L, *] views) ·
pos [1] int64 (the layer's `cumulative_length`) · out q_pe [Hq, R] contiguous.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    from localmoe.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_kw
    from localmoe.kernels.rounding import round_to
except ImportError:  # pragma: no cover
    triton = None
    tl = None


def _rope_ref(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_emb on x [..., R] with freqs [R/2, 2] (re, im)."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * torch.view_as_complex(freqs.contiguous())).flatten(-2).to(x.dtype)


def mla_rope_write_ref(q, ckv, norm_w, eps, freqs, keys, values, pos, Dn):
    """The same in torch (keys, values, pos updated in place); returns q_pe [Hq, R]."""
    C = norm_w.shape[0]
    c = ckv[:C].float()
    c = norm_w * (c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps)).to(ckv.dtype)
    p = int(pos.reshape(-1)[0])
    keys[p] = c.to(keys.dtype)
    values[p] = _rope_ref(ckv[C:], freqs)
    pos += 1
    return _rope_ref(q[:, Dn:], freqs).contiguous()


if triton is not None:

    @triton.jit
    def _rope_pairs(x_ptr, stride_row, rows, R, fr, fi, HALF: tl.constexpr):
        """[ROWS, HALF] (even, odd) rotated, fp32, of rows `rows` (each R wide, pairs contiguous); fr / fi [1, HALF]
        the frequencies' real and imaginary parts."""
        i = tl.arange(0, HALF)
        m = (rows[:, None] >= 0) & (i[None, :] < R // 2)
        base = x_ptr + rows[:, None] * stride_row + 2 * i[None, :]
        xe = tl.load(base, mask=m, other=0.0).to(tl.float32)
        xo = tl.load(base + 1, mask=m, other=0.0).to(tl.float32)
        return xe * fr - xo * fi, xe * fi + xo * fr, m

    @triton.jit
    def _mla_rope_write_kernel(
        q_ptr, ckv_ptr, w_ptr, f_ptr, k_ptr, v_ptr, pos_ptr, out_ptr,
        Hq, Dn, C, R, stride_q, stride_k, stride_v, eps,
        BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, HALF: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        DT = out_ptr.dtype.element_ty
        KT = k_ptr.dtype.element_ty
        i = tl.arange(0, HALF)
        cc = tl.arange(0, BLOCK_C)
        cm = cc < C
        # the norm's weight, the frequencies (the step's rotary embedding, made at its start) and the position (this
        # kernel's own write of the step before) do not come from the kernel just before: loaded before the wait
        w = tl.load(w_ptr + cc, mask=cm, other=0.0).to(tl.float32)
        fr = tl.load(f_ptr + 2 * i, mask=i < R // 2, other=0.0)[None, :]
        fi = tl.load(f_ptr + 2 * i + 1, mask=i < R // 2, other=0.0)[None, :]
        p = tl.load(pos_ptr)
        if PDL:  # programmatic dependent launch (kernels/pdl.py): q and ckv (the GEMV's output) follow the wait
            gdc_wait()
            gdc_launch_dependents()
        h = tl.arange(0, BLOCK_H)
        hrow = tl.where(h < Hq, h, -1)
        qe, qo, qm = _rope_pairs(q_ptr + Dn, stride_q, hrow, R, fr, fi, HALF)
        ob = out_ptr + h[:, None] * R + 2 * i[None, :]
        tl.store(ob, round_to(qe, DT).to(DT), mask=qm)
        tl.store(ob + 1, round_to(qo, DT).to(DT), mask=qm)
        one = tl.zeros((1,), dtype=tl.int32)
        ke, ko, km = _rope_pairs(ckv_ptr + C, 0, one, R, fr, fi, HALF)
        x = tl.load(ckv_ptr + cc, mask=cm, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / C + eps)
        n = round_to(x * r, DT)
        c = round_to(round_to(w * n, DT), KT)
        tl.store(k_ptr + p * stride_k + cc, c.to(KT), mask=cm)
        vb = v_ptr + p * stride_v + 2 * i[None, :]
        tl.store(vb, round_to(ke, DT).to(DT), mask=km)
        tl.store(vb + 1, round_to(ko, DT).to(DT), mask=km)
        tl.debug_barrier()
        tl.store(pos_ptr, p + 1)


def mla_rope_write(q, ckv, norm_w, eps: float, freqs, keys, values, pos, Dn: int) -> torch.Tensor:
    """The module docstring's step in one launch; returns q_pe [Hq, R] (rotated, q's dtype)."""
    if triton is None:
        raise RuntimeError("mla_rope_write needs triton")
    if q.dim() != 2 or q.stride(1) != 1 or q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q must be a float [Hq, Dn + R] tensor with contiguous rows, got {tuple(q.shape)}")
    Hq, R = q.shape[0], q.shape[1] - Dn
    C = norm_w.numel()
    dev, dt = q.device, q.dtype
    if R < 2 or R % 2:
        raise ValueError(f"the rope part of q must be even and >= 2 wide, got {R} (q {tuple(q.shape)}, Dn {Dn})")
    if ckv.dim() != 1 or ckv.numel() != C + R or ckv.stride(0) != 1 or ckv.dtype != dt or ckv.device != dev:
        raise ValueError(f"ckv must be a contiguous [C + R] = [{C + R}] {dt} vector on {dev}")
    if norm_w.dim() != 1 or norm_w.stride(0) != 1 or norm_w.dtype != dt or norm_w.device != dev:
        raise ValueError(f"norm_w must be a contiguous [{C}] {dt} vector on {dev} (the model's dtype)")
    if tuple(freqs.shape) != (R // 2, 2) or freqs.dtype != torch.float32 or not freqs.is_contiguous():
        raise ValueError(f"freqs must be contiguous fp32 [R/2, 2] = [{R // 2}, 2] (re, im), got {tuple(freqs.shape)}")
    for name, t, width in (("keys", keys, C), ("values", values, R)):
        if t.dim() != 2 or t.shape[1] != width or t.stride(1) != 1 or t.dtype != dt or t.device != dev:
            raise ValueError(f"{name} must be [L, {width}] {dt} with contiguous rows on {dev}, got {tuple(t.shape)}")
    if keys.shape[0] != values.shape[0]:
        raise ValueError("keys and values must hold the same positions")
    if pos.numel() != 1 or pos.dtype != torch.int64 or pos.device != dev:
        raise ValueError(f"pos must be one int64 on {dev} (a StaticLayer's cumulative_length)")
    out = torch.empty(Hq, R, dtype=dt, device=dev)
    _mla_rope_write_kernel[(1,)](
        q, ckv, norm_w, freqs.to(dev), keys, values, pos, out, Hq, Dn, C, R, q.stride(0), keys.stride(0),
        values.stride(0), float(eps), BLOCK_H=max(2, triton.next_power_of_2(Hq)),
        BLOCK_C=triton.next_power_of_2(C), HALF=max(2, triton.next_power_of_2(R // 2)), **pdl_kw(q),
    )  # fmt: skip
    return out
