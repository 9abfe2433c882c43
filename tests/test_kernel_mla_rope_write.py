"""kernels/mla_rope_write.py against transformers' DeepseekV2RMSNorm + apply_rotary_emb + StaticLayer.update for
one token: odd shapes and DeepSeek-V2's (16 heads, Dn 128, R 64, C 512), bf16 and fp32, yarn-scaled frequencies;
with W_UK's product in the same launch (equal to kernels/mla_absorb.py's) and the position left to the core;
bad arguments refused. Runs under TRITON_INTERPRET=1 on the CPU, compiled on a GPU."""

import pytest
import torch
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2RMSNorm, apply_rotary_emb

from localmoe.kernels.mla_absorb import absorb
from localmoe.kernels.mla_rope_write import mla_rope_write, mla_rope_write_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("Hq, Dn, R, C", [(3, 8, 6, 24), (16, 128, 64, 512)], ids=["odd", "deepseek-v2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@torch.no_grad()
def test_matches_transformers(Hq, Dn, R, C, dtype):
    gen = torch.Generator().manual_seed(Hq + C)
    q = torch.randn(Hq, Dn + R + 6, generator=gen).to(DEV, dtype)[:, : Dn + R]  # a row stride past Dn + R
    ckv = torch.randn(C + R, generator=gen).to(DEV, dtype)
    norm = DeepseekV2RMSNorm(C, eps=1e-6).to(DEV, dtype)
    norm.weight.copy_(torch.randn(C, generator=gen) * 0.3 + 1)
    angles = torch.rand(R // 2, generator=gen) * 6.0
    freqs_cis = (torch.polar(torch.ones_like(angles), angles) * 1.3).to(DEV)  # yarn's scaling rides in the magnitude
    L, p = 7, 4
    keys, values = torch.zeros(L, C, dtype=dtype, device=DEV), torch.zeros(L, R, dtype=dtype, device=DEV)
    pos = torch.tensor([p], device=DEV)
    want_q, want_k = apply_rotary_emb(q[:, Dn:].view(1, Hq, 1, R), ckv[C:].view(1, 1, 1, R), freqs_cis.view(1, 1, -1))
    want_c = norm(ckv[:C])
    freqs = torch.view_as_real(freqs_cis)
    got = mla_rope_write(q, ckv, norm.weight, 1e-6, freqs, keys, values, pos, Dn)
    torch.testing.assert_close(got, want_q.view(Hq, R), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(keys[p], want_c, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(values[p], want_k.view(R), rtol=1e-5, atol=1e-5)
    assert int(pos) == p + 1 and not keys[:p].any() and not values[p + 1 :].any()
    k2, v2, pos2 = torch.zeros_like(keys), torch.zeros_like(values), torch.tensor([p], device=DEV)
    ref = mla_rope_write_ref(q, ckv, norm.weight, 1e-6, freqs, k2, v2, pos2, Dn)
    assert torch.equal(ref, want_q.view(Hq, R)) and int(pos2) == p + 1


@pytest.mark.parametrize(
    "Hq, Dn, R, C, block_n", [(3, 8, 6, 24, 16), (16, 128, 64, 512, 64)], ids=["odd", "deepseek-v2"]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@torch.no_grad()
def test_w_uk_in_the_launch(Hq, Dn, R, C, block_n, dtype):
    """w_uk=: q_lat as kernels/mla_absorb.py computes it, the write as without it; advance=False keeps the position."""
    gen = torch.Generator().manual_seed(Hq + C + 1)
    q = torch.randn(Hq, Dn + R, generator=gen).to(DEV, dtype)
    ckv = torch.randn(C + R, generator=gen).to(DEV, dtype)
    w = (torch.randn(C, generator=gen) * 0.3 + 1).to(DEV, dtype)
    freqs = torch.randn(R // 2, 2, generator=gen).to(DEV)
    kv_b = (torch.randn(Hq, Dn + 5, C, generator=gen) * Dn**-0.5).to(DEV, dtype)  # [Hq, Dn + Dv, C] as kv_b_proj
    w_uk = kv_b[:, :Dn]
    L, p = 6, 2
    k1, v1 = torch.zeros(L, C, dtype=dtype, device=DEV), torch.zeros(L, R, dtype=dtype, device=DEV)
    k2, v2 = k1.clone(), v1.clone()
    pos1, pos2 = torch.tensor([p], device=DEV), torch.tensor([p], device=DEV)
    q_pe, q_lat = mla_rope_write(q, ckv, w, 1e-6, freqs, k1, v1, pos1, Dn, w_uk=w_uk, advance=False, BLOCK_N=block_n)
    want_pe = mla_rope_write(q, ckv, w, 1e-6, freqs, k2, v2, pos2, Dn)
    assert torch.equal(q_pe, want_pe) and torch.equal(k1, k2) and torch.equal(v1, v2)
    assert int(pos1) == p and int(pos2) == p + 1
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(q_lat.float(), absorb(q[:, :Dn], w_uk).float(), rtol=tol, atol=tol)


def test_refuses_bad_arguments():
    q, ckv, w = torch.zeros(2, 12), torch.zeros(20), torch.ones(16)
    freqs, keys, values, pos = (
        torch.zeros(2, 2),
        torch.zeros(3, 16),
        torch.zeros(3, 4),
        torch.zeros(1, dtype=torch.int64),
    )
    with pytest.raises(ValueError, match="ckv"):
        mla_rope_write(q, ckv[:19], w, 1e-6, freqs, keys, values, pos, 8)
    with pytest.raises(ValueError, match="freqs"):
        mla_rope_write(q, ckv, w, 1e-6, torch.zeros(3, 2), keys, values, pos, 8)
    with pytest.raises(ValueError, match="pos"):
        mla_rope_write(q, ckv, w, 1e-6, freqs, keys, values, pos.int(), 8)
    with pytest.raises(ValueError, match="values"):
        mla_rope_write(q, ckv, w, 1e-6, freqs, keys, torch.zeros(3, 5), pos, 8)
    with pytest.raises(ValueError, match="w_uk"):
        mla_rope_write(q, ckv, w, 1e-6, freqs, keys, values, pos, 8, w_uk=torch.zeros(2, 8, 8))
