"""DeepSeek-V2's multi-head latent attention (MLA) for one decode token, over the compressed cache: the attention core
of the absorbed form its paper describes.

transformers caches MLA's latents, not per-head keys and values: per position the normalised compressed KV
c [C] (C = kv_lora_rank, 512) and the rotary key k_pe [R] (R = qk_rope_head_dim, 64), shared by every head. Its
module expands the whole cache through kv_b_proj on every step (a [L, C] x [C, Hq·(D_nope + D_v)] GEMM, reading and
writing L·Hq·(D_nope + D_v) elements). Absorbed, W_UK moves into the query (q_lat = q_nope·W_UK, [Hq, C]) and W_UV
behind the core (localmoe/decode/mla.py: W_UK with kernels/mla_absorb.py, W_UV in this core's second launch), so
the core reads each cached position once for all heads, as multi-query attention with a C + R wide key and a C wide
value (the key's first C columns):

    s[h, j] = (q_lat[h]·c[j] + q_pe[h]·k_pe[j]) · scale,   j < n
    o_lat[h] = softmax_j(s[h]) · c

Two launches (flash decoding): `_mla_split_kernel`, grid (S,): program i takes the blocks of BLOCK_L positions
i, i + S, i + 2S, ... below n (strided, so a short context's few blocks run side by side in as many programs, one
block each, instead of one after another in the first split; S = min(MAX_SPLITS, ceil(L / BLOCK_L))), every head
at once (q_lat [BLOCK_H, C] x c [BLOCK_L, C]^T on the tensor cores), with an online softmax; it writes its fp32
partial output and (max, sum) per head (a program with no position below n writes (-inf, 0) and no output).
`_mla_combine_kernel`, grid (Hq,): the splits merged, BLOCK_S of them at a time, rounded to q's dtype; with `w_uv`
(W_UV, the absorbed value projection behind the core) grid (Hq, Dv / BLOCK_N): each program merges its head's splits
and multiplies the rounded o_lat by its BLOCK_N rows of W_UV[h] (loaded before the PDL wait), so the core and W_UV
are two launches, not three (the merge is repeated by a head's Dv / BLOCK_N programs, from L2). n (the valid
length) is read from a device int tensor, so the launch is fixed for a CUDA graph over a static cache of L >= n
rows. Both are programmatic dependent launches (kernels/pdl.py): the cache, n and q_pe come from
kernels/mla_rope_write.py two launches back, so the split loads them and its first block before the wait and only
q_lat (the W_UK absorb's, the launch just before) after it; the combine reads only the split's output, after it.
`advance=True` (mla.py on a static cache, behind mla_rope_write's launch that also makes q_lat and leaves the
position): n is this step's row, written by the launch just before, so the split prefetches only the rows below it,
reads q_pe, q_lat and that row after the wait, and its last program (a ticket) advances n.

Shapes: q_lat [Hq, C] · q_pe [Hq, R] · c [L, C] · k_pe [L, R] (rows contiguous, any row stride: views into a
transformers StaticLayer's keys [1, 1, L, C] and values [1, 1, L, R]) · n [1] int32/int64 · w_uv [Hq, Dv, C] (C
contiguous) · out [Hq, C], or [Hq, Dv] with w_uv.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    from localmoe.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_kw
    from localmoe.kernels.workspace import zeroed_int32
except ImportError:  # pragma: no cover
    triton = None
    tl = None

BLOCK_L = 32  # cached positions per block (16 for fp32: sm_89's 99 KiB of shared memory, 74 KiB then)
MAX_SPLITS = 64  # programs of the split launch (fewer for a cache of fewer blocks)
COMBINE_SPLITS = 16  # splits the combine merges at a time


def mla_decode_ref(q_lat, q_pe, c, k_pe, n, scale: float, w_uv=None, advance: bool = False) -> torch.Tensor:
    """Absorbed MLA core in fp32 over the first n cached positions; [Hq, C] in q_lat's dtype, or with `w_uv`
    [Hq, Dv, C] that times W_UV per head ([Hq, Dv], fp32 sums of the rounded o_lat, rounded once)."""
    if advance:  # n: this step's row; advanced in place
        n += 1
    n = int(n.reshape(-1)[0]) if isinstance(n, torch.Tensor) else int(n)
    cf, pf = c[:n].float(), k_pe[:n].float()
    s = (q_lat.float() @ cf.T + q_pe.float() @ pf.T) * scale  # [Hq, n]
    o_lat = (torch.softmax(s, dim=-1) @ cf).to(q_lat.dtype)
    if w_uv is None:
        return o_lat
    return torch.einsum("hc,hnc->hn", o_lat.float(), w_uv.float()).to(q_lat.dtype)


if triton is not None:

    @triton.jit
    def _mla_split_kernel(
        q_ptr, qp_ptr, c_ptr, p_ptr, n_ptr, acc_ptr, ml_ptr, tick_ptr,
        Hq, C, R, stride_c, stride_p, scale,
        BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr,
        DOT_F32: tl.constexpr, PREC: tl.constexpr, ADVANCE: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        i = tl.program_id(0)
        S = tl.num_programs(0)
        h = tl.arange(0, BLOCK_H)
        cc = tl.arange(0, BLOCK_C)
        rr = tl.arange(0, BLOCK_R)
        hm = h < Hq
        # Cache rows written two or more launches back have completed when this kernel is launched (each kernel lets
        # its dependents launch only after its own wait): the first block is loaded while the kernel before runs.
        # Without ADVANCE the cache, n and q_pe come from kernels/mla_rope_write.py two launches back (the W_UK
        # absorb between); with it n is this step's row, which the launch just before wrote with q_pe (and q_lat)
        # and which this launch's last program advances: only the rows below it are loaded before the wait.
        pos = tl.load(n_ptr).to(tl.int32)
        n = pos + 1 if ADVANCE else pos  # the valid length
        j = i * BLOCK_L + tl.arange(0, BLOCK_L)
        jm = j < pos
        kc = tl.load(c_ptr + j[:, None] * stride_c + cc[None, :], mask=jm[:, None] & (cc[None, :] < C), other=0.0)
        kp = tl.load(p_ptr + j[:, None] * stride_p + rr[None, :], mask=jm[:, None] & (rr[None, :] < R), other=0.0)
        if not ADVANCE:
            qp = tl.load(qp_ptr + h[:, None] * R + rr[None, :], mask=hm[:, None] & (rr[None, :] < R), other=0.0)
        if PDL:  # programmatic dependent launch (kernels/pdl.py): q_lat follows the wait
            gdc_wait()
            gdc_launch_dependents()
        if ADVANCE:
            qp = tl.load(qp_ptr + h[:, None] * R + rr[None, :], mask=hm[:, None] & (rr[None, :] < R), other=0.0)
            new = j == pos  # this step's row, if in the first block: read now
            kc = tl.where(new[:, None], tl.load(c_ptr + j[:, None] * stride_c + cc[None, :],
                                                mask=new[:, None] & (cc[None, :] < C), other=0.0), kc)  # fmt: skip
            kp = tl.where(new[:, None], tl.load(p_ptr + j[:, None] * stride_p + rr[None, :],
                                                mask=new[:, None] & (rr[None, :] < R), other=0.0), kp)  # fmt: skip
            jm = j < n
        q = tl.load(q_ptr + h[:, None] * C + cc[None, :], mask=hm[:, None] & (cc[None, :] < C), other=0.0)
        if DOT_F32:
            q, qp = q.to(tl.float32), qp.to(tl.float32)
        m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_C), dtype=tl.float32)
        for start in range(i * BLOCK_L, n, S * BLOCK_L):  # this program's blocks: i, i + S, ... below n
            if DOT_F32:  # the interpreter's bf16/fp16 tl.dot is wrong (triton 3.x): the same products in fp32
                kc, kp = kc.to(tl.float32), kp.to(tl.float32)
            s = tl.dot(q, tl.trans(kc), input_precision=PREC, out_dtype=tl.float32)
            s += tl.dot(qp, tl.trans(kp), input_precision=PREC, out_dtype=tl.float32)
            s = tl.where(jm[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(kc.dtype), kc, input_precision=PREC, out_dtype=tl.float32)
            m_i = m_new
            j = start + S * BLOCK_L + tl.arange(0, BLOCK_L)  # the next block (none past n: nothing is fetched)
            jm = j < n
            kc = tl.load(c_ptr + j[:, None] * stride_c + cc[None, :], mask=jm[:, None] & (cc[None, :] < C), other=0.0)
            kp = tl.load(p_ptr + j[:, None] * stride_p + rr[None, :], mask=jm[:, None] & (rr[None, :] < R), other=0.0)
        if ADVANCE:  # every program has read the position (before its wait): the last one advances it
            tl.debug_barrier()
            if tl.atomic_add(tick_ptr, 1, sem="acq_rel", scope="gpu") == S - 1:
                tl.store(n_ptr, (pos + 1).to(n_ptr.dtype.element_ty))
                tl.store(tick_ptr, 0)
        tl.store(ml_ptr + (h * S + i) * 2, m_i, mask=hm)
        tl.store(ml_ptr + (h * S + i) * 2 + 1, l_i, mask=hm)
        if i * BLOCK_L < n:  # a program with no position below n writes no output (the combine skips it)
            base = (h * S + i)[:, None] * BLOCK_C + cc[None, :]
            tl.store(acc_ptr + base, acc, mask=hm[:, None])

    @triton.jit
    def _mla_combine_kernel(
        acc_ptr, ml_ptr, out_ptr, w_ptr, C, S, Dv, stride_wh, stride_wn,
        BLOCK_S: tl.constexpr, S_P2: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr,
        ABSORB: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        h = tl.program_id(0)
        cc = tl.arange(0, BLOCK_C)
        if ABSORB:  # W_UV[h]'s rows of this program's outputs: weights, loaded before the wait
            nn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            nm = nn < Dv
            wrow = w_ptr + h.to(tl.int64) * stride_wh + nn.to(tl.int64)[:, None] * stride_wn + cc[None, :]
            w = tl.load(wrow, mask=nm[:, None] & (cc[None, :] < C), other=0.0)
        if PDL:  # everything else it reads is the split launch's, the kernel just before
            gdc_wait()
            gdc_launch_dependents()
        sa = tl.arange(0, S_P2)
        m_all = tl.max(tl.load(ml_ptr + (h * S + sa) * 2, mask=sa < S, other=float("-inf")), axis=0)
        o = tl.zeros((BLOCK_C,), dtype=tl.float32)
        denom = tl.zeros((), dtype=tl.float32)
        for s0 in range(0, S, BLOCK_S):  # BLOCK_S splits at a time: the [BLOCK_S, C] tile stays in registers
            s = s0 + tl.arange(0, BLOCK_S)
            sm = s < S
            m = tl.load(ml_ptr + (h * S + s) * 2, mask=sm, other=float("-inf"))
            ll = tl.load(ml_ptr + (h * S + s) * 2 + 1, mask=sm, other=0.0)
            live = sm & (ll > 0)  # splits with a position below n: only they wrote an output
            wt = tl.where(live, tl.exp(m - m_all), 0.0)
            denom += tl.sum(wt * ll, axis=0)
            parts = tl.load(acc_ptr + (h * S + s)[:, None] * BLOCK_C + cc[None, :], mask=live[:, None], other=0.0)
            o += tl.sum(parts * wt[:, None], axis=0)
        DT = out_ptr.dtype.element_ty
        o_lat = (o / denom).to(DT)  # the core's output, rounded as the unfused core returns it
        if ABSORB:  # o[h, n] = o_lat[h] . W_UV[h, n], fp32 sums rounded once (as kernels/mla_absorb.py)
            y = tl.sum(w.to(tl.float32) * o_lat.to(tl.float32)[None, :], axis=1)
            tl.store(out_ptr + h * Dv + nn, y.to(DT), mask=nm)
        else:
            tl.store(out_ptr + h * C + cc, o_lat, mask=cc < C)


def _rows(name: str, t: torch.Tensor, width: int, dtype: torch.dtype, device) -> None:
    if t.dim() != 2 or t.shape[1] != width or t.stride(1) != 1:
        raise ValueError(f"{name} must be [rows, {width}] with contiguous rows, got {tuple(t.shape)} {t.stride()}")
    if t.dtype != dtype or t.device != device:
        raise ValueError(f"{name} must be {dtype} on {device} (as q_lat), got {t.dtype} on {t.device}")


def mla_decode(
    q_lat,
    q_pe,
    c,
    k_pe,
    n: torch.Tensor,
    scale: float,
    *,
    w_uv=None,
    out: torch.Tensor | None = None,
    advance: bool = False,
    BLOCK_N=16,
):
    """The absorbed MLA core (module docstring) in two launches; returns out [Hq, C] in q_lat's dtype, or with
    `w_uv` (W_UV [Hq, Dv, C], C contiguous: a view of kv_b_proj's weight) [Hq, Dv], the core's output times W_UV
    per head inside the second launch (BLOCK_N of a head's Dv outputs a program). `advance`: n is this step's row
    (the valid length n + 1; kernels/mla_rope_write.py with advance=False wrote it in the launch just before), and
    the split launch advances n by one."""
    if triton is None:
        raise RuntimeError("mla_decode needs triton")
    if (
        q_lat.dim() != 2
        or not q_lat.is_contiguous()
        or q_lat.dtype not in (torch.bfloat16, torch.float16, torch.float32)
    ):
        raise ValueError(f"q_lat must be a contiguous float [Hq, C] tensor, got {q_lat.dtype} {tuple(q_lat.shape)}")
    Hq, C = q_lat.shape
    R = q_pe.shape[-1]
    dev, dt = q_lat.device, q_lat.dtype
    if tuple(q_pe.shape) != (Hq, R) or not q_pe.is_contiguous() or q_pe.dtype != dt or q_pe.device != dev:
        raise ValueError(f"q_pe must be a contiguous [Hq, R] = [{Hq}, {R}] {dt} tensor on {dev}")
    _rows("c", c, C, dt, dev)
    _rows("k_pe", k_pe, R, dt, dev)
    L = c.shape[0]
    if k_pe.shape[0] != L:
        raise ValueError(f"c and k_pe must cover the same positions, got {L} and {k_pe.shape[0]}")
    if n.numel() != 1 or n.dtype not in (torch.int32, torch.int64) or n.device != dev:
        raise ValueError(f"n must be one int32/int64 on {dev} (the valid cached length), got {n.dtype} {n.shape}")
    Dv = C
    if w_uv is not None:
        if w_uv.dim() != 3 or w_uv.shape[0] != Hq or w_uv.shape[2] != C or w_uv.stride(2) != 1:
            raise ValueError(f"w_uv must be [Hq, Dv, C] = [{Hq}, Dv, {C}] with C contiguous, got {tuple(w_uv.shape)}")
        if w_uv.dtype != dt or w_uv.device != dev:
            raise ValueError(f"w_uv must be {dt} on {dev} (as q_lat), got {w_uv.dtype} on {w_uv.device}")
        Dv = w_uv.shape[1]
    if out is None:
        out = torch.empty(Hq, Dv, dtype=dt, device=dev)
    elif tuple(out.shape) != (Hq, Dv) or not out.is_contiguous() or out.dtype != dt or out.device != dev:
        raise ValueError(f"out must be a contiguous [Hq, {Dv}] {dt} tensor")
    block_l = BLOCK_L if dt != torch.float32 else 16  # fp32 at 32: 110 KiB of shared memory (offline sm_89 build)
    S = max(1, min(MAX_SPLITS, triton.cdiv(L, block_l)))
    BLOCK_C = max(16, triton.next_power_of_2(C))
    BLOCK_H = max(16, triton.next_power_of_2(Hq))
    acc = torch.empty(Hq, S, BLOCK_C, dtype=torch.float32, device=dev)
    ml = torch.empty(Hq, S, 2, dtype=torch.float32, device=dev)
    tick = zeroed_int32("mla_decode", dev, 1)  # self-cleaning: the advancing program re-zeroes it
    _mla_split_kernel[(S,)](
        q_lat, q_pe, c, k_pe, n, acc, ml, tick, Hq, C, R, c.stride(0), k_pe.stride(0), float(scale),
        BLOCK_H=BLOCK_H, BLOCK_C=BLOCK_C, BLOCK_R=max(16, triton.next_power_of_2(R)), BLOCK_L=block_l,
        DOT_F32=os.environ.get("TRITON_INTERPRET") == "1" and dt != torch.float32, ADVANCE=bool(advance),
        PREC="ieee" if dt == torch.float32 else "tf32",  # fp32 models: exact products, not TF32's
        num_warps=4 if BLOCK_C <= 256 else 8, num_stages=1 if dt == torch.float32 else 2, **pdl_kw(q_lat),
    )  # fmt: skip
    bs = min(COMBINE_SPLITS, triton.next_power_of_2(S))
    bn = min(triton.next_power_of_2(max(1, BLOCK_N)), triton.next_power_of_2(Dv))
    absorb = w_uv is not None
    _mla_combine_kernel[(Hq, triton.cdiv(Dv, bn) if absorb else 1)](
        acc, ml, out, w_uv if absorb else acc, C, S, Dv, w_uv.stride(0) if absorb else 0,
        w_uv.stride(1) if absorb else 0, BLOCK_S=max(2, bs), S_P2=max(2, triton.next_power_of_2(S)),
        BLOCK_C=BLOCK_C, BLOCK_N=bn, ABSORB=absorb, **pdl_kw(q_lat),
    )  # fmt: skip
    return out
