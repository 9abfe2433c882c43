"""Tests of kernels/grouped_gemm.py: the grouped GEMM with its group ends on the device vs its torch reference.

Covers a span in the middle of the groups (g0 > 0) and at the start, empty groups (inside the span, first and last),
groups longer than a row tile, odd K and N (not multiples of the tiles), M larger than the rows routed (the host's
bound), fp32 and bf16, rows outside the span left untouched, and the launcher's refusals. Runs on CPU under
TRITON_INTERPRET=1; never asserts a time. Shape legend: M rows, K input width, N output width, E groups, G groups of
the span, g0 its first.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kernel_cases import DEV, rel_err  # noqa: E402

from localmoe.kernels.grouped_gemm import grouped_gemm, grouped_gemm_ref  # noqa: E402
from localmoe.kernels.int4 import Int4Tensor, quantize  # noqa: E402
from localmoe.kernels.nf4 import Nf4Tensor  # noqa: E402


def problem(counts, K, N, g0, G, dtype, spare=5, seed=0):
    """(x [M, K], w [G, N, K], ends [E] int32, out poisoned with NaN [M, N]); M = the rows routed + `spare`."""
    gen = torch.Generator().manual_seed(seed)
    ends = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    M = int(ends[-1]) + spare
    x = torch.randn(M, K, generator=gen).to(dtype).to(DEV)
    w = (torch.randn(G, N, K, generator=gen) / K**0.5).to(dtype).to(DEV)
    out = torch.full((M, N), float("nan"), dtype=dtype, device=DEV)
    return x, w, ends.to(DEV), out


def span_rows(ends, g0, G):
    e = [0] + ends.tolist()
    return e[g0], e[g0 + G]


@pytest.mark.parametrize(
    "counts,K,N,g0,G,blocks",
    [
        ([3, 0, 70, 5, 0, 17, 2], 40, 24, 1, 5, (16, 16, 16)),  # mid span, empty groups, a group over 4 row tiles
        ([0, 9, 33, 1], 72, 40, 0, 3, (32, 32, 32)),  # from group 0, the first empty, odd K and N
        ([4, 6, 0], 48, 20, 2, 1, (16, 16, 16)),  # a span of one empty group: nothing written
        ([20, 41, 13, 7], 2048, 64, 1, 3, (64, 64, 32)),  # K at Qwen3.5-35B-A3B's hidden size, the default tiles
    ],
    ids=["mid-span", "from-zero", "empty-span", "K2048"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_reference(counts, K, N, g0, G, blocks, dtype):
    x, w, ends, out = problem(counts, K, N, g0, G, dtype)
    bm, bn, bk = blocks
    got = grouped_gemm(x, w, ends, g0, out, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    assert got is out
    a, b = span_rows(ends, g0, G)
    ref = grouped_gemm_ref(x, w, ends, g0, torch.zeros_like(out))
    assert torch.isnan(out[:a]).all() and torch.isnan(out[b:]).all(), "rows outside the span must be untouched"
    if b > a:
        assert not torch.isnan(out[a:b]).any()
        assert rel_err(out[a:b].float(), ref[a:b].float()) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_transposed_weights():
    """The down projection's stack [G, K, N] passed transposed (w's last dim strided), as the dense path would."""
    counts = [6, 0, 19, 4]
    x, w, ends, out = problem(counts, 40, 24, 1, 3, torch.bfloat16, seed=5)
    w_t = w.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, K strided
    grouped_gemm(x, w_t, ends, 1, out, BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)
    a, b = span_rows(ends, 1, 3)
    ref = grouped_gemm_ref(x, w, ends, 1, torch.zeros_like(out))
    assert rel_err(out[a:b].float(), ref[a:b].float()) < 1e-2


def test_spans_fill_one_output():
    """A layer's spans, each with its own weights, fill one output between them; equals one pass over all groups."""
    counts = [5, 0, 12, 3, 9, 1]
    x, w_all, ends, out = problem(counts, 32, 16, 0, len(counts), torch.float32, spare=0, seed=3)
    for g0 in range(0, len(counts), 4):
        grouped_gemm(x, w_all[g0 : g0 + 4], ends, g0, out, BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)
    ref = grouped_gemm_ref(x, w_all, ends, 0, torch.zeros_like(out))
    assert rel_err(out, ref) < 1e-6


