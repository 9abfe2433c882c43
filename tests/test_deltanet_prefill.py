"""Tests of localmoe/decode/deltanet_prefill.py: FusedGatedDeltaNet's own forward for more than one token equals
transformers' Qwen3_5MoeGatedDeltaNet, output and cache, on the CPU (the chunk rule's torch reference; the Triton
kernel itself is tests/test_kernel_delta_rule_chunk.py's).

One layer (H_k 2, H_v 4, d 8, conv width 4): without a cache; on a DynamicCache a 3-token first piece (shorter than
the conv window: padded) then a 67-token second piece (starts from the cache's conv window and recurrent state,
crosses a chunk), then a cached decode step; on a StaticCache; with a left-padding attention mask (B 2); in bf16;
with past recording on (the conv state keeps the whole past). Every case compares the output and the cache's
conv_states, recurrent_states and has_previous_state with transformers' module on its own cache. Then a tiny
Qwen3.5 model (tests/test_fused.py's fixture) with the replacements installed but the decoder layers: its prefill runs
this forward and its greedy tokens equal transformers'. Passes with transformers 5.17 to 5.25 (bit for bit up
to 5.24; 5.25's module rounds its chunk rule differently in fp32: `_close`).
Shape legend: B batch, T tokens, H hidden.
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
from transformers import DynamicCache, StaticCache  # noqa: E402
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q35  # noqa: E402

from localmoe.decode import deltanet_prefill, replacements  # noqa: E402
from localmoe.decode.deltanet import FusedGatedDeltaNet  # noqa: E402

tiny_text_model = test_fused.tiny_text_model  # the fixture, shared with test_fused
_CONFIG = dict(
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    num_experts=4,
    num_experts_per_tok=2,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "full_attention"],
)


def _layer(dtype=torch.float32):
    cfg = q35.Qwen3_5MoeTextConfig(**_CONFIG)
    torch.manual_seed(5)
    hf = q35.Qwen3_5MoeGatedDeltaNet(cfg, layer_idx=0)
    with torch.no_grad():
        hf.A_log.copy_(torch.rand(hf.A_log.shape))
        hf.dt_bias.copy_(torch.rand(hf.dt_bias.shape))
        hf.norm.weight.copy_(1 + 0.3 * torch.randn(hf.norm.weight.shape))
    hf = hf.to(dtype).eval()
    return cfg, hf, FusedGatedDeltaNet(copy.deepcopy(hf))


def _close(got, want, msg=None):
    """Equal up to fp32 rounding: this module runs `torch_chunk_gated_delta_rule` op for op (bit for bit with the
    module up to 5.24); 5.25's module calls its flash-linear-attention fallback instead, ~1e-7 apart in fp32 over two
    chunks (with this module's rule swapped in, transformers' module gives this module's output exactly)."""
    tol = dict(rtol=1e-5, atol=1e-6) if got.dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)
    torch.testing.assert_close(got, want, msg=msg, **tol)


def _call(mod, x, cache, mask=None):
    kw = "cache" if "cache" in inspect.signature(q35.Qwen3_5MoeGatedDeltaNet.forward).parameters else "cache_params"
    return mod(x, attention_mask=mask, **{kw: cache})


def _same_cache(got, want):
    a, b = got.layers[0], want.layers[0]
    assert a.has_previous_state == b.has_previous_state
    if hasattr(b, "cumulative_length_linear"):  # transformers 5.25: the layer's token count, get_seq_length()'s
        assert int(a.cumulative_length_linear) == int(b.cumulative_length_linear)
    for name in ("conv_states", "recurrent_states"):
        x, y = getattr(a, name)[0], getattr(b, name)[0]
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.shape == y.shape and x.dtype == y.dtype, name
            _close(x, y, msg=name)


def _x(B, T, dtype=torch.float32, seed=0):
    return torch.randn(B, T, 32, generator=torch.Generator().manual_seed(seed)).to(dtype)


@torch.no_grad()
def test_prefill_without_cache():
    _, hf, mod = _layer()
    x = _x(1, 70)
    _close(_call(mod, x, None), _call(hf, x, None))
    assert mod.prefill_calls == 1


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the kernels on CPU tensors need the interpreter")
@pytest.mark.parametrize(
    "prepare,dtype",
    [("torch", torch.float32), ("split", torch.float32), ("split", torch.bfloat16), ("triton", torch.float32)],
    ids=["torch", "split", "split_bf16", "triton"],
)
@torch.no_grad()
def test_prefill_with_the_chunk_kernel(prepare, dtype, monkeypatch):
    """The path a GPU takes (the chunked rule's Triton scan, its intra-chunk phase as torch ops, split or one Triton
    launch: `FusedGatedDeltaNet.prefill_prepare`; "split" also joins the input projections and runs the gates and
    the gated norm as one launch each), here on CPU tensors under the interpreter: transformers' output and cache,
    two pieces on a DynamicCache."""
    monkeypatch.setattr(deltanet_prefill, "kernel_available", lambda t: True)
    monkeypatch.setattr(FusedGatedDeltaNet, "prefill_prepare", prepare)
    cfg, hf, mod = _layer(dtype)
    got_cache, want_cache = DynamicCache(config=cfg), DynamicCache(config=cfg)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for T, seed in ((3, 1), (67, 2)):
        x = _x(1, T, dtype, seed=seed)
        torch.testing.assert_close(_call(mod, x, got_cache), _call(hf, x, want_cache), **tol)
    a, b = got_cache.layers[0], want_cache.layers[0]
    torch.testing.assert_close(a.recurrent_states[0], b.recurrent_states[0], **tol)
    torch.testing.assert_close(a.conv_states[0], b.conv_states[0], rtol=0, atol=0)
    assert mod.prefill_calls == 2


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "0", reason="CPU tensors: the decode step's compiled kernels need CUDA ones"
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.no_grad()
def test_two_pieces_and_a_step_on_a_dynamic_cache(dtype):
    cfg, hf, mod = _layer(dtype)
    caches = DynamicCache(config=cfg), DynamicCache(config=cfg)
    for T, seed in ((3, 1), (67, 2), (1, 3)):
        x = _x(1, T, dtype, seed)
        got, want = _call(mod, x, caches[0]), _call(hf, x, caches[1])
        if T > 1:
            _close(got, want)
            _same_cache(*caches)
        else:  # the fused decode step (kernels/delta_rule_step.py) from the pieces' cache
            tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(got, want, **tol)
            assert mod.decode_calls == 1
            assert int(caches[0].get_seq_length()) == int(caches[1].get_seq_length())  # 5.25: 71, this layer's
    assert mod.prefill_calls == 2


