"""Softmax top-k MoE router for decode in one Triton launch: logits GEMV, fp32 softmax, top-k, renormalise, cast.

Owns `router_topk` (checked launcher), its torch reference `router_topk_ref`, and one Triton kernel
`_router_topk_kernel`; for a prompt piece, whose logits are one GEMM (F.linear, as transformers' router), also
`router_topk_of_logits` and `_topk_rows_kernel` (one program a token: the softmax / top-k part, `topk_row`). It
computes exactly what transformers' `Qwen3_5MoeTopKRouter` / `Qwen3MoeTopKRouter` / `OlmoeTopKRouter` compute for
each token row:

    logits = (x · Wᵀ).to(x.dtype)                      [T, E]   (fp32 accumulation, one rounding, as F.linear)
    probs  = softmax(logits.float())                   [T, E]   fp32
    w, idx = topk(probs, k)                            [T, k]   descending
    w      = w / w.sum(-1)          (if norm_topk_prob; Qwen3.5 always renormalises, Qwen3-MoE/OLMoE per config)
    return logits, w.to(logits.dtype), idx (int64)
GPT-OSS's router adds a bias to the logits (`bias`, into the fp32 sum before the one rounding) and takes the softmax
over its top-k logits: the renormalised softmax top-k (norm_topk_prob), equal up to fp32 rounding.

Group-limited top-k (DeaMoE's two-stage routing; `group_size=n`, `topk_group=g`; departments d = 0..D-1, D = E / n,
of the experts d·n .. d·n+n-1), as `localmoe.experts.departments.group_limited_topk` with score "max":
    dmax   = logits.view(T, D, n).max(-1)              [T, D]   (ranks departments as their best softmax prob does)
    keep   = the g departments of largest dmax                  ties: lowest department index
    w, idx = topk(probs where the expert's department is kept, k)   probs stay the softmax over all E logits
The kernel's constexprs GROUP_N = n (0: off) and GROUP_G = g; g >= D is plain top-k (launched with GROUP_N 0).
`topk_tail` defaults both to off, so its other callers (kernels/moe_front.py) do plain top-k unchanged.

Grid (T, cdiv(E, BLOCK_E)): program (t, j) computes logits rows [j·BLOCK_E, (j+1)·BLOCK_E) of token t (BLOCK_E
rows × H, the H axis in BLOCK_H chunks) and stores them (rounded to x's dtype) into `logits`. It then takes a per-token
ticket (acq_rel atomic after a CTA barrier, as kernels/sparse_fused.py does); the last program of token t reads the
token's E logits back through L2, does the softmax, the top-k by k rounds of "max, lowest index among equal maxima,
mask it out" (no sort), the renormalisation and the casts, writes the outputs and re-zeroes its ticket, so the
ticket buffer is zero between launches (no memset node; CUDA-graph capturable; keep one ticket buffer per stream).
With GROUP_N, g department rounds on a copy of the candidates come first: the max (lowest index among equal maxima)
names department i // n, kept, whose n experts all leave the copy; the candidates are then masked to the kept
departments before the k rounds. Among departments of equal best logit the one holding the lower-index expert, i.e.
the lower department index, wins.

Selection is on the (rounded) logits, which softmax maps monotonically onto the probabilities torch.topk sees: equal
logits give equal probabilities and distinct ones distinct probabilities (for any realistic logit range), so the
selected set is the one torch picks, given a tie rule. Ties: this kernel takes the LOWEST index among equal values,
which is what torch.topk does on CUDA for the boundary (gatherTopK writes the values > the k-th value, then the
values == the k-th value in index order; the order inside a run of equal values in the output may differ). torch.topk
on CPU breaks ties differently (nth_element; e.g. topk([1,3,3,2,3,0,3], 2) -> indices [1, 6]), so CPU tests compare
with `router_topk_ref` (stable sort, lowest index first) and with torch.topk only on rows without a tie at the k-th
value. With bf16 logits (8-bit mantissa) at E = 256, a tie at the k-th value occurs in roughly 15% of random rows.

The logits GEMV's accumulation order differs from cuBLAS's, so a logit can land one rounding step away from
F.linear's (bf16: rarely; fp32: at the ulp level); this is the only numerical difference from transformers.

Shape legend: T tokens, H hidden, E experts, k experts per token.
  x [T, H] · weight [E, H] · logits [T, E] (x.dtype) · top_k_weights [T, k] (x.dtype) · top_k_index [T, k] int64
  tickets [>= T] int32, zero between launches.
"""

from __future__ import annotations

import torch

from localmoe.kernels.workspace import zeroed_int32

