"""A prompt piece's q/k RMSNorm + rotary embedding (and its k/v write into a static cache) in one launch: the step
between an attention layer's q|k|v GEMM and its attention core, for T tokens (transformers' module: ~30 launches of
norms, RoPE and the cache's update).

Owns `qk_norm_rope_rows` (checked launcher), its torch reference `qk_norm_rope_rows_ref`, and
`_qk_norm_rope_rows_kernel`, grid (T, Hq + Hkv): program (t, h) is kernels/qk_norm_rope.py's program h on token t's
row of the projection with token t's angles (`norm_rope_head`, shared): each head normed over D (the norm's kind),
its first ROT dims rotated as transformers' apply_rotary_pos_emb, every step rounded to the model's dtype as torch's
ops round it; the query programs of a gated layer (Qwen3.5) also copy the gate out, de-interleaved. Norm kinds,
whole-projection norms (OLMoE) and kind "none" (Mixtral, GraniteMoE) as there; no biases, half angles or ring rows
(GPT-OSS's prefill runs transformers' module).

With `kv_cache=(keys, values, position)` (a StaticLayer's [Hkv, L, D] tensors and its position) key program (t, j)
writes token t's key and value head j at row position + t, and the last key program (a ticket over T·Hkv) advances
the position by T: StaticLayer.update's 5 launches in the same one.

Shape legend: T tokens, Hq query heads, Hkv key/value heads, D head dim, ROT rotary dims, QW = 2D (gated) or D,
F = Hq·QW + 2·Hkv·D. qkv [T, F] (rows of the q|k|v GEMM), cos / sin [T, ROT].
Out: q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] (a view of qkv), gate [T, Hq·D] | None.
"""

from __future__ import annotations

import torch

from localmoe.kernels.qk_layout import KINDS, check_cache, check_weights
from localmoe.kernels.qk_norm_rope import qk_norm_rope_ref
from localmoe.kernels.workspace import zeroed_int32

try:  # Triton is optional at import time; the launcher needs it.
    import triton
    import triton.language as tl

    from localmoe.kernels.qk_norm_rope import head_source, norm_rope_head
except ImportError:  # pragma: no cover
    triton = None
    tl = None

__all__ = ["qk_norm_rope_rows", "qk_norm_rope_rows_ref"]

_KIND_ID = {k: i for i, k in enumerate(KINDS)}
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def qk_norm_rope_rows_ref(qkv, q_weight, k_weight, cos, sin, eps, num_q_heads, num_kv_heads, kind="zero_centred",
                          gated=True, whole=False, head_dim=None):  # fmt: skip
    """Same arguments and results as `qk_norm_rope_rows` (without the cache write): kernels/qk_norm_rope.py's
    reference token by token."""
    rows = [
        qk_norm_rope_ref(
            qkv[t], q_weight, k_weight, cos[t], sin[t], eps, num_q_heads, num_kv_heads, kind, gated, whole, head_dim
        )  # fmt: skip
        for t in range(qkv.shape[0])
    ]
    q, k, v = (torch.stack([r[i] for r in rows]) for i in range(3))
    return q, k, v, torch.stack([r[3] for r in rows]) if gated else None


