"""Gated DeltaNet prefill: the chunked gated delta rule with its sequential part in one Triton launch.

`chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64, initial_state=None, output_final_state=True,
use_qk_l2norm_in_kernel=True)` has the semantics of transformers' `torch_chunk_gated_delta_rule` (the torch fallback
Qwen3.5's Gated DeltaNet runs for every call but the cached one-token step), in two parts:

1. `chunk_prepare` (kernels/delta_rule_prepare.py; torch, batched over every chunk at once, ~30 launches whatever T
   is): exactly transformers' first phase — l2norm, decays, (I + A)⁻¹ applied to beta·v and beta·k·exp(cg), the
   causal intra-chunk attention.
2. `_chunk_scan_kernel` (ONE launch): the inter-chunk recurrence fused with the output. Grid (B·H_v, d_v / BLOCK_V):
   the columns of the [d_k, d_v] state are independent, so each program owns a [d_k, BLOCK_V] fp32 slice of one
   head's state in registers and walks the chunks in order:
       v_new = u − w·S;   o = (q·exp(cg))·S + attn·v_new;   S = S·exp(cg_last) + (k·exp(cg_last − cg))ᵀ·v_new
   and stores o (rows t < T, cast to q's dtype) and, at the end, S (fp32).

`prepare="triton"` runs part 1 as one launch too (kernels/delta_rule_prepare.py `chunk_prepare_triton`);
`prepare="split"` its elementwise and per-chunk work as one launch and its [C, C] products and triangular solves in
fp32 torch (kernels/delta_rule_inputs.py `chunk_prepare_split`, ~7 launches). Which is faster on a GPU is
`bench/deltanet_prefill.py`'s and `bench/staging_ab.py --deltanet`'s to say; "torch" stays the default until measured.

`chunk_gated_delta_rule_ref` is the same first phase followed by transformers' own Python loop over the chunks: it
equals `torch_chunk_gated_delta_rule` bit for bit on the CPU (tests/test_kernel_delta_rule_chunk.py). The dots in
the kernels run in full fp32 (`precision="ieee"`, FMA) by default, like torch's fp32 matmuls; "tf32" (~1e-3
relative error) is the other input precision offered ("tf32x3" was dropped: on the H200 with triton 3.6 its scan
returned NaN, then faulted with an illegal memory access).
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

from localmoe.kernels.delta_rule_inputs import chunk_prepare_split
from localmoe.kernels.delta_rule_prepare import PRECISIONS, chunk_prepare, chunk_prepare_triton

try:  # Triton is optional at import time; the launcher needs it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PREPARES = ("torch", "split", "triton")  # the intra-chunk phase: torch ops, one Triton launch + torch dots, one launch


def kernel_available(t: torch.Tensor) -> bool:
    """Whether `chunk_gated_delta_rule` compiles for tensors like `t` (CUDA with Triton); else run the reference."""
    return triton is not None and t.is_cuda


# ----------------------------------------------------------------------------------------------------------
# torch: the reference (the first phase from delta_rule_prepare, then transformers' loop over the chunks)
# ----------------------------------------------------------------------------------------------------------
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
    127-164 KiB at block_v 16-64), else 1 (53-98 KiB: desktop GPUs' ~99 KiB; and "tf32",
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
    `prepare` (PREPARES): the intra-chunk phase as transformers' torch ops ("torch", ~30 launches whatever T), in one
    Triton launch ("triton", kernels/delta_rule_prepare.py: 2 launches in all), or its elementwise work in one launch
    and its products and solves in torch ("split", kernels/delta_rule_inputs.py: ~7 launches)."""
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
    if prepare not in PREPARES:
        raise ValueError(f"prepare must be one of {PREPARES}, got {prepare!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    prec = precision
    if prepare == "torch":
        prepared = chunk_prepare(q, k, v, g, beta, chunk_size, use_qk_l2norm_in_kernel)
    elif prepare == "split":
        prepared = chunk_prepare_split(q, k, v, g, beta, chunk_size, use_qk_l2norm_in_kernel)
    else:
        prepared = chunk_prepare_triton(q, k, v, g, beta, chunk_size, use_qk_l2norm_in_kernel, prec)
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
