"""Tests of the fused decoder layers' prompt path (localmoe/decode: `FusedDecoderLayer.prefill_norms`,
`FusedSparseMoeBlock.prefill_fused`, `FusedAttention.prefill_fused`, the Gated DeltaNet's prefill rule): a prompt
through the fused modules runs the same arithmetic as the original modules (greedy tokens equal, logits within the
whole-model tolerance) in fewer launches, on tiny random models of each family (CPU, TRITON_INTERPRET=1; launches
counted as tests/test_fused_model.py counts them).
Shape legend: P prompt tokens, E experts, k experts per token.
"""

import copy
import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import test_fused  # noqa: E402

# the fixtures, shared with test_fused (tiny_model takes the family's)
from test_fused import (  # noqa: E402, F401
    _greedy_steps,
    _run,
    tiny_granitemoe,
    tiny_mixtral,
    tiny_model,
    tiny_qwen3_moe,
    tiny_text_model,
)
from test_fused_model import DEV, _counted_launch, _installed, _Launches, _prompt  # noqa: E402

from localmoe.decode import moe_layer, replacements  # noqa: E402


def _prefill_switches(monkeypatch, on: bool) -> None:
    """The four prefill switches (fused norms, MoE block, attention: on by default; the DeltaNet rule's "split" on
    CUDA) all on or off."""
    from localmoe.decode.deltanet import FusedGatedDeltaNet

    monkeypatch.setattr(replacements.FusedDecoderLayer, "prefill_norms", on)
    monkeypatch.setattr(moe_layer.FusedSparseMoeBlock, "prefill_fused", on)
    monkeypatch.setattr(replacements.FusedAttention, "prefill_fused", on)
    monkeypatch.setattr(FusedGatedDeltaNet, "prefill_prepare", "split" if on else "torch")


