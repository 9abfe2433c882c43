"""Tests of kernels/sparse_updown.py: Triton up/down over kept neurons vs the torch reference.

Runs on CPU under TRITON_INTERPRET=1 (set below before triton is imported when no GPU is present).
Shape legend: T = tokens, k = experts per token, E = experts, I = expert width, H = hidden, C = capacity.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from localmoe.kernels.dense_experts import dense_experts_ref  # noqa: E402
from localmoe.kernels.sparse_gate import sparse_gate, sparse_gate_ref  # noqa: E402
from localmoe.kernels.sparse_updown import sparse_updown, sparse_updown_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# (T, H, I, E, k, BLOCK_N)
SHAPES = [(1, 72, 40, 5, 3, 4), (3, 72, 40, 5, 3, 8), (1, 2048, 512, 16, 8, 64)]
SPARSITIES = [0.0, 0.5, 0.9, "all"]


def make_inputs(T, H, I, E, k, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype).to(DEV)
    w = [(torch.randn(E, I, H, generator=gen) * 2.0 / H**0.5).to(dtype).to(DEV) for _ in range(3)]
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(torch.int32).to(DEV)
    rw = torch.softmax(torch.randn(T, k, generator=gen), -1).to(dtype).to(DEV)
    return x, w[0], w[1], w[2], ids, rw


def tau_for(g_abs, sparsity, E):
    if sparsity == "all":
        return torch.full((E,), float("inf"), device=DEV)
    if sparsity == 0.0:
        return torch.zeros(E, device=DEV)
    a = torch.sort(g_abs.flatten().cpu()).values
    m = int(sparsity * a.numel())
    return torch.full((E,), float(a[m - 1] + a[m]) / 2, device=DEV)


def rel_err(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}_H{}_I{}_E{}_k{}".format(*s[:5]))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sparse_updown_matches_reference(shape, dtype):
    T, H, I, E, k, bn = shape
    x, wg, wu, wd, ids, rw = make_inputs(T, H, I, E, k, dtype, seed=T * 100 + I)
    g_ref, _, _ = sparse_gate_ref(x, wg, ids, torch.zeros(E, device=DEV), I)
    for s in SPARSITIES:
        g, idx, cnt = sparse_gate_ref(x, wg, ids, tau_for(g_ref.abs(), s, E), I)
        ref = sparse_updown_ref(x, wu, wd, ids, rw, g, idx, cnt)
        out = torch.full((T, H), float("nan"), device=DEV)  # poisoned: the launcher must clear it
        y = sparse_updown(x, wu, wd, ids, rw, g, idx, cnt, out=out, BLOCK_N=bn)
        assert y is out and y.dtype == torch.float32 and not torch.isnan(y).any()
        if s == "all":
            assert torch.count_nonzero(y) == 0
        else:
            assert rel_err(y, ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gate_then_updown_dense_equivalence(dtype):
    # sparsity 0: the two kernels together compute the dense SwiGLU experts
    T, H, I, E, k = 3, 72, 40, 5, 3
    x, wg, wu, wd, ids, rw = make_inputs(T, H, I, E, k, dtype, seed=5)
    g, idx, cnt = sparse_gate(x, wg, ids.long(), torch.zeros(E, device=DEV), I, BLOCK_I=16)
    y = sparse_updown(x, wu, wd, ids.long(), rw, g, idx, cnt, BLOCK_N=8)
    assert rel_err(y, dense_experts_ref(x, wg, wu, wd, ids, rw)) < 1e-5


def test_fused_zeroing_and_accumulate():
    T, H, I, E, k = 2, 72, 40, 5, 3
    x, wg, wu, wd, ids, rw = make_inputs(T, H, I, E, k, torch.float32, seed=9)
    tau = torch.full((E,), 0.05, device=DEV)
    y = torch.full((T, H), float("nan"), device=DEV)
    g, idx, cnt = sparse_gate(x, wg, ids, tau, I, zero_out=y, BLOCK_I=8)
    sparse_updown(x, wu, wd, ids, rw, g, idx, cnt, out=y, accumulate=True, BLOCK_N=4)
    gr, idxr, cntr = sparse_gate_ref(x, wg, ids, tau, I)
    ref = sparse_updown_ref(x, wu, wd, ids, rw, gr, idxr, cntr)
    assert rel_err(y, ref) < 1e-5
    base = torch.randn(T, H, device=DEV)
    y2 = base.clone()
    sparse_updown(x, wu, wd, ids, rw, g, idx, cnt, out=y2, accumulate=True, BLOCK_N=4)
    assert rel_err(y2, ref + base) < 1e-5


def test_truncated_capacity():
    T, H, I, E, k = 1, 72, 40, 5, 3
    x, wg, wu, wd, ids, rw = make_inputs(T, H, I, E, k, torch.float32, seed=2)
    g, idx, cnt = sparse_gate_ref(x, wg, ids, torch.zeros(E, device=DEV), 7)
    y = sparse_updown(x, wu, wd, ids, rw, g, idx, cnt, BLOCK_N=4)
    assert rel_err(y, sparse_updown_ref(x, wu, wd, ids, rw, g, idx, cnt)) < 1e-5


@pytest.mark.parametrize("bad", ["g_dtype", "idx_dtype", "count_shape", "w_shape", "weights_shape", "accumulate"])
def test_rejects_bad_inputs(bad):
    T, H, I, E, k = 1, 72, 40, 5, 3
    x, wg, wu, wd, ids, rw = make_inputs(T, H, I, E, k, torch.float32, seed=1)
    g, idx, cnt = sparse_gate_ref(x, wg, ids, torch.zeros(E, device=DEV), I)
    kw = {}
    if bad == "g_dtype":
        g = g.half()
    elif bad == "idx_dtype":
        idx = idx.long()
    elif bad == "count_shape":
        cnt = cnt[:, :1]
    elif bad == "w_shape":
        wd = wd[:, :-1]
    elif bad == "weights_shape":
        rw = rw[:, :1]
    elif bad == "accumulate":
        kw = dict(accumulate=True)
    with pytest.raises(ValueError):
        sparse_updown(x, wu, wd, ids, rw, g, idx, cnt, **kw)
