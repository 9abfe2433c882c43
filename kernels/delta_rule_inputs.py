"""Gated DeltaNet prefill, part 1 split: the intra-chunk phase's elementwise and per-chunk work in ONE Triton launch,
its [C, C] products and triangular solves in torch (fp32, as `chunk_prepare`), so the phase takes ~7 launches a layer
instead of the torch phase's ~30 (`prepare="split"` in kernels/delta_rule_chunk.py).

Owns `chunk_prepare_split` (the phase, returning `chunk_prepare`'s outputs), `chunk_inputs` (the Triton launcher),
its torch reference `chunk_inputs_ref` and the kernel `_chunk_inputs_kernel`, grid (B·H_v, N): one chunk of one value
head a program; and the layer's decay and write strength from its projections in one launch (`gate_beta`, torch
reference `gate_beta_ref`, `_gate_beta_kernel`: transformers' g = −exp(A_log)·softplus(a + dt_bias) in fp32 and
beta = sigmoid(b) in b's dtype, 8 launches as torch ops; `deltanet_prefill` takes it with "split").
What `_chunk_inputs_kernel` writes, fp32, every chunk padded to C rows with zeros (g = 0, beta = 0 past T):
  q̂ = l2norm(q) / sqrt(d_k), k̂ = l2norm(k) (eps 1e-6; q and k from key head h // (H_v / H_k)),
  k̂·beta, v·beta, k̂·beta·exp(cg), q̂·exp(cg), k̂·exp(cg_last − cg), the decay [C, C] = exp(cg_i − cg_j) on and below
  the diagonal (0 above), exp(cg_last); cg the cumulative sum of g within the chunk.
Then torch: A = (k̂·beta)·k̂ᵀ·decay and attn = q̂·k̂ᵀ·decay (two batched matmuls, two products), u and w by
`torch.linalg.solve_triangular` on the unit lower triangle of A, as `chunk_prepare` (transformers' first phase op for
op, the reference) solves them. Equal to it within fp32 rounding (the sums' order, exp).

Shape legend as kernels/delta_rule_prepare.py: B batch, T tokens, H_k key heads, H_v value heads, d_k / d_v head dims,
C chunk size, N = ceil(T / C) chunks.
"""

from __future__ import annotations

import torch

from localmoe.kernels.delta_rule_prepare import rule_strides

try:  # Triton is optional at import time; the launcher needs it.
    import triton
    import triton.language as tl

    from localmoe.kernels.delta_rule_prepare import chunk_gates, chunk_rows
except ImportError:  # pragma: no cover
    triton = None
    tl = None

__all__ = ["chunk_inputs", "chunk_inputs_ref", "chunk_prepare_split", "gate_beta", "gate_beta_ref"]
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# the kernel's outputs, in order: [B, H_v, N, C, d] each but decay [B, H_v, N, C, C] and chunk_decay [B, H_v, N]
NAMES = ("q", "k", "k_beta", "v_beta", "k_decayed", "qd", "kd", "decay", "chunk_decay")


