"""Tests of kernels/shared_expert.py: the two-launch shared expert vs transformers' Qwen3_5MoeMLP + sigmoid gate.

Runs on CPU under TRITON_INTERPRET=1. out = routed + sigmoid(shared_expert_gate(x)) * shared_expert(x) (or, without a
gate, DeepSeek-V2's routed + shared_experts(x)), compared with
the transformers modules at Qwen3.5-35B (H 2048, I 512), Qwen3.5-122B-like widths and odd sizes, fp32 (a few ulp)
and bf16 (each rounding reproduced: equal to transformers up to the GEMVs' accumulation order), in place or not.
Shape legend: T tokens, H hidden, I shared-expert intermediate size.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from localmoe.kernels.shared_expert import shared_expert, shared_expert_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0" else "cpu"
SHAPES = [(1, 2048, 512), (1, 3072, 64), (3, 100, 37), (2, 32, 16), (1, 17, 5)]  # T, H, I
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=8e-3, atol=8e-3)}


def _modules(H, I, dtype, gen):
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeMLP

    mlp = Qwen3_5MoeMLP(Qwen3_5MoeTextConfig(hidden_size=H), intermediate_size=I)
    gate = torch.nn.Linear(H, 1, bias=False)
    with torch.no_grad():
        for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj, gate):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) / lin.in_features**0.5)
    return mlp.to(DEV, dtype), gate.to(DEV, dtype)


@pytest.mark.parametrize("inplace", [False, True], ids=["out", "inplace"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}H{}I{}".format(*s))
@torch.no_grad()
def test_matches_transformers(shape, dtype, inplace):
    T, H, I = shape
    gen = torch.Generator().manual_seed(H + I + T)
    mlp, gate = _modules(H, I, dtype, gen)
    x = torch.randn(T, H, generator=gen).to(DEV, dtype)
    routed = torch.randn(T, H, generator=gen).to(DEV, dtype)
    want = routed + torch.sigmoid(gate(x)) * mlp(x)  # Qwen3_5MoeSparseMoeBlock's formula
    torch.testing.assert_close(
        shared_expert_ref(x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, gate.weight, routed),
        want,
        rtol=0,
        atol=0,
    )
    args = (x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, gate.weight)
    if inplace:
        buf = routed.clone()
        got = shared_expert(*args, buf, out=buf)
        assert got is buf
    else:
        got = shared_expert(*args, routed)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **TOL[dtype])
    if dtype == torch.bfloat16:  # each rounding reproduced: nearly all elements identical
        assert (got != want).float().mean() < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 2048, 512), (3, 100, 37)], ids=lambda s: "T{}H{}I{}".format(*s))
@torch.no_grad()
def test_residual_add_fused(shape, dtype):
    """residual + (routed + shared): the decoder layer's closing add, with transformers' two roundings."""
    T, H, I = shape
    gen = torch.Generator().manual_seed(H + I + 5)
    mlp, gate = _modules(H, I, dtype, gen)
    x, routed, residual = (torch.randn(T, H, generator=gen).to(DEV, dtype) for _ in range(3))
    want = residual + (routed + torch.sigmoid(gate(x)) * mlp(x))
    got = shared_expert(
        x, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight, gate.weight, routed, residual=residual
    )
    torch.testing.assert_close(got, want, **TOL[dtype])
    with pytest.raises(ValueError, match="residual"):
        shared_expert(
            x,
            mlp.gate_proj.weight,
            mlp.up_proj.weight,
            mlp.down_proj.weight,
            gate.weight,
            routed,
            residual=residual[:, :-1],
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 256, 176), (3, 100, 37)], ids=lambda s: "T{}H{}I{}".format(*s))
@torch.no_grad()
def test_no_gate_deepseek(shape, dtype):
    """w_sg None: DeepSeek-V2's `routed + shared_experts(x)` (the gated tests cover the real widths)."""
    T, H, I = shape
    gen = torch.Generator().manual_seed(H + I + 7)
    mlp, _ = _modules(H, I, dtype, gen)
    x, routed = (torch.randn(T, H, generator=gen).to(DEV, dtype) for _ in range(2))
    want = routed + mlp(x)
    w = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    torch.testing.assert_close(shared_expert_ref(x, *w, None, routed), want, rtol=0, atol=0)
    torch.testing.assert_close(shared_expert(x, *w, None, routed), want, **TOL[dtype])


@torch.no_grad()
def test_checks():
    H, I = 16, 8
    x = torch.randn(1, H, device=DEV)
    wg, wu, wd, ws = (
        torch.randn(I, H, device=DEV),
        torch.randn(I, H, device=DEV),
        torch.randn(H, I, device=DEV),
        torch.randn(1, H, device=DEV),
    )
    with pytest.raises(ValueError):
        shared_expert(x, wg, wu, wd.T, ws, x)
    with pytest.raises(TypeError):
        shared_expert(x, wg, wu, wd, ws, x.bfloat16())
    with pytest.raises(ValueError):
        shared_expert(x, wg, wu, wd, ws, torch.randn(2, H, device=DEV))