if triton is not None:

    @triton.jit
    def _qk_norm_rope_rows_kernel(
        qkv_ptr,  # [T, F] row stride stride_x, last dim contiguous
        wq_ptr,  # [D] q norm weight ([Hq*D] WHOLE)
        wk_ptr,  # [D] k norm weight ([Hkv*D] WHOLE)
        cos_ptr,  # [T, ROT] row stride stride_c, qkv's dtype
        sin_ptr,  # [T, ROT] row stride stride_c
        out_ptr,  # [T, (Hq + Hkv (+ Hq gated)) * D] contiguous: q heads, k heads, the gate
        kc_ptr,  # [Hkv, L, D] key cache (CACHE only)
        vc_ptr,  # [Hkv, L, D] value cache
        pos_ptr,  # [] int: the first row written, advanced by T (CACHE only)
        tick_ptr,  # [1] int32 ticket of the key programs, zero between launches (CACHE only)
        T,
        HQ,
        HKV,
        eps,
        L,
        stride_x,
        stride_c,
        stride_kh,
        stride_kl,
        stride_vh,
        stride_vl,
        D: tl.constexpr,
        ROT: tl.constexpr,
        KIND: tl.constexpr,  # 0 standard, 1 zero_centred, 2 none
        GATED: tl.constexpr,
        CACHE: tl.constexpr,
        WHOLE: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_W: tl.constexpr,  # >= Hq*D and Hkv*D (WHOLE only)
    ):
        t = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)  # 0 .. Hq-1: query heads; Hq .. Hq+Hkv-1: key heads
        QW: tl.constexpr = 2 * D if GATED else D
        HALF: tl.constexpr = ROT // 2
        cols = tl.arange(0, BLOCK_D)
        m = cols < D
        partner = tl.where(cols < HALF, cols + HALF, cols - HALF)  # rotate_half's source of each rotary column
        pm = m & (cols < ROT)
        x_row = qkv_ptr + t * stride_x
        off, w_ptr, row, n_row, w_off = head_source(head, x_row, wq_ptr, wk_ptr, HQ, HKV, D, QW, WHOLE)
        if KIND != 2:
            w = tl.load(w_ptr + w_off + cols, mask=m, other=0.0).to(tl.float32)
            wp = tl.load(w_ptr + w_off + partner, mask=pm, other=0.0).to(tl.float32)
        else:
            w = tl.zeros([BLOCK_D], dtype=tl.float32)  # (unread)
            wp = w
        c = tl.load(cos_ptr + t * stride_c + cols, mask=pm, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * stride_c + cols, mask=pm, other=0.0).to(tl.float32)
        DT = out_ptr.dtype.element_ty
        src = x_row + off
        res = norm_rope_head(src, row, n_row, w, wp, c, s, eps, cols, m, partner, pm, D, HALF, KIND, WHOLE,
                             BLOCK_W, DT).to(DT)  # fmt: skip
        width = (2 * HQ + HKV) * D if GATED else (HQ + HKV) * D
        out_row = out_ptr + t * width
        tl.store(out_row + head * D + cols, res, mask=m)
        if CACHE:
            if head >= HQ:  # key head j of token t: its key and value at row position + t
                j = (head - HQ).to(tl.int64)
                pos = tl.load(pos_ptr).to(tl.int64)
                at = pos + t
                cm = m & ((cols * 0 + at) < L)  # (a tensor: the interpreter masks with tensors only)
                tl.store(kc_ptr + j * stride_kh + at * stride_kl + cols, res, mask=cm)
                vv = tl.load(x_row + HQ * QW + HKV * D + j * D + cols, mask=m, other=0.0)
                tl.store(vc_ptr + j * stride_vh + at * stride_vl + cols, vv.to(vc_ptr.dtype.element_ty), mask=cm)
                tl.debug_barrier()  # this program has read the position before the release below
                if tl.atomic_add(tick_ptr, 1, sem="acq_rel", scope="gpu") == T * HKV - 1:  # all have read it
                    tl.store(pos_ptr, (pos + T).to(pos_ptr.dtype.element_ty))
                    tl.store(tick_ptr, 0)
        if GATED:
            if head < HQ:  # de-interleave the output gate: [q_h | gate_h] -> gate[h*D : (h+1)*D]
                g = tl.load(src + D + cols, mask=m, other=0.0)
                tl.store(out_row + (HQ + HKV) * D + head * D + cols, g, mask=m)


