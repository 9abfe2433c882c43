"""kernels/mla_absorb.py against its reference: DeepSeek-V2's absorbed projections, q_nope · W_UK and o_lat · W_UVᵀ,
as strided views of one kv_b_proj weight (no copy), odd shapes and V2-Lite's (16 heads, 128, C 512), bf16 and fp32;
bad arguments refused. Runs under TRITON_INTERPRET=1 on the CPU, compiled on a GPU."""

import pytest
import torch

from localmoe.kernels.mla_absorb import absorb, absorb_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _views(Hq, Dn, Dv, C, dtype, seed):
    """(W_UK [Hq, Dn, C], W_UVᵀ [Hq, C, Dv]) as decode/mla.py takes them from kv_b_proj's weight [Hq·(Dn + Dv), C]."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(Hq * (Dn + Dv), C, generator=gen) * C**-0.5).to(DEV, dtype).view(Hq, Dn + Dv, C)
    return w[:, :Dn], w[:, Dn:].transpose(1, 2)


@pytest.mark.parametrize(
    "Hq, Dn, Dv, C", [(3, 5, 7, 24), (4, 16, 16, 32), (16, 128, 128, 512)], ids=["odd", "tiny", "deepseek-v2-lite"]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_matches_reference(Hq, Dn, Dv, C, dtype):
    w_uk, w_uv_t = _views(Hq, Dn, Dv, C, dtype, seed=Hq + C)
    gen = torch.Generator().manual_seed(C)
    q_nope = torch.randn(Hq, Dn + 3, generator=gen).to(DEV, dtype)[:, :Dn]  # a view of the query: rows strided
    o_lat = torch.randn(Hq, C, generator=gen).to(DEV, dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    q_lat = absorb(q_nope, w_uk)
    assert q_lat.dtype == dtype and tuple(q_lat.shape) == (Hq, C)
    torch.testing.assert_close(q_lat, absorb_ref(q_nope, w_uk), **tol)
    o = absorb(o_lat, w_uv_t, out=torch.empty(Hq, Dv, device=DEV, dtype=dtype))
    torch.testing.assert_close(o, absorb_ref(o_lat, w_uv_t), **tol)
    want = torch.bmm(o_lat.float().view(Hq, 1, C), w_uv_t.float()).view(Hq, Dv)  # what decode/mla.py computed
    torch.testing.assert_close(o.float(), want, **tol)


@pytest.mark.parametrize("block_k, block_n", [(4, 8), (32, 128)])
def test_tiles_do_not_change_the_sums(block_k, block_n):
    w_uk, _ = _views(5, 40, 8, 72, torch.float32, seed=3)
    x = torch.randn(5, 40, generator=torch.Generator().manual_seed(4)).to(DEV)
    torch.testing.assert_close(absorb(x, w_uk, BLOCK_K=block_k, BLOCK_N=block_n), absorb_ref(x, w_uk))


def test_bad_arguments_refused():
    w_uk, _ = _views(3, 5, 7, 24, torch.float32, seed=1)
    x = torch.randn(3, 5, device=DEV)
    with pytest.raises(ValueError, match="contiguous rows"):
        absorb(x.t(), w_uk)
    with pytest.raises(ValueError, match="w must be"):
        absorb(x[:2], w_uk)
    with pytest.raises(ValueError, match="float32 on"):
        absorb(x, w_uk.double())
    with pytest.raises(ValueError, match="out must be"):
        absorb(x, w_uk, out=torch.empty(3, 23, device=DEV))
