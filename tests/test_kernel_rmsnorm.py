"""Tests of kernels/rmsnorm.py: the fused RMSNorm (standard, zero-centred, gated) vs transformers' own modules.

Runs on CPU under TRITON_INTERPRET=1. fp32: bit-close (≤ a few ulp); bf16: within one bf16 rounding (~1e-2 rel).
Shape legend: x [..., N], w [N], z (gate) like x.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from localmoe.kernels.rmsnorm import rmsnorm, rmsnorm_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# leading shape, N: decode rows (hidden 2048, head 256 / 128), odd widths, several rows
SHAPES = [((1, 1), 2048), ((1, 1, 16), 256), ((32,), 128), ((3, 5), 72), ((2,), 37)]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def _hf(kind, N, eps):
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q35
    from transformers.models.qwen3_moe import modeling_qwen3_moe as q3

    if kind == "standard":
        return q3.Qwen3MoeRMSNorm(N, eps=eps)
    if kind == "zero_centred":
        return q35.Qwen3_5MoeRMSNorm(N, eps=eps)
    return q35.Qwen3_5MoeRMSNormGated(N, eps=eps)


@pytest.mark.parametrize("kind", ["standard", "zero_centred", "gated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, (*s[0], s[1]))))
def test_matches_transformers_module(kind, dtype, shape):
    lead, N = shape
    gen = torch.Generator().manual_seed(N + len(lead))
    eps = 1e-6
    mod = _hf(kind, N, eps)
    with torch.no_grad():
        mod.weight.copy_(torch.randn(N, generator=gen) * 0.3 + (1.0 if kind != "zero_centred" else 0.0))
    mod = mod.to(DEV, dtype)
    x = (torch.randn(*lead, N, generator=gen) * 3).to(DEV, dtype)
    z = (torch.randn(*lead, N, generator=gen) * 2).to(DEV, dtype) if kind == "gated" else None
    with torch.no_grad():
        want = mod(x, z) if kind == "gated" else mod(x)
    got = rmsnorm(x, mod.weight, eps, kind, z=z)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(rmsnorm_ref(x, mod.weight, eps, kind, z), want, rtol=0, atol=0)
    if dtype == torch.bfloat16:  # almost every element equal: differences are single-ulp rounding ties
        assert (got != want).float().mean() < 0.02


def test_strided_rows_and_fp32_weight():
    """A q_proj-like chunked view (row stride 2N) and an fp32 weight with bf16 input (output promotes to fp32)."""
    gen = torch.Generator().manual_seed(0)
    N = 64
    base = torch.randn(1, 1, 4, 2 * N, generator=gen).to(DEV, torch.bfloat16)
    q, _ = torch.chunk(base, 2, dim=-1)  # [1,1,4,N], row stride 2N
    w = torch.randn(N, generator=gen).to(DEV)
    for kind in ("standard", "zero_centred"):
        want = rmsnorm_ref(q, w, 1e-6, kind)
        got = rmsnorm(q, w, 1e-6, kind)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["standard", "zero_centred"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [((1, 1), 2048), ((3, 5), 72)], ids=lambda s: "x".join(map(str, (*s[0], s[1]))))
def test_residual_add_then_norm(kind, dtype, shape):
    """residual + x (rounded as transformers' add), stored, then normalised: one launch for "h = residual + h;
    residual = h; h = norm(h)"."""
    lead, N = shape
    gen = torch.Generator().manual_seed(N + 1)
    mod = _hf(kind, N, 1e-6)
    with torch.no_grad():
        mod.weight.copy_(torch.randn(N, generator=gen) * 0.3 + (1.0 if kind == "standard" else 0.0))
    mod = mod.to(DEV, dtype)
    x, r = ((torch.randn(*lead, N, generator=gen) * 3).to(DEV, dtype) for _ in range(2))
    with torch.no_grad():
        total = r + x
        want = mod(total)
    got, got_total = rmsnorm(x, mod.weight, 1e-6, kind, residual=r)
    assert torch.equal(got_total, total)
    torch.testing.assert_close(got, want, **TOL[dtype])
    with pytest.raises(ValueError, match="residual"):
        rmsnorm(x, mod.weight, 1e-6, kind, residual=r.float() if dtype != torch.float32 else r.double())


def test_checks():
    x = torch.randn(2, 8, device=DEV)
    with pytest.raises(ValueError):
        rmsnorm(x, torch.ones(7, device=DEV), 1e-6)
    with pytest.raises(ValueError):
        rmsnorm(x, torch.ones(8, device=DEV), 1e-6, "gated")
    with pytest.raises(ValueError):
        rmsnorm(x, torch.ones(8, device=DEV), 1e-6, "nope")
