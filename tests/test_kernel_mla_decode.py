"""kernels/mla_decode.py against its reference: the absorbed MLA core over the first n rows of a longer (static)
cache, odd shapes and DeepSeek-V2's (16 heads, C 512, R 64), bf16 and fp32, rows strided as a StaticLayer's views;
a cache of more blocks than splits (each split takes every S-th block; the combine merges the splits in several
rounds); bad arguments refused. Runs under TRITON_INTERPRET=1 on the CPU, compiled on a GPU."""

import pytest
import torch

from localmoe.kernels.mla_decode import mla_decode, mla_decode_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(Hq, C, R, L, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q_lat = torch.randn(Hq, C, generator=gen).to(DEV, dtype)
    q_pe = torch.randn(Hq, R, generator=gen).to(DEV, dtype)
    kv = torch.randn(L, C + R + 3, generator=gen).to(DEV, dtype)  # one buffer: rows strided past C and R
    return q_lat, q_pe, kv[:, :C], kv[:, C : C + R]


@pytest.mark.parametrize(
    "Hq, C, R, L, n",
    [(3, 24, 8, 5, 5), (5, 40, 12, 300, 1), (4, 32, 16, 700, 513), (4, 32, 16, 2100, 2050), (16, 512, 64, 96, 70)],
    ids=["tiny", "one-valid", "many-splits", "strided-blocks", "deepseek-v2"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_matches_reference(Hq, C, R, L, n, dtype):
    q_lat, q_pe, c, k_pe = _case(Hq, C, R, L, dtype, seed=Hq + L)
    scale = 0.1 / (C**0.5)
    nt = torch.tensor([n], device=DEV, dtype=torch.int64)
    want = mla_decode_ref(q_lat, q_pe, c, k_pe, nt, scale)
    got = mla_decode(q_lat, q_pe, c, k_pe, nt, scale)
    assert got.dtype == dtype and got.shape == (Hq, C)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_refuses_bad_arguments():
    q_lat, q_pe, c, k_pe = _case(2, 16, 8, 4, torch.float32, seed=0)
    n = torch.tensor([4], device=DEV)
    with pytest.raises(ValueError, match="q_pe"):
        mla_decode(q_lat, q_pe[:1].contiguous(), c, k_pe, n, 1.0)
    with pytest.raises(ValueError, match="c must be"):
        mla_decode(q_lat, q_pe, c.to(torch.bfloat16), k_pe, n, 1.0)
    with pytest.raises(ValueError, match="same positions"):
        mla_decode(q_lat, q_pe, c, k_pe[:3], n, 1.0)
    with pytest.raises(ValueError, match="n must be"):
        mla_decode(q_lat, q_pe, c, k_pe, n.float(), 1.0)
