"""The front of a decoder layer's MoE block for one decode token, in one launch: residual add, post-attention
RMSNorm, router (logits, softmax, top-k, renormalise) and the shared expert's sigmoid gate.

Owns `moe_front` (checked launcher), its torch reference `moe_front_ref`, and one Triton kernel
`_moe_front_kernel`, grid (cdiv(E, BLOCK_E) [+ cdiv(I_s, BLOCK_S)],). What it computes is what transformers
computes between the attention / DeltaNet output and the experts of a Qwen3.5-MoE decoder layer (router as
kernels/router_topk.py):

    s      = (x + residual).to(dtype)                             [H]  the residual stream after the mixer
    h      = RMSNorm(s)                                           [H]  zero_centred x̂·(1+w) or standard w·x̂
    logits = (h · Wᵀ).to(dtype); w, idx = top-k of softmax(logits)     [E], [k], [k]
    sg     = sigmoid((h · w_sg).to(dtype)).to(dtype)              [1]  the shared expert's gate (optional)
    acc   += sg · (silu(h · W_gateᵀ) ⊙ (h · W_upᵀ)) · W_down_t        [H]  the shared expert (optional, fp32)

Every program loads its BLOCK_E router rows first (weights: before the PDL wait, kernels/pdl.py), then the two
[H] activation vectors, and recomputes s and the norm itself (2 x H elements from L2: cheaper than a launch and a
grid-wide wait); program 0 stores s, h and sg. The last program to take the ticket does the top-k
(`topk_tail` of kernels/router_topk.py). One token (decode); no host sync; CUDA-graph capturable with a fixed
ticket buffer. Replaces three launches (norm, router, shared-expert gate inside the shared expert's first kernel)
and the waits between them.

With `shared_expert=`, cdiv(I_s, BLOCK_S) more programs run the shared expert (BLOCK_S 4 / 4 warps: 255 registers
for sm_90, spill-free; 1 neuron per program measured 7.5% slower in the step): it needs no routing, so its weights
load before the PDL wait (overlapping the kernel before) and its output goes, fp32 and unrounded as
kernels/sparse_fused.py's shared programs compute it, into the experts' workspace row by atomics; the experts'
launch then adds the routed experts and publishes y = residual + the sum. That takes the shared expert off the
path after the router.

With `group_size`/`topk_group` the router's top-k is DeaMoE's group-limited one (kernels/router_topk.py's group mode:
only the experts of the g departments with the best logits), and `acc` may be DeaMoE's department output row, which
kernels/department_experts.py then adds into (`accumulate=True`).

With `basis=` (issue #23's gate predictor, kernels/gate_predictor.py) cdiv(N·r, BLOCK_B) more programs compute its
stage 1 for every department, z_d = sB_d · (qB_d · h) (fp32, B's int8 rows loaded before the PDL wait): it needs no
routing either, so the predictor's `department_basis` launch between the router and the experts goes (all N
departments instead of the ones the token's experts touch: N·r·H bytes of int8, beside the router's E·H of bf16).

With `slots=` (DeaMoE, group-limited top-k) the program that routes also writes the step's departments in fixed
slots (kernels/department_slots.py's `write_slots`, reading back the k ids and weights it just stored), so
kernels/department_experts.py follows this launch directly: the slotting launch goes.

Launch: `block_e` router rows a program and `num_warps` come from the device's tuned table (kernels/tuned/); on a card
without an entry, 4 rows a program from 128 experts on (1 below) with 4 warps: on an H100 4 / 4 was within 12% of
the best of 12 launches at E 128, 256 (with Qwen3.5's shared expert in the launch) and 960, where one row a program
(960 programs, each taking the ticket the last one waits on) took 1.3-1.7x as long; the H200's tuned entries are 4
rows a program at E 128 and 256 too.

Shape legend: H hidden, E experts, k experts per token, I_s shared expert width.
"""

from __future__ import annotations

import torch

from localmoe.kernels.moe_front_args import check_basis, check_shared, check_slots
from localmoe.kernels.router_topk import group_args, router_tickets, router_topk_ref

try:  # Triton is optional at import time; the launcher needs it.
    import triton
    import triton.language as tl

    from localmoe.kernels.department_slots import write_slots
    from localmoe.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_kw
    from localmoe.kernels.rounding import round_to
    from localmoe.kernels.router_topk import topk_tail
except ImportError:  # pragma: no cover
    triton = None
    tl = None

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_KINDS = {"standard": 0, "zero_centred": 1}


