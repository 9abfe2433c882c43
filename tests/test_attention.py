"""Tests of localmoe/decode/sdpa.py: the "localmoe_sdpa" attention implementation gives transformers' logits on tiny
models of several families (GQA, DeepSeek-V2's MLA with different key and value head dims), with a dynamic and a
static cache, takes the decode kernel on one-token steps only, and switches back. CPU, TRITON_INTERPRET=1.
Shape legend: P prompt tokens, V vocab.
"""

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import tiny_models  # noqa: E402
from test_fused import STEPS, _run  # noqa: E402

from localmoe.decode import sdpa  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0" else "cpu"


def _text_model(family):
    from transformers import AutoModelForCausalLM

    full, _ = tiny_models.build(family)
    cfg = getattr(full.config, "text_config", full.config)
    torch.manual_seed(3)
    return AutoModelForCausalLM.from_config(cfg).eval().to(DEV)


@pytest.mark.parametrize("cache_kind", ["dynamic", "static"])
@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe", "deepseek_v2", "mixtral"])
@torch.no_grad()
def test_logits_equal_sdpa(family, cache_kind):
    ref = _text_model(family)
    assert ref.config._attn_implementation == "sdpa"
    prompt = torch.randint(0, ref.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(2)).to(DEV)
    want, want_toks = _run(ref, cache_kind, prompt)
    model = copy.deepcopy(ref)
    assert sdpa.install(model) and model.config._attn_implementation == sdpa.NAME
    calls = sdpa.decode_calls
    got, toks = _run(model, cache_kind, prompt)
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
    full = sum(t != "linear_attention" for t in types)
    assert sdpa.decode_calls - calls == STEPS * full  # every decode step of every attention layer, not prefill
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert toks == want_toks
    assert sdpa.uninstall(model) and model.config._attn_implementation == "sdpa"
    assert not sdpa.uninstall(model) and not sdpa.install(torch.nn.Linear(2, 2))
