"""Tests of kernels/gemv.py: the batch-1 GEMV against its torch reference and torch's F.linear, on odd and real
shapes (Qwen3.5-35B lm_head rows cut down, DeltaNet in_proj, out_proj with K 4096), bf16 and fp32, one- and
multi-chunk K; launcher checks. Runs on CPU under TRITON_INTERPRET=1; never asserts a time.

Shape legend: T = tokens, K = input features, N = output features.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from localmoe.kernels.gemv import gemv, gemv_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# (T, K, N, kwargs): odd widths with a ragged last row block and a multi-chunk K; real K with cut N
SHAPES = [
    (1, 72, 37, {}),
    (3, 100, 50, dict(BLOCK_N=4, BLOCK_K=32)),
    (1, 2048, 1000, dict(BLOCK_N=16)),
    (1, 4096, 96, dict(BLOCK_N=8, BLOCK_K=1024)),
    (2, 2048, 300, dict(BLOCK_N=2, num_warps=4)),
]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}K{}N{}".format(*s[:3]))
def test_matches_reference_and_linear(shape, dtype):
    T, K, N, kw = shape
    gen = torch.Generator().manual_seed(K + N)
    x = torch.randn(T, K, generator=gen).to(DEV, dtype)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(DEV, dtype)
    y = gemv(x, w, **kw)
    assert y.dtype == dtype and y.shape == (T, N)
    torch.testing.assert_close(y, gemv_ref(x, w), **TOL[dtype])
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w), **TOL[dtype])
    if dtype == torch.bfloat16:  # one round-to-nearest-even at the end: nearly every element equals the reference
        assert (y != gemv_ref(x, w)).float().mean() < 0.05
    out = torch.empty(T, N, dtype=dtype, device=DEV)
    assert gemv(x, w, out, **kw) is out and torch.equal(out, y)


def test_strided_rows_of_x():
    """x may be a row view of a wider buffer (stride > K), as a [1, 1, K] hidden state's last position is."""
    gen = torch.Generator().manual_seed(3)
    buf = torch.randn(2, 160, generator=gen).to(DEV)
    x = buf[:, :100]
    w = torch.randn(40, 100, generator=gen).to(DEV)
    torch.testing.assert_close(gemv(x, w, BLOCK_K=64), gemv_ref(x, w), rtol=1e-5, atol=1e-5)


def test_launcher_checks():
    x = torch.randn(1, 16, device=DEV)
    w = torch.randn(8, 16, device=DEV)
    with pytest.raises(ValueError, match="K = 16"):
        gemv(x, torch.randn(8, 15, device=DEV))
    with pytest.raises(ValueError, match="dtype"):
        gemv(x, w.bfloat16())
    with pytest.raises(ValueError, match="rows"):
        gemv(torch.randn(9, 16, device=DEV), w)
    with pytest.raises(ValueError, match="contiguous"):
        gemv(x, torch.randn(16, 8, device=DEV).T)
    with pytest.raises(ValueError, match="out"):
        gemv(x, w, torch.empty(1, 7, device=DEV))


@pytest.mark.parametrize("kind", ["zero_centred", "standard"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 72, 37), (2, 2048, 300)], ids=lambda s: "T{}K{}N{}".format(*s))
def test_input_norm_inside(shape, dtype, kind):
    """norm_weight=: y = RMSNorm(x) W^T, the norm computed by every program; equals the norm module then F.linear."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    T, K, N = shape
    gen = torch.Generator().manual_seed(K + N + len(kind))
    x = (torch.randn(T, K, generator=gen) * 3).to(DEV, dtype)
    w = (torch.randn(N, K, generator=gen) / K**0.5).to(DEV, dtype)
    module = (Qwen3_5MoeRMSNorm if kind == "zero_centred" else Qwen3MoeRMSNorm)(K, eps=1e-6).to(DEV, dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(K, generator=gen) * 0.2 + (0.0 if kind == "zero_centred" else 1.0))
        want = torch.nn.functional.linear(module(x), w)
    y = gemv(x, w, norm_weight=module.weight, eps=1e-6, norm_kind=kind)
    torch.testing.assert_close(y, gemv_ref(x, w, module.weight, 1e-6, kind), **TOL[dtype])
    torch.testing.assert_close(y, want, **TOL[dtype])
    with pytest.raises(ValueError, match="norm_kind"):
        gemv(x, w, norm_weight=module.weight, norm_kind="gated")
    with pytest.raises(ValueError, match="one tile"):
        gemv(x, w, norm_weight=module.weight, BLOCK_K=16)