# ----------------------------------------------------------------------------------------------------------
# torch reference (transformers' formulas, written out)
# ----------------------------------------------------------------------------------------------------------
def moe_front_ref(
    x, residual, norm_weight, eps, kind, router_weight, top_k, norm_topk_prob=True, w_sg=None, *, group_size=0,
    topk_group=0, x_scale=1.0, w_scale=1.0, router_bias=None,
):  # fmt: skip
    """x, residual [H] (or [1, H]) -> (s [H], h [H], logits [E], top-k weights [k], top-k ids [k], sg [1] | None).
    group_size / topk_group: DeaMoE's group-limited top-k (kernels/router_topk.py); x_scale / w_scale / router_bias:
    `moe_front`."""
    dt = x.dtype
    xs = x.reshape(-1) if x_scale == 1.0 else x.reshape(-1) * x_scale
    s = (xs.float() + residual.reshape(-1).float()).to(dt)
    v = s.float()
    n = v * torch.rsqrt(v.pow(2).mean() + eps)
    w = norm_weight.float()
    h = (n * (1.0 + w)).to(dt) if kind == "zero_centred" else (w * n.to(dt).float()).to(dt)
    logits, tw, ti = router_topk_ref(
        h[None], router_weight, top_k, norm_topk_prob, group_size=group_size, topk_group=topk_group, bias=router_bias
    )
    sg = None
    if w_sg is not None:
        sg = torch.sigmoid((h.float() @ w_sg.reshape(-1).float()).to(dt).float()).to(dt).reshape(1)
    if w_scale != 1.0:
        tw = tw * w_scale
    return s, h, logits[0], tw[0], ti[0], sg


