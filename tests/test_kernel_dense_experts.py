"""Tests of kernels/dense_experts.py: localmoe's fused dense decode experts vs the torch reference.

Runs on CPU under TRITON_INTERPRET=1 (set below before triton is imported when no GPU is present).
Shape legend: T = tokens, k = experts per token, E = experts, I = expert width, H = hidden.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from localmoe.kernels.dense_experts import dense_experts, dense_experts_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    "shape",
    [(1, 72, 40, 5, 3, 4), (3, 72, 40, 5, 3, 8), (1, 2048, 512, 16, 8, 64)],
    ids=lambda s: "T{}_H{}_I{}_E{}_k{}".format(*s[:5]),
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dense_experts_matches_reference(shape, dtype):
    T, H, I, E, k, bn = shape
    gen = torch.Generator().manual_seed(T + H)
    x = torch.randn(T, H, generator=gen).to(dtype).to(DEV)
    wg, wu, wd = [(torch.randn(E, I, H, generator=gen) / H**0.5).to(dtype).to(DEV) for _ in range(3)]
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(DEV)
    rw = torch.softmax(torch.randn(T, k, generator=gen), -1).to(dtype).to(DEV)
    out = torch.full((T, H), float("nan"), device=DEV)
    y = dense_experts(x, wg, wu, wd, ids, rw, out=out, BLOCK_N=bn)
    ref = dense_experts_ref(x, wg, wu, wd, ids, rw)
    assert y is out and not torch.isnan(y).any()
    assert float((y.double() - ref.double()).norm() / ref.double().norm()) < 1e-5


def test_dense_experts_rejects_bad_inputs():
    x = torch.randn(1, 72, device=DEV)
    w = torch.randn(5, 40, 72, device=DEV)
    ids = torch.zeros(1, 3, dtype=torch.int32, device=DEV)
    rw = torch.ones(1, 3, device=DEV)
    with pytest.raises(ValueError):
        dense_experts(x, w, w[:, :-1], w, ids, rw)
    with pytest.raises(ValueError):
        dense_experts(x, w, w, w, ids.float(), rw)
