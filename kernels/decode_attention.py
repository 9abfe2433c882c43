"""Attention for ONE query token over a KV cache, in time proportional to the keys the mask keeps (flash decoding).

Owns `decode_attention` (a checked Triton launcher), its torch reference `decode_attention_ref`, and one kernel
`_split_kernel`, grid (Hq, NP), with the combine in its tail (the online softmax's two halves, `_chunk` and
`_combine_head`, are kernels/decode_attention_softmax.py's; the launcher's argument checks
kernels/decode_attention_args.py's):

1. program (h, p) takes chunks p, p + NP, p + 2 NP, ... of CHUNK keys of query head h's KV head (GQA: kv = h //
   (Hq / Hkv)); NP = min(NS, max_splits), so a long static cache's unused tail does not grow the grid (at the
   default 8192-token context 16 programs per head, not 128). A chunk with no key kept (that unused tail) is
   skipped after its mask is read, so the time follows the tokens so far, not the cache size. Kept chunks are
   walked in BLOCK_L tiles with an online softmax (fp32 running max m, sum l and accumulator acc[Dv]); the program
   writes (m, l, acc) of its chunks. With one tile per chunk (PREFETCH, the default when BLOCK_L == CHUNK) every
   chunk's mask and the first chunk's keys and values are loaded before the PDL wait, overlapping the kernel
   before; after it q and the newest kept key/value row (this step's token, written by that kernel) are read, and
   any later kept chunk (contexts past NP chunks).
2. then it takes head h's ticket (acq_rel atomic, as kernels/sparse_fused.py does); the last of the head's NP
   programs combines (`_combine_head`): rescales the NP partial results to their common max and writes
   out[h] = Σ acc / Σ l in the query's dtype; with `gate` (Qwen3.5's gated attention output) it writes
   out[h] · sigmoid(gate[h]) instead, rounded as transformers' `attn_output * torch.sigmoid(gate)` rounds; and
   re-zeroes the ticket (no memset node, CUDA-graph capturable). One launch instead of two: one grid-wide wait
   fewer per attention layer in the decode step. A program with nothing kept writes no accumulator, and the
   combine reads none for it.
3. GPT-OSS: `sinks` [Hq] (a learned logit per head) join the combine's denominator as exp(sink_h - M), M the
   larger of the head's max score and its sink (no value: transformers' eager_attention_forward with s_aux);
   `window` keeps only keys at index > last - window (last: the newest key the mask keeps), so one call serves a
   full-length cache and transformers' StaticSlidingWindowLayer (its newest row last) alike; chunks wholly before
   the window are skipped unread.
4. QK: kernels/qk_norm_rope.py's step (q/k norm + RoPE, the k/v cache write) in the same launch, behind the
   constexpr QK: `decode_attention_qk` (kernels/decode_attention_qk.py, which says how) launches it through `_launch`.

Why: transformers' SDPA path on a static cache reads every one of its max_cache_len keys for each decode token
(the mask hides the unused ones but the kernel still streams them): at the default 8192-token context that
was ~1.4 ms of a ~5 ms Qwen3.5-35B step on the H200. Semantics equal SDPA with a boolean mask (True = attend), or
no mask (attend to all L keys, as SDPA does with is_causal=False for one query).

Shape legend: Hq query heads, Hkv KV heads, L cache length (keys), Dk query/key head dim, Dv value head dim,
NS = ceil(L / CHUNK) chunks, NP programs per head. q [Hq, Dk]; k [Hkv, L, Dk]; v [Hkv, L, Dv] (any strides, last dim
contiguous); mask [L] bool or None; out [Hq, Dv]; tickets [Hq] int32, zero between launches.
"""

from __future__ import annotations

import math

import torch

from localmoe.kernels.decode_attention_args import _mask_int8, _out, check_extras, check_qkv

try:
    import triton
    import triton.language as tl

    from localmoe.kernels.decode_attention_softmax import _chunk, _combine_head
    from localmoe.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_kw
    from localmoe.kernels.qk_norm_rope import norm_rope_head
    from localmoe.kernels.workspace import zeroed_int32
except ImportError:  # pragma: no cover
    triton = None
    tl = None


