"""A prompt piece's expert outputs weighted and summed back into its tokens in one Triton launch: the dense path's
last step (was ~6 launches a layer: the weights gathered into the sorted order, the weighting, the inverse
permutation, the rows gathered back, the fp32 sum and its cast).

Owns `token_combine` (checked launcher), its torch reference `token_combine_ref`, and `_token_combine_kernel`:

    out[t] = Σ_j  fp32( round_y( y[pos[t·k + j]] · round_y(w[t, j]) ) )      j = 0 .. k-1, in that order
    out    = out rounded to out's dtype
    with `shared` s [T, H] (a block's shared expert output) and its gate logit g [T] (`shared_gate`, optional):
    out    = round_out( out + round_y( round_y(sigmoid(g[t])) · s[t] ) )      (no gate: + s[t])

y [M, H] holds the expert outputs in the sorted slot order (kernels/slot_sort.py), pos [M] where each slot landed,
w [T, k] the routing weights. Each product is rounded to y's dtype as the dense path's `y * w.to(y.dtype)` rounds it
(transformers weights the expert outputs in the model's dtype), then a token's k products are summed in fp32 (not
bf16 atomics: kernels' order, deterministic) and rounded once; the shared expert's term is added to that rounded sum
as transformers' Qwen3.5 block adds it (`expert_output + sigmoid(gate(x)) * shared`, each op rounded to the model's
dtype). Grid (T, cdiv(H, BLOCK_H)).

Shape legend: T tokens, k experts per token, M = T·k slots, H hidden.
"""

from __future__ import annotations

import torch

try:  # Triton is optional at import time; the launcher needs it.
    import triton
    import triton.language as tl

    from localmoe.kernels.rounding import round_to
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None

__all__ = ["token_combine", "token_combine_ref"]

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def token_combine_ref(y, pos, w, out_dtype, shared=None, shared_gate=None) -> torch.Tensor:
    """out [T, H] in torch (module docstring)."""
    T, k = w.shape
    rows = y[pos].view(T, k, -1) * w.to(y.dtype).unsqueeze(-1)  # rounded to y's dtype
    acc = rows[:, 0].float()
    for j in range(1, k):
        acc = acc + rows[:, j].float()
    out = acc.to(out_dtype)
    if shared is None:
        return out
    term = shared if shared_gate is None else torch.sigmoid(shared_gate.view(T, 1).to(y.dtype)) * shared
    return out + term.to(out_dtype)


if triton is not None:

    @triton.jit
    def _token_combine_kernel(
        y_ptr,  # [M, H] sorted slot rows, row stride stride_y
        pos_ptr,  # [M] int64
        w_ptr,  # [T, k] routing weights, contiguous
        out_ptr,  # [T, H] contiguous
        s_ptr,  # [T, H] the shared expert's output, row stride stride_s (HAS_SHARED)
        g_ptr,  # [T] its gate logit, row stride stride_g (HAS_GATE)
        H,
        stride_y,
        stride_s,
        stride_g,
        K: tl.constexpr,
        BLOCK_H: tl.constexpr,
        HAS_SHARED: tl.constexpr,
        HAS_GATE: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        cm = cols < H
        y_ty = y_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(K):
            r = tl.load(pos_ptr + t * K + j)
            wj = round_to(tl.load(w_ptr + t * K + j).to(tl.float32), y_ty)
            v = tl.load(y_ptr + r * stride_y + cols, mask=cm, other=0.0).to(tl.float32)
            acc += round_to(v * wj, y_ty)
        o_ty = out_ptr.dtype.element_ty
        out = round_to(acc, o_ty)
        if HAS_SHARED:  # + sigmoid(g) * s, each op rounded as torch's on the model's dtype
            sv = tl.load(s_ptr + t * stride_s + cols, mask=cm, other=0.0).to(tl.float32)
            if HAS_GATE:
                g = tl.load(g_ptr + t * stride_g).to(tl.float32)
                sv = round_to(round_to(1.0 / (1.0 + tl.exp(-g)), y_ty) * sv, y_ty)
            out = round_to(out + sv, o_ty)
        tl.store(out_ptr + t * H + cols, out.to(o_ty), mask=cm)


def token_combine(
    y: torch.Tensor,
    pos: torch.Tensor,
    w: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    *,
    shared: torch.Tensor | None = None,
    shared_gate: torch.Tensor | None = None,
    block_h: int = 1024,
) -> torch.Tensor:
    """out [T, H] (out_dtype, y's by default) = each token's k weighted expert rows summed in fp32, one launch
    (module docstring). y [M, H] (last dim contiguous), pos [M] int64, w [T, k] with M = T·k; `shared` [T, H] (y's
    dtype, last dim contiguous) added, times sigmoid(`shared_gate`) ([T] or [T, 1], y's dtype) when given."""
    if triton is None:
        raise RuntimeError("token_combine needs triton")
    if y.dim() != 2 or w.dim() != 2 or pos.dim() != 1:
        raise ValueError(f"y [M, H], pos [M], w [T, k] expected, got {tuple(y.shape)}, {tuple(pos.shape)}, "
                         f"{tuple(w.shape)}")  # fmt: skip
    T, k = w.shape
    M, H = y.shape
    if M != T * k or pos.numel() != M:
        raise ValueError(f"y has {M} rows and pos {pos.numel()} entries for {T} tokens x {k} experts")
    out_dtype = out_dtype or y.dtype
    if y.dtype not in _FLOAT_DTYPES or w.dtype not in _FLOAT_DTYPES or out_dtype not in _FLOAT_DTYPES:
        raise TypeError(f"float y, w and output expected, got {y.dtype}, {w.dtype}, {out_dtype}")
    if pos.dtype != torch.int64:
        raise TypeError(f"pos must be int64, got {pos.dtype}")
    if len({y.device, pos.device, w.device}) != 1:
        raise ValueError("y, pos and w must be on one device")
    if y.stride(1) != 1:
        y = y.contiguous()
    if shared is not None and (tuple(shared.shape) != (T, H) or shared.dtype != y.dtype or shared.stride(1) != 1
                               or shared.device != y.device):  # fmt: skip
        raise ValueError(f"shared must be a [{T}, {H}] {y.dtype} tensor with a contiguous last dim on {y.device}")
    if shared_gate is not None and (shared is None or shared_gate.numel() != T or shared_gate.dtype != y.dtype
                                    or shared_gate.device != y.device):  # fmt: skip
        raise ValueError(f"shared_gate must be a [{T}] {y.dtype} tensor on {y.device}, with `shared`")
    g = shared_gate.view(T, -1) if shared_gate is not None else None
    if block_h & (block_h - 1):
        raise ValueError("block_h must be a power of two")
    out = torch.empty(T, H, dtype=out_dtype, device=y.device)
    if T == 0 or H == 0:
        return out
    block_h = min(block_h, triton.next_power_of_2(H))
    _token_combine_kernel[(T, triton.cdiv(H, block_h))](
        y,
        pos.contiguous(),
        w.contiguous(),
        out,
        shared if shared is not None else y,
        g if g is not None else y,
        H,
        y.stride(0),
        shared.stride(0) if shared is not None else 0,
        g.stride(0) if g is not None else 0,
        K=k,
        BLOCK_H=block_h,
        HAS_SHARED=shared is not None,
        HAS_GATE=g is not None,
        num_warps=4,
    )
    return out
