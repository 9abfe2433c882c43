"""q/k norm + RoPE, the k/v cache write and the attention core for ONE query token, in one launch.

Owns `decode_attention_qk` (a checked launcher) and its torch reference `decode_attention_qk_ref`: the step of
kernels/qk_norm_rope.py (`qk_norm_rope(qkv, ..., kv_cache=(keys, values, position))`: its arguments and checks,
kernels/qk_layout.py's `qk_layout`) joined into the launch of kernels/decode_attention.py (`_split_kernel` with QK
on, through its `_launch`). q is read from the q|k|v projection (gated: the output gate beside it, read in place by
the combine) and normed and rotated by each program after the PDL wait (`norm_rope_head`, the same jit code and
roundings), as is its KV head's new key; program 0 of each KV head's first query head writes the new key and value
at the position (the norm weights, the angles and the position are read before the wait), every program skips that
cache row, program 0 of each query head folds the new key and value into its softmax from registers, and the last
program of the launch (a ticket after the heads') advances the position. One launch fewer per attention layer (the
projection's GEMV, this, o_proj).

Shape legend (kernels/qk_norm_rope.py's): Hq query heads, Hkv KV heads, D head dim, QW = 2D (gated: [q_h | gate_h]
per head) or D, L cache rows. qkv [Hq*QW + 2*Hkv*D] one token's q|k|v projection; keys, values [Hkv, L, D] a static
cache in position order; position [] int; out [Hq, D].
"""

from __future__ import annotations

import torch

from localmoe.kernels.decode_attention import _launch, _mask_int8, _out, decode_attention_ref
from localmoe.kernels.qk_layout import KINDS, qk_layout
from localmoe.kernels.qk_norm_rope import qk_norm_rope_ref

try:  # Triton is optional at import time; the launcher needs it.
    import triton
except ImportError:  # pragma: no cover
    triton = None


def decode_attention_qk_ref(
    qkv, keys, values, position, mask=None, scale=None, *, q_weight, k_weight, cos, sin, eps, num_q_heads,
    num_kv_heads, kind="standard", gated=False, whole=False, head_dim=None,
):  # fmt: skip
    """`decode_attention_qk` as the two steps it joins: kernels/qk_norm_rope.py's reference, the key and value written
    at the position (advanced by one; keys / values / position updated in place), then `decode_attention_ref`."""
    q, k, v, gate = qk_norm_rope_ref(
        qkv, q_weight, k_weight, cos, sin, eps, num_q_heads, num_kv_heads, kind=kind, gated=gated, whole=whole,
        head_dim=head_dim,
    )  # fmt: skip
    p = int(position.reshape(-1)[0])
    if p < keys.shape[1]:
        keys[:, p] = k
        values[:, p] = v
    position += 1
    return decode_attention_ref(q, keys, values, mask, scale, gate=None if gate is None else gate.view(q.shape))


def decode_attention_qk(
    qkv: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    position: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    *,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    num_q_heads: int,
    num_kv_heads: int,
    kind: str = "standard",
    gated: bool = False,
    whole: bool = False,
    head_dim: int | None = None,
    chunk: int = 64,
    block_l: int = 64,
    num_warps: int = 4,
    prefetch: bool | None = None,
    max_splits: int = 16,
) -> torch.Tensor:
    """kernels/qk_norm_rope.py's step (`qk_norm_rope(qkv, ..., kv_cache=(keys, values, position))`: its arguments
    and checks) and `decode_attention(q, keys, values, mask, scale, gate=gate)` in ONE launch: after the PDL wait each
    program norms and rotates its query head and its KV head's new key from the projection, one program a KV head
    writes the key and value at the position, program 0 of each query head folds the new key and value into its
    softmax from registers (every program skips that cache row: it may not be written yet), and the last program
    advances the position. The norm weights, the angles and the position are read before the wait (the angles are
    made at the start of the step). Returns [Hq, D] in qkv's dtype (gated: times sigmoid(gate), as
    `decode_attention`). A static cache of L >= 1 rows in position order: no ring, no biases, no sinks or window."""
    if triton is None:
        raise RuntimeError("decode_attention_qk needs triton")
    x, qw, kw, D, QW, ROT, c, s, kc, vc, pos = qk_layout(
        qkv, q_weight, k_weight, cos, sin, num_q_heads, num_kv_heads, kind, gated, (keys, values, position), whole,
        head_dim,
    )  # fmt: skip
    Hq, Hkv, L = num_q_heads, num_kv_heads, kc.shape[1]
    if L == 0:
        raise ValueError("decode_attention_qk needs a cache of at least one row")
    rows = x[: Hq * QW].view(Hq, QW)
    q, gate = rows[:, :D], (rows[:, D:] if gated else None)
    qk = {
        "q_weight": qw,
        "k_weight": kw,
        "cos": c,
        "sin": s,
        "position": pos,
        "k_new": x[Hq * QW : Hq * QW + Hkv * D],
        "v_new": x[Hq * QW + Hkv * D :],
        "eps": eps,
        "kind": KINDS.index(kind),
        "whole": whole,
        "rot": ROT,
        "block_w": triton.next_power_of_2(max(Hq, Hkv) * D) if whole else 1,
    }
    mask = _mask_int8(mask, L, x.device)
    out = _out(out, Hq, D, q)
    return _launch(q, kc, vc, mask, scale, out, gate, None, None, chunk, block_l, num_warps, prefetch, max_splits, qk)
