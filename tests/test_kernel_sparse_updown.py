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

from kernel_cases import DEV, SPARSITIES, expert_inputs, layer_tau, rel_err  # noqa: E402
from localmoe.kernels.dense_experts import dense_experts_ref  # noqa: E402
from localmoe.kernels.sparse_gate import sparse_gate, sparse_gate_ref  # noqa: E402
from localmoe.kernels.sparse_updown import sparse_updown, sparse_updown_ref  # noqa: E402

# (T, H, I, E, k, BLOCK_N)
SHAPES = [(1, 72, 40, 5, 3, 4), (3, 72, 40, 5, 3, 8), (1, 2048, 512, 16, 8, 64)]








@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}_H{}_I{}_E{}_k{}".format(*s[:5]))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sparse_updown_matches_reference(shape, dtype):
    T, H, I, E, k, bn = shape
    x, wg, wu, wd, ids, rw = expert_inputs(T, H, I, E, k, dtype, seed=T * 100 + I)
    g_ref, _, _ = sparse_gate_ref(x, wg, ids, torch.zeros(E, device=DEV), I)
    for s in SPARSITIES:
        g, idx, cnt = sparse_gate_ref(x, wg, ids, layer_tau(g_ref.abs(), s, E), I)
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
    x, wg, wu, wd, ids, rw = expert_inputs(T, H, I, E, k, dtype, seed=5)
    g, idx, cnt = sparse_gate(x, wg, ids.long(), torch.zeros(E, device=DEV), I, BLOCK_I=16)
    y = sparse_updown(x, wu, wd, ids.long(), rw, g, idx, cnt, BLOCK_N=8)
    assert rel_err(y, dense_experts_ref(x, wg, wu, wd, ids, rw)) < 1e-5


def test_fused_zeroing_and_accumulate():
    T, H, I, E, k = 2, 72, 40, 5, 3
    x, wg, wu, wd, ids, rw = expert_inputs(T, H, I, E, k, torch.float32, seed=9)
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
    x, wg, wu, wd, ids, rw = expert_inputs(T, H, I, E, k, torch.float32, seed=2)
    g, idx, cnt = sparse_gate_ref(x, wg, ids, torch.zeros(E, device=DEV), 7)
    y = sparse_updown(x, wu, wd, ids, rw, g, idx, cnt, BLOCK_N=4)
    assert rel_err(y, sparse_updown_ref(x, wu, wd, ids, rw, g, idx, cnt)) < 1e-5


@pytest.mark.parametrize("bad", ["g_dtype", "idx_dtype", "count_shape", "w_shape", "weights_shape", "accumulate"])
def test_rejects_bad_inputs(bad):
    T, H, I, E, k = 1, 72, 40, 5, 3
    x, wg, wu, wd, ids, rw = expert_inputs(T, H, I, E, k, torch.float32, seed=1)
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
