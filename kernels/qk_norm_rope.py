"""Per-head (or whole-projection, or no) q/k RMSNorm + rotary embedding of one decode token in one launch: the step
between an attention layer's q|k|v projection (one GEMV) and its cache update.

Owns `qk_norm_rope` (checked Triton launcher; its arguments' layout and checks are kernels/qk_layout.py's), its torch
reference `qk_norm_rope_ref`, the per-head norm + RoPE @triton.jit helpers (`norm_rope`, `norm_rope_head`,
`head_source`: shared with kernels/qk_norm_rope_rows.py and kernels/decode_attention.py), and one Triton kernel
`_qk_norm_rope_kernel`, grid (Hq + Hkv,): one program per query or key head, one full-width load of the head (no
loop: head_dim <= a few hundred). Each program normalises its head over D (fp32, the norm's `kind`), rotates its
first ROT dims by (cos, sin) in transformers' rotate_half convention (partial rotary: ROT < D leaves the rest
as normed), and writes the head; the query programs of a gated layer (Qwen3.5: q_proj gives each head's query and
output gate interleaved, [q_h | gate_h]) also copy the gate out, de-interleaved. Value heads need no work: they
are returned as a view of the projection. Whole-projection norms (OLMoE: q_norm over all Hq*D query features, k_norm
over all Hkv*D key features, weights [Hq*D] / [Hkv*D]): each program takes the mean of squares over its whole q or k
row (one more load of Hq*D values, from L2) and its head's slice of the weight; not with a gate.

Norm kinds (transformers' `*RMSNorm` modules, x̂ = x·rsqrt(mean(x²)+eps) in fp32):
* "zero_centred" (Qwen3.5 `Qwen3_5MoeRMSNorm`):  y = (x̂ · (1 + w.float())).to(x.dtype)
* "standard"     (Qwen3-MoE & co.):              y = w * x̂.to(x.dtype)          (promote(w, x) must be x's dtype)
* "none"         (Mixtral, GraniteMoE: no q/k norms):  y = x; no weights (None), the head dim given as `head_dim`
RoPE (transformers' `apply_rotary_pos_emb`, in x's dtype): y_rot = y·cos + rotate_half(y)·sin, each product and the
sum rounded to x's dtype as torch's elementwise ops round them (`round_to`: RTNE, also under the interpreter), so
bf16 results equal transformers' except where rsqrt differs by an ulp.

With `kv_cache=(keys, values, position)` (a static cache layer's [Hkv, L, D] tensors and its int position tensor)
the key programs also write their key and value heads at that position and the last of them (a ticket) advances
the position by one: transformers' StaticLayer.update (5 launches: arange, add, the position's add_, two
index_copy_) in the same launch.

Shape legend: Hq query heads, Hkv key/value heads, D head dim, ROT rotary dims (even, <= D), QW = 2D (gated:
[q_h | gate_h] per head) or D. qkv [Hq*QW + Hkv*D + Hkv*D] one token's q|k|v projection; cos, sin [ROT].
Out: q [Hq, D], k [Hkv, D], v [Hkv, D] (view of qkv), gate [Hq*D] (gated) — q, k, gate views of one new buffer.
"""

from __future__ import annotations

import torch

from localmoe.kernels.qk_layout import KINDS, qk_layout
from localmoe.kernels.workspace import zeroed_int32

try:  # Triton is optional at import time; the launcher needs it.
    import triton
    import triton.language as tl

    from localmoe.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_kw
    from localmoe.kernels.rounding import round_to
except ImportError:  # pragma: no cover
    triton = None
    tl = None

_KIND_ID = {k: i for i, k in enumerate(KINDS)}  # the kernel's KIND constexpr


# ----------------------------------------------------------------------------------------------------------
# torch reference (transformers' formulas, written out)
# ----------------------------------------------------------------------------------------------------------
def _norm_ref(x, w, eps, kind):
    if kind == "none":
        return x
    dt = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if kind == "zero_centred":
        return (h * (1.0 + w.float())).type_as(x)
    if kind == "standard":
        return w * h.to(dt)
    raise ValueError(kind)


