"""The argument layout and checks of the q/k norm + RoPE step (kernels/qk_norm_rope.py's `qk_norm_rope`), shared by
every kernel that takes that step: kernels/qk_norm_rope.py (one decode token), kernels/qk_norm_rope_rows.py (a prompt
piece's rows) and kernels/decode_attention_qk.py's `decode_attention_qk` (the step joined to the attention core).

Owns `KINDS` (the norm kinds "standard", "zero_centred", "none"; a kernel's KIND constexpr is the kind's index),
`qk_layout` (one token's arguments checked -> the flat q|k|v row, the norm weights, D, QW, ROT, the flat angles and
the cache tensors to launch with), `check_weights` (the q/k norm weights -> the head dim D) and `check_cache` (a
static cache layer's (keys, values, position), or dummies without one). Each check raises ValueError naming the
argument, what it must be and what it got.

Shape legend: Hq query heads, Hkv key/value heads, D head dim, ROT rotary dims (even, <= D; cos / sin hold ROT/2
angles with `half_angles`), QW = 2D (gated: [q_h | gate_h] per head) or D. qkv [Hq*QW + Hkv*D + Hkv*D] one token's
q|k|v projection; cos, sin [ROT]; norm weights [D] each (whole-projection norms: [Hq*D] and [Hkv*D]); kv_cache keys,
values [Hkv, L, D] (last dim contiguous), position a one-element int32/int64 tensor.
"""

from __future__ import annotations

import torch

KINDS = ("standard", "zero_centred", "none")
_KIND_ID = {k: i for i, k in enumerate(KINDS)}
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _one_row(name: str, t: torch.Tensor) -> torch.Tensor:
    """A tensor holding one row (numel == last dim, last dim contiguous) as a flat view."""
    if t.numel() != t.shape[-1] or t.stride(-1) != 1:
        raise ValueError(
            f"{name} must hold one token's row with a contiguous last dim, got shape {tuple(t.shape)} "
            f"strides {t.stride()}"
        )
    return t.view(-1)


def check_weights(q_weight, k_weight, kind, x_dtype, device, whole: bool, Hq: int, Hkv: int) -> int:
    """The head dim D (the norm weights' length; with `whole`, q_weight's / Hq) after checking the weights."""
    n = q_weight.shape[0] if q_weight.dim() == 1 else -1
    D = n // Hq if whole and n % Hq == 0 else (-1 if whole else n)
    if D < 1 or tuple(k_weight.shape) != ((Hkv * D,) if whole else (D,)):
        want = "[Hq*D] and [Hkv*D]" if whole else "both [D]"
        raise ValueError(
            f"q_weight and k_weight must be {want}, got {tuple(q_weight.shape)} and {tuple(k_weight.shape)}"
        )
    if q_weight.dtype not in _FLOAT_DTYPES or k_weight.dtype != q_weight.dtype:
        raise ValueError(f"norm weights must share a float dtype, got {q_weight.dtype} and {k_weight.dtype}")
    if kind == "standard" and torch.promote_types(q_weight.dtype, x_dtype) != x_dtype:
        raise ValueError(f"standard norm: a {q_weight.dtype} weight would promote {x_dtype} activations")
    if q_weight.device != device or k_weight.device != device:
        raise ValueError(f"norm weights are on {q_weight.device} / {k_weight.device}, qkv is on {device}")
    if q_weight.stride(0) != 1 or k_weight.stride(0) != 1:
        raise ValueError("norm weights must be contiguous")
    return D


def qk_layout(qkv, q_weight, k_weight, cos, sin, num_q_heads, num_kv_heads, kind, gated, kv_cache, whole, head_dim,
              half_angles=False):  # fmt: skip
    """`qk_norm_rope`'s arguments checked -> (qkv as one flat row, q_weight, k_weight (dummies for kind "none"), D,
    QW, ROT, cos, sin (flat), keys, values, position (dummies without `kv_cache`)); also for
    kernels/decode_attention_qk.py's `decode_attention_qk`, which takes the same step into its launch."""
    if kind not in _KIND_ID:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if num_q_heads < 1 or num_kv_heads < 1:
        raise ValueError(f"head counts must be positive, got {num_q_heads} query and {num_kv_heads} key/value heads")
    x = _one_row("qkv", qkv)
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"qkv must be bf16/fp16/fp32, got {x.dtype}")
    Hq, Hkv = num_q_heads, num_kv_heads
    if whole and gated:
        raise ValueError("whole-projection norms are for ungated layers (OLMoE)")
    if kind == "none":
        if q_weight is not None or k_weight is not None or whole or not isinstance(head_dim, int) or head_dim < 1:
            raise ValueError("kind 'none' (no q/k norms) takes no norm weights and no `whole`, and needs head_dim")
        D = head_dim
        q_weight = k_weight = x  # dummies, never read
    else:
        D = check_weights(q_weight, k_weight, kind, x.dtype, x.device, whole, Hq, Hkv)
        if head_dim is not None and head_dim != D:
            raise ValueError(f"head_dim {head_dim} differs from the norm weights' head dim {D}")
    QW = 2 * D if gated else D
    if x.numel() != Hq * QW + 2 * Hkv * D:
        raise ValueError(
            f"qkv has {x.numel()} features; {Hq} query heads ({'gated, ' if gated else ''}{QW} each) + "
            f"2 x {Hkv} key/value heads of {D} need {Hq * QW + 2 * Hkv * D}"
        )
    c, s = _one_row("cos", cos), _one_row("sin", sin)
    ROT = c.numel() * (2 if half_angles else 1)
    if s.numel() != c.numel() or ROT % 2 or not 2 <= ROT <= D:
        raise ValueError(
            f"cos and sin must be one token's [ROT] angles, ROT even and <= head dim {D}; got "
            f"{tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if c.dtype != x.dtype or s.dtype != x.dtype or c.device != x.device or s.device != x.device:
        raise ValueError(
            f"cos/sin must be {x.dtype} on {x.device} like qkv, got {c.dtype}/{s.dtype} on {c.device}/{s.device}"
        )
    kc, vc, pos = check_cache(kv_cache, Hkv, D, x)
    return x, q_weight, k_weight, D, QW, ROT, c, s, kc, vc, pos


def check_cache(kv_cache, Hkv: int, D: int, x: torch.Tensor):
    """(keys, values, position) to launch with; dummies (never written) without a cache."""
    if kv_cache is None:
        return x.view(1, 1, -1), x.view(1, 1, -1), x
    keys, values, pos = kv_cache
    for name, t in (("keys", keys), ("values", values)):
        if t.dim() != 3 or t.shape[0] != Hkv or t.shape[2] != D or t.stride(2) != 1:
            raise ValueError(
                f"kv_cache {name} must be [Hkv, L, D] = [{Hkv}, L, {D}] with a contiguous last dim, got "
                f"{tuple(t.shape)} strides {t.stride()}"
            )
        if t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"kv_cache {name} must be {x.dtype} on {x.device}, got {t.dtype} on {t.device}")
    if values.shape[1] != keys.shape[1]:
        raise ValueError("kv_cache keys and values must have one length L")
    if pos.numel() != 1 or pos.dtype not in (torch.int32, torch.int64) or pos.device != x.device:
        raise ValueError(f"kv_cache position must be a one-element int32/int64 tensor on {x.device}")
    return keys, values, pos
