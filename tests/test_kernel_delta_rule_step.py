"""Tests of kernels/delta_rule_step.py against transformers' own Gated DeltaNet torch fallbacks.

`delta_rule_step` vs `torch_recurrent_gated_delta_rule` (T = 1, l2norm on); `gated_deltanet_step` vs the chain
transformers runs for one cached decode token: `causal_conv1d_update` -> split/sigmoid/softplus ->
`torch_recurrent_gated_delta_rule` -> `Qwen3_5MoeRMSNormGated`. Real head sizes (16 key / 32 value heads, 128-dim)
and odd ones, fp32 and bf16. Runs on CPU under TRITON_INTERPRET=1.
Shape legend: B batch, H_k/H_v key/value heads, d_k/d_v head dims, K conv width, C conv channels.
"""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q35  # noqa: E402

from localmoe.kernels.delta_rule_step import (  # noqa: E402
    delta_rule_step,
    delta_rule_step_ref,
    gated_deltanet_step,
    gated_deltanet_step_ref,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# (B, H_k, H_v, d_k, d_v, K)
SHAPES = [(1, 16, 32, 128, 128, 4), (1, 2, 4, 8, 8, 4), (2, 3, 3, 24, 40, 3), (1, 2, 6, 20, 12, 4)]
IDS = ["real", "tiny", "odd_b2", "odd_r3"]


def _tol(dtype):
    return dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def _inputs(B, HK, HV, DK, DV, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, 1, HK, DK, generator=gen).to(DEV, dtype)
    k = torch.randn(B, 1, HK, DK, generator=gen).to(DEV, dtype)
    v = torch.randn(B, 1, HV, DV, generator=gen).to(DEV, dtype)
    g = (-torch.rand(B, 1, HV, generator=gen) * 2).to(DEV)  # fp32 like the model's g
    beta = torch.rand(B, 1, HV, generator=gen).to(DEV, dtype)
    state = (torch.randn(B, HV, DK, DV, generator=gen) * 0.5).to(DEV)
    return q, k, v, g, beta, state


def _hf_recurrent(q, k, v, **kw):
    """transformers' recurrent rule with the key heads repeated to the value heads first (5.17 repeats in the
    module, later versions inside the function; repeating here is right for both)."""
    rep = v.shape[2] // q.shape[2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    return q35.torch_recurrent_gated_delta_rule(q, k, v, **kw)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_delta_rule_step_matches_transformers(shape, dtype):
    B, HK, HV, DK, DV, _ = shape
    q, k, v, g, beta, state = _inputs(B, HK, HV, DK, DV, dtype, seed=DK * 7 + HV)
    want, want_state = _hf_recurrent(
        q, k, v, g=g, beta=beta, initial_state=state.clone(), output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    ref, ref_state = delta_rule_step_ref(q, k, v, g, beta, state)
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ref_state, want_state, rtol=1e-5, atol=1e-6)
    st = state.clone()
    got = delta_rule_step(q, k, v, g, beta, st)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, **_tol(dtype))
    torch.testing.assert_close(st, want_state, rtol=1e-4, atol=1e-5)  # the state is fp32 in both


