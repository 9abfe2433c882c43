"""Attention with learned sinks through SDPA (localmoe/decode/sinks.py) against GPT-OSS's own eager attention:
causal prompts (no mask), prompt pieces after a past with full and sliding-window masks (boolean as sdpa_mask builds
them, or eager's additive float), grouped KV heads, fp32 and bf16; a loaded GPT-OSS model runs it. Never a time."""

from __future__ import annotations

import pytest
import torch
from conftest import repo_id
from transformers import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, eager_attention_forward

from localmoe.decode import sinks
from localmoe.engine.engine import Engine


def _attention(dtype) -> GptOssAttention:
    config = GptOssConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, head_dim=16)
    m = GptOssAttention(config, 0).to(dtype).eval()
    with torch.no_grad():
        m.sinks.copy_(torch.randn(8, generator=torch.Generator().manual_seed(1)) * 2)
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("T", "L", "window"), [(7, 7, None), (5, 12, None), (6, 20, 4), (1, 9, None)])
def test_equals_eager(dtype, T, L, window):
    m = _attention(dtype)
    gen = torch.Generator().manual_seed(T * L)
    q = torch.randn(1, 8, T, 16, generator=gen).to(dtype)
    k, v = (torch.randn(1, 2, L, 16, generator=gen).to(dtype) for _ in range(2))
    pos = torch.arange(L - T, L)[:, None]
    keys = torch.arange(L)[None, :]
    allowed = (keys <= pos) & ((pos - keys < window) if window else True)
    additive = torch.zeros(T, L, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
    want, _ = eager_attention_forward(m, q.float(), k.float(), v.float(), additive.float(), scaling=m.scaling)
    masks = [allowed[None, None], additive] + ([None] if (T == L and window is None) else [])
    for mask in masks:
        got, probs = sinks.sinks_attention(m, q, k, v, mask, scaling=m.scaling, s_aux=m.sinks)
        assert probs is None and got.shape == (1, T, 8, 16) and got.dtype == dtype
        torch.testing.assert_close(
            got.float(), want, **({} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2})
        )


def test_loaded_model_runs_it():
    """The loader switches GPT-OSS to the implementation (any device); uninstall puts eager back."""
    e = Engine.load(repo_id("gpt_oss"), device="cpu", sparsity=0.0)
    model = e.loaded.model
    assert model.config._attn_implementation == sinks.NAME
    assert sinks.uninstall(model) and model.config._attn_implementation == "eager"
    assert sinks.install(model) and model.config._attn_implementation == sinks.NAME
    assert not sinks.install(Engine.load(repo_id("qwen3_moe"), device="cpu", sparsity=0.0).loaded.model)
