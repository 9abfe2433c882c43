"""Tests of kernels/qk_norm_rope_rows.py: a prompt piece's q/k norms + RoPE (+ the k/v write into a static cache) in
one launch against kernels/qk_norm_rope.py's reference token by token.

Covers Qwen3.5's gated layout with partial rotary and zero-centred norms, Qwen3-MoE's per-head standard norms,
OLMoE's whole-projection norms, kind "none" (Mixtral, GraniteMoE); fp32 and bf16; odd T; the cache write at the
position (rows past L not written), the position advanced by T and the ticket left zero; qkv rows read through a
strided view. Runs on CPU under TRITON_INTERPRET=1; never asserts a time. Shape legend: T tokens, Hq / Hkv heads,
D head dim, ROT rotary dims, L cache length.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kernel_cases import DEV  # noqa: E402

from localmoe.kernels.qk_norm_rope_rows import qk_norm_rope_rows, qk_norm_rope_rows_ref  # noqa: E402
from localmoe.kernels.workspace import zeroed_int32  # noqa: E402

# kind, gated, whole, Hq, Hkv, D, ROT
CASES = {
    "qwen3.5": ("zero_centred", True, False, 4, 2, 32, 8),
    "qwen3": ("standard", False, False, 4, 2, 16, 16),
    "olmoe": ("standard", False, True, 4, 4, 16, 16),
    "mixtral": ("none", False, False, 4, 1, 16, 16),
}


def problem(case, T, dtype, seed=0, spare=0):
    kind, gated, whole, Hq, Hkv, D, ROT = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    F = Hq * (2 * D if gated else D) + 2 * Hkv * D
    qkv = torch.randn(T, F + spare, generator=gen).to(DEV, dtype)[:, spare:]  # a strided view when spare > 0
    n = (Hq * D, Hkv * D) if whole else (D, D)
    wq, wk = (None, None) if kind == "none" else ((torch.randn(m, generator=gen) * 0.3 + 1).to(DEV, dtype) for m in n)
    ang = torch.rand(T, ROT // 2, generator=gen) * 3
    cos, sin = (torch.cat([f(ang), f(ang)], -1).to(DEV, dtype) for f in (torch.cos, torch.sin))
    kw = dict(num_q_heads=Hq, num_kv_heads=Hkv, kind=kind, gated=gated, whole=whole, head_dim=D)
    return qkv, wq, wk, cos, sin, kw


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_reference(case, dtype):
    qkv, wq, wk, cos, sin, kw = problem(case, 5, dtype, spare=3)
    got = qk_norm_rope_rows(qkv, wq, wk, cos, sin, 1e-6, **kw)
    want = qk_norm_rope_rows_ref(qkv, wq, wk, cos, sin, 1e-6, kw["num_q_heads"], kw["num_kv_heads"], kw["kind"],
                                 kw["gated"], kw["whole"], kw["head_dim"])  # fmt: skip
    for name, g, w in zip(("q", "k", "v", "gate"), got, want):
        if w is None:
            assert g is None, name
            continue
        assert g.shape == w.shape and g.dtype == dtype, name
        if dtype == torch.float32:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)
        else:  # the same roundings; rsqrt may differ by an ulp
            assert (g.float() - w.float()).abs().max() <= 2**-6 * w.float().abs().max().clamp_min(1), name


@pytest.mark.parametrize("case", ["qwen3.5", "qwen3"])
def test_cache_rows_written_and_position_advanced(case):
    """k and v of token t at row position + t; rows past L not written; the position advanced by T and the ticket
    zero after each launch (a second piece continues the first)."""
    _, gated, _, Hq, Hkv, D, _ = CASES[case]
    L = 9
    keys = torch.full((Hkv, L, D), float("nan"), device=DEV)
    values = torch.full((Hkv, L, D), float("nan"), device=DEV)
    pos = torch.tensor([2], device=DEV)
    qkv, wq, wk, cos, sin, kw = problem(case, 4, torch.float32, seed=1)
    q, k, v, gate = qk_norm_rope_rows(qkv, wq, wk, cos, sin, 1e-6, kv_cache=(keys, values, pos), **kw)
    assert int(pos) == 6 and int(zeroed_int32("qk_norm_rope_rows", DEV, 1).abs().sum()) == 0
    torch.testing.assert_close(keys[:, 2:6], k.transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(values[:, 2:6], v.transpose(0, 1), rtol=0, atol=0)
    assert torch.isnan(keys[:, :2]).all() and torch.isnan(keys[:, 6:]).all()
    qkv2, _, _, cos2, sin2, _ = problem(case, 5, torch.float32, seed=2)  # rows 6..10: 9 and 10 fall outside L
    _, k2, v2, _ = qk_norm_rope_rows(qkv2, wq, wk, cos2, sin2, 1e-6, kv_cache=(keys, values, pos), **kw)
    assert int(pos) == 11
    torch.testing.assert_close(keys[:, 6:9], k2[:3].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(values[:, 6:9], v2[:3].transpose(0, 1), rtol=0, atol=0)


def test_rejects():
    qkv, wq, wk, cos, sin, kw = problem("qwen3.5", 3, torch.float32)
    with pytest.raises(ValueError, match="features"):
        qk_norm_rope_rows(qkv[:, 1:], wq, wk, cos, sin, 1e-6, **kw)
    with pytest.raises(ValueError, match="cos and sin"):
        qk_norm_rope_rows(qkv, wq, wk, cos[:2], sin[:2], 1e-6, **kw)
    with pytest.raises(ValueError, match="kind"):
        qk_norm_rope_rows(qkv, wq, wk, cos, sin, 1e-6, **{**kw, "kind": "layer"})