def _rope_ref(x, cos, sin):
    """apply_rotary_pos_emb on one tensor: x [..., D], cos/sin [ROT] (partial rotary when ROT < D)."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2 :]
    return torch.cat([x_rot * cos + torch.cat((-x2, x1), dim=-1) * sin, x_pass], dim=-1)


def qk_norm_rope_ref(
    qkv,
    q_weight,
    k_weight,
    cos,
    sin,
    eps,
    num_q_heads,
    num_kv_heads,
    kind="zero_centred",
    gated=True,
    whole=False,
    head_dim=None,
    bias=None,
    half_angles=False,
):
    """Same arguments and results as `qk_norm_rope`: (q [Hq, D], k [Hkv, D], v [Hkv, D], gate [Hq*D] | None)."""
    if bias is not None:
        qkv = qkv.reshape(-1) + bias
    if half_angles:
        cos, sin = (torch.cat([t.reshape(-1), t.reshape(-1)]) for t in (cos, sin))
    Hq, Hkv = num_q_heads, num_kv_heads
    if kind == "none":
        D = head_dim
    else:
        D = q_weight.shape[0] // Hq if whole else q_weight.shape[0]
    QW = 2 * D if gated else D
    flat = qkv.reshape(-1)
    q_all = flat[: Hq * QW].view(Hq, QW)
    k = flat[Hq * QW : Hq * QW + Hkv * D].view(Hkv, D)
    v = flat[Hq * QW + Hkv * D :].view(Hkv, D)
    cos, sin = cos.reshape(-1), sin.reshape(-1)
    if whole:
        q = _rope_ref(_norm_ref(q_all.reshape(-1), q_weight, eps, kind).view(Hq, D), cos, sin)
        k = _rope_ref(_norm_ref(k.reshape(-1), k_weight, eps, kind).view(Hkv, D), cos, sin)
        return q, k, v, None
    q = _rope_ref(_norm_ref(q_all[:, :D], q_weight, eps, kind), cos, sin)
    k = _rope_ref(_norm_ref(k, k_weight, eps, kind), cos, sin)
    return q, k, v, (q_all[:, D:].reshape(-1) if gated else None)


# ----------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _normed(h, w, KIND: tl.constexpr, DT: tl.constexpr):
        """x̂ -> the norm's output, rounded to DT (exact in fp32 from here on)."""
        if KIND == 0:
            return round_to(round_to(h, DT) * w, DT)
        else:
            return round_to(h * (1.0 + w), DT)  # (KIND 2, no norm, never comes here)

    @triton.jit
    def norm_rope(
        x, xp, row, n_row, w, wp, c, s, eps, cols,
        D: tl.constexpr, HALF: tl.constexpr, KIND: tl.constexpr, WHOLE: tl.constexpr, BLOCK_W: tl.constexpr,
        DT: tl.constexpr,
    ):  # fmt: skip
        """One head x (fp32; xp: x at rotate_half's partner columns) normed (`KIND`; WHOLE: over the n_row values
        at `row`) and rotated by (c, s) over its first 2 HALF columns, every step rounded to DT as transformers
        rounds it: fp32 holding DT values. Shared with kernels/decode_attention.py's QK prologue."""
        if KIND == 2:  # no norm: the projection's values (exact in fp32)
            y = x
            yp = xp
        else:
            if WHOLE:
                wc = tl.arange(0, BLOCK_W)
                xa = tl.load(row + wc, mask=wc < n_row, other=0.0).to(tl.float32)
                rstd = tl.math.rsqrt(tl.sum(xa * xa, axis=0) / n_row + eps)
            else:
                rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)
            y = _normed(x * rstd, w, KIND, DT)
            yp = _normed(xp * rstd, wp, KIND, DT)
        sign = tl.where(cols < HALF, -1.0, 1.0)  # rotate_half = cat(-x2, x1)
        r = round_to(round_to(y * c, DT) + round_to((sign * yp) * s, DT), DT)
        return tl.where(cols < 2 * HALF, r, y)

    @triton.jit
    def norm_rope_head(
        src, row, n_row, w, wp, c, s, eps, cols, m, partner, pm,
        D: tl.constexpr, HALF: tl.constexpr, KIND: tl.constexpr, WHOLE: tl.constexpr, BLOCK_W: tl.constexpr,
        DT: tl.constexpr,
    ):  # fmt: skip
        """`norm_rope` of the head at `src` (D values, loaded here at `cols` and at their `partner`s)."""
        x = tl.load(src + cols, mask=m, other=0.0).to(tl.float32)
        xp = tl.load(src + partner, mask=pm, other=0.0).to(tl.float32)
        return norm_rope(x, xp, row, n_row, w, wp, c, s, eps, cols, D, HALF, KIND, WHOLE, BLOCK_W, DT)

    @triton.jit
    def head_source(head, x_row, wq_ptr, wk_ptr, HQ, HKV, D: tl.constexpr, QW: tl.constexpr, WHOLE: tl.constexpr):
        """Program `head`'s place in one token's q|k|v row x_row (query heads 0 .. HQ-1, then key heads): (its offset,
        its norm weight, and for WHOLE norms the projection the norm spans, that projection's length and the head's
        slice of the weight; w_off 0 for per-head norms). Shared with kernels/qk_norm_rope_rows.py."""
        if head < HQ:
            off = head * QW
            w_ptr = wq_ptr
            row = x_row
            n_row = HQ * D
            w_off = head * D
        else:
            off = HQ * QW + (head - HQ) * D
            w_ptr = wk_ptr
            row = x_row + HQ * QW
            n_row = HKV * D
            w_off = (head - HQ) * D
        if not WHOLE:
            w_off = 0
        return off, w_ptr, row, n_row, w_off

    @triton.jit
    def _qk_norm_rope_kernel(
        qkv_ptr,  # [Hq*QW + 2*Hkv*D] one token's q|k|v projection, contiguous
        wq_ptr,  # [D] q norm weight
        wk_ptr,  # [D] k norm weight, wq's dtype
        cos_ptr,  # [ROT] qkv's dtype
        sin_ptr,  # [ROT]
        out_ptr,  # [(Hq + Hkv)*D (+ Hq*D gated)] out, qkv's dtype: q heads, then k heads, then the gate
        kc_ptr,  # [Hkv, L, D] key cache, strides (stride_kh, stride_kl, 1) (CACHE only)
        vc_ptr,  # [Hkv, L, D] value cache, strides (stride_vh, stride_vl, 1)
        pos_ptr,  # [] int: the position written, advanced by one (CACHE only)
        tick_ptr,  # [1] int32 ticket of the key programs, zero between launches (CACHE only)
        b_ptr,  # [Hq*QW + 2*Hkv*D] the projections' biases, qkv's dtype (HAS_BIAS only)
        HQ,
        HKV,
        eps,
        L,
        stride_kh,
        stride_kl,
        stride_vh,
        stride_vl,
        D: tl.constexpr,
        ROT: tl.constexpr,
        KIND: tl.constexpr,  # 0 standard, 1 zero_centred, 2 none (no norm: wq_ptr / wk_ptr unread)
        GATED: tl.constexpr,  # q heads are [q_h | gate_h] (QW = 2D); else [q_h] (QW = D)
        CACHE: tl.constexpr,
        WHOLE: tl.constexpr,  # norms over the whole q / k projection (weights [Hq*D] / [Hkv*D]); else per head
        HAS_BIAS: tl.constexpr,  # q|k|v + bias (rounded to qkv's dtype) first; v (+ bias) also written to out
        HALF_ANGLES: tl.constexpr,  # cos/sin [ROT/2], one angle per rotated pair (GPT-OSS); else [ROT]
        RING: tl.constexpr,  # the cache row written is position % L (a sliding window's ring); else the position
        BLOCK_D: tl.constexpr,
        BLOCK_W: tl.constexpr,  # >= Hq*D and Hkv*D (WHOLE only)
        PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py): the norm weights are read before the wait
    ):
        head = tl.program_id(0)  # 0 .. Hq-1: query heads; Hq .. Hq+Hkv-1: key heads
        QW: tl.constexpr = 2 * D if GATED else D
        HALF: tl.constexpr = ROT // 2
        cols = tl.arange(0, BLOCK_D)
        m = cols < D
        rot = cols < ROT
        partner = tl.where(cols < HALF, cols + HALF, cols - HALF)  # rotate_half's source of each rotary column
        pm = m & rot
        off, w_ptr, row, n_row, w_off = head_source(head, qkv_ptr, wq_ptr, wk_ptr, HQ, HKV, D, QW, WHOLE)
        src = qkv_ptr + off
        if KIND != 2:
            w = tl.load(w_ptr + w_off + cols, mask=m, other=0.0).to(tl.float32)
            wp = tl.load(w_ptr + w_off + partner, mask=pm, other=0.0).to(tl.float32)
        # cos, sin: made at the start of the step, with the q|k|v projection's kernel at least between: complete
        ang = tl.where(cols < HALF, cols, cols - HALF) if HALF_ANGLES else cols
        c = tl.load(cos_ptr + ang, mask=pm, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + ang, mask=pm, other=0.0).to(tl.float32)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        DT = out_ptr.dtype.element_ty
        x = tl.load(src + cols, mask=m, other=0.0).to(tl.float32)
        xp = tl.load(src + partner, mask=pm, other=0.0).to(tl.float32)
        if HAS_BIAS:  # F.linear's bias, rounded to qkv's dtype with the product
            x = round_to(x + tl.load(b_ptr + off + cols, mask=m, other=0.0).to(tl.float32), DT)
            xp = round_to(xp + tl.load(b_ptr + off + partner, mask=pm, other=0.0).to(tl.float32), DT)
        if KIND == 2:
            w = x  # (unread)
            wp = x
        res = norm_rope(x, xp, row, n_row, w, wp, c, s, eps, cols, D, HALF, KIND, WHOLE, BLOCK_W, DT).to(DT)
        tl.store(out_ptr + head * D + cols, res, mask=m)
        if HAS_BIAS:  # value head j + its bias (key programs), into out after the q, k (and gate) heads; defined
            # for every program (masked off for query heads): a value made under a runtime `if` would not reach the
            # cache write below in a compiled kernel
            jv = tl.maximum(head - HQ, 0)
            vm = m & ((cols * 0 + head) >= HQ)
            vb = tl.load(qkv_ptr + HQ * QW + HKV * D + jv * D + cols, mask=vm, other=0.0).to(tl.float32)
            vb = round_to(
                vb + tl.load(b_ptr + HQ * QW + HKV * D + jv * D + cols, mask=vm, other=0.0).to(tl.float32), DT
            )
            tl.store(out_ptr + (HQ + HKV + (HQ if GATED else 0) + jv) * D + cols, vb.to(DT), mask=vm)
        if CACHE:
            if head >= HQ:  # key head j: its key and value at the cache position
                j = (head - HQ).to(tl.int64)
                pos = tl.load(pos_ptr).to(tl.int64)
                at = pos % L if RING else pos  # the cache row written
                cm = m & ((cols * 0 + at) < L)  # (a tensor: the interpreter masks with tensors only)
                tl.store(kc_ptr + j * stride_kh + at * stride_kl + cols, res, mask=cm)
                if HAS_BIAS:
                    vv = vb
                else:
                    vv = tl.load(qkv_ptr + HQ * QW + HKV * D + j * D + cols, mask=m, other=0.0)
                tl.store(vc_ptr + j * stride_vh + at * stride_vl + cols, vv.to(vc_ptr.dtype.element_ty), mask=cm)
                tl.debug_barrier()  # this program has read the position before the release below
                if tl.atomic_add(tick_ptr, 1, sem="acq_rel", scope="gpu") == HKV - 1:  # every key program has read it
                    tl.store(pos_ptr, (pos + 1).to(pos_ptr.dtype.element_ty))
                    tl.store(tick_ptr, 0)
        if GATED:
            if head < HQ:  # de-interleave the output gate: [q_h | gate_h] -> gate[h*D : (h+1)*D]
                g = tl.load(src + D + cols, mask=m, other=0.0)
                if HAS_BIAS:
                    g = round_to(g.to(tl.float32) + tl.load(b_ptr + off + D + cols, mask=m, other=0.0), DT).to(DT)
                tl.store(out_ptr + (HQ + HKV) * D + head * D + cols, g, mask=m)