try:  # Triton is optional at import time; the launcher needs it.
    import triton
    import triton.language as tl

    from localmoe.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_kw
    from localmoe.kernels.rounding import round_to
except ImportError:  # pragma: no cover
    triton = None
    tl = None

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------------------------
# torch reference (transformers' router, with CUDA's tie rule made explicit)
# ----------------------------------------------------------------------------------------------------------
def group_args(E: int, top_k: int, group_size: int, topk_group: int) -> tuple[int, int]:
    """Checked (n, g) for group-limited top-k, (0, 0) when off (group_size 0, or topk_group >= E // group_size)."""
    if group_size == 0:
        if topk_group != 0:
            raise ValueError(f"topk_group {topk_group} needs a group_size")
        return 0, 0
    if group_size < 1 or E % group_size:
        raise ValueError(f"group_size {group_size} does not divide {E} experts")
    D = E // group_size
    if topk_group < 1:
        raise ValueError(f"topk_group must be >= 1 with group_size {group_size}, got {topk_group}")
    if top_k > min(topk_group, D) * group_size:
        raise ValueError(f"top_k {top_k} exceeds the {min(topk_group, D) * group_size} experts of {topk_group} groups")
    return (0, 0) if topk_group >= D else (group_size, topk_group)


def router_topk_ref(x, weight, top_k, norm_topk_prob=True, logits=None, *, group_size=0, topk_group=0, bias=None):
    """(logits [T,E], top_k_weights [T,k] in x.dtype, top_k_index [T,k] int64); ties -> lowest index first.
    group_size n / topk_group g: only the experts of the g departments (n consecutive experts each) with the highest
    best logit may be chosen (ties between departments -> lowest department index); weights stay the softmax over
    all E logits (renormalised over the k chosen if norm_topk_prob)."""
    if logits is None:  # an fp32 router over a lower-precision x (DeepSeek-V2): x in fp32, as its router does
        logits = torch.nn.functional.linear(x.to(weight.dtype) if weight.dtype == torch.float32 else x, weight, bias)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    lf = logits.float()
    order = torch.sort(lf, dim=-1, descending=True, stable=True).indices  # ties: lowest index first
    n, g = group_args(lf.shape[-1], top_k, group_size, topk_group)
    if n:
        T, E = lf.shape
        dmax = lf.view(T, E // n, n).amax(-1)  # [T, D]
        dsel = torch.sort(dmax, dim=-1, descending=True, stable=True).indices[:, :g]
        allowed = torch.zeros_like(dmax, dtype=torch.bool).scatter_(1, dsel, True).repeat_interleave(n, dim=1)
        # allowed experts first, each part in logit order (a stable sort keeps it)
        first = torch.sort((~allowed.gather(1, order)).to(torch.int8), dim=-1, stable=True).indices
        order = order.gather(1, first)
    idx = order[:, :top_k]
    w = probs.gather(1, idx)
    if norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return logits, w.to(logits.dtype), idx


# ----------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def topk_row(
        logits_ptr,
        tw_ptr,
        ti_ptr,
        t,
        E,
        stride_l,  # the logits' row stride
        K: tl.constexpr,
        K_P2: tl.constexpr,
        NORM: tl.constexpr,
        E_P2: tl.constexpr,
        GROUP_N: tl.constexpr,
        GROUP_G: tl.constexpr,
        W_SCALED: tl.constexpr,
        w_scale,
    ):
        """Token t's routing from its E logits: softmax, top-k (max, lowest index among equal maxima, mask it out;
        k rounds, no sort), the renormalisation and the casts; stores the k weights and indices. With GROUP_N, G
        department rounds come first (max, mask out its whole department) and the k rounds run on the experts of
        the G departments picked."""
        offs = tl.arange(0, E_P2)
        em = offs < E
        lg = tl.load(logits_ptr + t * stride_l + offs, mask=em, other=float("-inf"), cache_modifier=".cg")
        lg = lg.to(tl.float32)
        mx = tl.max(lg, axis=0)
        ex = tl.where(em, tl.exp(lg - mx), 0.0)
        den = tl.sum(ex, axis=0)
        kk = tl.arange(0, K_P2)
        ids = tl.zeros([K_P2], dtype=tl.int32)
        # one max per round over (the logit as an order-preserving integer, then E_P2-1-index), so the max is the
        # largest logit and, among equal ones, the lowest index. 16-bit logits pack into an int32 (half the
        # shuffle traffic of an int64 per round); the probabilities are gathered after the rounds, off their chain
        LT = logits_ptr.dtype.element_ty
        if LT == tl.float32:
            bits = tl.where(em, lg, float("-inf")).to(tl.int32, bitcast=True)
            key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
            cand = (key << 32) | (E_P2 - 1 - offs).to(tl.int64)
            low = 0xFFFFFFFF
            least = -9223372036854775807 - 1
        else:
            tl.static_assert(E_P2 <= 65536, "the index takes the key's low 16 bits")
            b16 = tl.where(em, lg, float("-inf")).to(LT).to(tl.int16, bitcast=True).to(tl.int32)
            key = tl.where(b16 >= 0, b16, b16 ^ 0x7FFF)
            cand = (key << 16) | (E_P2 - 1 - offs)
            low = 0xFFFF
            least = -2147483647 - 1
        if GROUP_N > 0:
            # G rounds on a copy: the max (lowest index among equal maxima) names a department, all of whose
            # experts leave the copy; then the k rounds see only the experts of the G departments named
            dept = offs // GROUP_N
            dcand = cand
            keep = offs < 0
            for _g in tl.static_range(GROUP_G):
                d = (E_P2 - 1 - (tl.max(dcand, axis=0) & low)).to(tl.int32) // GROUP_N
                dcand = tl.where(dept == d, least, dcand)
                keep = keep | (dept == d)
            cand = tl.where(keep, cand, least)
        for j in tl.static_range(K):
            best = tl.max(cand, axis=0)
            i = (E_P2 - 1 - (best & low)).to(tl.int32)
            ids = tl.where(kk == j, i, ids)
            cand = tl.where(offs == i, least, cand)
        # one term per column: exact (the softmax prob of the j-th pick, ex[i] / den)
        vals = tl.sum(tl.where(offs[:, None] == ids[None, :], (ex / den)[:, None], 0.0), axis=0)  # [K_P2]
        if NORM:
            vals = vals / tl.sum(tl.where(kk < K, vals, 0.0), axis=0)
        km = kk < K
        w_ty = tw_ptr.dtype.element_ty
        vals = round_to(vals, w_ty)
        if W_SCALED:  # as `weights * m` on the rounded weights: one more rounding
            vals = round_to(vals * w_scale, w_ty)
        tl.store(tw_ptr + t * K + kk, vals.to(w_ty), mask=km)
        tl.store(ti_ptr + t * K + kk, ids.to(tl.int64), mask=km)

    @triton.jit
    def topk_tail(
        logits_ptr,
        tw_ptr,
        ti_ptr,
        tick_ptr,
        t,
        E,
        programs,
        K: tl.constexpr,
        K_P2: tl.constexpr,
        NORM: tl.constexpr,
        E_P2: tl.constexpr,
        GROUP_N: tl.constexpr = 0,  # department size n (0: plain top-k)
        GROUP_G: tl.constexpr = 0,  # departments kept (topk_group), 1 <= G < E // n when GROUP_N
        W_SCALED: tl.constexpr = False,  # the stored weights times w_scale (GraniteMoE's residual_multiplier)
        w_scale=1.0,
    ):
        """Called by every program of token t after storing its logits: the last one to take the token's ticket
        reads the E logits back through L2 and routes them (`topk_row`), then re-zeroes the ticket. Returns whether
        this program was the last (it wrote the token's top-k)."""
        tl.debug_barrier()  # this program's logits stores precede the release below
        done = tl.atomic_add(tick_ptr + t, 1, sem="acq_rel", scope="gpu")
        last = done == programs - 1
        if last:
            topk_row(logits_ptr, tw_ptr, ti_ptr, t, E, E, K, K_P2, NORM, E_P2, GROUP_N, GROUP_G, W_SCALED, w_scale)
            tl.store(tick_ptr + t, 0)  # ready for the next launch / graph replay
        return last

    @triton.jit
    def _router_topk_kernel(
        x_ptr,  # [T, H] row stride stride_x, last dim contiguous
        w_ptr,  # [E, H] contiguous
        logits_ptr,  # [T, E] out (x.dtype), contiguous; also the programs' exchange buffer
        tw_ptr,  # [T, K] out top-k weights (x.dtype)
        ti_ptr,  # [T, K] out top-k indices (int64)
        tick_ptr,  # [>= T] int32 tickets, zero between launches
        b_ptr,  # [E] logit bias, weight's dtype (HAS_BIAS only: GPT-OSS's router)
        H,
        E,
        stride_x,
        K: tl.constexpr,
        K_P2: tl.constexpr,
        NORM: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_H: tl.constexpr,
        E_P2: tl.constexpr,
        GROUP_N: tl.constexpr,  # department size n for group-limited top-k (0: plain top-k)
        GROUP_G: tl.constexpr,  # departments kept (topk_group)
        HAS_BIAS: tl.constexpr,
        PDL: tl.constexpr,  # programmatic dependent launch (kernels/pdl.py)
    ):
        t = tl.program_id(0).to(tl.int64)
        pid_e = tl.program_id(1)
        rows = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
        rmask = rows < E
        cols = tl.arange(0, BLOCK_H)
        acc = tl.zeros([BLOCK_E, BLOCK_H], dtype=tl.float32)
        x_row = x_ptr + t * stride_x
        w_rows = w_ptr + rows.to(tl.int64)[:, None] * H
        cm = cols < H
        wv = tl.load(w_rows + cols[None, :], mask=rmask[:, None] & cm[None, :], other=0.0)  # first tile: weights,
        if PDL:  # loaded before the PDL wait
            gdc_wait()
            gdc_launch_dependents()
        xv = tl.load(x_row + cols, mask=cm, other=0.0).to(tl.float32)
        acc += wv.to(tl.float32) * xv[None, :]
        for h0 in range(BLOCK_H, H, BLOCK_H):
            cm = (h0 + cols) < H
            xv = tl.load(x_row + h0 + cols, mask=cm, other=0.0).to(tl.float32)
            wv = tl.load(w_rows + h0 + cols[None, :], mask=rmask[:, None] & cm[None, :], other=0.0)
            acc += wv.to(tl.float32) * xv[None, :]
        logit = tl.sum(acc, axis=1)  # [BLOCK_E] fp32
        if HAS_BIAS:  # F.linear's bias: added to the fp32 sum, one rounding
            logit += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        out_ty = logits_ptr.dtype.element_ty
        tl.store(logits_ptr + t * E + rows, round_to(logit, out_ty).to(out_ty), mask=rmask)

        # ---- the last program of token t: softmax, top-k, renormalise ----
        topk_tail(
            logits_ptr,
            tw_ptr,
            ti_ptr,
            tick_ptr,
            t,
            E,
            tl.num_programs(1),
            K=K,
            K_P2=K_P2,
            NORM=NORM,
            E_P2=E_P2,
            GROUP_N=GROUP_N,
            GROUP_G=GROUP_G,
        )

    @triton.jit
    def _topk_rows_kernel(
        logits_ptr,  # [T, E] row stride stride_l, last dim contiguous
        tw_ptr,  # [T, K] out top-k weights (the logits' dtype)
        ti_ptr,  # [T, K] out top-k indices (int64)
        E,
        stride_l,
        K: tl.constexpr,
        K_P2: tl.constexpr,
        NORM: tl.constexpr,
        E_P2: tl.constexpr,
        GROUP_N: tl.constexpr,
        GROUP_G: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        topk_row(logits_ptr, tw_ptr, ti_ptr, t, E, stride_l, K, K_P2, NORM, E_P2, GROUP_N, GROUP_G, False, 1.0)


# ----------------------------------------------------------------------------------------------------------
# ticket buffers
# ----------------------------------------------------------------------------------------------------------
def router_tickets(device, numel: int = 1) -> torch.Tensor:
    """Zeroed int32 ticket buffer with >= numel entries, one per (device, stream); the kernel leaves it zeroed.
    Create it before CUDA-graph capture (or pass your own zeroed buffer as `tickets=`)."""
    return zeroed_int32("router_topk", device, numel)


def router_topk(
    x: torch.Tensor,
    weight: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool = True,
    *,
    tickets: torch.Tensor | None = None,
    block_e: int | None = None,
    block_h: int | None = None,
    num_warps: int = 4,
    group_size: int = 0,
    topk_group: int = 0,
    bias: torch.Tensor | None = None,
):
    """One-launch softmax top-k router (module docstring). x [T, H] (or [..., H]), weight [E, H], x's dtype or fp32
    (DeepSeek-V2's router: x read in fp32, logits and weights fp32).
    Returns (router_logits [T, E], top_k_weights [T, k], top_k_index [T, k] int64), as transformers' router.
    group_size n > 0 with topk_group g: group-limited top-k over departments of n consecutive experts (module
    docstring); needs E % n == 0, g >= 1, top_k <= min(g, E // n) * n; g >= E // n is plain top-k.
    `bias` [E] (GPT-OSS's router; the weight's dtype): logits = x · Wᵀ + bias, the bias added to the fp32 sum.
    Untuned launch (block_e / block_h None): E // 128 rows a program (1..8), so even 32 experts make 32 programs
    (8 rows a program left GPT-OSS's 32 x 2880 router to 4 programs: 13 µs on an H200), one tile of up to 4096
    columns a row."""
    if triton is None:
        raise RuntimeError("router_topk needs triton")
    H = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != H:
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match hidden size {H}")
    E = weight.shape[0]
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k {top_k} out of range for {E} experts")
    if x.dtype not in _FLOAT_DTYPES or weight.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"x and weight must share a float dtype (or weight fp32), got {x.dtype} and {weight.dtype}")
    if weight.device != x.device:
        raise ValueError("x and weight must be on one device")
    if bias is not None and (
        tuple(bias.shape) != (E,) or bias.dtype != weight.dtype or bias.stride(0) != 1 or bias.device != x.device
    ):
        raise ValueError(f"bias must be a contiguous [{E}] tensor of the weight's dtype ({weight.dtype}) on {x.device}")
    group_n, group_g = group_args(E, top_k, group_size, topk_group)
    if block_e is None:
        block_e = min(8, max(1, 1 << (E // 128).bit_length() - 1)) if E >= 128 else 1
    if block_h is None:
        block_h = min(triton.next_power_of_2(H), max(512, 4096 // block_e))
    if block_e & (block_e - 1) or block_h & (block_h - 1):
        raise ValueError("block_e and block_h must be powers of two")
    x2 = x.reshape(-1, H)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    weight = weight if weight.is_contiguous() else weight.contiguous()
    T = x2.shape[0]
    out_dt = weight.dtype  # x's, or fp32 for an fp32 router (its logits and weights stay fp32)
    logits = torch.empty((T, E), dtype=out_dt, device=x.device)
    tw = torch.empty((T, top_k), dtype=out_dt, device=x.device)
    ti = torch.empty((T, top_k), dtype=torch.int64, device=x.device)
    if T == 0:
        return logits, tw, ti
    if tickets is None:
        tickets = router_tickets(x.device, T)
    elif tickets.dtype != torch.int32 or tickets.numel() < T or tickets.device != x.device:
        raise ValueError(f"tickets must be a zeroed int32 buffer of >= {T} entries on {x.device}")
    block_h = min(block_h, triton.next_power_of_2(H))
    block_e = min(block_e, triton.next_power_of_2(E))
    grid = (T, triton.cdiv(E, block_e))
    _router_topk_kernel[grid](
        x2,
        weight,
        logits,
        tw,
        ti,
        tickets,
        bias if bias is not None else weight,
        H,
        E,
        x2.stride(0),
        K=top_k,
        K_P2=triton.next_power_of_2(top_k),
        NORM=bool(norm_topk_prob),
        BLOCK_E=block_e,
        BLOCK_H=block_h,
        E_P2=triton.next_power_of_2(E),
        GROUP_N=group_n,
        GROUP_G=group_g,
        HAS_BIAS=bias is not None,
        num_warps=num_warps,
        **pdl_kw(x),
    )
    return logits, tw, ti


def router_topk_of_logits(
    logits: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool = True,
    *,
    group_size: int = 0,
    topk_group: int = 0,
    num_warps: int = 4,
):
    """The router's softmax, top-k, renormalisation and casts on logits [T, E] already computed (a prompt piece:
    F.linear's GEMM, as transformers' router runs it), one launch of one program a token, the selection and the
    ties as `router_topk`'s. Returns (top_k_weights [T, k] in the logits' dtype, top_k_index [T, k] int64)."""
    if triton is None:
        raise RuntimeError("router_topk_of_logits needs triton")
    if logits.dim() != 2 or logits.dtype not in _FLOAT_DTYPES or logits.stride(1) != 1:
        raise ValueError(f"logits must be a float [T, E] tensor with a contiguous last dim, got {logits.dtype} "
                         f"{tuple(logits.shape)}")  # fmt: skip
    T, E = logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k {top_k} out of range for {E} experts")
    group_n, group_g = group_args(E, top_k, group_size, topk_group)
    tw = torch.empty((T, top_k), dtype=logits.dtype, device=logits.device)
    ti = torch.empty((T, top_k), dtype=torch.int64, device=logits.device)
    if T == 0:
        return tw, ti
    _topk_rows_kernel[(T,)](
        logits,
        tw,
        ti,
        E,
        logits.stride(0),
        K=top_k,
        K_P2=triton.next_power_of_2(top_k),
        NORM=bool(norm_topk_prob),
        E_P2=triton.next_power_of_2(E),
        GROUP_N=group_n,
        GROUP_G=group_g,
        num_warps=num_warps,
    )
    return tw, ti
