"""kernels/mla_decode.py against its reference: the absorbed MLA core over the first n rows of a longer (static)
cache, odd shapes and DeepSeek-V2's (16 heads, C 512, R 64), bf16 and fp32, rows strided as a StaticLayer's views;
a cache of more blocks than splits (each split takes every S-th block; the combine merges the splits in several
rounds); W_UV inside the combine; bad arguments refused. Runs under TRITON_INTERPRET=1 on the CPU, compiled on a GPU."""

import pytest
import torch

from localmoe.kernels.mla_absorb import absorb
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


@pytest.mark.parametrize(
    "Hq, C, R, L, n, Dv, block_n",
    [(3, 24, 8, 5, 5, 7, 16), (4, 32, 16, 2100, 2050, 20, 8), (16, 512, 64, 96, 70, 128, 16)],
    ids=["tiny-odd-dv", "strided-blocks", "deepseek-v2"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_w_uv_in_the_combine_matches_reference(Hq, C, R, L, n, Dv, block_n, dtype):
    """W_UV inside the second launch equals the core then kernels/mla_absorb.py's product (as mla.py ran them)."""
    q_lat, q_pe, c, k_pe = _case(Hq, C, R, L, dtype, seed=Hq + L + Dv)
    gen = torch.Generator().manual_seed(Dv)
    kv_b = (torch.randn(Hq, 5 + Dv, C, generator=gen) * C**-0.5).to(DEV, dtype)  # [Hq, Dn + Dv, C] as kv_b_proj
    w_uv = kv_b[:, 5:]  # a strided view, C contiguous
    scale = 0.1 / (C**0.5)
    nt = torch.tensor([n], device=DEV, dtype=torch.int64)
    want = mla_decode_ref(q_lat, q_pe, c, k_pe, nt, scale, w_uv=w_uv)
    got = mla_decode(q_lat, q_pe, c, k_pe, nt, scale, w_uv=w_uv, BLOCK_N=block_n)
    assert got.dtype == dtype and got.shape == (Hq, Dv)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    two = absorb(mla_decode(q_lat, q_pe, c, k_pe, nt, scale), w_uv.transpose(1, 2))
    torch.testing.assert_close(got.float(), two.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("L, pos", [(96, 70), (2100, 2080), (40, 3)], ids=["first-block", "later-block", "short"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_advance(L, pos, dtype):
    """advance=True: n is this step's row (valid length n + 1), advanced by the split launch; with W_UV as in mla.py."""
    Hq, C, R = 4, 32, 16
    q_lat, q_pe, c, k_pe = _case(Hq, C, R, L, dtype, seed=L)
    w_uv = (torch.randn(Hq, 8, C, generator=torch.Generator().manual_seed(1)) * C**-0.5).to(DEV, dtype)
    n, n_ref = torch.tensor([pos], device=DEV), torch.tensor([pos], device=DEV)
    got = mla_decode(q_lat, q_pe, c, k_pe, n, 0.05, w_uv=w_uv, advance=True)
    want = mla_decode_ref(q_lat, q_pe, c, k_pe, n_ref, 0.05, w_uv=w_uv, advance=True)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert int(n) == int(n_ref) == pos + 1
    plain = mla_decode(q_lat, q_pe, c, k_pe, torch.tensor([pos + 1], device=DEV), 0.05, w_uv=w_uv)
    torch.testing.assert_close(got.float(), plain.float(), atol=tol, rtol=tol)


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
    with pytest.raises(ValueError, match="w_uv must be"):
        mla_decode(q_lat, q_pe, c, k_pe, n, 1.0, w_uv=torch.zeros(2, 3, 16, device=DEV).transpose(1, 2))
