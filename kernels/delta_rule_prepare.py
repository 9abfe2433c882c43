"""Gated DeltaNet prefill, part 1 of the chunked gated delta rule (kernels/delta_rule_chunk.py has part 2, the scan):
the intra-chunk phase, every chunk independent of the others.

* `chunk_prepare` (torch, batched over every chunk at once; a fixed ~30 launches whatever T is): exactly
  transformers' first phase of `torch_chunk_gated_delta_rule`, op for op — fp32, l2norm of q and k (eps 1e-6),
  q / sqrt(d_k), padding to a multiple of the chunk size C, cumulative log-decay `cg` within each chunk, the
  unit-lower-triangular system (I + A), A = strictly-lower(beta·k·kᵀ·decay), solved for u = (I + A)⁻¹·(beta·v) and
  w = (I + A)⁻¹·(beta·k·exp(cg)) (`torch.linalg.solve_triangular`), the causal intra-chunk attention (q·kᵀ)·decay,
  q·exp(cg), k·exp(cg_last − cg) and exp(cg_last). It is also the reference of the kernel below.
* `chunk_prepare_triton`: the same in ONE launch of `_chunk_prepare_kernel` (grid B·H_v x N, one chunk of one head
  per program): l2norm, cumsum, the [C, C] products, (I + A)⁻¹ by doubling inverted diagonal blocks (X ← X − X·E·X,
  log2(C) levels of two [C, C] dots) and u, w as two dots; equal to `chunk_prepare` within fp32 rounding. Opt-in
  (`chunk_gated_delta_rule(prepare="triton")`) until `bench/deltanet_prefill.py` times it on a GPU: session 26's
  version, forward substitution over the C rows (63 dependent steps on a [C, C] tile), took 3.885 ms against the
  torch phase's 2.274 at T 2048 (bench/RESULTS.md, "Tried"). The torch phase is ~30 launches a layer, this one.

Shape legend: B batch, T tokens, H_k key heads, H_v value heads, d_k key head dim, d_v value head dim, C chunk size,
N = ceil(T / C) chunks, T_p = N·C.
  q, k [B, T, H_k|H_v, d_k] · v [B, T, H_v, d_v] · g, beta [B, T, H_v]
  prepared: qd, kd, w [B, H_v, T_p, d_k] · u [B, H_v, T_p, d_v] · attn [B, H_v, N, C, C] · chunk_decay [B, H_v, N]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:  # Triton is optional at import time; the launcher needs it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

PRECISIONS = ("ieee", "tf32")  # tl.dot's input_precision ("tf32x3": NaN, then an illegal access, H200 triton 3.6)


def _l2norm(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_prepare(q, k, v, g, beta, chunk_size=64, use_qk_l2norm_in_kernel=True):
    """transformers' intra-chunk phase, batched over all chunks (fp32). Returns (qd, kd, w, u, attn, chunk_decay),
    shapes in the module docstring."""
    HK, HV = k.shape[2], v.shape[2]
    if HK != HV:  # grouped value attention: key head h // R serves value head h
        q = q.repeat_interleave(HV // HK, dim=2)
        k = k.repeat_interleave(HV // HK, dim=2)
    q, k, v, beta, g = (
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for x in (q, k, v, beta, g)
    )
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    q = q * (q.shape[-1] ** -0.5)
    T, C = q.shape[2], chunk_size
    pad = (C - T % C) % C
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(x.shape[0], x.shape[1], -1, C, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(g.shape[0], g.shape[1], -1, C)
    upper = torch.ones(C, C, dtype=torch.bool, device=q.device).triu(1)
    cg = g.cumsum(dim=3)
    decay = (cg.unsqueeze(4) - cg.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * decay
    attn = (q @ k.transpose(-1, -2)) * decay
    k_decayed = k_beta * cg.exp().unsqueeze(-1)
    u = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(ut, k_decayed, upper=False, unitriangular=True)
    qd = q * cg.exp().unsqueeze(-1)
    kd = k * (cg[..., -1:] - cg).exp().unsqueeze(-1)
    chunk_decay = cg[..., -1].exp()
    B, H, N = cg.shape[:3]
    flat = (qd, kd, w, u)
    qd, kd, w, u = (x.reshape(B, H, N * C, x.shape[-1]) for x in flat)
    return qd, kd, w, u, attn, chunk_decay


if triton is not None:

    @triton.jit
    def chunk_gates(g_ptr, b_ptr, bi, h, t64, tm, ic, sg_b, sg_t, sb_b, sb_t, C: tl.constexpr):
        """One chunk of one value head: beta [C], the cumulative log-decay cg [C] and cg's last entry, fp32 (rows past
        T: g = 0 and beta = 0). Shared with kernels/delta_rule_inputs.py."""
        gg = tl.load(g_ptr + bi * sg_b + t64 * sg_t + h, mask=tm, other=0.0).to(tl.float32)
        bb = tl.load(b_ptr + bi * sb_b + t64 * sb_t + h, mask=tm, other=0.0).to(tl.float32)
        cg = tl.cumsum(gg, 0)
        return bb, cg, tl.sum(tl.where(ic == C - 1, cg, 0.0), 0)

    @triton.jit
    def chunk_rows(ptr, bi, hk, t64, tm, ik, km, s_b, s_t, s_h, L2: tl.constexpr):
        """One chunk's rows of q or k [C, d_k] from key head hk in fp32, l2-normalised (eps 1e-6) when L2; rows past
        T are 0. Shared with kernels/delta_rule_inputs.py."""
        x = tl.load(
            ptr + bi * s_b + t64[:, None] * s_t + hk * s_h + ik[None, :], mask=tm[:, None] & km[None, :], other=0.0
        )
        x = x.to(tl.float32)
        if L2:
            x = x * tl.math.rsqrt(tl.sum(x * x, 1) + 1e-6)[:, None]
        return x

    @triton.jit
    def _chunk_prepare_kernel(
        q_ptr,  # [B, T, H_k, d_k] (any float dtype; last dim contiguous)
        k_ptr,
        v_ptr,  # [B, T, H_v, d_v]
        g_ptr,  # [B, T, H_v]
        b_ptr,  # [B, T, H_v] beta
        qd_ptr,  # fp32 [B*H_v, T_p, d_k] outputs (contiguous)
        kd_ptr,
        w_ptr,
        u_ptr,  # fp32 [B*H_v, T_p, d_v]
        a_ptr,  # fp32 [B*H_v, N, C, C]
        cd_ptr,  # fp32 [B*H_v, N]
        T,
        N,
        H,
        R,
        DK,
        DV,
        sq_b,
        sq_t,
        sq_h,
        sk_b,
        sk_t,
        sk_h,
        sv_b,
        sv_t,
        sv_h,
        sg_b,
        sg_t,
        sb_b,
        sb_t,
        scale,
        C: tl.constexpr,
        LOG_C: tl.constexpr,
        DK_P2: tl.constexpr,
        DV_P2: tl.constexpr,
        L2: tl.constexpr,
        PREC: tl.constexpr,
    ):
        """One (batch row, value head, chunk): transformers' intra-chunk phase. The inverse (I + A)^-1 by doubling
        inverted diagonal blocks (2 log2(C) dots), then u and w as two dots."""
        pid = tl.program_id(0)
        c = tl.program_id(1)
        bi = (pid // H).to(tl.int64)
        h = pid % H
        hk = h // R
        ic = tl.arange(0, C)
        t = c * C + ic
        tm = t < T
        t64 = t.to(tl.int64)
        ik = tl.arange(0, DK_P2)
        km = ik < DK
        jv = tl.arange(0, DV_P2)
        vm = jv < DV
        bb, cg, cg_last = chunk_gates(g_ptr, b_ptr, bi, h, t64, tm, ic, sg_b, sg_t, sb_b, sb_t, C)
        lower = ic[:, None] >= ic[None, :]
        decay = tl.where(lower, tl.exp(tl.where(lower, cg[:, None] - cg[None, :], 0.0)), 0.0)  # [C, C]
        k = chunk_rows(k_ptr, bi, hk, t64, tm, ik, km, sk_b, sk_t, sk_h, L2)
        kb = k * bb[:, None]
        a = tl.dot(kb, tl.trans(k), input_precision=PREC) * decay
        a = tl.where(ic[:, None] > ic[None, :], a, 0.0)  # A, strictly lower: L = I + A
        # L^-1 by doubling the inverted diagonal blocks: X, the inverse of L's block diagonal of s x s blocks, gives
        # that of 2s x 2s blocks as X - X E X, E = L's blocks below X's within each 2s block ([[P, 0], [Q, R]]^-1 =
        # [[P^-1, 0], [-R^-1 Q P^-1, R^-1]]). log2(C) levels of two [C, C] dots, no row-by-row loop, and every X is a
        # true inverse (no growing powers of A, as a Neumann product would have).
        tinv = tl.where(ic[:, None] == ic[None, :], 1.0, 0.0)  # s = 1: the unit diagonal
        for lvl in tl.static_range(LOG_C):
            s2 = 2 << lvl
            below = (
                (ic[:, None] // s2 == ic[None, :] // s2) & (ic[:, None] % s2 >= s2 // 2) & (ic[None, :] % s2 < s2 // 2)
            )
            e = tl.where(below, a, 0.0)
            tinv = tinv - tl.dot(tl.dot(tinv, e, input_precision=PREC), tinv, input_precision=PREC)
        row0 = pid.to(tl.int64) * N * C + c * C  # this chunk's first row in the [B*H_v, T_p, .] outputs
        orow = (row0 + ic).to(tl.int64)
        kall = km[None, :] & (ic[:, None] < C)
        w = tl.dot(tinv, kb * tl.exp(cg)[:, None], input_precision=PREC)
        tl.store(w_ptr + orow[:, None] * DK + ik[None, :], w, mask=kall)
        tl.store(kd_ptr + orow[:, None] * DK + ik[None, :], k * tl.exp(cg_last - cg)[:, None], mask=kall)
        q = chunk_rows(q_ptr, bi, hk, t64, tm, ik, km, sq_b, sq_t, sq_h, L2) * scale
        attn = tl.dot(q, tl.trans(k), input_precision=PREC) * decay
        tl.store(a_ptr + (pid.to(tl.int64) * N + c) * C * C + ic[:, None] * C + ic[None, :], attn)
        tl.store(qd_ptr + orow[:, None] * DK + ik[None, :], q * tl.exp(cg)[:, None], mask=kall)
        vmask = tm[:, None] & vm[None, :]
        v = tl.load(v_ptr + bi * sv_b + t64[:, None] * sv_t + h * sv_h + jv[None, :], mask=vmask, other=0.0)
        u = tl.dot(tinv, v.to(tl.float32) * bb[:, None], input_precision=PREC)
        tl.store(u_ptr + orow[:, None] * DV + jv[None, :], u, mask=vm[None, :] & (ic[:, None] < C))
        tl.store(cd_ptr + pid.to(tl.int64) * N + c, tl.exp(cg_last))


def rule_strides(q, k, v, g, beta) -> list[int]:
    """The chunk kernels' stride arguments: q, k, v's batch / token / head strides, then g's, beta's batch / token."""
    return [*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *g.stride()[:2], *beta.stride()[:2]]


def chunk_prepare_triton(q, k, v, g, beta, C, l2, prec):
    """`chunk_prepare`'s outputs from one launch of `_chunk_prepare_kernel` (grid B·H_v x N)."""
    B, T, HK, DK = k.shape
    HV, DV = v.shape[2], v.shape[3]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    g, beta = (x if x.stride(-1) == 1 else x.contiguous() for x in (g, beta))
    N = triton.cdiv(T, C)
    dev = q.device
    qd, kd, w = (torch.empty((B, HV, N * C, DK), dtype=torch.float32, device=dev) for _ in range(3))
    u = torch.empty((B, HV, N * C, DV), dtype=torch.float32, device=dev)
    attn = torch.empty((B, HV, N, C, C), dtype=torch.float32, device=dev)
    chunk_decay = torch.empty((B, HV, N), dtype=torch.float32, device=dev)
    dk2 = max(16, triton.next_power_of_2(DK))
    dv2 = max(16, triton.next_power_of_2(DV))
    _chunk_prepare_kernel[(B * HV, N)](
        q,
        k,
        v,
        g,
        beta,
        qd,
        kd,
        w,
        u,
        attn,
        chunk_decay,
        T,
        N,
        HV,
        HV // HK,
        DK,
        DV,
        *rule_strides(q, k, v, g, beta),
        float(DK**-0.5),
        C=C,
        LOG_C=C.bit_length() - 1,
        DK_P2=dk2,
        DV_P2=dv2,
        L2=bool(l2),
        PREC=prec,
        num_warps=(16 if prec == "ieee" else 8) if max(dk2, dv2) >= 128 else 4,  # sm_90 ieee at 8: 9.7 KiB stack
    )
    return qd, kd, w, u, attn, chunk_decay