def _hf_chain(mixed_qkv, z, a, b, conv_state, conv_w, conv_b, A_log, dt_bias, norm, state, HK, DK, HV, DV):
    """What Qwen3_5MoeGatedDeltaNet.forward runs for one cached token, from transformers' own functions."""
    B = mixed_qkv.shape[0]
    x = q35.causal_conv1d_update(mixed_qkv.unsqueeze(-1), conv_state, conv_w, conv_b, "silu")  # [B, C, 1]
    x = x.transpose(1, 2)
    q, k, v = torch.split(x, [HK * DK, HK * DK, HV * DV], dim=-1)
    q, k, v = q.reshape(B, 1, HK, DK), k.reshape(B, 1, HK, DK), v.reshape(B, 1, HV, DV)
    beta = b.unsqueeze(1).sigmoid()
    g = -A_log.float().exp() * F.softplus(a.unsqueeze(1).float() + dt_bias)
    o, s = _hf_recurrent(
        q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    state.copy_(s)
    o = norm(o.reshape(-1, DV), z.reshape(-1, DV))
    return o.reshape(B, -1)


# grids: one program per key head (None), or split over value heads and d_v slices (4-column slices only on the
# small shapes: 1024 programs of the real one are slow under the interpreter, 32 covers it)
# split grids take their tickets in one int64 word per key head (one_ticket, the default) or two int32 arrays (on the
# small shapes: the same tickets, 6-9 s a dtype at the real one)
GRIDS = [
    (sh, bv, one)
    for sh in zip(SHAPES, IDS)
    for bv in (None, 4, 32)
    for one in (True, False)
    if not (bv == 4 and sh[0][4] > 64) and (one or (bv == 32 and sh[1] != "real"))
]


@pytest.mark.parametrize(
    "shape,block_v,one_ticket",
    [(sh, bv, one) for (sh, _), bv, one in GRIDS],
    ids=[
        f"{name}-{'head_grid' if bv is None else f'split{bv}'}{'' if one else '-two_tickets'}"
        for (_, name), bv, one in GRIDS
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gated_deltanet_step_matches_transformers(shape, dtype, block_v, one_ticket):
    B, HK, HV, DK, DV, KS = shape
    C = 2 * HK * DK + HV * DV
    gen = torch.Generator().manual_seed(C)
    proj = torch.randn(B, C + HV * DV + 2 * HV, generator=gen).to(DEV, dtype)  # one [B, N] projection output
    mixed_qkv, z, a, b = torch.split(proj, [C, HV * DV, HV, HV], dim=-1)  # strided rows, as in a fused projection
    conv_state = torch.randn(B, C, KS, generator=gen).to(DEV, dtype)
    conv_w = (torch.randn(C, KS, generator=gen) * 0.5).to(DEV, dtype)
    conv_b = (torch.randn(C, generator=gen) * 0.1).to(DEV, dtype) if B == 2 else None
    A_log = torch.rand(HV, generator=gen).to(DEV, dtype)
    dt_bias = torch.rand(HV, generator=gen).to(DEV, dtype)
    norm = q35.Qwen3_5MoeRMSNormGated(DV, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(DV, generator=gen))
    norm = norm.to(DEV, dtype)
    state = (torch.randn(B, HV, DK, DV, generator=gen) * 0.5).to(DEV)
    cs_want, st_want = conv_state.clone(), state.clone()
    with torch.no_grad():
        want = _hf_chain(mixed_qkv, z, a, b, cs_want, conv_w, conv_b, A_log, dt_bias, norm, st_want, HK, DK, HV, DV)
    kw = dict(
        conv_weight=conv_w,
        conv_bias=conv_b,
        A_log=A_log,
        dt_bias=dt_bias,
        norm_weight=norm.weight,
        norm_eps=1e-6,
        num_k_heads=HK,
        head_k_dim=DK,
        num_v_heads=HV,
        head_v_dim=DV,
    )
    cs_ref, st_ref = conv_state.clone(), state.clone()
    ref = gated_deltanet_step_ref(mixed_qkv, z, a, b, conv_state=cs_ref, state=st_ref, **kw)
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-6)
    cs_got, st_got = conv_state.clone(), state.clone()
    count = torch.tensor(7, dtype=torch.int64, device=DEV)  # transformers 5.25's token count: advanced in the launch
    got = gated_deltanet_step(
        mixed_qkv, z, a, b, conv_state=cs_got, state=st_got, count=count, block_v=block_v, one_ticket=one_ticket, **kw
    )
    assert int(count) == 8
    with pytest.raises(ValueError, match="count must be one int64"):
        gated_deltanet_step(mixed_qkv, z, a, b, conv_state=cs_ref, state=st_ref, count=count.int(), **kw)
    if block_v is not None:  # the split grid's tickets are left zeroed for the next launch (graph replays)
        from localmoe.kernels.delta_rule_step_split import _split_workspace
        from localmoe.kernels.workspace import zeroed_int32

        _, tk, th = _split_workspace(DEV, B, HK, HV, DV)
        tk64 = zeroed_int32("gdn_split_ticket64", DEV, 2 * B * HK)
        assert int(tk.abs().sum()) == 0 and int(th.abs().sum()) == 0 and int(tk64.abs().sum()) == 0
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(cs_got, cs_want)  # the conv window shift is exact
    torch.testing.assert_close(st_got, st_want, **_tol(dtype))
    torch.testing.assert_close(got, want, **_tol(dtype))
    if dtype == torch.bfloat16:  # rounding-tie differences only
        assert (got != want).float().mean() < 0.05


def test_checks():
    q, k, v, g, beta, state = _inputs(1, 2, 4, 8, 8, torch.float32, 0)
    with pytest.raises(ValueError):
        delta_rule_step(q, k, v, g, beta, state[:, :2])
    with pytest.raises(ValueError):
        delta_rule_step(q.expand(1, 2, 2, 8), k.expand(1, 2, 2, 8), v, g, beta, state)
