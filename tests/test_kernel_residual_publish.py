"""kernels/residual_publish.py against its reference: y = residual + acc rounded once, acc zeroed; odd and real
shapes, bf16 and fp32; bad arguments refused. Runs under TRITON_INTERPRET=1 on the CPU, compiled on a GPU."""

import pytest
import torch

from localmoe.kernels.residual_publish import residual_publish, residual_publish_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("T, H", [(1, 2048), (3, 1000), (1, 7)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_matches_reference_and_zeroes_acc(T, H, dtype):
    gen = torch.Generator().manual_seed(T + H)
    acc = torch.randn(T, H, generator=gen).to(DEV)
    residual = (torch.randn(T, 2 * H, generator=gen) * 3).to(DEV, dtype)[:, :H]  # a row stride past H
    want = residual_publish_ref(acc.clone(), residual)
    got = residual_publish(acc, residual)
    assert got.dtype == dtype and torch.equal(got, want)
    assert not acc.any()


def test_refuses_bad_arguments():
    r = torch.zeros(1, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="fp32"):
        residual_publish(torch.zeros(1, 8, dtype=torch.bfloat16), r)
    with pytest.raises(ValueError, match="fp32"):
        residual_publish(torch.zeros(1, 9), r)
    with pytest.raises(ValueError, match="out"):
        residual_publish(torch.zeros(1, 8), r, out=torch.zeros(1, 8))