@pytest.mark.parametrize(
    "case,match",
    [
        ("w-dtype", "w must be"),
        ("ends-dtype", "ends must be int32"),
        ("ends-short", "ends must be int32"),
        ("out-shape", "out must be"),
        ("block", "BLOCK_M must be a power of two"),
    ],
)
def test_rejects(case, match):
    x, w, ends, out = problem([2, 3, 4], 16, 16, 0, 3, torch.float32)
    args = {"x": x, "w": w, "ends": ends, "g0": 0, "out": out}
    kw = {}
    if case == "w-dtype":
        args["w"] = w.to(torch.bfloat16)
    elif case == "ends-dtype":
        args["ends"] = ends.long()
    elif case == "ends-short":
        args["g0"] = 1
    elif case == "out-shape":
        args["out"] = out[:, :8]
    else:
        kw["BLOCK_M"] = 24
    with pytest.raises(ValueError, match=match):
        grouped_gemm(**args, **kw)


def int4_stack(G, K, N, group, dtype, seed=7, every=1):
    """An Int4Tensor [G, K, N] (packed along N, the down projection's w_down_t as stored) on DEV; `every` > 1: a view
    of every `every`-th expert of a larger stack (an expert stride that is not its size)."""
    w = torch.randn(G * every, K, N, generator=torch.Generator().manual_seed(seed)) / K**0.5
    q = quantize(w, group=group)
    return Int4Tensor(*(t.to(DEV)[::every] for t in q.parts()), dtype)


@pytest.mark.parametrize(
    "counts,K,N,group,g0,blocks,every",
    [
        ([3, 0, 70, 5, 0, 17, 2], 40, 64, 32, 1, (16, 32, 16), 1),  # mid span, empty groups, tiles of one group
        ([0, 9, 33, 1], 72, 96, 16, 0, (32, 64, 32), 2),  # a tile over four groups, odd K, a partial column tile
        ([20, 41, 13], 512, 2048, 128, 0, (64, 64, 32), 1),  # Qwen3.5-35B-A3B's down projection, the default tiles
    ],
    ids=["mid-span", "groups-in-tile", "real"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int4_in_place_matches_the_dequantized_weights(counts, K, N, group, g0, blocks, every, dtype):
    G = len(counts) - g0
    x, _, ends, out = problem(counts, K, N, g0, G, dtype)
    w4 = int4_stack(G, K, N, group, dtype, every=every)
    bm, bn, bk = blocks
    grouped_gemm(x, w4, ends, g0, out, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    a, b = span_rows(ends, g0, G)
    assert torch.isnan(out[:a]).all() and torch.isnan(out[b:]).all(), "rows outside the span must be untouched"
    ref = grouped_gemm_ref(x, w4, ends, g0, torch.zeros_like(out))
    assert rel_err(out[a:b].float(), ref[a:b].float()) < (1e-6 if dtype == torch.float32 else 1e-2)
    plain = torch.zeros_like(out)  # the same launch over the dequantized stack
    grouped_gemm(x, w4.dequantize(dtype).transpose(1, 2), ends, g0, plain, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
    assert rel_err(out[a:b].float(), plain[a:b].float()) < (1e-6 if dtype == torch.float32 else 4e-3)


def test_int4_refusals():
    x, _, ends, out = problem([2, 3, 4], 16, 64, 0, 3, torch.float32)
    w4 = int4_stack(3, 16, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="tile of >= 32"):
        grouped_gemm(x, w4, ends, 0, out, BLOCK_N=16)
    odd = Int4Tensor(w4.packed, w4.scale, w4.minimum.transpose(1, 2).contiguous().transpose(1, 2), w4.dtype)
    with pytest.raises(ValueError, match="one stride"):
        grouped_gemm(x, odd, ends, 0, out)
    with pytest.raises(ValueError, match="out must be"):
        grouped_gemm(x, int4_stack(3, 16, 32, 16, torch.float32), ends, 0, out)
    nf4 = Nf4Tensor(w4.packed, w4.scale.float(), None, w4.dtype)
    with pytest.raises(ValueError, match="only int4"):
        grouped_gemm(x, nf4, ends, 0, out)
