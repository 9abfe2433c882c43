"""Gated DeltaNet prefill: the chunked gated delta rule with its sequential part in one Triton launch.

`chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64, initial_state=None, output_final_state=True,
use_qk_l2norm_in_kernel=True)` has the semantics of transformers' `torch_chunk_gated_delta_rule` (the torch fallback
Qwen3.5's Gated DeltaNet runs for every call but the cached one-token step), in two parts:

1. `chunk_prepare` (torch, batched over every chunk at once; a fixed ~30 launches whatever T is): exactly
   transformers' first phase, op for op — fp32, l2norm of q and k (eps 1e-6), q / sqrt(d_k), padding to a multiple
   of the chunk size C, cumulative log-decay `cg` within each chunk, the unit-lower-triangular system
   (I + A), A = strictly-lower(beta·k·kᵀ·decay), solved for u = (I + A)⁻¹·(beta·v) and w = (I + A)⁻¹·(beta·k·exp(cg))
   (`torch.linalg.solve_triangular`), the causal intra-chunk attention (q·kᵀ)·decay, q·exp(cg), k·exp(cg_last − cg)
   and exp(cg_last).
2. `_chunk_scan_kernel` (ONE launch): the inter-chunk recurrence fused with the output. Grid (B·H_v, d_v / BLOCK_V):
   the columns of the [d_k, d_v] state are independent, so each program owns a [d_k, BLOCK_V] fp32 slice of one
   head's state in registers and walks the chunks in order:
       v_new = u − w·S;   o = (q·exp(cg))·S + attn·v_new;   S = S·exp(cg_last) + (k·exp(cg_last − cg))ᵀ·v_new
   and stores o (rows t < T, cast to q's dtype) and, at the end, S (fp32).

`prepare="triton"` runs part 1 as one launch too, `_chunk_prepare_kernel` (grid B·H_v x N, one chunk of one head
per program): l2norm, cumsum, the [C, C] products, (I + A)⁻¹ by forward substitution over its rows (transformers'
export branch) and u, w as two dots; equal to the torch phase within fp32 rounding. Which is faster on a GPU is
`bench/deltanet_prefill.py`'s to say; "torch" stays the default until measured.

`chunk_gated_delta_rule_ref` is the same first phase followed by transformers' own Python loop over the chunks: it
equals `torch_chunk_gated_delta_rule` bit for bit on the CPU (tests/test_kernel_delta_rule_chunk.py). The dots in
the kernels run in full fp32 (`precision="ieee"`, FMA) by default, like torch's fp32 matmuls; "tf32x3" (three TF32
tensor-core products, about fp32's accuracy) and "tf32" (~1e-3 relative error) are tl.dot's other input precisions.
Compiled offline for sm_90 and sm_89 (triton 3.9, d_k 128; not yet run on a GPU) every scan variant fits in shared
memory with `_scan_stages`, but all spill registers (0.2-13 KiB of stack a thread; ~1 KiB at block_v 16, the default
at d_k 128): which launch is fastest is `bench/deltanet_prefill.py`'s sweep.

q and k may have H_k heads with H_v a multiple of H_k (key head h // (H_v / H_k) serves value head h, transformers'
repeat_interleave; 5.17's module repeats before calling, 5.2x's function inside) or H_v heads.

Shape legend: B batch, T tokens, H_k key heads, H_v value heads, d_k key head dim, d_v value head dim, C chunk size,
N = ceil(T / C) chunks, T_p = N·C.
  q, k [B, T, H_k|H_v, d_k] · v [B, T, H_v, d_v] · g, beta [B, T, H_v] · initial_state [B, H_v, d_k, d_v]
  out [B, T, H_v, d_v] (q's dtype) · final state [B, H_v, d_k, d_v] fp32
  prepared: qd, kd, w [B, H_v, T_p, d_k] · u [B, H_v, T_p, d_v] · attn [B, H_v, N, C, C] · chunk_decay [B, H_v, N]
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

try:  # Triton is optional at import time; the launcher needs it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_PRECISIONS = ("ieee", "tf32x3", "tf32")  # tl.dot's input_precision


def kernel_available(t: torch.Tensor) -> bool:
    """Whether `chunk_gated_delta_rule` compiles for tensors like `t` (CUDA with Triton); else run the reference."""
    return triton is not None and t.is_cuda


# ----------------------------------------------------------------------------------------------------------
# torch: transformers' first phase (shared by the reference and the Triton path), and the reference's loop
# ----------------------------------------------------------------------------------------------------------
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


def chunk_gated_delta_rule_ref(
    q,
    k,
    v,
    g,
    beta,
    chunk_size=64,
    initial_state=None,
    output_final_state=True,
    use_qk_l2norm_in_kernel=True,
):
    """transformers' `torch_chunk_gated_delta_rule`, op for op: (out [B, T, H_v, d_v] in q's dtype, final state
    [B, H_v, d_k, d_v] fp32 or None)."""
    dt, T = q.dtype, q.shape[1]
    qd, kd, w, u, attn, chunk_decay = chunk_prepare(q, k, v, g, beta, chunk_size, use_qk_l2norm_in_kernel)
    B, H, N = chunk_decay.shape
    C, DK, DV = chunk_size, qd.shape[-1], u.shape[-1]
    qd, kd, w, u = (x.reshape(B, H, N, C, x.shape[-1]) for x in (qd, kd, w, u))
    if initial_state is None:
        state = torch.zeros((B, H, DK, DV), dtype=u.dtype, device=u.device)
    else:
        state = initial_state.to(u)
    out = torch.zeros_like(u)
    cd = chunk_decay[..., None, None]
    for i in range(N):
        v_new = u[:, :, i] - w[:, :, i] @ state
        out[:, :, i] = qd[:, :, i] @ state + attn[:, :, i] @ v_new
        state = state * cd[:, :, i] + kd[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(B, H, -1, DV)[:, :, :T]
    out = out.transpose(1, 2).to(dt, memory_format=torch.contiguous_format)
    return out, (state if output_final_state else None)


# ----------------------------------------------------------------------------------------------------------
# Triton kernel: the sequential scan over chunks, fused with the output
# ----------------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _chunk_scan_kernel(
        qd_ptr,  # fp32 [B*H, T_p, d_k] (contiguous)
        kd_ptr,  # fp32 [B*H, T_p, d_k]
        w_ptr,  # fp32 [B*H, T_p, d_k]
        u_ptr,  # fp32 [B*H, T_p, d_v]
        a_ptr,  # fp32 [B*H, N, C, C]
        cd_ptr,  # fp32 [B*H, N]
        s0_ptr,  # [B, H, d_k, d_v] initial state (any float dtype), unused without HAS_S0
        o_ptr,  # [B, T, H, d_v] out, q's dtype
        sf_ptr,  # fp32 [B, H, d_k, d_v] final state, unused without STORE_S
        T,
        N,
        H,
        DK,
        DV,
        so_b,
        so_t,
        so_h,
        s0_b,
        s0_h,
        s0_k,
        C: tl.constexpr,
        DK_P2: tl.constexpr,
        BLOCK_V: tl.constexpr,
        HAS_S0: tl.constexpr,
        STORE_S: tl.constexpr,
        PREC: tl.constexpr,
    ):
        pid = tl.program_id(0)  # one (batch row, value head)
        vb = tl.program_id(1)  # one BLOCK_V slice of that head's d_v columns
        bi = pid // H
        h = pid % H
        ik = tl.arange(0, DK_P2)
        km = ik < DK
        jv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        vm = jv < DV
        ic = tl.arange(0, C)
        if HAS_S0:
            sp = s0_ptr + bi.to(tl.int64) * s0_b + h * s0_h + ik[:, None] * s0_k + jv[None, :]
            s = tl.load(sp, mask=km[:, None] & vm[None, :], other=0.0).to(tl.float32)
        else:
            s = tl.zeros([DK_P2, BLOCK_V], dtype=tl.float32)
        TP = N * C
        base_k = pid.to(tl.int64) * TP * DK
        base_v = pid.to(tl.int64) * TP * DV
        base_a = pid.to(tl.int64) * N * C * C
        o_base = o_ptr + bi.to(tl.int64) * so_b + h * so_h
        for i in range(N):
            rows = i * C + ic
            kmask = km[None, :]
            koff = base_k + rows[:, None].to(tl.int64) * DK + ik[None, :]
            voff = base_v + rows[:, None].to(tl.int64) * DV + jv[None, :]
            w = tl.load(w_ptr + koff, mask=kmask, other=0.0)  # [C, DK_P2]
            u = tl.load(u_ptr + voff, mask=vm[None, :], other=0.0)  # [C, BLOCK_V]
            v_new = u - tl.dot(w, s, input_precision=PREC)
            qd = tl.load(qd_ptr + koff, mask=kmask, other=0.0)
            a = tl.load(a_ptr + base_a + i * C * C + ic[:, None] * C + ic[None, :])  # [C, C]
            o = tl.dot(qd, s, input_precision=PREC) + tl.dot(a, v_new, input_precision=PREC)
            om = (rows < T)[:, None] & vm[None, :]
            tl.store(o_base + rows[:, None].to(tl.int64) * so_t + jv[None, :], o.to(o_ptr.dtype.element_ty), mask=om)
            kd = tl.load(kd_ptr + koff, mask=kmask, other=0.0)
            cd = tl.load(cd_ptr + pid.to(tl.int64) * N + i)
            s = s * cd + tl.dot(tl.trans(kd), v_new, input_precision=PREC)
        if STORE_S:
            fp = sf_ptr + pid.to(tl.int64) * DK * DV + ik[:, None] * DV + jv[None, :]
            tl.store(fp, s, mask=km[:, None] & vm[None, :])

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
        DK_P2: tl.constexpr,
        DV_P2: tl.constexpr,
        L2: tl.constexpr,
        PREC: tl.constexpr,
    ):
        """One (batch row, value head, chunk): transformers' intra-chunk phase. The inverse (I + A)^-1 by forward
        substitution over the rows (transformers' export branch), then u and w as two dots."""
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
        gg = tl.load(g_ptr + bi * sg_b + t64 * sg_t + h, mask=tm, other=0.0).to(tl.float32)  # padding: g = 0
        bb = tl.load(b_ptr + bi * sb_b + t64 * sb_t + h, mask=tm, other=0.0).to(tl.float32)  # and beta = 0
        cg = tl.cumsum(gg, 0)
        cg_last = tl.sum(tl.where(ic == C - 1, cg, 0.0), 0)
        lower = ic[:, None] >= ic[None, :]
        decay = tl.where(lower, tl.exp(tl.where(lower, cg[:, None] - cg[None, :], 0.0)), 0.0)  # [C, C]
        kmask = tm[:, None] & km[None, :]
        k = tl.load(k_ptr + bi * sk_b + t64[:, None] * sk_t + hk * sk_h + ik[None, :], mask=kmask, other=0.0)
        k = k.to(tl.float32)
        if L2:
            k = k * tl.math.rsqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
        kb = k * bb[:, None]
        m = -(tl.dot(kb, tl.trans(k), input_precision=PREC) * decay)
        m = tl.where(ic[:, None] > ic[None, :], m, 0.0)  # -A, strictly lower
        for i in range(1, C):  # row i += row i @ rows < i (already final): M becomes (I + A)^-1 - I
            row = tl.sum(tl.where(ic[:, None] == i, m, 0.0), 0)  # [C], nonzero at columns < i
            new = row + tl.sum(row[:, None] * m, 0)
            m = tl.where(ic[:, None] == i, new[None, :], m)
        tinv = m + tl.where(ic[:, None] == ic[None, :], 1.0, 0.0)
        row0 = pid.to(tl.int64) * N * C + c * C  # this chunk's first row in the [B*H_v, T_p, .] outputs
        orow = (row0 + ic).to(tl.int64)
        kall = km[None, :] & (ic[:, None] < C)
        w = tl.dot(tinv, kb * tl.exp(cg)[:, None], input_precision=PREC)
        tl.store(w_ptr + orow[:, None] * DK + ik[None, :], w, mask=kall)
        tl.store(kd_ptr + orow[:, None] * DK + ik[None, :], k * tl.exp(cg_last - cg)[:, None], mask=kall)
        q = tl.load(q_ptr + bi * sq_b + t64[:, None] * sq_t + hk * sq_h + ik[None, :], mask=kmask, other=0.0)
        q = q.to(tl.float32)
        if L2:
            q = q * tl.math.rsqrt(tl.sum(q * q, 1) + 1e-6)[:, None]
        q = q * scale
        attn = tl.dot(q, tl.trans(k), input_precision=PREC) * decay
        tl.store(a_ptr + (pid.to(tl.int64) * N + c) * C * C + ic[:, None] * C + ic[None, :], attn)
        tl.store(qd_ptr + orow[:, None] * DK + ik[None, :], q * tl.exp(cg)[:, None], mask=kall)
        vmask = tm[:, None] & vm[None, :]
        v = tl.load(v_ptr + bi * sv_b + t64[:, None] * sv_t + h * sv_h + jv[None, :], mask=vmask, other=0.0)
        u = tl.dot(tinv, v.to(tl.float32) * bb[:, None], input_precision=PREC)
        tl.store(u_ptr + orow[:, None] * DV + jv[None, :], u, mask=vm[None, :] & (ic[:, None] < C))
        tl.store(cd_ptr + pid.to(tl.int64) * N + c, tl.exp(cg_last))


@functools.cache
def _max_shared(device_index: int) -> int:
    """Bytes of shared memory one program may take on a CUDA device (0 when Triton's driver cannot say)."""
    try:
        return int(triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"])
    except Exception:  # noqa: BLE001 (no driver query: assume the least and take one stage)
        return 0


def _scan_stages(prec: str, dk2: int, t: torch.Tensor) -> int:
    """Software-pipeline depth of the scan's chunk loop: 2 (the next chunk's tiles load during this one's dots) where
    its shared memory fits, i.e. on an H100/H200 (227 KiB a program; sm_90 builds at d_k 128: fp32 "ieee" dots
    127-164 KiB, "tf32x3" 135-197 KiB at block_v 16-64), else 1 (53-98 KiB: desktop GPUs' ~99 KiB; and "tf32",
    whose 2 stages take 246-295 KiB)."""
    if not t.is_cuda:
        return 2
    smem = _max_shared(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return 2 if prec != "tf32" and dk2 <= 128 and smem >= 200 * 1024 else 1


def _block_v(DV: int, DK: int, B: int, H: int) -> int:
    """Columns per program: at d_k >= 128, 16 (the offline sm_89/sm_90 builds spill least there: ~1 KiB of stack a
    thread against 3-8 KiB at 32-64 with fp32 dots; it also gives B·H_v·d_v/16 programs); at smaller d_k 64, or 32 /
    16 when B·H_v programs alone would leave most of a GPU's SMs idle."""
    dv2 = max(16, triton.next_power_of_2(DV))
    if DK >= 128:
        return 16
    bv = 64 if B * H >= 256 else (32 if B * H >= 32 else 16)
    return min(bv, dv2)


def _prepare_triton(q, k, v, g, beta, C, l2, prec):
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
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        g.stride(0),
        g.stride(1),
        beta.stride(0),
        beta.stride(1),
        float(DK**-0.5),
        C=C,
        DK_P2=dk2,
        DV_P2=dv2,
        L2=bool(l2),
        PREC=prec,
        num_warps=(16 if prec == "ieee" else 8) if max(dk2, dv2) >= 128 else 4,  # sm_90 ieee at 8: 9.7 KiB stack
    )
    return qd, kd, w, u, attn, chunk_decay


def chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    chunk_size=64,
    initial_state=None,
    output_final_state=True,
    use_qk_l2norm_in_kernel=True,
    *,
    block_v: int | None = None,
    num_warps: int | None = None,
    precision: str = "ieee",
    num_stages: int | None = None,
    prepare: str = "torch",
):
    """transformers' `torch_chunk_gated_delta_rule` with the chunk loop in one Triton launch (module docstring).
    q, k [B, T, H_k|H_v, d_k]; v [B, T, H_v, d_v]; g, beta [B, T, H_v]; initial_state [B, H_v, d_k, d_v] or None.
    Returns (out [B, T, H_v, d_v] in q's dtype, final state [B, H_v, d_k, d_v] fp32, or None when not asked for).
    `prepare`: the intra-chunk phase as transformers' torch ops ("torch", ~30 launches whatever T) or in one Triton
    launch ("triton", `_chunk_prepare_kernel`: 2 launches in all)."""
    if triton is None:
        raise RuntimeError("chunk_gated_delta_rule needs triton")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k must be [B, T, H, d_k] and v [B, T, H_v, d_v]")
    B, T, HK, DK = k.shape
    HV, DV = v.shape[2], v.shape[3]
    if q.shape != k.shape or v.shape[:2] != (B, T):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must match, v {tuple(v.shape)} share [B, T]")
    if T < 1 or HV % HK:
        raise ValueError(f"T ({T}) must be >= 1 and H_v ({HV}) a multiple of H_k ({HK})")
    if g.shape != (B, T, HV) or beta.shape != (B, T, HV):
        raise ValueError(f"g and beta must be [B, T, H_v] = {(B, T, HV)}, got {tuple(g.shape)}, {tuple(beta.shape)}")
    if any(t.dtype not in _FLOAT_DTYPES for t in (q, k, v, g, beta)):
        raise ValueError("q, k, v, g, beta must be bf16/fp16/fp32")
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16, got {chunk_size}")
    if len({t.device for t in (q, k, v, g, beta)}) != 1:
        raise ValueError("q, k, v, g, beta must be on one device")
    if initial_state is not None:
        if tuple(initial_state.shape) != (B, HV, DK, DV):
            raise ValueError(
                f"initial_state must be [B, H_v, d_k, d_v] = {(B, HV, DK, DV)}, got {tuple(initial_state.shape)}"
            )
        if initial_state.stride(-1) != 1 or initial_state.dtype not in _FLOAT_DTYPES:
            raise ValueError("initial_state must be a float tensor with a contiguous last dim")
        if initial_state.device != q.device:
            raise ValueError("initial_state must be on q's device")
    if block_v is not None and (block_v < 16 or block_v & (block_v - 1)):
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
    if prepare not in ("torch", "triton"):
        raise ValueError(f"prepare must be 'torch' or 'triton', got {prepare!r}")
    if precision not in _PRECISIONS:
        raise ValueError(f"precision must be one of {_PRECISIONS}, got {precision!r}")
    prec = precision
    if prepare == "torch":
        prepared = chunk_prepare(q, k, v, g, beta, chunk_size, use_qk_l2norm_in_kernel)
    else:
        prepared = _prepare_triton(q, k, v, g, beta, chunk_size, use_qk_l2norm_in_kernel, prec)
    qd, kd, w, u, attn, chunk_decay = (x.contiguous() for x in prepared)  # solve_triangular's may be column-major
    N = chunk_decay.shape[-1]
    out = torch.empty((B, T, HV, DV), dtype=q.dtype, device=q.device)
    final = torch.empty((B, HV, DK, DV), dtype=torch.float32, device=q.device) if output_final_state else out
    s0 = initial_state if initial_state is not None else out
    bv = block_v or _block_v(DV, DK, B, HV)
    dk2 = max(16, triton.next_power_of_2(DK))
    _chunk_scan_kernel[(B * HV, triton.cdiv(DV, bv))](
        qd,
        kd,
        w,
        u,
        attn,
        chunk_decay,
        s0,
        out,
        final,
        T,
        N,
        HV,
        DK,
        DV,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        s0.stride(0) if initial_state is not None else 0,
        s0.stride(1) if initial_state is not None else 0,
        s0.stride(2) if initial_state is not None else 0,
        C=chunk_size,
        DK_P2=dk2,
        BLOCK_V=bv,
        HAS_S0=initial_state is not None,
        STORE_S=output_final_state,
        PREC=prec,
        num_warps=num_warps or 8,
        num_stages=num_stages or _scan_stages(prec, dk2, q),
    )
    return out, (final if output_final_state else None)