# ----------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _residual_norm(
        x_ptr, r_ptr, rv, nw, cols, cm, eps, x_scale, H: tl.constexpr, KIND: tl.constexpr, EARLY_RES: tl.constexpr,
        X_SCALED: tl.constexpr,
    ):  # fmt: skip
        """After a program's PDL wait: (s, h) in fp32, each rounded to x's dtype: s = x + residual, h = RMSNorm(s)
        (module docstring; X_SCALED: s = round(x · x_scale) + residual). rv is the residual when EARLY_RES loaded it
        before the wait."""
        xin = tl.load(x_ptr + cols, mask=cm, other=0.0)
        if not EARLY_RES:
            rv = tl.load(r_ptr + cols, mask=cm, other=0.0)
        DT = xin.dtype
        xf = xin.to(tl.float32)
        if X_SCALED:  # GraniteMoE: the mixer's output times residual_multiplier, rounded, before the add
            xf = round_to(xf * x_scale, DT)
        s = round_to(xf + rv.to(tl.float32), DT)
        n = s * tl.math.rsqrt(tl.sum(s * s, axis=0) / H + eps)
        if KIND == 1:
            h = round_to(n * (1.0 + nw), DT)
        else:
            h = round_to(round_to(n, DT) * nw, DT)
        return s, h

    @triton.jit
    def _shared_gate(ws, h, DT: tl.constexpr):
        """sg = sigmoid((h . w_sg) rounded to DT), rounded to DT (fp32 value)."""
        z = round_to(tl.sum(ws * h, axis=0), DT)
        return round_to(1.0 / (1.0 + tl.exp(-z)), DT)

    @triton.jit
    def _moe_front_kernel(
        x_ptr,  # [H] the mixer's output
        r_ptr,  # [H] the residual stream before the mixer
        nw_ptr,  # [H] post-attention RMSNorm weight
        w_ptr,  # [E, H] router weight, contiguous
        rb_ptr,  # [E] router bias, the weight's dtype (BIAS only: GPT-OSS's router)
        wsg_ptr,  # [H] shared expert gate weight (SHARED_GATE / SHARED_EXPERT)
        s_ptr,  # [H] out: x + residual (x's dtype)
        h_ptr,  # [H] out: RMSNorm(s) (x's dtype)
        logits_ptr,  # [E] out (the router's dtype: x's or fp32); also the programs' exchange buffer
        tw_ptr,  # [k] out top-k weights (the router's dtype)
        ti_ptr,  # [k] out top-k ids (int64)
        sg_ptr,  # [1] out sigmoid gate (SHARED_GATE without SHARED_EXPERT)
        tick_ptr,  # [1] int32 ticket, zero between launches
        seg_ptr,  # [I_S, H] shared expert W_gate (SHARED_EXPERT only)
        seu_ptr,  # [I_S, H] shared expert W_up
        sed_ptr,  # [I_S, H] shared expert W_down transposed
        acc_ptr,  # [H] fp32, added into: sg * the shared expert's output (SHARED_EXPERT only)
        b_ptr,  # [N·r, H] int8 the predictor's bases, contiguous (BASIS only)
        bsc_ptr,  # [N·r] fp32 their row scales (BASIS only)
        z_ptr,  # [N·r] fp32 out: sB · (qB · h) (BASIS only)
        dept_ptr,  # [S] int32 out: the step's departments in slots, then -1 (SLOTS only)
        sw_ptr,  # [S, 1, n] fp32 out: each slot's routing weights (SLOTS only)
        E,
        NR,  # router programs (cdiv(E, BLOCK_E)); programs NR.. run the shared expert, then the basis
        NS,  # shared expert programs (0 without SHARED_EXPERT)
        NB,  # basis rows N·r (BASIS only)
        SLOT_N,  # experts per department n (SLOTS only)
        SLOT_S,  # slots S (SLOTS only)
        I_S,
        eps,
        x_scale,  # X_SCALED: the mixer's output times x_scale before the residual add
        w_scale,  # W_SCALED: the top-k weights times w_scale
        H: tl.constexpr,
        H_P2: tl.constexpr,
        KIND: tl.constexpr,  # 0 standard, 1 zero_centred
        K: tl.constexpr,
        K_P2: tl.constexpr,
        NORM: tl.constexpr,
        BLOCK_E: tl.constexpr,
        E_P2: tl.constexpr,
        SHARED_GATE: tl.constexpr,
        SHARED_EXPERT: tl.constexpr,
        BLOCK_S: tl.constexpr,  # shared expert neurons per program
        EARLY_RES: tl.constexpr,  # load the residual before the PDL wait
        PDL: tl.constexpr,
        BASIS: tl.constexpr = False,  # the gate predictor's stage 1 in programs NR + NS..
        BLOCK_B: tl.constexpr = 1,  # basis rows per program
        BIAS: tl.constexpr = False,  # the router's logits get a bias (added to the fp32 sum, one rounding)
        SLOTS: tl.constexpr = False,  # the last router program writes the department slots
        S_P2: tl.constexpr = 1,  # SLOTS: next_pow2(S)
        Z_P2: tl.constexpr = 1,  # SLOTS: next_pow2(S * n)
        GROUP_N: tl.constexpr = 0,  # group-limited top-k: department size (0: plain top-k)
        GROUP_G: tl.constexpr = 0,  # departments kept
        X_SCALED: tl.constexpr = False,
        W_SCALED: tl.constexpr = False,
    ):
        pid = tl.program_id(0)
        DT = x_ptr.dtype.element_ty
        cols = tl.arange(0, H_P2)
        cm = cols < H
        nw = tl.load(nw_ptr + cols, mask=cm, other=0.0).to(tl.float32)
        if EARLY_RES:  # the residual was written two or more kernels back: complete when this one launches
            rv = tl.load(r_ptr + cols, mask=cm, other=0.0)
        else:
            rv = nw  # a placeholder: _residual_norm loads the residual after the wait
        if pid < NR:
            rows = pid * BLOCK_E + tl.arange(0, BLOCK_E)  # [BLOCK_E] router rows
            rmask = rows < E
            # ---- weights, before the wait ----
            wv = tl.load(
                w_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :], mask=rmask[:, None] & cm[None, :], other=0.0
            )
            first = (tl.zeros([H_P2], dtype=tl.int32) + pid) == 0
            STORE_SG: tl.constexpr = SHARED_GATE and not SHARED_EXPERT  # else applied by the shared programs
            if STORE_SG:
                ws = tl.load(wsg_ptr + cols, mask=cm & first, other=0.0).to(tl.float32)
            if PDL:
                gdc_wait()
                gdc_launch_dependents()
            # ---- residual add and RMSNorm, in every program ----
            s, h = _residual_norm(x_ptr, r_ptr, rv, nw, cols, cm, eps, x_scale, H, KIND, EARLY_RES, X_SCALED)
            tl.store(s_ptr + cols, s.to(DT), mask=cm & first)
            tl.store(h_ptr + cols, h.to(DT), mask=cm & first)
            # ---- router logits of this program's rows, the shared expert's gate in program 0 ----
            logit = tl.sum(wv.to(tl.float32) * h[None, :], axis=1)  # [BLOCK_E]
            if BIAS:  # F.linear's bias: added to the fp32 sum, one rounding (as router_topk's)
                logit += tl.load(rb_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
            LT = logits_ptr.dtype.element_ty  # x's dtype, or fp32 (an fp32 router)
            tl.store(logits_ptr + rows, round_to(logit, LT).to(LT), mask=rmask)
            if STORE_SG:
                if pid == 0:
                    tl.store(sg_ptr, _shared_gate(ws, h, DT).to(DT))
            last = topk_tail(
                logits_ptr, tw_ptr, ti_ptr, tick_ptr, 0, E, NR, K=K, K_P2=K_P2, NORM=NORM, E_P2=E_P2,
                GROUP_N=GROUP_N, GROUP_G=GROUP_G, W_SCALED=W_SCALED, w_scale=w_scale,
            )  # fmt: skip
            if SLOTS:
                if last:
                    tl.debug_barrier()  # the top-k this program's threads stored, visible to all of them
                    write_slots(
                        ti_ptr, tw_ptr, dept_ptr, sw_ptr, dept_ptr, dept_ptr, sw_ptr, K, K, 1, SLOT_N, SLOT_S,
                        TK_P2=K_P2, S_P2=S_P2, Z_P2=Z_P2, MAPS=False,
                    )  # fmt: skip
        elif pid < NR + NS:  # NS = 0 without SHARED_EXPERT
            if SHARED_EXPERT:
                # ---- the shared expert (needs no routing): BLOCK_S neurons' gate, up, down rows before the wait ----
                # (names apart from the router's: the two branches' common names must share types)
                srows = (pid - NR) * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S]
                m2 = (srows < I_S)[:, None] & cm[None, :]
                roff = srows.to(tl.int64)[:, None] * H + cols[None, :]  # [BLOCK_S, H_P2]
                wg = tl.load(seg_ptr + roff, mask=m2, other=0.0)
                wu = tl.load(seu_ptr + roff, mask=m2, other=0.0)
                wd = tl.load(sed_ptr + roff, mask=m2, other=0.0)
                ws = tl.load(wsg_ptr + cols, mask=cm, other=0.0).to(tl.float32)
                if PDL:
                    gdc_wait()
                    gdc_launch_dependents()
                _, h = _residual_norm(x_ptr, r_ptr, rv, nw, cols, cm, eps, x_scale, H, KIND, EARLY_RES, X_SCALED)
                sg = _shared_gate(ws, h, DT)
                # as kernels/sparse_fused.py's shared programs: silu(h . W_gate) * (h . W_up) * sg, then down
                zg = tl.sum(wg.to(tl.float32) * h[None, :], axis=1)  # [BLOCK_S]
                a = zg / (1.0 + tl.exp(-zg)) * tl.sum(wu.to(tl.float32) * h[None, :], axis=1) * sg
                contrib = tl.sum(wd.to(tl.float32) * a[:, None], axis=0)  # [H_P2]
                tl.atomic_add(acc_ptr + cols, contrib, mask=cm, sem="relaxed")
        elif BASIS:
            # ---- the gate predictor's stage 1 (needs no routing): BLOCK_B rows of B before the wait ----
            brow = (pid - NR - NS) * BLOCK_B + tl.arange(0, BLOCK_B)  # [BLOCK_B] rows of B viewed [N·r, H]
            bm = brow < NB
            qb = tl.load(
                b_ptr + brow.to(tl.int64)[:, None] * H + cols[None, :], mask=bm[:, None] & cm[None, :], other=0
            )
            sb = tl.load(bsc_ptr + brow, mask=bm, other=0.0)
            if PDL:
                gdc_wait()
                gdc_launch_dependents()
            _, hb = _residual_norm(x_ptr, r_ptr, rv, nw, cols, cm, eps, x_scale, H, KIND, EARLY_RES, X_SCALED)
            zb = tl.sum(qb.to(tl.float32) * hb[None, :], axis=1) * sb  # as department_basis: scale after the sum
            tl.store(z_ptr + brow, zb, mask=bm)


