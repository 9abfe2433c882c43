"""Tests of kernels/sparse_gate.py: Triton gate + threshold + compaction vs the torch reference.

Runs on CPU under TRITON_INTERPRET=1 (set below before triton is imported when no GPU is present).
Shape legend: T = tokens, k = experts per token, E = experts, I = expert width, H = hidden, C = capacity.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kernel_cases import DEV, SPARSITIES, expert_inputs, layer_tau  # noqa: E402
from localmoe.kernels.sparse_gate import sparse_gate, sparse_gate_ref  # noqa: E402

# (T, H, I, E, k, BLOCK_I): odd shapes, and one real shape (Qwen3.5-35B-A3B widths, few experts)
SHAPES = [(1, 72, 40, 5, 3, 8), (3, 72, 40, 5, 3, 16), (1, 2048, 512, 16, 8, 64)]






def check(out, ref, C):
    g, idx, cnt = out
    gr, idxr, cntr = ref
    assert g.dtype == torch.float32 and idx.dtype == torch.int32 and cnt.dtype == torch.int32
    assert not torch.isnan(g).any()
    torch.testing.assert_close(g, gr, rtol=1e-4, atol=1e-5)
    assert torch.equal(cnt.cpu(), cntr.cpu())
    assert torch.equal(idx.cpu(), idxr.cpu())  # kept ascending, padding 0
    assert int(cnt.max()) <= C


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}_H{}_I{}_E{}_k{}".format(*s[:5]))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sparse_gate_matches_reference(shape, dtype):
    T, H, I, E, k, bi = shape
    x, w_gate, _, _, ids, _ = expert_inputs(T, H, I, E, k, dtype, seed=T * 1000 + H)
    g_ref, _, _ = sparse_gate_ref(x, w_gate, ids, torch.zeros(E, device=DEV), I)
    for s in SPARSITIES:
        tau = layer_tau(g_ref.abs(), s, E)
        ref = sparse_gate_ref(x, w_gate, ids, tau, I)
        # poison the outputs: every element must be written
        out = (torch.full((T, k, I), float("nan"), device=DEV), torch.full((T, k, I), -7, dtype=torch.int32, device=DEV),
               torch.full((T, k), -7, dtype=torch.int32, device=DEV))
        got = sparse_gate(x, w_gate, ids, tau, I, out=out, BLOCK_I=bi)
        assert got[0] is out[0]
        check(got, ref, I)
        kept = float(ref[2].float().mean()) / I
        if s == "all":
            assert kept == 0.0
        elif s == 0.0:
            assert kept == 1.0


def test_capacity_truncates_and_per_expert_tau():
    T, H, I, E, k = 2, 72, 40, 5, 3
    x, w_gate, _, _, ids, _ = expert_inputs(T, H, I, E, k, torch.float32, seed=7, id_dtype=torch.int64)
    tau = torch.tensor([0.0, 0.1, 0.3, float("inf"), 0.05], device=DEV)
    C = 9
    check(sparse_gate(x, w_gate, ids, tau, C, BLOCK_I=8), sparse_gate_ref(x, w_gate, ids, tau, C), C)


def test_repeated_launches_reuse_ticket_workspace():
    # the compaction ticket must be reset by the kernel: a second launch must give the same answer
    T, H, I, E, k = 1, 72, 40, 5, 3
    x, w_gate, _, _, ids, _ = expert_inputs(T, H, I, E, k, torch.float32, seed=11)
    tau = torch.full((E,), 0.1, device=DEV)
    ref = sparse_gate_ref(x, w_gate, ids, tau, I)
    for _ in range(2):
        check(sparse_gate(x, w_gate, ids, tau, I, BLOCK_I=8), ref, I)


def test_view_of_fused_gate_up_layout():
    # w_gate may be the gate half of a fused [E, 2I, H] tensor (rows contiguous, any expert stride)
    T, H, I, E, k = 1, 72, 40, 5, 3
    x, _, _, _, ids, _ = expert_inputs(T, H, I, E, k, torch.float32, seed=3)
    gate_up = torch.randn(E, 2 * I, H, device=DEV) / H**0.5
    tau = torch.full((E,), 0.05, device=DEV)
    check(sparse_gate(x, gate_up[:, :I], ids, tau, I, BLOCK_I=8),
          sparse_gate_ref(x, gate_up[:, :I].contiguous(), ids, tau, I), I)


@pytest.mark.parametrize("bad", ["x_rank", "tau_dtype", "tau_len", "ids_dtype", "capacity", "w_stride", "w_shape"])
def test_rejects_bad_inputs(bad):
    T, H, I, E, k = 1, 72, 40, 5, 3
    x, w_gate, _, _, ids, _ = expert_inputs(T, H, I, E, k, torch.float32, seed=1)
    tau = torch.zeros(E, device=DEV)
    cap = I
    if bad == "x_rank":
        x = x[0]
    elif bad == "tau_dtype":
        tau = tau.double()
    elif bad == "tau_len":
        tau = torch.zeros(E + 1, device=DEV)
    elif bad == "ids_dtype":
        ids = ids.float()
    elif bad == "capacity":
        cap = I + 1
    elif bad == "w_stride":
        w_gate = w_gate.transpose(1, 2).contiguous().transpose(1, 2)
    elif bad == "w_shape":
        w_gate = w_gate[:, :, :-1]
    with pytest.raises(ValueError):
        sparse_gate(x, w_gate, ids, tau, cap)
