"""Tests of localmoe/experts/local_experts.py's dense path (prefill, calibration, evaluation's masked mode): the
grouped-GEMM
version (torch's grouped_mm, three launches for all experts) against the per-expert loop and a per-token reference,
fp32 and bf16, with unrouted experts, the evaluation mask and calibration's gate recorder. CPU (CUDA when present:
bf16 only there, torch's CUDA grouped GEMM); never a time.

Shape legend: T tokens, k experts per token, E experts, I expert width, H hidden.
"""

from __future__ import annotations

import os

import pytest
import torch

from localmoe.experts.dense_path import token_sum
from localmoe.experts.expert_weights import ExpertWeights
from localmoe.experts.gate_recorder import GateRecorder
from localmoe.experts.local_experts import LocalExperts

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _experts(E, I, H, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    m = LocalExperts(E, H, I, "silu", 0)
    m.weights = ExpertWeights(*((torch.randn(E, I, H, generator=gen) / H**0.5).to(DEV, dtype) for _ in range(3)))
    return m


def _routing(T, k, E, seed=1):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E - 1, generator=gen)[:k] for _ in range(T)])  # expert E-1 never routed
    return idx.to(DEV), torch.rand(T, k, generator=gen).to(DEV)


def _reference(m, x, idx, wts, tau=None):
    """Per token and routed expert, in fp32: sum_j w_j · down(silu(gate x) ⊙ up x), gate masked by tau."""
    w, y = m.weights, torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            g = torch.nn.functional.silu(w.w_gate[e].float() @ x[t].float())
            if tau is not None:
                g = g * (g.abs() >= tau[e])
            y[t] += float(wts[t, j]) * ((g * (w.w_up[e].float() @ x[t].float())) @ w.w_down_t[e].float())
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_equals_loop_and_reference(dtype):
    if DEV == "cuda" and dtype != torch.bfloat16:
        pytest.skip("torch's CUDA grouped GEMM is taken for bf16 only")
    T, k, E, I, H = 37, 3, 7, 24, 40
    m = _experts(E, I, H, dtype)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).to(DEV, dtype)
    idx, wts = _routing(T, k, E)
    assert m._groups(x)
    got = m(x, idx, wts.to(dtype))
    m.grouped = False
    assert not m._groups(x)
    loop = m(x, idx, wts.to(dtype))
    assert got.dtype == dtype and got.shape == (T, H)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, loop, **tol)
    torch.testing.assert_close(got.float(), _reference(m, x, idx, wts.to(dtype)), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_token_sum_equals_index_add(dtype):
    """The CUDA grouped path's final sum (a token's k rows gathered back, fp32) against index_add_ in fp64."""
    T, k, E, H = 23, 4, 9, 33
    idx, _ = _routing(T, k, E)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    y = torch.randn(T * k, H, generator=torch.Generator().manual_seed(3)).to(DEV, dtype)
    want = torch.zeros(T, H, dtype=torch.float64, device=DEV).index_add_(0, order // k, y.double())
    got = token_sum(y, order, k)
    assert got.dtype == torch.float32 and got.shape == (T, H)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


def test_grouped_masked_and_recorded():
    """Evaluation's mask on the dense path counts the same kept neurons; calibration's recorder gets each routed
    expert's |g| rows, as from the loop."""
    T, k, E, I, H = 29, 2, 6, 16, 32
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    m = _experts(E, I, H, dt, seed=3)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(4)).to(DEV, dt)
    idx, wts = _routing(T, k, E, seed=5)
    tau = torch.full((E,), 0.15, device=DEV)
    m.tau, m.sparse_enabled, m.mask_all_tokens = tau, True, True
    outs, kept, recs = [], [], []
    for grouped in (True, False):
        m.grouped = grouped
        m.reset_counters()
        outs.append(m(x, idx, wts))
        kept.append(int(m.kept))
        m.recorder = GateRecorder()
        m.mask_all_tokens = False
        m(x, idx, wts)
        recs.append((dict(m.recorder.routed), torch.cat(m.recorder.values), torch.cat(m.recorder.experts)))
        m.recorder, m.mask_all_tokens = None, True
    ref = _reference(m, x, idx, wts, tau)
    if dt == torch.float32:
        tol = dict(rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(outs[0], outs[1], **tol)
        torch.testing.assert_close(outs[0], ref, **tol)
    else:  # bf16 GEMMs round g differently: a few borderline neurons flip, whole rows of H move with them
        tol = dict(rtol=2e-2, atol=2e-2)
        for out in outs:
            assert float((out.float() - ref).norm() / ref.norm()) < 5e-2
    assert abs(kept[0] - kept[1]) <= 0.01 * kept[1] and 0 < kept[0] < T * k * I
    (routed, v, e), (routed_l, v_l, e_l) = recs
    assert routed == routed_l and E - 1 not in routed
    assert torch.equal(e, e_l)
    torch.testing.assert_close(v, v_l, **tol)


@pytest.mark.skipif(DEV == "cpu" and os.environ.get("TRITON_INTERPRET") != "1", reason="kernels on CPU: interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("masked", [False, True], ids=["dense", "masked"])
def test_device_spans_equal_grouped(dtype, masked):
    """`device_spans` (every expert in fixed spans, group ends read on the device by the grouped kernels) gives the
    grouped path's output and kept count, resident, with int4 experts read in place (`int4_in_place`) and with int4
    experts dequantized a few at a time; unrouted experts (E - 1) are spanned too."""
    if DEV == "cuda" and dtype != torch.bfloat16:
        pytest.skip("torch's CUDA grouped GEMM is taken for bf16 only")
    T, k, E, I, H = 33, 3, 7, 24, 48
    m = _experts(E, I, H, dtype, seed=6)
    m.kernel_on_cpu = True
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(7)).to(DEV, dtype)
    idx, wts = _routing(T, k, E, seed=8)
    if masked:
        m.tau, m.sparse_enabled, m.mask_all_tokens = torch.full((E,), 0.15, device=DEV), True, True
    for fmt in ("plain", "int4", "int4-dequantized"):
        if fmt == "int4":
            m.weights = m.weights.to_int4()
            m.dequant_bytes = 3 * I * H * dtype.itemsize * 2  # spans of two experts (when dequantized)
        m.int4_in_place = fmt == "int4"
        outs, kept = [], []
        for device_spans in (False, True):
            m.device_spans = device_spans
            assert m._device_ok(x, idx) == device_spans
            m.reset_counters()
            outs.append(m(x, idx, wts.to(dtype)).float())
            kept.append(int(m.kept))
        err = float((outs[1] - outs[0]).norm() / outs[0].norm())
        assert err < (1e-5 if dtype == torch.float32 else 3e-2), (fmt, err)
        if masked:
            assert abs(kept[0] - kept[1]) <= (0 if dtype == torch.float32 else 0.01 * kept[0]) and kept[0] > 0


def test_loop_where_no_grouped_gemm():
    """A decode-sized call on offloaded experts (fetched one by one, admitted) and a dtype other than x's take the
    loop (a longer offloaded call streams through the cache's staging buffers: tests/test_offload_prefill.py)."""
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    m = _experts(4, 8, 16, dt)
    x = torch.randn(3, 16).to(DEV, dt)
    assert m._groups(x) and not m._groups(x.double())
    idx = torch.zeros(0, 2, dtype=torch.long, device=DEV)
    assert not m._groups(x[:0]) and m(x[:0], idx, idx.to(dt)).shape == (0, 16)  # no tokens: the loop, no GEMM
    m.cache = object()  # any expert cache: a decode-sized call takes the loop, which admits into the cache
    assert not m._groups(x[:1])
