"""Tests of the MXFP4 expert format (kernels/mxfp4.py) and its dequantizing kernel (kernels/mxfp4_dequant.py): the
reference dequantization equals transformers' `_convert_moe_packed_tensors` exactly on gpt-oss's hub layout, the
hub conversions round-trip losslessly, the quantizer's rounding, `Mxfp4Tensor`'s API, and the Triton launch (under
TRITON_INTERPRET=1 on CPU) equal to the reference in both scale layouts.

Shape legend: E experts, I expert width, H hidden (both multiples of 32, odd multiples here).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from transformers.integrations.mxfp4 import FP4_VALUES as HF_FP4_VALUES  # noqa: E402
from transformers.integrations.mxfp4 import _convert_moe_packed_tensors  # noqa: E402

from localmoe.kernels.mxfp4 import (  # noqa: E402
    BLOCK,
    FP4_VALUES,
    Mxfp4Tensor,
    dequant_mxfp4_ref,
    down_t_from_hub,
    down_t_to_hub,
    gate_up_from_hub,
    gate_up_to_hub,
    quantize_mxfp4,
)
from localmoe.kernels.mxfp4_dequant import dequant_mxfp4  # noqa: E402

E, I, H = 3, 96, 160
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def hub_tensors(seed=0, lo=100, hi=150):
    """Random gpt-oss expert tensors in the hub layout: every byte, scales around 2**0 (in range for bf16)."""
    gen = torch.Generator().manual_seed(seed)
    gub = torch.randint(0, 256, (E, 2 * I, H // 32, 16), dtype=torch.uint8, generator=gen)
    gus = torch.randint(lo, hi, (E, 2 * I, H // 32), dtype=torch.uint8, generator=gen)
    db = torch.randint(0, 256, (E, H, I // 32, 16), dtype=torch.uint8, generator=gen)
    ds = torch.randint(lo, hi, (E, H, I // 32), dtype=torch.uint8, generator=gen)
    return gub, gus, db, ds


def from_hub(gub, gus, db, ds, dtype):
    """(gate, up, down_t) Mxfp4Tensors filled expert by expert into preallocated storage, as a loader does."""
    g, u = (Mxfp4Tensor.empty((E, I, H), dtype, "cpu", along_rows=True) for _ in range(2))
    d = Mxfp4Tensor.empty((E, I, H), dtype, "cpu", along_rows=False)
    for e in range(E):
        gb, gs, ub, us = gate_up_from_hub(gub[e], gus[e])
        for t, src in ((g.blocks, gb), (g.scales, gs), (u.blocks, ub), (u.scales, us)):
            t[e].copy_(src)
        d.blocks[e], d.scales[e] = down_t_from_hub(db[e], ds[e])
    return g, u, d


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_reference_equals_transformers(dtype):
    assert FP4_VALUES == tuple(HF_FP4_VALUES) and BLOCK == 32
    gub, gus, db, ds = hub_tensors()
    g, u, d = from_hub(gub, gus, db, ds, dtype)
    gate_up = _convert_moe_packed_tensors(gub, gus, dtype=dtype)  # [E, H, 2I]: gate columns 0::2, up 1::2
    down = _convert_moe_packed_tensors(db, ds, dtype=dtype)  # [E, I, H]
    assert torch.equal(g.dequantize(), gate_up[..., 0::2].transpose(1, 2))
    assert torch.equal(u.dequantize(), gate_up[..., 1::2].transpose(1, 2))
    assert torch.equal(d.dequantize(), down)
    assert torch.equal(dequant_mxfp4_ref(d.blocks, d.scales, False, dtype), down)


def test_hub_round_trips_are_exact():
    gub, gus, db, ds = hub_tensors(seed=1, lo=0, hi=255)  # every byte and every finite scale
    g, u, d = from_hub(gub, gus, db, ds, torch.bfloat16)
    for got, want in zip(gate_up_to_hub(g, u) + down_t_to_hub(d), (gub, gus, db, ds)):
        assert got.dtype == torch.uint8 and torch.equal(got, want)


def test_quantize_rounding_and_requantize():
    # one block of 32 along H: amax 3 = 6 * 2**-1 -> exponent -1; x / 2**-1 rounded to FP4, ties to the even code
    row = torch.zeros(1, 1, 32)
    vals = [3.0, 0.125, 0.375, 0.625, 0.875, 1.25, 1.75, 2.5, -0.375, 0.2, -0.0001]
    row[0, 0, : len(vals)] = torch.tensor(vals)
    q = quantize_mxfp4(row)
    assert int(q.scales[0, 0, 0]) == 127 - 1
    want = [3.0, 0.0, 0.5, 0.5, 1.0, 1.0, 2.0, 2.0, -0.5, 0.25, 0.0]  # at scale 2**-1: x/2 rounded, times 2
    assert q.dequantize(torch.float32)[0, 0, : len(vals)].tolist() == want
    assert int(quantize_mxfp4(torch.zeros(1, 1, 32)).scales[0, 0, 0]) == 0  # an all-zero block: 2**-127
    # requantizing dequantized weights gives them back exactly, along rows and across
    gub, gus, db, ds = hub_tensors(seed=2)
    for w in from_hub(gub, gus, db, ds, torch.float32)[1:]:
        v = w.dequantize()
        assert torch.equal(quantize_mxfp4(v, w.along_rows).dequantize(), v)
    # random weights: error within half of FP4's top step (2 * 2**e < 2 * amax / 3) of the block's scale
    x = torch.randn(2, 64, 96)
    for along in (True, False):
        q = quantize_mxfp4(x, along_rows=along)
        assert tuple(q.scales.shape) == ((2, 64, 3) if along else (2, 2, 96))
        assert float((q.dequantize(torch.float32) - x).abs().max()) <= float(x.abs().max()) / 3


def test_tensor_api():
    gub, gus, db, ds = hub_tensors(seed=3)
    g, _, d = from_hub(gub, gus, db, ds, torch.bfloat16)
    assert g.shape == (E, I, H) and d.shape == (E, I, H) and g.device == torch.device("cpu")
    assert g.element_size() == 0.5 + 1 / 32 and g.nbytes() == E * I * H * g.element_size() == d.nbytes()
    assert g.parts() == (g.blocks, g.scales)
    full = d.dequantize()
    assert d.dequantize(torch.float32).dtype == torch.float32 and full.dtype == torch.bfloat16
    assert torch.equal(d[1], full[1]) and torch.equal(d[1:3], full[1:3]) and torch.equal(d.expert_on(2, "cpu"), full[2])
    assert torch.equal(d[torch.tensor([2, 0])], full[[2, 0]])
    made = []
    m = Mxfp4Tensor.empty(
        (2, 32, 64), torch.float32, "cpu", False, alloc=lambda s, dt: made.append(s) or torch.ones(s, dtype=dt)
    )
    assert made == [(2, 32, 32), (2, 1, 64)] and not m.along_rows
    w = torch.randn(32, 64)
    m.put(1, w)
    assert torch.equal(m[1], quantize_mxfp4(w[None], along_rows=False)[0])
    with pytest.raises(ValueError, match="divisible by 32"):
        Mxfp4Tensor.empty((1, 48, 64), torch.float32, "cpu", False)


@pytest.mark.parametrize(
    "along_rows,dtype", [(True, torch.bfloat16), (False, torch.float32)], ids=["rows-bf16", "cols-fp32"]
)
def test_dequant_kernel_matches_reference(along_rows, dtype):
    gub, gus, db, ds = hub_tensors(seed=4, lo=2, hi=250)  # results in fp32's normal range (scale 0, 1: subnormals)
    g, _, d = from_hub(gub, gus, db, ds, dtype)
    w = g if along_rows else d
    blocks, scales = w.blocks[1:].to(DEV), w.scales[1:].to(DEV)  # a span of experts
    want = dequant_mxfp4_ref(blocks, scales, along_rows, dtype)
    out = torch.full(want.shape, float("nan"), dtype=dtype, device=DEV)
    got = dequant_mxfp4(blocks, scales, along_rows, dtype, out=out, BLOCK_R=8)
    assert got is out and torch.equal(got, want)


@pytest.mark.parametrize(
    "case,match",
    [
        ("blocks-dtype", "blocks must be uint8"),
        ("scales-shape", "scales must be uint8"),
        ("odd-width", "divisible by 32"),
        ("out-shape", "out must be contiguous"),
    ],
)
def test_dequant_kernel_rejects(case, match):
    b = torch.zeros(2, 32, 32, dtype=torch.uint8)
    s = torch.zeros(2, 32, 2, dtype=torch.uint8)
    args = {
        "blocks-dtype": (b.float(), s, True, torch.float32),
        "scales-shape": (b, s, False, torch.float32),
        "odd-width": (torch.zeros(2, 48, 32, dtype=torch.uint8), s, True, torch.float32),
        "out-shape": (b, s, True, torch.float32),
    }[case]
    kw = {"out": torch.empty(2, 32, 32)} if case == "out-shape" else {}
    with pytest.raises(ValueError, match=match):
        dequant_mxfp4(*args, **kw)