# ----------------------------------------------------------------------------------------------------------
# torch reference
# ----------------------------------------------------------------------------------------------------------
def chunk_inputs_ref(q, k, v, g, beta, chunk_size=64, l2=True):
    """`chunk_inputs`' outputs (NAMES) in fp32 torch, transformers' ops."""
    HK, HV = k.shape[2], v.shape[2]
    if HK != HV:
        q = q.repeat_interleave(HV // HK, dim=2)
        k = k.repeat_interleave(HV // HK, dim=2)
    q, k, v, beta, g = (x.transpose(1, 2).to(torch.float32) for x in (q, k, v, beta, g))
    if l2:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * (q.shape[-1] ** -0.5)
    B, H, T = q.shape[:3]
    C = chunk_size
    pad = (C - T % C) % C
    q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (torch.nn.functional.pad(x, (0, pad)) for x in (beta, g))
    q, k, v = (x.reshape(B, H, -1, C, x.shape[-1]) for x in (q, k, v))
    beta, g = beta.reshape(B, H, -1, C), g.reshape(B, H, -1, C)
    cg = g.cumsum(-1)
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = (cg.unsqueeze(-1) - cg.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    kb = k * beta.unsqueeze(-1)
    e = cg.exp().unsqueeze(-1)
    kd = k * (cg[..., -1:] - cg).exp().unsqueeze(-1)
    return q, k, kb, v * beta.unsqueeze(-1), kb * e, q * e, kd, decay, cg[..., -1].exp()


def gate_beta_ref(a, b, A_log, dt_bias):
    """(g fp32, beta in b's dtype) [B, T, H_v] as transformers' Gated DeltaNet computes them from a, b [B, T, H_v]."""
    return -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias), b.sigmoid()


# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _gate_beta_kernel(a_ptr, b_ptr, al_ptr, dt_ptr, g_ptr, beta_ptr, n, H, sa, sb, BLOCK: tl.constexpr):
        """g = -exp(A_log[h]) * softplus(a + dt_bias[h]) (fp32; softplus x past 20, as torch's threshold) and
        beta = sigmoid(b) rounded to beta's dtype, over n = B*T*H_v elements i = r*H_v + h (a, b rows r at strides
        sa, sb; g and beta contiguous)."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        r = (i // H).to(tl.int64)
        h = i % H
        x = tl.load(a_ptr + r * sa + h, mask=m, other=0.0).to(tl.float32)
        x += tl.load(dt_ptr + h, mask=m, other=0.0).to(tl.float32)
        sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        g = -tl.exp(tl.load(al_ptr + h, mask=m, other=0.0).to(tl.float32)) * sp
        tl.store(g_ptr + i, g, mask=m)
        bb = tl.load(b_ptr + r * sb + h, mask=m, other=0.0).to(tl.float32)
        tl.store(beta_ptr + i, (1.0 / (1.0 + tl.exp(-bb))).to(beta_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _chunk_inputs_kernel(
        q_ptr,  # [B, T, H_k, d_k] any float, last dim contiguous
        k_ptr,
        v_ptr,  # [B, T, H_v, d_v]
        g_ptr,  # [B, T, H_v]
        b_ptr,  # [B, T, H_v] beta
        qo_ptr,  # fp32 [B*H_v, N*C, d_k] (contiguous): q̂
        ko_ptr,  # k̂
        kb_ptr,  # k̂ beta
        kx_ptr,  # k̂ beta exp(cg)
        qd_ptr,  # q̂ exp(cg)
        kd_ptr,  # k̂ exp(cg_last - cg)
        vb_ptr,  # fp32 [B*H_v, N*C, d_v]: v beta
        dc_ptr,  # fp32 [B*H_v, N, C, C]: the decay
        cd_ptr,  # fp32 [B*H_v, N]: exp(cg_last)
        T,
        N,
        H,
        R,  # H_v / H_k
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
        DK_P2: tl.constexpr,
        DV_P2: tl.constexpr,
        L2: tl.constexpr,
    ):
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
        e = tl.exp(cg)[:, None]
        row0 = pid.to(tl.int64) * N * C + c * C  # this chunk's first row in the [B*H_v, N*C, .] outputs
        orow = (row0 + ic).to(tl.int64)
        kall = km[None, :] & (ic[:, None] < C)
        okk = orow[:, None] * DK + ik[None, :]
        k = chunk_rows(k_ptr, bi, hk, t64, tm, ik, km, sk_b, sk_t, sk_h, L2)
        kb = k * bb[:, None]
        tl.store(ko_ptr + okk, k, mask=kall)
        tl.store(kb_ptr + okk, kb, mask=kall)
        tl.store(kx_ptr + okk, kb * e, mask=kall)
        tl.store(kd_ptr + okk, k * tl.exp(cg_last - cg)[:, None], mask=kall)
        q = chunk_rows(q_ptr, bi, hk, t64, tm, ik, km, sq_b, sq_t, sq_h, L2) * scale
        tl.store(qo_ptr + okk, q, mask=kall)
        tl.store(qd_ptr + okk, q * e, mask=kall)
        vmask = tm[:, None] & vm[None, :]
        v = tl.load(v_ptr + bi * sv_b + t64[:, None] * sv_t + h * sv_h + jv[None, :], mask=vmask, other=0.0)
        vb = v.to(tl.float32) * bb[:, None]
        tl.store(vb_ptr + orow[:, None] * DV + jv[None, :], vb, mask=vm[None, :] & (ic[:, None] < C))
        lower = ic[:, None] >= ic[None, :]
        decay = tl.where(lower, tl.exp(tl.where(lower, cg[:, None] - cg[None, :], 0.0)), 0.0)
        tl.store(dc_ptr + (pid.to(tl.int64) * N + c) * C * C + ic[:, None] * C + ic[None, :], decay)
        tl.store(cd_ptr + pid.to(tl.int64) * N + c, tl.exp(cg_last))


# ----------------------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------------------
def chunk_inputs(q, k, v, g, beta, chunk_size: int = 64, l2: bool = True, num_warps: int | None = None):
    """One launch of `_chunk_inputs_kernel`: `chunk_inputs_ref`'s outputs (NAMES), fp32 [B, H_v, N, C, .].

    q, k [B, T, H_k, d_k] and v [B, T, H_v, d_v] bf16/fp16/fp32 with a contiguous last dim (any other strides: the
    conv output's views), H_v a multiple of H_k; g, beta [B, T, H_v] float (last dim contiguous); chunk_size a power
    of two >= 16."""
    if triton is None:
        raise RuntimeError("chunk_inputs needs triton")
    if q.dim() != 4 or q.shape != k.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} [B, T, H_k, d_k], v {tuple(v.shape)} share [B, T]")
    B, T, HK, DK = k.shape
    HV, DV = v.shape[2], v.shape[3]
    if T < 1 or HV % HK:
        raise ValueError(f"T ({T}) must be >= 1 and H_v ({HV}) a multiple of H_k ({HK})")
    if g.shape != (B, T, HV) or beta.shape != (B, T, HV):
        raise ValueError(f"g and beta must be [B, T, H_v] = {(B, T, HV)}, got {tuple(g.shape)}, {tuple(beta.shape)}")
    if any(x.dtype not in _FLOAT_DTYPES for x in (q, k, v, g, beta)):
        raise ValueError("q, k, v, g, beta must be bf16/fp16/fp32")
    if len({x.device for x in (q, k, v, g, beta)}) != 1:
        raise ValueError("q, k, v, g, beta must be on one device")
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16, got {chunk_size}")
    q, k, v, g, beta = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, g, beta))
    C = chunk_size
    N = triton.cdiv(T, C)
    dev = q.device
    qo, ko, kb, kx, qd, kd = (torch.empty((B, HV, N, C, DK), dtype=torch.float32, device=dev) for _ in range(6))
    vb = torch.empty((B, HV, N, C, DV), dtype=torch.float32, device=dev)
    decay = torch.empty((B, HV, N, C, C), dtype=torch.float32, device=dev)
    chunk_decay = torch.empty((B, HV, N), dtype=torch.float32, device=dev)
    dk2, dv2 = triton.next_power_of_2(DK), triton.next_power_of_2(DV)
    _chunk_inputs_kernel[(B * HV, N)](
        q, k, v, g, beta, qo, ko, kb, kx, qd, kd, vb, decay, chunk_decay,
        T, N, HV, HV // HK, DK, DV,
        *rule_strides(q, k, v, g, beta),
        float(DK**-0.5),
        C=C, DK_P2=dk2, DV_P2=dv2, L2=bool(l2),
        num_warps=num_warps or (8 if max(dk2, dv2) >= 128 else 4),
    )  # fmt: skip
    return qo, ko, kb, vb, kx, qd, kd, decay, chunk_decay


def gate_beta(a, b, A_log, dt_bias, block: int = 1024):
    """`gate_beta_ref` in one launch of `_gate_beta_kernel`: a, b [B, T, H_v] float, each with its last dim
    contiguous and rows at one stride (views of a wider projection's output are read in place); A_log and dt_bias [H_v]
    float. Returns (g fp32, beta in b's dtype), [B, T, H_v] contiguous."""
    if triton is None:
        raise RuntimeError("gate_beta needs triton")
    H = A_log.numel()
    if a.shape != b.shape or a.dim() != 3 or a.shape[-1] != H or dt_bias.numel() != H:
        raise ValueError(
            f"a {tuple(a.shape)} and b {tuple(b.shape)} must be [B, T, H_v] with A_log and dt_bias [H_v] = [{H}]"
        )
    if any(x.dtype not in _FLOAT_DTYPES for x in (a, b, A_log, dt_bias)):
        raise ValueError("a, b, A_log, dt_bias must be bf16/fp16/fp32")
    if len({x.device for x in (a, b, A_log, dt_bias)}) != 1:
        raise ValueError("a, b, A_log, dt_bias must be on one device")
    a, b = (x if x.stride(2) == 1 and x.stride(0) == x.shape[1] * x.stride(1) else x.contiguous() for x in (a, b))
    A_log, dt_bias = A_log.contiguous(), dt_bias.contiguous()
    g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    beta = torch.empty(b.shape, dtype=b.dtype, device=b.device)
    n = a.numel()
    if n:
        grid = (triton.cdiv(n, block),)
        _gate_beta_kernel[grid](a, b, A_log, dt_bias, g, beta, n, H, a.stride(1), b.stride(1), BLOCK=block)
    return g, beta


def chunk_prepare_split(q, k, v, g, beta, chunk_size=64, l2=True):
    """kernels/delta_rule_prepare.chunk_prepare's outputs (qd, kd, w, u, attn, chunk_decay): `chunk_inputs` (one
    launch), then the two [C, C] products and the two unit-lower-triangular solves in fp32 torch."""
    q, k, kb, vb, kx, qd, kd, decay, chunk_decay = chunk_inputs(q, k, v, g, beta, chunk_size, l2)
    kt = k.transpose(-1, -2)
    a = torch.matmul(kb, kt).mul_(decay)  # (I + A)'s A below the diagonal; the solves read only that part
    attn = torch.matmul(q, kt).mul_(decay)
    u = torch.linalg.solve_triangular(a, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(a, kx, upper=False, unitriangular=True)
    B, H, N, C = decay.shape[:4]
    qd, kd, w, u = (x.reshape(B, H, N * C, x.shape[-1]) for x in (qd, kd, w, u))
    return qd, kd, w, u, attn, chunk_decay
