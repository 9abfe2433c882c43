"""Tests of kernels/sparse_split.py: the gate pass and the kept-row launch against sparse_fused's torch reference
(the same function), on odd shapes and Qwen3-30B-A3B's expert shape, bf16 and fp32, every sparsity, with the
decoder-layer tail (residual, kept total) and the workspace left clean for the next launch; and against
sparse_fused itself (the counts bit for bit, the outputs to rounding).

Runs on CPU under TRITON_INTERPRET=1 (set below before triton is imported when no GPU is present); never asserts a
time. Shape legend: T = tokens, k = experts per token, E = experts, I = expert width, H = hidden.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kernel_cases import DEV, SPARSITIES, expert_inputs, rel_err, shape_id  # noqa: E402
from test_kernel_sparse_fused import gate_abs, tau_for  # noqa: E402

from localmoe.kernels.sparse_fused import sparse_fused  # noqa: E402
from localmoe.kernels.sparse_split import sparse_split, sparse_split_ref  # noqa: E402

# (T, H, I, E, k, BLOCK_G, BLOCK_I); the last is Qwen3-30B-A3B's expert (E cut to 12)
SHAPES = [(1, 72, 40, 5, 3, 8, 8), (3, 72, 40, 5, 3, 16, 4), (1, 2048, 768, 12, 8, 64, 128)]


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_reference(shape, dtype):
    T, H, I, E, k, bg, bi = shape
    x, wg, wu, wd, ids, rw = expert_inputs(T, H, I, E, k, dtype, seed=T * 100 + I)
    ga = gate_abs(x, wg, ids)
    out = torch.empty(T, H, device=DEV)
    cnt = torch.empty(T, k, dtype=torch.int32, device=DEV)
    for s in SPARSITIES if H < 100 else (0.0, 0.85):  # the same buffers and workspace every time: each launch must
        # leave the workspace clean
        tau = tau_for(ga, ids, s, E)
        y_ref, c_ref = sparse_split_ref(x, wg, wu, wd, ids, rw, tau)
        out.fill_(float("nan"))  # poisoned: the launch must overwrite every element
        cnt.fill_(-7)
        y, c = sparse_split(x, wg, wu, wd, ids, rw, tau, out, count=cnt, BLOCK_G=bg, BLOCK_I=bi, num_warps=4)
        assert y is out and c is cnt and not torch.isnan(y).any()
        assert torch.equal(c, c_ref), f"sparsity {s}"
        if s == "all":
            assert torch.count_nonzero(y) == 0 and torch.count_nonzero(c) == 0
        else:
            assert rel_err(y, y_ref) < 1e-5, f"sparsity {s}"
            if s == 0.0:
                assert torch.equal(c, torch.full_like(c, I))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decoder_tail_equals_sparse_fused(dtype):
    """residual + experts in the output's dtype and the kept total, as sparse_fused's tail: two steps in a row
    through the same workspace, activation buffer and totals."""
    T, H, I, E, k = 2, 96, 56, 7, 3
    x, wg, wu, wd, ids, rw = expert_inputs(T, H, I, E, k, dtype, seed=11)
    tau = tau_for(gate_abs(x, wg, ids), ids, 0.5, E)
    res = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEV)
    act = torch.empty(T * k, I, device=DEV)
    tot_s, tot_f = (torch.zeros(1, dtype=torch.int64, device=DEV) for _ in range(2))
    for _ in range(2):
        ys, cs = sparse_split(
            x, wg, wu, wd, ids, rw, tau, torch.empty(T, H, dtype=dtype, device=DEV), residual=res,
            kept_total=tot_s, act=act, BLOCK_G=16, BLOCK_I=8, num_warps=2, warps_g=2,
        )  # fmt: skip
        yf, cf = sparse_fused(
            x, wg, wu, wd, ids, rw, tau, torch.empty(T, H, dtype=dtype, device=DEV), residual=res,
            kept_total=tot_f, BLOCK_I=8, num_warps=2,
        )  # fmt: skip
        assert ys.dtype == dtype and torch.equal(cs, cf)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(ys.float(), yf.float(), **tol)
    assert int(tot_s) == int(tot_f) == 2 * int(cf.sum())


def test_empty_and_bad_input():
    T, H, I, E, k = 1, 40, 24, 4, 2
    x, wg, wu, wd, ids, rw = expert_inputs(T, H, I, E, k, torch.float32, seed=2)
    tau = torch.zeros(E, device=DEV)
    y, c = sparse_split(x[:0], wg, wu, wd, ids[:0], rw[:0], tau)
    assert y.shape == (0, H) and c.shape == (0, k)
    with pytest.raises(ValueError, match="tau must be a float32"):
        sparse_split(x, wg, wu, wd, ids, rw, tau.double())
    with pytest.raises(ValueError, match="act must be"):
        sparse_split(x, wg, wu, wd, ids, rw, tau, act=torch.empty(T * k * I - 1, device=DEV))
    with pytest.raises(ValueError, match="w_up must have shape"):
        sparse_split(x, wg, wu[:, :-1], wd, ids, rw, tau)