@torch.no_grad()
def test_static_cache_and_recorded_past():
    cfg, hf, mod = _layer()
    caches = StaticCache(config=cfg, max_cache_len=32), StaticCache(config=cfg, max_cache_len=32)
    for T, seed in ((9, 4), (5, 5)):
        x = _x(1, T, seed=seed)
        _close(_call(mod, x, caches[0]), _call(hf, x, caches[1]))
        _same_cache(*caches)
    caches = DynamicCache(config=cfg), DynamicCache(config=cfg)
    for c in caches:
        _record_past(c.layers[0], keep=0)
    for T, seed in ((6, 6), (4, 7)):
        x = _x(1, T, seed=seed)
        _close(_call(mod, x, caches[0]), _call(hf, x, caches[1]))
        _same_cache(*caches)
    assert caches[0].layers[0].conv_states[0].shape[-1] == 10  # the whole past kept
    assert mod.prefill_calls == 4


def _record_past(layer, keep: int) -> bool:
    """transformers' activate_past_recording; `keep` recurrent states kept step by step (5.25 on: False before)."""
    if "recurrent_states_to_keep" not in inspect.signature(layer.activate_past_recording).parameters:
        layer.activate_past_recording()
        return False
    layer.activate_past_recording(recurrent_states_to_keep=keep)
    return True


@torch.no_grad()
def test_recorded_recurrent_states_run_transformers_module():
    """A layer that records its last recurrent states one by one (transformers 5.25, assisted decoding's `crop`):
    the prefill is transformers' own, and the cache holds what transformers leaves."""
    cfg, hf, mod = _layer()
    caches = DynamicCache(config=cfg), DynamicCache(config=cfg)
    if not all(_record_past(c.layers[0], keep=2) for c in caches):
        pytest.skip("transformers before 5.25 records no intermediate recurrent states")
    x = _x(1, 6, seed=9)
    _close(_call(mod, x, caches[0]), _call(hf, x, caches[1]))
    _same_cache(*caches)
    assert mod.prefill_calls == 0


@torch.no_grad()
def test_padding_mask_and_declined_calls():
    cfg, hf, mod = _layer()
    x = _x(2, 8, seed=8)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0  # left padding on the second row
    caches = DynamicCache(config=cfg), DynamicCache(config=cfg)
    _close(_call(mod, x, caches[0], mask), _call(hf, x, caches[1], mask))
    _same_cache(*caches)
    assert mod.prefill_calls == 1
    try:  # packed sequences: transformers' module (5.2x refuses them without fla, 5.17 runs them as one)
        mod(x, None, cu_seq_lens_q=torch.tensor([0, 8]))
    except ValueError:
        pass
    assert mod.prefill_calls == 1


@torch.no_grad()
def test_tiny_model_greedy_tokens(tiny_text_model):
    """A tiny Qwen3.5 with every replacement installed (FusedDecoderLayer sends a prefill to its original layer, whose
    linear_attn `install` points at the fused module): the layers' prefill runs deltanet_prefill, greedy tokens and
    logits equal transformers'; uninstall puts transformers' modules back."""
    dev = test_fused.DEV  # the CPU, or CUDA with compiled kernels (TRITON_INTERPRET=0): then the Triton chunk rule
    ref = copy.deepcopy(tiny_text_model).to(dev)
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, ref.config.vocab_size, (1, 9), generator=gen).to(dev)
    want, want_toks = test_fused._run(ref, "dynamic", prompt, steps=1)
    model = copy.deepcopy(ref)
    assert replacements.install(model, dev, force=True)["Qwen3_5MoeDecoderLayer"] > 0
    nets = [m for m in model.modules() if isinstance(m, FusedGatedDeltaNet)]
    got, toks = test_fused._run(model, "dynamic", prompt, steps=1)
    assert nets and all(m.prefill_calls == 1 for m in nets)
    assert toks == want_toks
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    replacements.uninstall(model)
    assert not any(isinstance(m, FusedGatedDeltaNet) for m in model.modules())
