"""The online softmax of kernels/decode_attention.py's split kernel (flash decoding), as two Triton jit helpers.

* `_chunk`: keys [base, base + CHUNK) of one KV head in BLOCK_L tiles, folded into a program's running fp32 max m,
  sum l and accumulator acc[Dv] (masked keys and rows before a window's start skipped; with QK, this step's row too).
* `_combine_head`: the last of a query head's NP programs merges their partial results (m, l, acc): rescales them to
  their common max and writes out[h] = Σ acc / Σ l in the query's dtype; GPT-OSS's `sinks` [Hq] (a learned logit per
  head) join the denominator as exp(sink_h - M), M the larger of the head's max score and its sink (no value:
  transformers' eager_attention_forward with s_aux); with `gate` (Qwen3.5's gated attention output) it writes
  out[h] · sigmoid(gate[h]) instead, rounded as transformers' `attn_output * torch.sigmoid(gate)` rounds. A program
  with nothing kept wrote no accumulator (m = -inf), and the combine reads none for it.

Shape legend (kernels/decode_attention.py's): Hq query heads, Dk query/key head dim, Dv value head dim, NP programs
per head; the partials are fp32 [Hq, NP, 2 + Dv] (m, l, acc of each program).
"""

from __future__ import annotations

try:  # Triton is optional at import time; the kernels need it.
    import triton
    import triton.language as tl

    from localmoe.kernels.rounding import round_to
except ImportError:  # pragma: no cover
    triton = None
    tl = None

if triton is not None:

    @triton.jit
    def _chunk(
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
        DK: tl.constexpr,
        DV: tl.constexpr,
        DK_P2: tl.constexpr,
        DV_P2: tl.constexpr,
        CHUNK: tl.constexpr,
        BLOCK_L: tl.constexpr,
        HAS_MASK: tl.constexpr,
        skip,
    ):
        """Keys [base, base + CHUNK) at index >= lo but `skip` (this step's row with QK; -1) in BLOCK_L tiles, folded
        into the running (m, l, acc) by the online softmax."""
        dk = tl.arange(0, DK_P2)
        dkm = dk < DK
        dv = tl.arange(0, DV_P2)
        dvm = dv < DV
        for t0 in range(0, CHUNK, BLOCK_L):
            rows = base + t0 + tl.arange(0, BLOCK_L)  # [BLOCK_L] key positions
            ok = (rows < L) & (rows >= lo) & (rows != skip)
            if HAS_MASK:
                ok = ok & (tl.load(m_ptr + rows, mask=rows < L, other=0) != 0)
            r64 = rows.to(tl.int64)
            kt = tl.load(
                k_ptr + kvh * stride_kh + r64[:, None] * stride_kl + dk[None, :],
                mask=ok[:, None] & dkm[None, :],
                other=0.0,
            )
            sc = tl.sum(kt.to(tl.float32) * q[None, :], axis=1) * scale  # [BLOCK_L]
            sc = tl.where(ok, sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing kept so far: no NaN
            pr = tl.exp(sc - m_safe)  # masked keys: exp(-inf) = 0
            alpha = tl.exp(m_i - m_safe)
            vt = tl.load(
                v_ptr + kvh * stride_vh + r64[:, None] * stride_vl + dv[None, :],
                mask=ok[:, None] & dvm[None, :],
                other=0.0,
            )
            acc = acc * alpha + tl.sum(pr[:, None] * vt.to(tl.float32), axis=0)
            l_i = l_i * alpha + tl.sum(pr, axis=0)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _combine_head(
        part_ptr,
        o_ptr,
        g_ptr,
        s_ptr,
        h,
        NS,
        stride_oh,
        stride_gh,
        DV: tl.constexpr,
        DV_P2: tl.constexpr,
        NS_P2: tl.constexpr,
        HAS_GATE: tl.constexpr,
        HAS_SINKS: tl.constexpr,
    ):
        """out[h] from head h's NS partials (m, l, acc), read through L2 (other programs wrote them)."""
        sp = tl.arange(0, NS_P2)
        sm = sp < NS
        row = part_ptr + (h * NS + sp) * (2 + DV)  # [NS_P2]
        m = tl.load(row, mask=sm, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(row + 1, mask=sm, other=0.0, cache_modifier=".cg")
        M = tl.max(m, axis=0)
        if HAS_SINKS:  # the head's sink logit: in the denominator, with no value
            sk = tl.load(s_ptr + h).to(tl.float32)
            M = tl.maximum(M, sk)
        w = tl.exp(m - tl.where(M == float("-inf"), 0.0, M))  # splits with nothing kept weigh 0
        dv = tl.arange(0, DV_P2)
        dvm = dv < DV
        kept = sm & (m > float("-inf"))  # splits with nothing kept wrote no accumulator
        acc = tl.load(
            row[:, None] + 2 + dv[None, :], mask=kept[:, None] & dvm[None, :], other=0.0, cache_modifier=".cg"
        )
        den = tl.sum(l * w, axis=0)
        if HAS_SINKS:
            den += tl.exp(sk - M)
        o = tl.sum(acc * w[:, None], axis=0) / den
        DT = o_ptr.dtype.element_ty
        o = round_to(o, DT)
        if HAS_GATE:  # (attn.to(DT) * sigmoid(gate).to(DT)).to(DT), as torch computes it on DT tensors
            gv = tl.load(g_ptr + h * stride_gh + dv, mask=dvm, other=0.0).to(tl.float32)
            o = round_to(o * round_to(1.0 / (1.0 + tl.exp(-gv)), DT), DT)
        tl.store(o_ptr + h * stride_oh + dv, o.to(DT), mask=dvm)
