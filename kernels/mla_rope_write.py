"""DeepSeek-V2's MLA for one decode token, between its input projections and the absorbed core, in one launch: the
compressed KV's RMSNorm, the rotary embedding of the query's and the key's rope parts, and the write of the token's
latents into a transformers StaticLayer (advancing its position), as `DeepseekV2Attention` computes them.

    c     = kv_a_layernorm(ckv[:C])                        w · (x·rsqrt(mean(x²) + eps)).to(dtype), standard RMSNorm
    q_pe  = rope(q[h, Dn:])  for every head h              transformers' `apply_rotary_emb`: pairs (2i, 2i+1) as
    k_pe  = rope(ckv[C:])                                  complex numbers times freqs_cis[i], in fp32, cast back
    keys[pos] = c, values[pos] = k_pe, pos += 1            StaticLayer.update for one token

freqs_cis (complex64 [R/2], its magnitude carrying yarn's attention scaling) is read as (re, im) pairs. Every
rounding transformers makes is reproduced with `round_to`. Grid (1,): one program does it all (Hq·R + C + R values;
the position is advanced by the same program after its writes, or left to the core: `advance=False`). With `w_uk`
the absorbed query q_lat = q_nope · W_UK (kernels/mla_absorb.py's product, which needs only the projection) comes
from Hq·C/BLOCK_N more programs of the same launch, one launch fewer per layer. A programmatic dependent launch
(kernels/pdl.py): the norm's weight, the frequencies, the position and W_UK are loaded before the wait, q and ckv
(the GEMV's) after it.

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
        q_ptr, ckv_ptr, w_ptr, f_ptr, k_ptr, v_ptr, pos_ptr, out_ptr, wuk_ptr, lat_ptr,
        Hq, Dn, C, R, stride_q, stride_k, stride_v, eps, stride_uh, stride_uk, NB,
        BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, HALF: tl.constexpr, BLOCK_K: tl.constexpr,
        BLOCK_N: tl.constexpr, ABSORB: tl.constexpr, ADVANCE: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        i = tl.arange(0, HALF)
        cc = tl.arange(0, BLOCK_C)
        cm = cc < C
        # the norm's weight, the frequencies (the step's rotary embedding, made at its start), the position (its
        # last write was the step before's) and W_UK do not come from the kernel just before: loaded before the wait
        w = tl.load(w_ptr + cc, mask=cm, other=0.0).to(tl.float32)
        fr = tl.load(f_ptr + 2 * i, mask=i < R // 2, other=0.0)[None, :]
        fi = tl.load(f_ptr + 2 * i + 1, mask=i < R // 2, other=0.0)[None, :]
        p = tl.load(pos_ptr)
        if ABSORB:  # programs pid < Hq * NB: q_lat[h, n-block] = q_nope[h] . W_UK[h][:, n-block]; the last: the write
            hu = (pid // NB).to(tl.int64)
            nn = (pid % NB) * BLOCK_N + tl.arange(0, BLOCK_N)
            nm = (nn < C) & ((nn * 0 + pid) < Hq * NB)  # (a tensor: the interpreter masks with tensors only)
            kk = tl.arange(0, BLOCK_K)
            wt = tl.load(wuk_ptr + hu * stride_uh + kk.to(tl.int64)[:, None] * stride_uk + nn[None, :],
                         mask=(kk < Dn)[:, None] & nm[None, :], other=0.0)  # fmt: skip
        if PDL:  # programmatic dependent launch (kernels/pdl.py): q and ckv (the GEMV's output) follow the wait
            gdc_wait()
            gdc_launch_dependents()
        write = True  # this program norms, rotates and writes (with ABSORB only the last one)
        if ABSORB:
            write = pid == Hq * NB
            if pid < Hq * NB:  # fp32 sums rounded once to q's dtype (as kernels/mla_absorb.py)
                xv = tl.load(q_ptr + hu * stride_q + kk, mask=kk < Dn, other=0.0).to(tl.float32)
                acc = tl.sum(wt.to(tl.float32) * xv[:, None], axis=0)
                tl.store(lat_ptr + hu * C + nn, acc.to(lat_ptr.dtype.element_ty), mask=nm)
        if write:
            _rope_write(q_ptr, ckv_ptr, k_ptr, v_ptr, pos_ptr, out_ptr, w, fr, fi, p, i, cc, cm, Hq, Dn, C, R,
                        stride_q, stride_k, stride_v, eps, BLOCK_H, HALF, ADVANCE)  # fmt: skip

    @triton.jit
    def _rope_write(
        q_ptr, ckv_ptr, k_ptr, v_ptr, pos_ptr, out_ptr, w, fr, fi, p, i, cc, cm, Hq, Dn, C, R, stride_q, stride_k,
        stride_v, eps, BLOCK_H: tl.constexpr, HALF: tl.constexpr, ADVANCE: tl.constexpr,
    ):  # fmt: skip
        """After the wait: q_pe for every head, the latents normed and written at p (and p advanced)."""
        DT = out_ptr.dtype.element_ty
        KT = k_ptr.dtype.element_ty
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
        if ADVANCE:  # (else kernels/mla_decode.py's split advances it, after reading it before its wait)
            tl.debug_barrier()
            tl.store(pos_ptr, p + 1)


def mla_rope_write(
    q, ckv, norm_w, eps: float, freqs, keys, values, pos, Dn: int, *, w_uk=None, advance: bool = True, BLOCK_N=64
):
    """The module docstring's step in one launch; returns q_pe [Hq, R] (rotated, q's dtype), or with `w_uk` (W_UK
    [Hq, Dn, C], C contiguous: a view of kv_b_proj's weight) (q_pe, q_lat [Hq, C]): q_lat = q[:, :Dn] · W_UK per head,
    computed by Hq·C/BLOCK_N more programs of the same launch (it does not depend on the write). `advance=False`
    leaves the position for the core to advance (kernels/mla_decode.py's `advance=True`)."""
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
    if w_uk is not None and (
        w_uk.dim() != 3 or tuple(w_uk.shape) != (Hq, Dn, C) or w_uk.stride(2) != 1 or w_uk.dtype != dt
        or w_uk.device != dev
    ):  # fmt: skip
        raise ValueError(f"w_uk must be [Hq, Dn, C] = {(Hq, Dn, C)} {dt} on {dev} with C contiguous")
    out = torch.empty(Hq, R, dtype=dt, device=dev)
    absorb = w_uk is not None
    bn = min(triton.next_power_of_2(max(1, BLOCK_N)), triton.next_power_of_2(C))
    nb = triton.cdiv(C, bn) if absorb else 0
    lat = torch.empty(Hq, C, dtype=dt, device=dev) if absorb else out
    _mla_rope_write_kernel[(Hq * nb + 1,)](
        q, ckv, norm_w, freqs.to(dev), keys, values, pos, out, w_uk if absorb else out, lat, Hq, Dn, C, R,
        q.stride(0), keys.stride(0), values.stride(0), float(eps), w_uk.stride(0) if absorb else 0,
        w_uk.stride(1) if absorb else 0, nb, BLOCK_H=max(2, triton.next_power_of_2(Hq)),
        BLOCK_C=triton.next_power_of_2(C), HALF=max(2, triton.next_power_of_2(R // 2)),
        BLOCK_K=triton.next_power_of_2(Dn), BLOCK_N=bn, ABSORB=absorb, ADVANCE=bool(advance), **pdl_kw(q),
    )  # fmt: skip
    return (out, lat) if absorb else out
