"""kernels/dequant_int4.py against its torch reference (localmoe.experts.int4.dequantize): odd and real shapes, groups
of
16 to 128, bf16 / fp16 / fp32 outputs, a reused `out`, and the launcher's checks. Triton under the interpreter on
the CPU (CUDA when present)."""

from __future__ import annotations

import pytest
import torch

from localmoe.experts.int4 import quantize
from localmoe.kernels.dequant_int4 import dequant_int4, dequant_int4_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    "shape,group",
    [((3, 5, 96), 32), ((2, 7, 80), 16), ((1, 3, 200), 8), ((2, 16, 2048), 128)],
    ids=["odd-NG3", "odd-NG5", "H200", "qwen3.5"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_matches_reference(shape, group, dtype):
    w = quantize(torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.05, group=group)
    p, s, m = (t.to(DEV) for t in (w.packed, w.scale, w.minimum))
    got = dequant_int4(p, s, m, dtype)
    want = dequant_int4_ref(p, s, m, dtype)
    assert got.shape == shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)  # an fma may round once where torch rounds twice
    else:  # within one ulp of the 16-bit type (the interpreter's fp32 -> bf16 conversion may not round to nearest)
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-5)
    out = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
    assert dequant_int4(p[1:], s[1:], m[1:], dtype, out=out[1:]).data_ptr() == out[1:].data_ptr()
    assert out[0].isnan().all() and torch.equal(out[1:], got[1:])


def test_checks():
    w = quantize(torch.randn(2, 3, 64), group=32)
    p, s, m = (t.to(DEV) for t in (w.packed, w.scale, w.minimum))
    with pytest.raises(ValueError, match="uint8"):
        dequant_int4(p.float(), s, m, torch.bfloat16)
    with pytest.raises(ValueError, match="scale must be"):
        dequant_int4(p, s[:, :2], m, torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous"):
        dequant_int4(p.transpose(0, 1), s.transpose(0, 1), m.transpose(0, 1), torch.bfloat16)
    with pytest.raises(ValueError, match="out must be"):
        dequant_int4(p, s, m, torch.bfloat16, out=torch.empty(2, 3, 64, device=DEV))
    with pytest.raises(ValueError, match="groups"):
        dequant_int4(
            p, s[..., :1].expand(2, 3, 3).contiguous(), m[..., :1].expand(2, 3, 3).contiguous(), torch.bfloat16
        )