# ----------------------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------------------
def qk_norm_rope(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
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
    bias: torch.Tensor | None = None,
    half_angles: bool = False,
    ring: bool = False,
):
    """One token's q|k|v projection -> (q [Hq, D], k [Hkv, D], v [Hkv, D], gate [Hq*D] | None): q and k normed (per
    head, `kind`) and rotated by cos/sin [ROT] (one token's, qkv's dtype; ROT even, <= D), v a view of qkv, the gate
    (gated layers) de-interleaved and contiguous. D = the norm weights' length. With `kv_cache` (keys [Hkv, L, D],
    values [Hkv, L, D] of qkv's dtype, last dim contiguous; position: a one-element int tensor) k and v are also
    written at the position, which is then advanced by one (a position >= L writes nothing but still advances).
    `whole`: q_weight [Hq*D] and k_weight [Hkv*D] normalise the whole q and k projections (OLMoE; not gated).
    kind "none" (Mixtral, GraniteMoE): no q/k norms, q_weight and k_weight None, D = `head_dim`, eps unused; RoPE only.
    No host sync: capturable. With PDL, cos and sin are read before the wait: they must not come from the kernel just
    before this launch (the decode step makes them before its layers; the projection's GEMV runs between).
    GPT-OSS: `bias` [Hq*QW + 2*Hkv*D] (qkv's dtype) is added to the projection first (rounded to its dtype, as
    F.linear's output), and v is then a new [Hkv, D] tensor holding v + its bias; `half_angles`: cos/sin hold ROT/2
    angles, rotated pair (i, i + ROT/2) by angle i (GPT-OSS's _apply_rotary_emb; rotate_half's with the angles
    repeated); `ring`: the cache row written is position % L (a sliding window's ring of L rows), the position still
    advanced by one."""
    if triton is None:
        raise RuntimeError("qk_norm_rope needs triton")
    x, q_weight, k_weight, D, QW, ROT, c, s, kc, vc, pos = qk_layout(
        qkv, q_weight, k_weight, cos, sin, num_q_heads, num_kv_heads, kind, gated, kv_cache, whole, head_dim,
        half_angles,
    )  # fmt: skip
    Hq, Hkv = num_q_heads, num_kv_heads
    if ring and kv_cache is None:
        raise ValueError("ring writes need kv_cache")
    if bias is not None and (
        bias.dim() != 1
        or bias.numel() != x.numel()
        or bias.dtype != x.dtype
        or bias.stride(0) != 1
        or bias.device != x.device
    ):
        raise ValueError(f"bias must be a contiguous [{x.numel()}] tensor of {x.dtype} on {x.device}")
    tick = zeroed_int32("qk_norm_rope", x.device, 1) if kv_cache is not None else pos
    nv = Hkv if bias is not None else 0  # biased values are written after the q, k (and gate) heads
    out = torch.empty((Hq + Hkv + (Hq if gated else 0) + nv) * D, dtype=x.dtype, device=x.device)
    _qk_norm_rope_kernel[(Hq + Hkv,)](
        x,
        q_weight,
        k_weight,
        c,
        s,
        out,
        kc,
        vc,
        pos,
        tick,
        bias if bias is not None else x,
        Hq,
        Hkv,
        float(eps),
        kc.shape[1],
        kc.stride(0),
        kc.stride(1),
        vc.stride(0),
        vc.stride(1),
        D=D,
        ROT=ROT,
        KIND=_KIND_ID[kind],
        GATED=gated,
        CACHE=kv_cache is not None,
        WHOLE=whole,
        HAS_BIAS=bias is not None,
        HALF_ANGLES=half_angles,
        RING=ring,
        BLOCK_D=triton.next_power_of_2(D),
        BLOCK_W=triton.next_power_of_2(max(Hq, Hkv) * D) if whole else 1,
        num_warps=1 if D <= 128 else 2,
        **pdl_kw(x),
    )
    q, k = out[: Hq * D].view(Hq, D), out[Hq * D : (Hq + Hkv) * D].view(Hkv, D)
    g_end = (Hq + Hkv + (Hq if gated else 0)) * D
    gate = out[(Hq + Hkv) * D : g_end] if gated else None
    v = out[g_end:].view(Hkv, D) if bias is not None else x[Hq * QW + Hkv * D :].view(Hkv, D)
    return q, k, v, gate