def _count_call(model, prompt, monkeypatch) -> _Launches:
    """Every launch of one uncached call of the model on `prompt` (aten ops that compute, Triton launches)."""
    from triton.runtime import interpreter

    mode = _Launches()
    mode.inside = True
    with monkeypatch.context() as mp:
        mp.setattr(interpreter.GridExecutor, "__call__", _counted_launch(mode))
        with mode:
            model(input_ids=prompt)
    return mode


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="counts Triton launches of the interpreter")
@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe", "mixtral", "granitemoe"])
@torch.no_grad()
def test_prefill_norms_equal_the_original_layer(tiny_model, family, monkeypatch):
    """`FusedDecoderLayer.prefill_norms`: a prompt runs each layer's arithmetic with its fused norms (the input norm
    one launch, the residual add and post-attention norm one) instead of transformers' layer; prefill logits and the
    greedy continuation equal the original layer's within fp32 tolerance, the decode steps stay the fused ones, the
    prefill is not counted as a decode call, and the piece makes fewer launches (GraniteMoE: its residual_multiplier
    on both branches)."""
    _prefill_switches(monkeypatch, False)  # the baseline: transformers' modules
    ref = copy.deepcopy(tiny_model).to(DEV)
    test_fused.nontrivial(ref)
    model, _ = _installed(ref)
    prompt = _prompt(model, P=7)
    want, want_toks = _run(model, "static", prompt, 2)
    off = _count_call(model, prompt, monkeypatch)
    monkeypatch.setattr(replacements.FusedDecoderLayer, "prefill_norms", True)
    layers = [m for m in model.modules() if isinstance(m, replacements.FusedDecoderLayer)]
    calls = [m.decode_calls for m in layers]
    got, toks = _run(model, "static", prompt, 2)
    assert [m.decode_calls - c for m, c in zip(layers, calls)] == [2] * len(layers)  # the decode steps only
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert toks == want_toks
    on = _count_call(model, prompt, monkeypatch)
    n = model.config.num_hidden_layers
    print(f"\n{family} prefill launches: {len(off.ops)} -> {len(on.ops)} ({n} layers)")
    assert len(on.ops) <= len(off.ops) - 8 * n


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="counts Triton launches of the interpreter")
@pytest.mark.parametrize("experts", ["transformers", "local"])
@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe"])
@torch.no_grad()
def test_prefill_block_equals_the_original_block(tiny_model, family, experts, monkeypatch):
    """`FusedSparseMoeBlock.prefill_fused`: a prompt's MoE blocks route by F.linear and one top-k launch, Qwen3.5's
    shared expert by its SwiGLU GEMM launch, down GEMM and gate GEMV, added in the experts' last launch (localmoe's
    experts on the device dense path: kernels/token_combine.py) or by torch's ops (transformers' experts); prefill
    logits and the greedy continuation equal the original block's within fp32 tolerance, with fewer launches."""
    _prefill_switches(monkeypatch, False)  # the baseline: transformers' modules
    ref = copy.deepcopy(tiny_model).to(DEV)
    test_fused.nontrivial(ref)
    local = experts == "local"
    if local:
        for m in test_fused._with_local_experts(ref, 0.5):
            m.kernel_on_cpu = True
    model, _ = _installed(ref)
    cfg = model.config
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    prompt = _prompt(model, P=4 * E // k + 3)  # T·k >= 4E: the dense path's device spans
    want, want_toks = _run(model, "static", prompt, 2)
    off = _count_call(model, prompt, monkeypatch)
    monkeypatch.setattr(moe_layer.FusedSparseMoeBlock, "prefill_fused", True)
    got, toks = _run(model, "static", prompt, 2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert toks == want_toks
    on = _count_call(model, prompt, monkeypatch)
    n = cfg.num_hidden_layers
    print(f"\n{family} ({experts} experts) prefill launches: {len(off.ops)} -> {len(on.ops)} ({n} layers)")
    assert on.ops.count("triton:_topk_rows_kernel") == n
    shared = family == "qwen3_5_moe"
    assert on.ops.count("triton:_token_combine_kernel") == (n if local else 0)
    assert on.ops.count("triton:_grouped_gate_up_kernel") == (n if shared else 0) + (n if local else 0)
    # fp32 on the CPU: no launch for transformers' casts to the model's dtype (bf16 on a GPU: one or two more saved)
    assert len(on.ops) <= len(off.ops) - (3 + 2 * shared + 3 * (shared and local)) * n


def _two_pieces(model, prompt, steps=2):
    """A prompt in two pieces on one StaticCache (the second on an initialised layer), then greedy decode steps:
    (logits of each piece's last position and of each step, fp32, tokens)."""
    from transformers import StaticCache

    P, cut = prompt.shape[1], prompt.shape[1] // 2
    cache = StaticCache(config=model.config, max_cache_len=P + steps + 1)
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    logits = []
    for a, b in ((0, cut), (cut, P)):
        out = model(
            input_ids=prompt[:, a:b], cache_position=torch.arange(a, b, device=DEV), use_cache=True, **{kw: cache}
        )
        logits.append(out.logits[0, -1].float())
    return _greedy_steps(model, {kw: cache}, logits, P, steps)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="counts Triton launches of the interpreter")
@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe", "mixtral", "granitemoe"])
@torch.no_grad()
def test_prefill_attention_equals_the_original_module(tiny_model, family, monkeypatch):
    """`FusedAttention.prefill_fused`: a prompt's attention layers run `attention_prefill` (one q|k|v GEMM, the norms,
    RoPE and the static layer's k/v write in one launch, the core, the gate, o_proj): a prompt in two pieces (the
    first through the cache's update on a fresh StaticCache, the second written by the kernel) gives the original
    module's logits and greedy continuation within fp32 tolerance, the decode steps after it equal, fewer launches."""
    _prefill_switches(monkeypatch, False)  # the baseline: transformers' modules
    ref = copy.deepcopy(tiny_model).to(DEV)
    test_fused.nontrivial(ref)
    model, _ = _installed(ref)
    prompt = _prompt(model, P=9)
    want, want_toks = _two_pieces(model, prompt)
    off = _count_call(model, prompt, monkeypatch)
    monkeypatch.setattr(replacements.FusedAttention, "prefill_fused", True)
    attn = [m for m in model.modules() if isinstance(m, replacements.FusedAttention)]
    got, toks = _two_pieces(model, prompt)
    assert all(m.prefill_calls == 2 for m in attn)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert toks == want_toks
    on = _count_call(model, prompt, monkeypatch)
    print(f"\n{family} prefill launches: {len(off.ops)} -> {len(on.ops)} ({len(attn)} attention layers)")
    assert on.ops.count("triton:_qk_norm_rope_rows_kernel") == len(attn)
    assert len(on.ops) <= len(off.ops) - 8 * len(attn)