# ----------------------------------------------------------------------------------------------------------
# torch reference
# ----------------------------------------------------------------------------------------------------------
def decode_attention_ref(q, k, v, mask=None, scale=None, gate=None, sinks=None, window=None):
    """softmax(q kᵀ · scale, masked) v per query head, fp32 math. q [Hq,Dk], k [Hkv,L,Dk], v [Hkv,L,Dv],
    mask [L] bool (True = attend) or None -> [Hq, Dv] in q's dtype; times sigmoid(gate [Hq, Dv]) with `gate`.
    `sinks` [Hq]: one more logit per head in the softmax's denominator, with no value (GPT-OSS); `window`: only the
    keys at index > last - window, last the largest index the mask keeps (L - 1 without a mask)."""
    if gate is not None:
        return decode_attention_ref(q, k, v, mask, scale, sinks=sinks, window=window) * torch.sigmoid(gate)
    Hq, Dk = q.shape
    Hkv, L = k.shape[0], k.shape[1]
    scale = Dk**-0.5 if scale is None else scale
    kk = k.float().repeat_interleave(Hq // Hkv, dim=0)  # [Hq, L, Dk]
    vv = v.float().repeat_interleave(Hq // Hkv, dim=0)
    s = torch.einsum("hd,hld->hl", q.float(), kk) * scale
    keep = torch.ones(L, dtype=torch.bool, device=q.device) if mask is None else mask.bool()
    if window is not None:
        idx = torch.arange(L, device=q.device)
        last = torch.where(keep, idx, -1).max()
        keep = keep & (idx > last - window)
    s = s.masked_fill(~keep[None, :], float("-inf"))
    if sinks is not None:
        p = torch.softmax(torch.cat([s, sinks.float().view(Hq, 1)], dim=-1), dim=-1)[:, :L]
    else:
        p = torch.softmax(s, dim=-1)
    return torch.einsum("hl,hld->hd", p, vv).to(q.dtype)


# ----------------------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _split_kernel(
        q_ptr,  # [Hq, Dk], row stride stride_qh
        k_ptr,  # [Hkv, L, Dk], strides stride_kh, stride_kl
        v_ptr,  # [Hkv, L, Dv], strides stride_vh, stride_vl
        m_ptr,  # [L] int8 (1 = attend) (HAS_MASK only)
        part_ptr,  # [Hq, NP, 2 + Dv] fp32: m, l, acc of each program
        o_ptr,  # [Hq, Dv] out (q's dtype), row stride stride_oh
        g_ptr,  # [Hq, Dv] output gate (q's dtype), row stride stride_gh (HAS_GATE only)
        s_ptr,  # [Hq] sinks (float; HAS_SINKS only)
        tick_ptr,  # [Hq (+ 1 with QK)] int32 tickets, zero between launches
        qw_ptr,  # QK: [D] (WHOLE: [Hq*D]) q norm weight
        kw_ptr,  # QK: [D] (WHOLE: [Hkv*D]) k norm weight
        cos_ptr,  # QK: [ROT] the token's angles (q's dtype)
        sin_ptr,  # QK: [ROT]
        pos_ptr,  # QK: [] int, the cache row this step writes, advanced by one
        kn_ptr,  # QK: [Hkv, Dk] the token's raw keys (the projection's k part)
        vn_ptr,  # QK: [Hkv, Dv] the token's values
        L,
        NS,  # chunks of CHUNK keys
        NP,  # programs per head: program p takes chunks p, p + NP, p + 2 NP, ... (at most NCH of them)
        GROUP,  # Hq // Hkv
        scale,
        window,  # keys at index > last - window only (HAS_WINDOW)
        eps,  # QK: the q/k norms' epsilon
        HKV,  # QK: key/value heads
        stride_qh,
        stride_kh,
        stride_kl,
        stride_vh,
        stride_vl,
        stride_oh,
        stride_gh,
        DK: tl.constexpr,
        DV: tl.constexpr,
        DK_P2: tl.constexpr,
        DV_P2: tl.constexpr,
        NP_P2: tl.constexpr,
        NCH: tl.constexpr,  # chunks per program, a power of two >= cdiv(NS, NP)
        CHUNK: tl.constexpr,
        BLOCK_L: tl.constexpr,
        HAS_MASK: tl.constexpr,
        HAS_GATE: tl.constexpr,
        HAS_SINKS: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        SCAN: tl.constexpr,  # mask positions a window's scan for the last kept key loads at a time
        PREFETCH: tl.constexpr,  # CHUNK == BLOCK_L: the first chunk's keys/values, every chunk's mask before the wait
        QK: tl.constexpr,  # q/k norm + RoPE and the k/v cache write in this launch (kernels/qk_norm_rope.py's step)
        KIND: tl.constexpr,  # QK: qk_norm_rope's norm kind (0 standard, 1 zero_centred, 2 none)
        WHOLE: tl.constexpr,  # QK: norms over the whole q / k projection (OLMoE)
        ROT: tl.constexpr,  # QK: rotary dims (even, <= Dk)
        BLOCK_W: tl.constexpr,  # QK and WHOLE: >= Hq*Dk and Hkv*Dk
        PDL: tl.constexpr,
    ):
        h = tl.program_id(0)
        p = tl.program_id(1)
        kvh = (h // GROUP).to(tl.int64)
        out = part_ptr + (h.to(tl.int64) * NP + p) * (2 + DV)
        dk = tl.arange(0, DK_P2)
        dkm = dk < DK
        dv = tl.arange(0, DV_P2)
        dvm = dv < DV
        m_i = tl.full([], float("-inf"), tl.float32)  # running max, sum and accumulator of this program's keys
        l_i = tl.zeros([], dtype=tl.float32)
        acc = tl.zeros([DV_P2], dtype=tl.float32)
        ci = tl.arange(0, NCH)  # this program's chunks: p + ci * NP
        lo = tl.full([], 0, tl.int32)  # the first key index kept (a window's); the mask was made before the step
        if HAS_WINDOW:
            if HAS_MASK:  # the last kept key: a scan of the whole mask (L / SCAN loads, from L2 after the first)
                last = tl.full([], -1, tl.int32)
                for t0 in range(0, L, SCAN):
                    sr = t0 + tl.arange(0, SCAN)
                    mk = tl.load(m_ptr + sr, mask=sr < L, other=0)
                    last = tl.maximum(last, tl.max(tl.where(mk != 0, sr, -1), axis=0))
            else:
                last = tl.full([], 0, tl.int32) + L - 1
            lo = last - window + 1
        skip = tl.full([], -1, tl.int32)  # QK: the row this step writes (read from registers, never from the cache)
        if QK:  # the norm weights, the angles (made at the start of the step) and the position (this kernel's own
            # write of the step before): constants of this launch, read before the wait
            HALF: tl.constexpr = ROT // 2
            partner = tl.where(dk < HALF, dk + HALF, dk - HALF)  # rotate_half's source of each rotary column
            pm = dkm & (dk < ROT)
            rc = tl.load(cos_ptr + dk, mask=pm, other=0.0).to(tl.float32)  # (cs: the chunk starts below)
            rs = tl.load(sin_ptr + dk, mask=pm, other=0.0).to(tl.float32)
            wq = tl.zeros([DK_P2], dtype=tl.float32)
            wqp = wq
            wk = wq
            wkp = wq
            if KIND != 2:
                qo = h.to(tl.int64) * DK if WHOLE else 0
                ko = kvh * DK if WHOLE else 0
                wq = tl.load(qw_ptr + qo + dk, mask=dkm, other=0.0).to(tl.float32)
                wqp = tl.load(qw_ptr + qo + partner, mask=pm, other=0.0).to(tl.float32)
                wk = tl.load(kw_ptr + ko + dk, mask=dkm, other=0.0).to(tl.float32)
                wkp = tl.load(kw_ptr + ko + partner, mask=pm, other=0.0).to(tl.float32)
            pos = tl.load(pos_ptr).to(tl.int32)
            skip = pos
        if PREFETCH:
            # The mask (made at the start of the step) and every cached key/value but the newest were written two
            # or more kernels back, which have completed when this kernel is launched (each kernel lets its
            # dependents launch only after its own wait): load the first chunk now, while the kernel before runs.
            # Only the newest kept row may be this step's token, written by the kernel just before: re-read after
            # the wait.
            rows = p * CHUNK + tl.arange(0, CHUNK)  # [CHUNK] key positions
            ok = (rows < L) & (rows >= lo) & (rows != skip)
            if HAS_MASK:
                ok = ok & (tl.load(m_ptr + rows, mask=ok, other=0) != 0)
            r64 = rows.to(tl.int64)
            kt = tl.load(
                k_ptr + kvh * stride_kh + r64[:, None] * stride_kl + dk[None, :],
                mask=ok[:, None] & dkm[None, :],
                other=0.0,
            )  # masked rows are not fetched
            vt = tl.load(
                v_ptr + kvh * stride_vh + r64[:, None] * stride_vl + dv[None, :],
                mask=ok[:, None] & dvm[None, :],
                other=0.0,
            )
            newest = tl.max(tl.where(ok, rows, -1), axis=0)
            later = tl.zeros([NCH], dtype=tl.int32)  # which of the later chunks keep any key (a static cache's
            if NCH > 1:  # unused tail does not)
                cs = p + ci * NP
                crow = cs[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]  # [NCH, CHUNK]
                cin = (ci[:, None] >= 1) & (cs[:, None] < NS) & (crow < L) & (crow >= lo)
                if HAS_MASK:
                    later = tl.max(tl.load(m_ptr + crow, mask=cin, other=0).to(tl.int32), axis=1)  # [NCH]
                else:
                    later = tl.max(cin.to(tl.int32), axis=1)
        if PDL:  # programmatic dependent launch (kernels/pdl.py): q and the newest key/value follow the wait
            gdc_wait()
            gdc_launch_dependents()
        DT = o_ptr.dtype.element_ty
        if QK:  # q and this step's key normed and rotated here; the key and value written by one program a KV head
            q = norm_rope_head(q_ptr + h.to(tl.int64) * stride_qh, q_ptr, tl.num_programs(0) * DK, wq, wqp, rc, rs,
                               eps, dk, dkm, partner, pm, DK, HALF, KIND, WHOLE, BLOCK_W, DT)  # fmt: skip
            k_new = norm_rope_head(kn_ptr + kvh * DK, kn_ptr, HKV * DK, wk, wkp, rc, rs,
                                   eps, dk, dkm, partner, pm, DK, HALF, KIND, WHOLE, BLOCK_W, DT)  # fmt: skip
            v_new = tl.load(vn_ptr + kvh * DV + dv, mask=dvm, other=0.0)
            p64 = pos.to(tl.int64)
            if (p == 0) & (h % GROUP == 0) & (pos < L):
                tl.store(k_ptr + kvh * stride_kh + p64 * stride_kl + dk, k_new.to(DT), mask=dkm)
                tl.store(v_ptr + kvh * stride_vh + p64 * stride_vl + dv, v_new, mask=dvm)
        else:
            q = tl.load(q_ptr + h.to(tl.int64) * stride_qh + dk, mask=dkm, other=0.0).to(tl.float32)
        if PREFETCH:
            if newest >= 0:
                if not QK:  # the newest kept row may be this step's, written by the kernel just before: re-read
                    n64 = newest.to(tl.int64)
                    kn = tl.load(k_ptr + kvh * stride_kh + n64 * stride_kl + dk, mask=dkm, other=0.0)
                    vn = tl.load(v_ptr + kvh * stride_vh + n64 * stride_vl + dv, mask=dvm, other=0.0)
                    is_new = (rows == newest)[:, None]
                    kt = tl.where(is_new, kn[None, :], kt)
                    vt = tl.where(is_new, vn[None, :], vt)
                sc = tl.sum(kt.to(tl.float32) * q[None, :], axis=1) * scale  # [CHUNK]
                sc = tl.where(ok, sc, float("-inf"))
                m_i = tl.max(sc, axis=0)
                pr = tl.exp(sc - m_i)  # masked keys: exp(-inf) = 0
                l_i = tl.sum(pr, axis=0)
                acc = tl.sum(pr[:, None] * vt.to(tl.float32), axis=0)
            for j in range(1, NCH):  # later chunks (contexts past NP chunks), read after the wait
                if tl.max(tl.where(ci == j, later, 0), axis=0) != 0:
                    m_i, l_i, acc = _chunk(
                        q,
                        k_ptr,
                        v_ptr,
                        m_ptr,
                        kvh,
                        (p + j * NP) * CHUNK,
                        L,
                        lo,
                        scale,
                        m_i,
                        l_i,
                        acc,
                        stride_kh,
                        stride_kl,
                        stride_vh,
                        stride_vl,
                        DK,
                        DV,
                        DK_P2,
                        DV_P2,
                        CHUNK,
                        BLOCK_L,
                        HAS_MASK,
                        skip,
                    )
        else:
            for j in range(0, NCH):
                base = (p + j * NP) * CHUNK
                if HAS_MASK:  # a chunk whose keys are all masked (a static cache's unused tail): no further work
                    cl = base + tl.arange(0, CHUNK)
                    live = tl.max(tl.load(m_ptr + cl, mask=(cl < L) & (cl >= lo), other=0).to(tl.int32), axis=0)
                else:
                    live = ((base < L) & (base + CHUNK > lo)).to(tl.int32)
                if live != 0:
                    m_i, l_i, acc = _chunk(
                        q,
                        k_ptr,
                        v_ptr,
                        m_ptr,
                        kvh,
                        base,
                        L,
                        lo,
                        scale,
                        m_i,
                        l_i,
                        acc,
                        stride_kh,
                        stride_kl,
                        stride_vh,
                        stride_vl,
                        DK,
                        DV,
                        DK_P2,
                        DV_P2,
                        CHUNK,
                        BLOCK_L,
                        HAS_MASK,
                        skip,
                    )
        if QK:
            keep_new = (p == 0) & (pos < L) & (pos >= lo)
            if HAS_MASK:
                keep_new = keep_new & (tl.load(m_ptr + pos, mask=pos < L, other=0) != 0)
            if keep_new:  # this step's key and value, from registers, into program 0's running softmax
                s_new = tl.sum(k_new * q, axis=0) * scale
                m_new = tl.maximum(m_i, s_new)
                a = tl.exp(m_i - m_new)  # nothing kept yet: exp(-inf) = 0
                b = tl.exp(s_new - m_new)
                l_i = l_i * a + b
                acc = acc * a + b * v_new.to(tl.float32)
                m_i = m_new
            tl.debug_barrier()  # this program has read the position (before the wait) before the release below
            if tl.atomic_add(tick_ptr + tl.num_programs(0), 1, sem="acq_rel", scope="gpu") == (
                tl.num_programs(0) * NP - 1
            ):  # every program has read it: advance it for the next step
                tl.store(pos_ptr, (pos + 1).to(pos_ptr.dtype.element_ty))
                tl.store(tick_ptr + tl.num_programs(0), 0)
        tl.store(out, m_i)
        tl.store(out + 1, l_i)
        if m_i > float("-inf"):  # a program with nothing kept writes no accumulator: m = -inf says it all
            tl.store(out + 2 + dv, acc, mask=dvm)
        # ---- the last of head h's programs combines the head's NP partial results ----
        tl.debug_barrier()  # this program's stores precede the release below
        done = tl.atomic_add(tick_ptr + h, 1, sem="acq_rel", scope="gpu")
        if done == NP - 1:
            _combine_head(
                part_ptr,
                o_ptr,
                g_ptr,
                s_ptr,
                h.to(tl.int64),
                NP,
                stride_oh,
                stride_gh,
                DV=DV,
                DV_P2=DV_P2,
                NS_P2=NP_P2,
                HAS_GATE=HAS_GATE,
                HAS_SINKS=HAS_SINKS,
            )
            tl.store(tick_ptr + h, 0)  # ready for the next launch / graph replay


# ----------------------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------------------
def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    *,
    gate: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
    chunk: int = 64,
    block_l: int = 64,
    num_warps: int = 4,
    prefetch: bool | None = None,
    max_splits: int = 16,
) -> torch.Tensor:
    """One query token's attention over a KV cache (module docstring). q [Hq,Dk]; k [Hkv,L,Dk]; v [Hkv,L,Dv];
    mask [L] bool (True = attend) or None (all L keys); scale default Dk^-0.5. Returns [Hq, Dv] in q's dtype (into
    `out` when given: [Hq, Dv] of q's dtype, last dim contiguous); with `gate` [Hq, Dv] (q's dtype, last dim
    contiguous) the output is multiplied by sigmoid(gate) in the same launch. `sinks` [Hq] (fp32, or any float dtype:
    read in fp32; GPT-OSS's learned per-head logit): exp(sinks[h] - m) joins head h's softmax denominator, with no
    value. `window` (>= 1; a sliding-window layer): only the keys at index > last - window count, last the largest
    index the mask keeps (L - 1 without a mask) -- on a full-length cache indexed by position that is the query's
    position, and on transformers' StaticSlidingWindowLayer (the last `window` positions in order, newest last) its
    newest row, so the same call serves both; with a mask the kernel scans it once for `last` (L / 1024 loads a
    program). No host sync: CUDA-graph capturable.
    Defaults: the best launch of `bench/decode_attention_sweep.py` on the H200 at Qwen3.5-35B heads with 640 of 8192
    cache positions used, 15.6 µs (SDPA over the masked cache: 22.8); at 140 of 1024 the best launch was chunk 32,
    block_l 32, 8 warps, 8.7 µs (SDPA 15.7; the defaults were not timed there). `prefetch` (default: whenever
    chunk == block_l) loads the chunk's mask, keys and values before the PDL wait and re-reads only the newest kept
    row after it: the caller's cache rows other than the newest must not be written by the kernel just before."""
    if triton is None:
        raise RuntimeError("decode_attention needs triton")
    Hq, Dk, Hkv, L, Dv = check_qkv(q, k, v)
    mask = _mask_int8(mask, L, q.device)
    out = _out(out, Hq, Dv, q)
    check_extras(gate, sinks, window, Hq, Dv, q)
    if L == 0:
        return out.zero_()
    return _launch(q, k, v, mask, scale, out, gate, sinks, window, chunk, block_l, num_warps, prefetch, max_splits)


def _launch(q, k, v, mask, scale, out, gate, sinks, window, chunk, block_l, num_warps, prefetch, max_splits, qk=None):
    """The split kernel's launch for checked arguments (mask as int8); `qk`: the QK prologue's tensors and modes
    (`decode_attention_qk`)."""
    Hq, Dk = q.shape
    Hkv, L, Dv = v.shape
    chunk = max(16, triton.next_power_of_2(chunk))
    bl = min(triton.next_power_of_2(block_l), chunk)
    prefetch = bl == chunk if prefetch is None else bool(prefetch)
    if max_splits < 1:
        raise ValueError(f"max_splits must be >= 1, got {max_splits}")
    if prefetch and bl != chunk:
        raise ValueError(f"prefetch needs block_l == chunk (one tile per program), got {block_l}, {chunk}")
    ns = triton.cdiv(L, chunk)
    # programs per head: at most max_splits (more only past 16 chunks each, which bounds the mask tile a program
    # loads), so the grid does not grow with a long static cache's unused tail
    npg = min(ns, max(int(max_splits), triton.cdiv(ns, 16)))
    nch = triton.next_power_of_2(triton.cdiv(ns, npg))
    part = torch.empty(Hq, npg, 2 + Dv, dtype=torch.float32, device=q.device)
    scale = Dk**-0.5 if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    g = gate if gate is not None else out
    # self-cleaning: the combining program re-zeroes its head's, the last program the position's (QK)
    tickets = zeroed_int32("decode_attention", q.device, Hq + 1)
    qk = qk or {}
    qkt = [qk.get(n, out) for n in ("q_weight", "k_weight", "cos", "sin", "position", "k_new", "v_new")]
    _split_kernel[(Hq, npg)](
        q,
        k,
        v,
        mask if mask is not None else q,
        part,
        out,
        g,
        sinks if sinks is not None else out,
        tickets,
        *qkt,
        L,
        ns,
        npg,
        Hq // Hkv,
        scale,
        window or 0,
        float(qk.get("eps", 0.0)),
        Hkv,
        q.stride(0),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        g.stride(0),
        DK=Dk,
        DV=Dv,
        DK_P2=triton.next_power_of_2(Dk),
        DV_P2=triton.next_power_of_2(Dv),
        NP_P2=triton.next_power_of_2(npg),
        NCH=nch,
        CHUNK=chunk,
        BLOCK_L=bl,
        HAS_MASK=mask is not None,
        HAS_GATE=gate is not None,
        HAS_SINKS=sinks is not None,
        HAS_WINDOW=window is not None,
        SCAN=min(1024, triton.next_power_of_2(L)),
        PREFETCH=prefetch,
        QK=bool(qk),
        KIND=qk.get("kind", 2),
        WHOLE=qk.get("whole", False),
        ROT=qk.get("rot", 2),
        BLOCK_W=qk.get("block_w", 1),
        num_warps=num_warps,
        **pdl_kw(q),
    )
    return out
