"""Tests of kernels/grouped_gate_up.py: a span's gate and up projections with the SwiGLU and the threshold as their
epilogue, group ends on the device, against its torch reference.

Covers a span in the middle (empty groups, a group over several row tiles) and from group 0, fp32 and bf16, with and
without the threshold (the kept count), transposed weight strides, rows outside the span left untouched, and the
launcher's refusals. Runs on CPU under TRITON_INTERPRET=1; never asserts a time. Shape legend: M rows, K input width,
N expert width, E groups, G groups of the span, g0 its first.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kernel_cases import DEV, rel_err  # noqa: E402

from localmoe.kernels.grouped_gate_up import grouped_gate_up, grouped_gate_up_ref  # noqa: E402
from localmoe.kernels.int4 import Int4Tensor, quantize  # noqa: E402


def problem(counts, K, N, G, dtype, seed=0):
    """(x [M, K], w_gate, w_up [G, N, K], ends [E] int32, h poisoned with NaN [M, N]); M = rows routed + 3."""
    gen = torch.Generator().manual_seed(seed)
    ends = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    M = int(ends[-1]) + 3
    x = torch.randn(M, K, generator=gen).to(dtype).to(DEV)
    wg, wu = [(torch.randn(G, N, K, generator=gen) * 2 / K**0.5).to(dtype).to(DEV) for _ in range(2)]
    h = torch.full((M, N), float("nan"), dtype=dtype, device=DEV)
    return x, wg, wu, ends.to(DEV), h


def midpoint_tau(x, wg, ends, g0, E, sparsity):
    """Per-group thresholds midway between two neighbouring |silu(z)| of the group's rows at the quantile (no value
    within rounding of its threshold); groups outside the span or without rows 0."""
    end = [0] + ends.tolist()
    tau = torch.zeros(E)
    for i in range(wg.shape[0]):
        a, b = end[g0 + i], end[g0 + i + 1]
        if b > a:
            v = torch.sort(torch.nn.functional.silu(x[a:b].float() @ wg[i].float().T).abs().flatten().cpu()).values
            m = max(1, int(sparsity * v.numel()))
            tau[g0 + i] = float(v[m - 1] + v[m]) / 2
    return tau.to(DEV)


CASES = [
    ([3, 0, 70, 5, 0, 17, 2], 40, 24, 1, 5),  # mid span, empty groups, a group over several row tiles
    ([9, 33, 1], 72, 40, 0, 3),  # from group 0, odd K and N
]


@pytest.mark.parametrize("case", CASES, ids=["mid-span", "from-zero"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("sparsity", [None, 0.6], ids=["dense", "tau"])
def test_matches_reference(case, dtype, sparsity):
    counts, K, N, g0, G = case
    x, wg, wu, ends, h = problem(counts, K, N, G, dtype)
    E = len(counts)
    kw, kept, kept_ref = {}, None, None
    if sparsity is not None:
        tau = midpoint_tau(x, wg, ends, g0, E, sparsity)
        kept = torch.zeros(1, dtype=torch.int64, device=DEV)
        kept_ref = torch.zeros(1, dtype=torch.int64, device=DEV)
        kw = {"tau": tau, "kept": kept}
    got = grouped_gate_up(x, wg, wu, ends, g0, h, BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, **kw)
    ref = grouped_gate_up_ref(x, wg, wu, ends, g0, torch.zeros_like(h), kw.get("tau"), kept_ref)
    end = [0] + ends.tolist()
    a, b = end[g0], end[g0 + G]
    assert got is h and torch.isnan(h[:a]).all() and torch.isnan(h[b:]).all()
    assert not torch.isnan(h[a:b]).any()
    assert rel_err(h[a:b].float(), ref[a:b].float()) < (1e-5 if dtype == torch.float32 else 1e-2)
    if sparsity is not None:
        n = int(kept_ref)
        if dtype == torch.float32:
            assert int(kept) == n
        else:  # bf16 rounds silu(z) before the comparison: a value next to its threshold may fall either side
            assert abs(int(kept) - n) <= max(2, n // 50)


def test_transposed_weights_and_default_tiles():
    """Weight stacks with K strided, the launcher's default tiles, K at Qwen3.5-35B-A3B's hidden size."""
    counts = [20, 41, 13, 7]
    x, wg, wu, ends, h = problem(counts, 2048, 64, 3, torch.bfloat16, seed=4)
    wg_t, wu_t = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (wg, wu))
    grouped_gate_up(x, wg_t, wu_t, ends, 1, h)
    ref = grouped_gate_up_ref(x, wg, wu, ends, 1, torch.zeros_like(h))
    a, b = 20, 81
    assert rel_err(h[a:b].float(), ref[a:b].float()) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_read_in_place(dtype):
    """`x_rows`: each sorted row reads its token's row of x [T, K] in place (tokens repeated, out of order), equal to
    the kernel on the gathered copy x[x_rows]; with the threshold, the same kept count."""
    counts, K, N, g0, G = [5, 0, 37, 9, 4], 40, 24, 1, 3
    xs, wg, wu, ends, h = problem(counts, K, N, G, dtype, seed=5)
    M, T = xs.shape[0], 11
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(T, K, generator=gen).to(dtype).to(DEV)
    rows = torch.randint(0, T, (M,), generator=gen).to(DEV)
    tau = torch.full((len(counts),), 0.2, device=DEV)
    kept, kept_copy = (torch.zeros(1, dtype=torch.int64, device=DEV) for _ in range(2))
    got = grouped_gate_up(x, wg, wu, ends, g0, h, tau=tau, kept=kept, x_rows=rows, BLOCK_M=16, BLOCK_N=16)
    want = grouped_gate_up(x[rows], wg, wu, ends, g0, torch.full_like(h, float("nan")), tau=tau, kept=kept_copy,
                           BLOCK_M=16, BLOCK_N=16)  # fmt: skip
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert int(kept) == int(kept_copy) > 0
    ref = grouped_gate_up_ref(x, wg, wu, ends, g0, torch.zeros_like(h), x_rows=rows)  # dense: tau 0 keeps all
    grouped_gate_up(x, wg, wu, ends, g0, got, tau=tau * 0, kept=kept, x_rows=rows, BLOCK_M=16, BLOCK_N=16)
    a, b = 5, 51
    assert rel_err(got[a:b].float(), ref[a:b].float()) < 1e-2
    with pytest.raises(ValueError, match="x_rows"):
        grouped_gate_up(x, wg, wu, ends, g0, h, x_rows=rows.int())


@pytest.mark.parametrize(
    "case,match",
    [
        ("up-shape", "w_up must match w_gate"),
        ("h-dtype", "h must have x's dtype"),
        ("tau-alone", "tau and kept go together"),
        ("tau-dtype", "tau must be float32"),
        ("h-shape", "h must be"),
    ],
)
def test_rejects(case, match):
    x, wg, wu, ends, h = problem([2, 3, 4], 16, 16, 3, torch.float32)
    args = {"x": x, "w_gate": wg, "w_up": wu, "ends": ends, "g0": 0, "h": h}
    kw = {}
    if case == "up-shape":
        args["w_up"] = wu[:2]
    elif case == "h-dtype":
        args["h"] = h.to(torch.bfloat16)
    elif case == "tau-alone":
        kw["tau"] = torch.zeros(3, device=DEV)
    elif case == "tau-dtype":
        kw = {"tau": torch.zeros(3, dtype=torch.float64, device=DEV), "kept": torch.zeros(1, dtype=torch.int64)}
    else:
        args["h"] = h[:, :8]
    with pytest.raises(ValueError, match=match):
        grouped_gate_up(**args, **kw)


def int4_pair(G, N, K, group, dtype, seed=8, every=1):
    """Gate and up Int4Tensor stacks [G, N, K] (packed along K, as stored) on DEV; `every` > 1: views of every
    `every`-th expert of larger stacks."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(2):
        q = quantize(torch.randn(G * every, N, K, generator=gen) * 2 / K**0.5, group=group)
        out.append(Int4Tensor(*(t.to(DEV)[::every] for t in q.parts()), dtype))
    return out