# ----------------------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------------------
def moe_front(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    kind: str,
    router_weight: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool = True,
    w_sg: torch.Tensor | None = None,
    *,
    tickets: torch.Tensor | None = None,
    block_e: int | None = None,
    num_warps: int = 4,
    residual_early: bool = False,
    shared_expert: tuple | None = None,
    acc: torch.Tensor | None = None,
    shared_block: int = 4,
    group_size: int = 0,
    topk_group: int = 0,
    x_scale: float = 1.0,
    w_scale: float = 1.0,
    basis: tuple | None = None,
    basis_block: int | None = None,
    slots: tuple | None = None,
    router_bias: torch.Tensor | None = None,
):
    """One decode token's MoE front (module docstring). x, residual: one row of H (any shape with H elements, last
    dim contiguous), one float dtype; norm_weight [H]; router_weight [E, H] in x's dtype or fp32 (DeepSeek-V2's
    router: logits and top-k weights then fp32, as kernels/router_topk.py), w_sg (H elements, or None) in x's
    dtype. Returns (s [H], h [H], router logits [1, E], top-k weights [1, k], top-k ids [1, k] int64, sg [1] | None);
    sg is None without w_sg, and with `shared_expert` (the gate is applied inside, nobody else needs it).
    `residual_early`: the residual was not written by the kernel just before this launch (a decoder layer's input,
    with the mixer's kernels between), so it is loaded before the PDL wait, overlapping that kernel.
    `shared_expert` = (w_gate, w_up, w_down_t), each [I_s, H] contiguous in x's dtype (w_down_t: W_down
    transposed), with w_sg and `acc` (fp32, H elements, contiguous): cdiv(I_s, shared_block) more programs add
    sg * silu(h . W_gate) * (h . W_up) @ W_down_t into acc (atomics), their weights loaded before the PDL wait: the
    shared expert needs no routing, so it overlaps the kernel before instead of following the router. acc is then
    the experts' workspace row (kernels/sparse_fused.py adds the routed experts and publishes the sum), or DeaMoE's
    department output (kernels/department_experts.py adds into it with `accumulate=True`).
    `group_size` n / `topk_group` g: DeaMoE's group-limited top-k (only the experts of the g departments of n
    consecutive experts with the best logits may be chosen; kernels/router_topk.py's group mode).
    `x_scale` / `w_scale` (GraniteMoE's residual_multiplier m on both branches): s = round(x · m) + residual, and the
    top-k weights are returned times m (each rounded as transformers' `h * m` and the layer's scaled MoE output,
    folded into the k weights, round them): the two multiplies' launches go into this one.
    `basis` = (B, B_scale, z): the gate predictor's stage 1 for every department (module docstring): B int8 [N, r, H]
    contiguous, B_scale fp32 [N, r] contiguous, z the fp32 output of N·r values (contiguous: the [1, N, r] `z` of
    kernels/gate_predictor.py's GatePredictor), z[d, i] = B_scale[d, i] · (B[d, i] · h). `basis_block` rows of B a
    program (a power of two; default: a tile of 32 elements per thread, as department_basis).
    `slots` = (n, dept, weights) with the group-limited top-k (`group_size` = n): the step's departments in S fixed
    slots as kernels/department_slots.py's `department_slots(ti, tw, n, S)` writes them, into dept (int32, S values)
    and weights (fp32 [S, 1, n], contiguous).
    `router_bias` (E values, the router weight's dtype; GPT-OSS's router): logits = h · Wᵀ + b, the bias added to the
    fp32 sum before the one rounding, as F.linear and kernels/router_topk.py's `bias` compute it.
    """
    if triton is None:
        raise RuntimeError("moe_front needs triton")
    H = x.shape[-1]
    if x.numel() != H or residual.numel() != H:
        raise ValueError(
            f"moe_front is for one token: x and residual must hold H = {H} values, got "
            f"{x.numel()} and {residual.numel()}"
        )
    if x.dtype not in _FLOAT_DTYPES or residual.dtype != x.dtype or router_weight.dtype not in (x.dtype, torch.float32):
        raise TypeError(
            f"x and residual must share a float dtype and router_weight have it (or be fp32), got {x.dtype}, "
            f"{residual.dtype}, {router_weight.dtype}"
        )
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {sorted(_KINDS)}, got {kind!r}")
    if router_weight.dim() != 2 or router_weight.shape[1] != H or norm_weight.numel() != H:
        raise ValueError(
            f"router_weight must be [E, {H}] and norm_weight [{H}], got {tuple(router_weight.shape)} "
            f"and {tuple(norm_weight.shape)}"
        )
    E = router_weight.shape[0]
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k {top_k} out of range for {E} experts")
    group_n, group_g = group_args(E, top_k, group_size, topk_group)
    if w_sg is not None and (w_sg.numel() != H or w_sg.dtype != x.dtype):
        raise ValueError(f"w_sg must hold H = {H} values of {x.dtype}")
    if router_bias is not None and (router_bias.numel() != E or router_bias.dtype != router_weight.dtype):
        raise ValueError(f"router_bias must hold E = {E} values of the router weight's dtype {router_weight.dtype}")
    tensors = [residual, norm_weight, router_weight] + ([w_sg] if w_sg is not None else [])
    tensors += [router_bias] if router_bias is not None else []
    if any(t.device != x.device for t in tensors):
        raise ValueError("every tensor must be on x's device")
    I_s = check_shared(shared_expert, w_sg, acc, shared_block, x, H)
    nb, bb = check_basis(basis, basis_block, x, H, num_warps)
    sn, ss = check_slots(slots, group_n, x)
    if block_e is None:  # untuned: 4 router rows a program from 128 experts on (few tickets; module doc)
        block_e = 4 if E >= 128 else 1
    if block_e < 1 or block_e & (block_e - 1):
        raise ValueError(f"block_e must be a power of two, got {block_e}")
    x1, r1 = x.reshape(H), residual.reshape(H)
    if x1.stride(0) != 1 or r1.stride(0) != 1:
        raise ValueError("x and residual need a contiguous last dim")
    nw = norm_weight.reshape(H).contiguous()
    w = router_weight if router_weight.is_contiguous() else router_weight.contiguous()
    dev, dt = x.device, x.dtype
    s, h = torch.empty(H, dtype=dt, device=dev), torch.empty(H, dtype=dt, device=dev)
    lt = router_weight.dtype  # x's, or fp32 for an fp32 router (DeepSeek-V2: its logits and weights stay fp32)
    logits = torch.empty((1, E), dtype=lt, device=dev)
    tw = torch.empty((1, top_k), dtype=lt, device=dev)
    ti = torch.empty((1, top_k), dtype=torch.int64, device=dev)
    sg = torch.empty(1, dtype=dt, device=dev) if w_sg is not None and shared_expert is None else None
    if tickets is None:
        tickets = router_tickets(dev, 1)
    elif tickets.dtype != torch.int32 or tickets.numel() < 1 or tickets.device != dev:
        raise ValueError(f"tickets must be a zeroed int32 buffer on {dev}")
    be = min(block_e, triton.next_power_of_2(E))
    nr = triton.cdiv(E, be)
    bs = min(shared_block, triton.next_power_of_2(max(I_s, 1)))
    ns = triton.cdiv(I_s, bs) if shared_expert is not None else 0
    nbp = triton.cdiv(nb, bb)
    se = shared_expert if shared_expert is not None else (w, w, w)  # dummies, never read
    bt = basis if basis is not None else (nw, nw, nw)
    st = slots[1:] if slots is not None else (ti, nw)  # dummies, never read
    _moe_front_kernel[(nr + ns + nbp,)](
        x1,
        r1,
        nw,
        w,
        router_bias.reshape(E).contiguous() if router_bias is not None else w,
        w_sg.reshape(H) if w_sg is not None else nw,
        s,
        h,
        logits,
        tw,
        ti,
        sg if sg is not None else s,
        tickets,
        *se,
        acc if acc is not None else nw,
        *bt,
        *st,
        E,
        nr,
        ns,
        nb,
        sn,
        ss,
        I_s,
        float(eps),
        float(x_scale),
        float(w_scale),
        H=H,
        H_P2=triton.next_power_of_2(H),
        KIND=_KINDS[kind],
        K=top_k,
        K_P2=triton.next_power_of_2(top_k),
        NORM=bool(norm_topk_prob),
        BLOCK_E=be,
        E_P2=triton.next_power_of_2(E),
        SHARED_GATE=w_sg is not None,
        SHARED_EXPERT=shared_expert is not None,
        BLOCK_S=bs,
        EARLY_RES=bool(residual_early),
        BASIS=basis is not None,
        BLOCK_B=bb,
        BIAS=router_bias is not None,
        SLOTS=slots is not None,
        S_P2=triton.next_power_of_2(max(ss, 1)),
        Z_P2=triton.next_power_of_2(max(ss * sn, 1)),
        GROUP_N=group_n,
        GROUP_G=group_g,
        X_SCALED=x_scale != 1.0,
        W_SCALED=w_scale != 1.0,
        num_warps=num_warps,
        **pdl_kw(x),
    )
    return s, h, logits, tw, ti, sg
