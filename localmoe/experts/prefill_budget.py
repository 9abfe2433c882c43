"""The prefill chunk and the staging span a VRAM budget holds (issue #29): what a prompt piece allocates, by formula.

A prompt is prefilled in pieces of at most `chunk` tokens (decode/prefix.piece_cuts: equal pieces, no padding; a
short prompt is one piece of its own length). Offloaded, every piece streams nearly every absent expert through two
staging buffers of `span` experts (experts/staging.py), so a piece's PCIe time hardly depends on its length: the
longer the piece, the fewer times each expert crosses the bus per prompt (Qwen3.5-35B int4 at 16 GiB: ~6 GB of
absent expert parts a piece, whether it has 256 tokens or 2,048). `fit` therefore takes the longest chunk up
to MAX_CHUNK whose activations fit the bytes left after weights, expert cache and KV/state with a span of MIN_SPAN
experts, then the largest span (up to `default_span`) the rest holds. `reserve_bytes` is what the plan sets aside
for it (`placement.plan(workspace=...)`), so the expert cache is sized after it.

Peak bytes of one piece of T tokens (`peak_bytes`; read off the code that runs it, CUDA paths; el = dtype bytes,
N = T·k, H hidden, I expert width, E experts, L = the cache length a full-attention layer attends to (the context:
the CUDA-graph decoder's StaticCache), V vocab):
    KERNEL_WORKSPACE (64 MiB: cuBLAS workspace, launch scratch, small tensors not itemised)
  + staging: 2·span·S (S one expert's stored bytes, int4 / NF4 its dequantized bytes D; offloaded only; the buffers
            outlive the piece)
  + stream: 4·T·H·el (the embeddings, the layer's input, the residual after its mixer, the normed input)
            + 2·T·Dh·el (RoPE cos/sin) + T·L bytes (the boolean mask, pieces after the first)
  + V·(el + 4) (the last position's logits)
  + the largest of the layer kinds' transients:
    MoE (transformers' block around LocalExperts._grouped):
        T·E·el (router logits) + T·H·el (shared expert's output) + T·k·(el + 8) + 24·N (sort order, token, expert)
        + N·H·el (xs) + max(N·H·el (ys) + 2·Dspan + 3·N·I·el (gate, up, h),   3·N·H·el (ys, cat, weighted) + T·H·el)
        with Dspan = span·3·I·H·el for staged MXFP4 experts (each span dequantized; the generator dequantizes the next
        span while the loop still holds the last one: two alive), resident 4-bit experts the dequantized span `fit`
        chooses (dense_path.DEQUANT_BYTES up to DEQUANT_MAX_BYTES), 0 for plain and staged int4 / NF4 experts
        (staging buffers are used as they are) and for resident int4 read in place (`DensePath.int4_in_place`) in a
        piece of N >= 4·E slots (shorter calls dequantize DEQUANT_BYTES spans)
    full attention (sdpa): T·Hq·Dh·(3·el + 8) (q projection, Qwen3.5's gate copy (2·el without), fp32 q-norm)
        + 2·T·Hkv·Dh·el
        + 2·Hq·L·Dh·el (repeat_kv of the cache when a mask is given and Hq > Hkv) + T·L·(1 + el) (the mask's negation
        and its float copy inside SDPA); eager attention adds the scores Hq·T·L·max(3·el, 2·el + 4)
    attention with sinks (GPT-OSS, decode/sinks.py): T·Hq·D·(2·el + 8) + 2·T·Hkv·D·el + T·Hq·Dp·el (the padded
        query, Dp = D + 1 rounded up to 8) + 2·(Hq + Hkv)·(L + 1)·Dp·el (padded keys and values, repeated)
        + 2·T·(L + 1) (the mask with its sink column)
    Gated DeltaNet (decode/deltanet_prefill.py + the chunk rule's torch prepare): (3·C + Vd)·el·T (in_proj_qkv,
        the conv's output, q/k/v copies, z) + (7·Qh + 3·Vd + 3·Hv·64)·4·T (chunk_prepare's fp32 q, k, v, k·β, v·β,
        k decayed, u, w, q/k decayed and three [Hv, T/64, 64, 64] matrices), C = 2·Hk·dk + Hv·dv, Vd = Hv·dv,
        Qh = Hv·dk
    dense MLP layers (DeepSeek's first layers): 3·T·Idense·el + T·H·el
Checked on the CPU at Qwen3.5-35B shapes with a counter of live tensors (every aten op's new storages, freed with their
last tensor): deltanet_prefill with the kernel's launcher 225 KiB/token measured against the formula's 240; the
offloaded experts' call 519 MiB (int4 staged packed, before kernels/gather_dequant.py; span 42, T 256) against 526, 32
MiB (bf16) against 33; the whole two-piece prefill of a 4-layer model of those shapes (3 DeltaNet + 1 attention layer;
less KERNEL_WORKSPACE) 150 / 172 MiB (int4, T 256 / 512) against 149 / 177 and 176 / 216 MiB (bf16) against 173 / 226
(the CPU runs transformers' own DeltaNet there, not deltanet_prefill). Not counted: CUDA-only allocations outside the
caching allocator's view of these ops (SDPA's backend choice: a math fallback would materialise the scores),
accelerate's per-forward copies of spilled non-expert modules.

Shapes: T tokens, k experts per token, E experts, I expert width, H hidden, L cache length, Hq / Hkv heads, Dh head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localmoe.experts.dense_path import DEQUANT_BYTES, DEQUANT_MAX_BYTES, DEVICE_SLOTS_PER_EXPERT, DensePath
from localmoe.experts.int4 import expert_bytes as quantized_expert_bytes
from localmoe.experts.int4 import format_of, parts
from localmoe.experts.placement import WORKSPACE_RESERVE, GiB, OffloadPlan, state_bytes

MAX_CHUNK = 2048  # the longest prompt piece (tokens)
CHUNK_STEP = 64  # chunks are multiples of this (the DeltaNet rule's chunk), then halves of it down to MIN_CHUNK
MIN_CHUNK = 16
MIN_SPAN = 8  # experts per staging buffer at least (each span costs three grouped GEMMs and a gather per part)
STAGE_BYTES = 96 << 20  # stored expert bytes per staging buffer the span aims at (two buffers)
STAGE_DEQUANT_BYTES = 512 << 20  # 4-bit experts: dequantized bytes of one staged span (two alive at once)
KERNEL_WORKSPACE = 64 << 20
RESERVE_SHARE = 8  # the plan's prefill reserve takes at most 1/RESERVE_SHARE of the budget (beyond WORKSPACE_RESERVE)


@dataclass(frozen=True)
class PrefillShapes:
    """What a prefill piece's allocations depend on (`of` reads them from a transformers config)."""

    hidden: int
    width: int  # expert width I
    top_k: int
    experts: int
    el: int  # bytes of the model dtype
    vocab: int
    shared_width: int  # shared expert(s) width (0: none)
    heads: int
    kv_heads: int
    head_dim: int
    q_gate: bool  # Qwen3.5: q_proj also yields the output gate
    eager: bool  # attention scores materialised (transformers' eager attention)
    sinks: bool  # GPT-OSS: learned sinks through SDPA (decode/sinks.py, which the loader always installs)
    full_layers: int
    sliding_layers: int
    window: int
    linear_layers: int
    linear: tuple[int, int, int, int]  # DeltaNet (H_k, d_k, H_v, d_v)
    dense_width: int  # dense MLP layers' width (0: none)
    stored: int  # one expert's stored bytes (gate + up + down, its format)
    quantized: bool  # 4-bit experts: dequantized a span at a time
    staged_dequantized: bool = False  # int4 / NF4: offloaded spans are staged dequantized (kernels/gather_dequant.py)
    in_place: bool = False  # int4 read in place by the grouped GEMMs (DensePath.int4_in_place): no dequantized span

    @classmethod
    def of(cls, config, dtype: torch.dtype, fmt: str = "full", *, experts=None, width=None, hidden=None, top_k=None):
        """From a text config; `experts`, `width`, `hidden`, `top_k` override the config's (the experts modules')."""
        el = torch.finfo(dtype).bits // 8
        g = lambda *names, default=0: next(  # noqa: E731
            (int(getattr(config, n)) for n in names if getattr(config, n, None) is not None), default
        )
        H = int(hidden or config.hidden_size)
        E = int(experts or g("num_experts", "num_local_experts", "n_routed_experts", default=1))
        I = int(width or g("moe_intermediate_size", "intermediate_size"))
        layers = int(config.num_hidden_layers)
        types = list(getattr(config, "layer_types", None) or ["full_attention"] * layers)
        heads = g("num_attention_heads", default=1)
        head_dim = g("head_dim", default=H // heads)
        if getattr(config, "kv_lora_rank", None):  # MLA: keys and values expanded per head
            head_dim = g("qk_nope_head_dim") + g("qk_rope_head_dim") + g("v_head_dim")
        kv_heads = heads if getattr(config, "kv_lora_rank", None) else g("num_key_value_heads", default=heads)
        shared = g("shared_expert_intermediate_size") or g("n_shared_experts") * I
        dense = g("first_k_dense_replace") and g("intermediate_size")
        model_type = str(getattr(config, "model_type", ""))
        impl = getattr(config, "_attn_implementation", None)
        stored = 3 * I * H * el if fmt == "full" else quantized_expert_bytes(I, H, fmt)
        return cls(
            hidden=H,
            width=I,
            top_k=int(top_k or g("num_experts_per_tok", default=1)),
            experts=E,
            el=el,
            vocab=g("vocab_size"),
            shared_width=shared,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            q_gate=model_type.startswith("qwen3_5"),
            eager=impl == "eager" and model_type != "gpt_oss",
            sinks=model_type == "gpt_oss",
            full_layers=sum(t not in ("linear_attention", "sliding_attention") for t in types),
            sliding_layers=sum(t == "sliding_attention" for t in types),
            window=g("sliding_window"),
            linear_layers=sum(t == "linear_attention" for t in types),
            linear=(
                g("linear_num_key_heads"),
                g("linear_key_head_dim"),
                g("linear_num_value_heads"),
                g("linear_value_head_dim"),
            ),
            dense_width=dense,
            stored=stored,
            quantized=fmt != "full",
            staged_dequantized=fmt in ("int4", "nf4"),
            in_place=fmt == "int4" and DensePath.int4_in_place,
        )

    @property
    def dequantized(self) -> int:
        """One expert's bytes dequantized (gate + up + down in the model dtype)."""
        return 3 * self.width * self.hidden * self.el


def default_span(s: PrefillShapes) -> int:
    """Experts per staging buffer when room allows (`span_for` of these shapes)."""
    return span_for(s.stored, s.dequantized, s.quantized, s.experts, s.staged_dequantized)


def span_for(stored: int, dequantized: int, quantized: bool, experts: int, staged_dequantized: bool = False) -> int:
    """STAGE_BYTES of stored expert weights a buffer, and for 4-bit experts STAGE_DEQUANT_BYTES of dequantized ones
    (int4 / NF4 staged dequantized: only that, their buffers hold no stored bytes), evened out over the layer's
    experts (`even`; at most every expert, at least one)."""
    per = STAGE_DEQUANT_BYTES // max(dequantized, 1) if staged_dequantized else STAGE_BYTES // max(stored, 1)
    if quantized:
        per = min(per, STAGE_DEQUANT_BYTES // max(dequantized, 1))
    return even(per, experts)


def even(span: int, experts: int) -> int:
    """The smallest span that streams `experts` in as few spans as `span` does: spans of equal size, no short last
    one (Qwen3.5-35B-A3B int4: 85 experts a span is four spans, of 64; 60 was five, the last of 16 experts: a
    span's gather and two grouped GEMM launches more a layer, the last a fraction of a wave)."""
    span = max(1, min(experts, span))
    return -(-experts // -(-experts // span))


def _attention(s: PrefillShapes, T: int, L: int) -> int:
    el, Hq, Hkv, D = s.el, s.heads, s.kv_heads, s.head_dim
    per_token = Hq * D * ((3 if s.q_gate else 2) * el + 8) + 2 * Hkv * D * el
    if s.sinks:  # the padded query, keys and values (repeated to the query heads), the mask and its sink column
        Dp = -(-(D + 1) // 8) * 8
        return T * (per_token + Hq * Dp * el) + 2 * (Hq + Hkv) * (L + 1) * Dp * el + 2 * T * (L + 1)
    cached = (2 * Hq * L * D * el if Hq > Hkv else 0) + T * L * (1 + el)
    scores = Hq * T * L * max(3 * el, 2 * el + 4) if s.eager else 0
    return T * per_token + cached + scores


def _deltanet(s: PrefillShapes, T: int) -> int:
    hk, dk, hv, dv = s.linear
    C, Vd, Qh = 2 * hk * dk + hv * dv, hv * dv, hv * dk
    return T * ((3 * C + Vd) * s.el + (7 * Qh + 3 * Vd + 3 * hv * 64) * 4)


def _moe(s: PrefillShapes, T: int, span: int, dequant: int = DEQUANT_BYTES) -> int:
    el, H, I, N = s.el, s.hidden, s.width, T * s.top_k
    if not s.quantized or (span and s.staged_dequantized):  # plain experts, or staging buffers used as they are
        dspan = 0
    elif s.in_place and N >= DEVICE_SLOTS_PER_EXPERT * s.experts:  # resident int4 read in place (DensePath._device_ok)
        dspan = 0
    elif span:  # staged (offloaded) MXFP4
        dspan = span * s.dequantized
    else:  # resident 4-bit experts: dense_path._spans, `dequant` bytes a span (at most every expert)
        dspan = max(1, min(s.experts, dequant // s.dequantized)) * s.dequantized
    fixed = T * s.experts * el + (T * H * el if s.shared_width else 0) + T * s.top_k * (el + 8) + 24 * N + N * H * el
    return fixed + max(N * H * el + 2 * dspan + 3 * N * I * el, 3 * N * H * el + T * H * el)


def peak_bytes(s: PrefillShapes, chunk: int, span: int, context: int, dequant: int = DEQUANT_BYTES) -> int:
    """Bytes a prefill piece of `chunk` tokens allocates at its peak, staging buffers of `span` experts included
    (span 0: resident experts, no staging), the cache `context` tokens long, resident 4-bit experts dequantized
    `dequant` bytes a span (the module docstring's formula)."""
    T, el = chunk, s.el
    L = max(context, T)
    Ls = min(L, s.window + T) if s.sliding_layers else 0
    mixers = [_moe(s, T, span, dequant)]
    if s.full_layers:
        mixers.append(_attention(s, T, L))
    if s.sliding_layers:
        mixers.append(_attention(s, T, Ls))
    if s.linear_layers:
        mixers.append(_deltanet(s, T))
    if s.dense_width:
        mixers.append(3 * T * s.dense_width * el + T * s.hidden * el)
    stream = 4 * T * s.hidden * el + 2 * T * s.head_dim * el + T * ((L if s.full_layers else 0) + Ls)
    staged = s.dequantized if s.staged_dequantized else s.stored  # one expert in a staging buffer
    return KERNEL_WORKSPACE + 2 * span * staged + stream + s.vocab * (el + 4) + max(mixers)


@dataclass(frozen=True)
class PrefillFit:
    chunk: int  # prompt tokens per prefill piece
    span: int  # experts per staging buffer (0: resident experts, no staging)
    peak_bytes: int  # the formula's peak at (chunk, span)
    left_bytes: int  # the bytes it had: budget - weights on the GPU - expert cache - KV/state
    fits: bool  # False: not even MIN_CHUNK with MIN_SPAN fits (the smallest is used; the budget may not hold)
    dequant_bytes: int = 0  # resident 4-bit experts: dequantized bytes a span of grouped GEMMs (0: not such experts)

    def line(self) -> str:
        span = f", staging {self.span} experts a buffer" if self.span else ""
        if self.dequant_bytes:
            span += f", dequantizing {self.dequant_bytes >> 20} MiB of experts a span"
        return (
            f"prefill pieces of up to {self.chunk} tokens{span}: ~{self.peak_bytes / GiB:.2f} GiB of the "
            f"{self.left_bytes / GiB:.2f} GiB left after weights, expert cache and KV/state"
            + ("" if self.fits else " (does not fit: give a larger --vram or a shorter --context)")
        )


def _chunks(longest: int) -> list[int]:
    """Candidate chunks, longest first: multiples of CHUNK_STEP, then halves down to MIN_CHUNK."""
    top = max(MIN_CHUNK, min(longest, MAX_CHUNK))
    out = list(range(top - top % CHUNK_STEP, CHUNK_STEP - 1, -CHUNK_STEP)) or [top]
    if out[0] != top:
        out.insert(0, top)
    c = CHUNK_STEP // 2
    while c >= MIN_CHUNK:
        out.append(c)
        c //= 2
    return out


def fit(s: PrefillShapes, left: int, context: int, offloaded: bool, longest: int = MAX_CHUNK) -> PrefillFit:
    """The longest chunk (up to `longest`, and shorter than `context`: a prompt must leave room in the cache) whose
    peak fits `left` bytes with a span of MIN_SPAN experts, then the largest span up to `default_span` that still
    fits (resident experts: span 0). A short context thus reserves only the pieces it can hold: gpt-oss-120b at
    `--vram 24` and context 640 set 2.4 GiB aside for 2,048-token pieces, taking every up/down slot from decode."""
    top = default_span(s) if offloaded else 0
    least = min(MIN_SPAN, top)
    chunks = _chunks(min(longest, context - 1))
    for chunk in chunks:
        if peak_bytes(s, chunk, least, context) > left:
            continue
        span = least
        for n in range(top, least, -1):
            if peak_bytes(s, chunk, n, context) <= left:
                span = even(n, s.experts)
                break
        dq = _dequant(s, chunk, context, left) if s.quantized and not offloaded and not s.in_place else 0
        return PrefillFit(chunk, span, peak_bytes(s, chunk, span, context, dq or DEQUANT_BYTES), int(left), True, dq)
    chunk = chunks[-1]
    dq = DEQUANT_BYTES if s.quantized and not offloaded and not s.in_place else 0
    return PrefillFit(chunk, least, peak_bytes(s, chunk, least, context), int(left), False, dq)


def _dequant(s: PrefillShapes, chunk: int, context: int, left: int) -> int:
    """Resident 4-bit experts: the largest dequantized span, DEQUANT_MAX_BYTES halved down to DEQUANT_BYTES, whose
    piece of `chunk` tokens still fits `left` (fewer, longer spans: fewer launches and host syncs a layer)."""
    size = DEQUANT_MAX_BYTES
    while size > DEQUANT_BYTES and peak_bytes(s, chunk, 0, context, size) > left:
        size //= 2
    return max(size, DEQUANT_BYTES)


def reserve_bytes(s: PrefillShapes, context: int, budget_bytes: int, offloaded: bool = True) -> int:
    """The plan's workspace for prefill: the peak of the chunk `fit` picks within max(WORKSPACE_RESERVE, the budget /
    RESERVE_SHARE) (MAX_CHUNK with the default span wherever that fits), never below WORKSPACE_RESERVE. The cap keeps
    a model whose attention materialises its scores (eager) from giving most of a small budget's cache away."""
    cap = max(int(WORKSPACE_RESERVE), budget_bytes // RESERVE_SHARE)
    return max(int(WORKSPACE_RESERVE), fit(s, cap, context, offloaded).peak_bytes)


def least_bytes(s: PrefillShapes, context: int) -> int:
    """Resident experts: the workspace of the shortest chunk (MIN_CHUNK), never below WORKSPACE_RESERVE; a budget that
    holds every expert beside it stays resident, with shorter pieces (offloading would cost far more)."""
    return max(int(WORKSPACE_RESERVE), peak_bytes(s, MIN_CHUNK, 0, context))


def workspaces(config, dtype: torch.dtype, fmt: str, context: int, budget_bytes: int, **experts) -> tuple[int, int]:
    """(workspace, resident_workspace) for `placement.plan` at this budget: `reserve_bytes` for an offloaded plan,
    `least_bytes` for the all-resident test. `experts`: `PrefillShapes.of`'s overrides (experts, width, hidden)."""
    s = PrefillShapes.of(config, dtype, fmt, **experts)
    return reserve_bytes(s, context, budget_bytes), least_bytes(s, context)


def left_bytes(plan, cache, config, dtype: torch.dtype, context: int) -> int:
    """Bytes an OffloadPlan's budget leaves for prefill: budget - non-expert weights on the GPU - the expert cache's
    pools (`cache`; None: every expert resident) - KV/state at `context`."""
    if cache is not None:
        pool = cache.pool
        experts = sum(t.numel() * t.element_size() for w in (pool.w_gate, pool.w_up, pool.w_down_t) for t in parts(w))
    else:
        experts = plan.total_experts * plan.expert_bytes
    return plan.budget_bytes - plan.gpu_non_expert_bytes - experts - state_bytes(config, context, dtype)


def fit_loaded(plan, mods, cache, config, dtype, context: int, left: int | None = None) -> PrefillFit | None:
    """A loaded model's prefill fit under its VRAM budget `plan` (None, or DeaMoE's department plan: no fit) from
    the bytes it leaves (`left_bytes`, or `left`); the cache's staging buffers are resized to its span."""
    if not isinstance(plan, OffloadPlan) or not mods or not hasattr(mods[0], "intermediate_size"):
        return None
    m0 = mods[0]
    fmt = format_of(m0.weights.w_gate) if m0.weights is not None else "full"
    shapes = PrefillShapes.of(
        config, dtype, fmt, experts=m0.num_experts, width=m0.intermediate_size, hidden=m0.hidden_size
    )
    if left is None:
        left = left_bytes(plan, cache, config, dtype, context)
    chosen = fit(shapes, left, context, offloaded=cache is not None)
    if cache is not None:
        cache.staging.resize(chosen.span)
    for m in mods:  # resident 4-bit experts' dequantized span (the dense path's default where 0)
        m.dequant_bytes = chosen.dequant_bytes or None
    return chosen