@pytest.mark.parametrize(
    "counts,K,N,group,g0,blocks,every,sparsity",
    [
        ([3, 0, 70, 5, 0, 17, 2], 64, 24, 32, 1, (16, 16, 32), 1, None),  # mid span, a K step of one group
        ([9, 33, 1], 96, 40, 16, 0, (32, 32, 64), 2, 0.6),  # a K step over four groups, partial tiles, tau
        ([20, 41, 13], 2048, 64, 128, 0, (64, 64, 32), 1, None),  # Qwen3.5-35B-A3B's hidden size, default tiles
    ],
    ids=["mid-span", "groups-in-step", "real"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int4_in_place_matches_the_dequantized_weights(counts, K, N, group, g0, blocks, every, sparsity, dtype):
    G = len(counts) - g0
    x, _, _, ends, h = problem(counts, K, N, G, dtype)
    wg, wu = int4_pair(G, N, K, group, dtype, every=every)
    bm, bn, bk = blocks
    kw, kw_plain, kept_ref = {}, {}, None
    if sparsity is not None:
        tau = midpoint_tau(x, wg.dequantize(dtype), ends, g0, len(counts), sparsity)
        kept, kept_plain, kept_ref = (torch.zeros(1, dtype=torch.int64, device=DEV) for _ in range(3))
        kw, kw_plain = {"tau": tau, "kept": kept}, {"tau": tau, "kept": kept_plain}
    grouped_gate_up(x, wg, wu, ends, g0, h, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **kw)
    end = [0] + ends.tolist()
    a, b = end[g0], end[g0 + G]
    assert torch.isnan(h[:a]).all() and torch.isnan(h[b:]).all() and not torch.isnan(h[a:b]).any()
    ref = grouped_gate_up_ref(x, wg, wu, ends, g0, torch.zeros_like(h), kw.get("tau"), kept_ref)
    assert rel_err(h[a:b].float(), ref[a:b].float()) < (1e-5 if dtype == torch.float32 else 1e-2)
    plain = torch.zeros_like(h)  # the same launch over the dequantized stacks
    grouped_gate_up(x, wg.dequantize(dtype), wu.dequantize(dtype), ends, g0, plain, BLOCK_M=bm, BLOCK_N=bn,
                    BLOCK_K=bk, **kw_plain)  # fmt: skip
    assert rel_err(h[a:b].float(), plain[a:b].float()) < (1e-5 if dtype == torch.float32 else 1e-2)
    if sparsity is not None:
        assert abs(int(kw["kept"]) - int(kept_ref)) <= max(2, int(kept_ref) // 50)


def test_int4_refusals():
    x, _, _, ends, h = problem([2, 3, 4], 64, 16, 3, torch.float32)
    wg, wu = int4_pair(3, 16, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="tile of >= 32"):
        grouped_gate_up(x, wg, wu, ends, 0, h, BLOCK_K=16)
    with pytest.raises(ValueError, match="w_up must match w_gate"):
        grouped_gate_up(x, wg, wu.dequantize(torch.float32), ends, 0, h, BLOCK_K=32)
    with pytest.raises(ValueError, match="group size"):
        grouped_gate_up(x, wg, int4_pair(3, 16, 64, 32, torch.float32)[1], ends, 0, h, BLOCK_K=32)