def qk_norm_rope_rows(
    qkv: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    kind: str = "zero_centred",
    gated: bool = True,
    kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    whole: bool = False,
    head_dim: int | None = None,
):
    """T tokens' q|k|v projection rows qkv [T, F] -> (q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] (a view of qkv),
    gate [T, Hq*D] | None), kernels/qk_norm_rope.py's arithmetic per token with its angles cos / sin [T, ROT] (qkv's
    dtype). `kv_cache` (keys, values [Hkv, L, D], a one-element int position): k and v also written at rows
    position .. position + T - 1 (rows >= L are not written), the position advanced by T. No host sync."""
    if triton is None:
        raise RuntimeError("qk_norm_rope_rows needs triton")
    if kind not in _KIND_ID:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if qkv.dim() != 2 or qkv.dtype not in _FLOAT_DTYPES or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be a float [T, F] tensor with a contiguous last dim, got {qkv.dtype} "
                         f"{tuple(qkv.shape)}")  # fmt: skip
    T, F = qkv.shape
    Hq, Hkv = num_q_heads, num_kv_heads
    if Hq < 1 or Hkv < 1:
        raise ValueError(f"head counts must be positive, got {Hq} and {Hkv}")
    if whole and gated:
        raise ValueError("whole-projection norms are for ungated layers (OLMoE)")
    if kind == "none":
        if q_weight is not None or k_weight is not None or whole or not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError("kind 'none' (no q/k norms) takes no norm weights and no `whole`, and needs head_dim")
        D = head_dim
        q_weight = k_weight = qkv  # dummies, never read
    else:
        D = check_weights(q_weight, k_weight, kind, qkv.dtype, qkv.device, whole, Hq, Hkv)
        if head_dim is not None and head_dim != D:
            raise ValueError(f"head_dim {head_dim} differs from the norm weights' head dim {D}")
    QW = 2 * D if gated else D
    if F != Hq * QW + 2 * Hkv * D:
        raise ValueError(f"qkv has {F} features; the heads need {Hq * QW + 2 * Hkv * D}")
    ROT = cos.shape[-1] if cos.dim() == 2 else -1
    if (cos.shape != sin.shape or cos.dim() != 2 or cos.shape[0] != T or ROT % 2 or not 2 <= ROT <= D
            or cos.stride(1) != 1 or sin.stride(1) != 1 or sin.stride(0) != cos.stride(0)):  # fmt: skip
        raise ValueError(f"cos and sin must be [T, ROT] = [{T}, ROT] rows (ROT even, <= {D}) of one stride, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")  # fmt: skip
    if cos.dtype != qkv.dtype or sin.dtype != qkv.dtype or cos.device != qkv.device or sin.device != qkv.device:
        raise ValueError(f"cos/sin must be {qkv.dtype} on {qkv.device} like qkv")
    row = qkv[0] if T else qkv.new_empty(F)
    kc, vc, pos = check_cache(kv_cache, Hkv, D, row)
    tick = zeroed_int32("qk_norm_rope_rows", qkv.device, 1) if kv_cache is not None else pos
    width = (2 * Hq + Hkv) * D if gated else (Hq + Hkv) * D
    out = torch.empty(T, width, dtype=qkv.dtype, device=qkv.device)
    if T:
        _qk_norm_rope_rows_kernel[(T, Hq + Hkv)](
            qkv, q_weight, k_weight, cos, sin, out, kc, vc, pos, tick,
            T, Hq, Hkv, float(eps), kc.shape[1], qkv.stride(0), cos.stride(0),
            kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
            D=D, ROT=ROT, KIND=_KIND_ID[kind], GATED=gated, CACHE=kv_cache is not None, WHOLE=whole,
            BLOCK_D=triton.next_power_of_2(D),
            BLOCK_W=triton.next_power_of_2(max(Hq, Hkv) * D) if whole else 1,
            num_warps=1 if D <= 128 else 2,
        )  # fmt: skip
    q = out[:, : Hq * D].view(T, Hq, D)
    k = out[:, Hq * D : (Hq + Hkv) * D].view(T, Hkv, D)
    gate = out[:, (Hq + Hkv) * D :] if gated else None
    v = qkv[:, Hq * QW + Hkv * D :].view(T, Hkv, D)
    return q, k, v, gate
