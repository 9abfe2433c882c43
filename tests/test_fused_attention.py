"""Tests of localmoe/decode/attention.py: Qwen3.5-MoE's gated full attention and Qwen3-MoE's / OLMoE's / Mixtral's /
GraniteMoE's plain ones (where parametrised by `family`; the last two without q/k norms), fused for a cached
one-token step (q|k|v GEMV; on a static cache the q/k norms, RoPE, the k/v write and the core in one launch
(kernels/decode_attention_qk.py's decode_attention_qk), else kernels/qk_norm_rope.py, the cache's update and the core;
[sigmoid gate], o_proj),
equal transformers' module on a tiny random model: the layer's own output and cache writes, whole-model logits with
everything else fused alike, greedy `generate`; prefill, uncached, eager-core, biased, sliding-window (Mixtral's from
its config too) and clip_qkv calls fall back to the original module.
CPU, TRITON_INTERPRET=1.
Shape legend: P prompt tokens, H hidden, V vocab.
"""

import copy
import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

# the fixtures, shared with test_fused
from test_fused import (  # noqa: E402, F401
    STEPS,
    _run,
    tiny_granitemoe,
    tiny_mixtral,
    tiny_model,
    tiny_olmoe,
    tiny_qwen3_moe,
    tiny_text_model,
)

from localmoe.decode import replacements, sdpa
from localmoe.decode.attention import FusedAttention  # noqa: E402
from localmoe.decode.text_model import FusedTextModel  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0" else "cpu"
P = 6


def _full_attention_index(model) -> int:
    types = getattr(model.config, "layer_types", None)
    return types.index("full_attention") if types else 0  # Qwen3-MoE: every layer


def _layer_inputs(model, T, start, seed):
    """(hidden [1, T, H], (cos, sin)) for positions start .. start+T-1, in the model's dtype."""
    H = model.config.hidden_size
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(1, T, H, generator=gen).to(DEV, model.dtype)
    pos = torch.arange(start, start + T, device=DEV).view(1, T)
    if hasattr(model.model.rotary_emb, "mrope_section"):  # Qwen3.5: text positions on 3 mrope axes
        pos = pos.view(1, 1, T).expand(3, 1, T)
    return h, model.model.rotary_emb(h, pos)


def _cache_kw(module) -> str:
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


_FP32, _BF16 = torch.float32, torch.bfloat16


@pytest.mark.parametrize(
    "family,dtype,core",
    [
        ("qwen3_5_moe", _FP32, "sdpa"),
        ("qwen3_5_moe", _FP32, sdpa.NAME),
        ("qwen3_5_moe", _BF16, "sdpa"),
        ("qwen3_5_moe", _BF16, sdpa.NAME),
        ("qwen3_moe", _FP32, "sdpa"),
        ("qwen3_moe", _FP32, sdpa.NAME),
        ("qwen3_moe", _BF16, sdpa.NAME),
        ("olmoe", _FP32, sdpa.NAME),
        ("mixtral", _FP32, sdpa.NAME),
        ("granitemoe", _BF16, sdpa.NAME),
    ],
    ids=lambda v: {_FP32: "fp32", _BF16: "bf16"}.get(v, v),
)
@torch.no_grad()
def test_decode_step_equals_module(tiny_model, family, dtype, core):
    """After a P-token prefill into a DynamicCache, fused decode steps give the original module's output and write
    the same keys and values into the cache; the prefill itself runs `attention_prefill` (`prefill_fused`, the
    default), equal within the dtype's tolerance (its GEMM's summation order)."""
    from transformers import DynamicCache

    model = copy.deepcopy(tiny_model).to(DEV, dtype)
    if core == sdpa.NAME:
        assert sdpa.install(model)
    i = _full_attention_index(model)
    hf = model.model.layers[i].self_attn
    holder = torch.nn.Sequential(copy.deepcopy(hf))
    done = replacements.install(holder, force=True)  # the projections FusedLinear, the norms FusedRMSNorm, as install
    norms = {type(hf.q_norm).__name__: 2} if hasattr(hf, "q_norm") else {}  # Mixtral, GraniteMoE: none
    assert done == {type(hf).__name__: 1, "Linear": 4, **norms}
    fa = holder[0]
    assert isinstance(fa, FusedAttention) and fa.q_proj.weight is fa._hf.q_proj.weight
    kw = _cache_kw(hf)
    want_cache, got_cache = DynamicCache(config=model.config), DynamicCache(config=model.config)
    h, pe = _layer_inputs(model, P, 0, seed=1)
    want = hf(h, pe, None, **{kw: want_cache})
    got = fa(h, pe, None, cache=got_cache)
    assert fa.decode_calls == 0 and fa.prefill_calls == 1  # prefill: attention_prefill
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got[0], want[0], **tol)
    cores = 0
    for step in range(3):
        h, pe = _layer_inputs(model, 1, P + step, seed=10 + step)
        want = hf(h, pe, None, **{kw: want_cache})
        calls = sdpa.decode_calls
        got = fa(h, pe, None, past_key_values=got_cache) if step == 1 else fa(h, pe, None, got_cache)
        cores += sdpa.decode_calls - calls
        assert got[1] is None and want[1] is None and got[0].shape == want[0].shape and got[0].dtype == dtype
        torch.testing.assert_close(got[0], want[0], **tol)
        k_got, v_got = got_cache.layers[i].keys, got_cache.layers[i].values
        k_want, v_want = want_cache.layers[i].keys, want_cache.layers[i].values
        assert k_got.shape == k_want.shape == (1, model.config.num_key_value_heads, P + step + 1, fa.head_dim)
        torch.testing.assert_close(k_got, k_want, **tol)  # normed and roped keys
        torch.testing.assert_close(v_got, v_want, **tol)  # (the GEMV sums in another order than torch's)
    assert fa.decode_calls == 3
    assert cores == (3 if core == sdpa.NAME else 0)  # localmoe's decode core under localmoe_sdpa


@pytest.mark.parametrize(
    "cache_kind,dtype",
    [("static", torch.float32), ("static", torch.bfloat16), ("dynamic", torch.float32)],
    ids=["static-fp32", "static-bf16", "dynamic-fp32"],
)
@torch.no_grad()
def test_full_model_against_unfused_attention(tiny_text_model, cache_kind, dtype):
    """Only the attention module differs (both on localmoe_sdpa, nothing else replaced: the interpreter stays quick):
    same attention outputs, logits and tokens; every decode step of every full-attention layer is fused, the prefill
    through attention_prefill."""
    ref = copy.deepcopy(tiny_text_model).to(DEV, dtype)
    assert sdpa.install(ref)
    model = copy.deepcopy(ref)
    others = tuple(name for name in replacements.REPLACEMENTS if name != "Qwen3_5MoeAttention")
    n_full = model.config.layer_types.count("full_attention")
    assert replacements.install(model, DEV, force=True, exclude=others) == {"Qwen3_5MoeAttention": n_full}
    fas = [m for m in model.modules() if isinstance(m, FusedAttention)]
    originals = [m for m in ref.modules() if type(m).__name__ == "Qwen3_5MoeAttention"]
    assert len(fas) == len(originals) == n_full
    outs = {"want": [], "got": []}
    hooks = [
        m.register_forward_hook(lambda mod, a, out, key=key: outs[key].append(out[0].clone()))
        for key, ms in (("want", originals), ("got", fas))
        for m in ms
    ]
    prompt = torch.randint(0, ref.config.vocab_size, (1, P), generator=torch.Generator().manual_seed(4)).to(DEV)
    want, want_toks = _run(ref, cache_kind, prompt)
    got, toks = _run(model, cache_kind, prompt)
    for hk in hooks:
        hk.remove()
    assert [m.decode_calls for m in fas] == [STEPS] * n_full
    assert [m.prefill_calls for m in fas] == [1] * n_full  # the prefill through attention_prefill
    assert len(outs["got"]) == len(outs["want"]) == (1 + STEPS) * n_full
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(outs["got"], outs["want"], **tol)
    torch.testing.assert_close(got, want, **tol)
    assert toks == want_toks


@torch.no_grad()
def test_greedy_generate_equals_transformers(tiny_text_model):
    """transformers' own generation loop (its cache, masks and positions) on the fully fused model (the attention
    called by FusedDecoderLayer, as in the engine): the same tokens."""
    ref = copy.deepcopy(tiny_text_model).to(DEV)
    model = copy.deepcopy(ref)
    replacements.install(model, DEV, force=True)
    prompt = torch.randint(0, ref.config.vocab_size, (1, P), generator=torch.Generator().manual_seed(9)).to(DEV)
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=ref.config.pad_token_id)
    want = ref.generate(prompt, **kw)
    got = model.generate(prompt, **kw)
    assert [m.decode_calls for m in model.modules() if isinstance(m, FusedAttention)] == [2]
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe"])
@torch.no_grad()
def test_other_calls_run_the_original(tiny_model, family):
    """No cache, an eager attention core, training mode: transformers' module, untouched results."""
    from transformers import DynamicCache

    model = copy.deepcopy(tiny_model).to(DEV)
    hf = model.model.layers[_full_attention_index(model)].self_attn
    fa = FusedAttention(hf)
    h, pe = _layer_inputs(model, 1, 0, seed=2)
    torch.testing.assert_close(fa(h, pe, None)[0], hf(h, pe, None)[0], rtol=0, atol=0)  # uncached
    model.set_attn_implementation("eager")
    want = hf(h, pe, None, **{_cache_kw(hf): DynamicCache(config=model.config)})
    got = fa(h, pe, None, cache=DynamicCache(config=model.config))
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    assert got[1] is not None  # eager returns its attention weights
    model.set_attn_implementation("sdpa")
    fa.train()
    fa(h, pe, None, cache=DynamicCache(config=model.config))
    assert fa.decode_calls == 0
    fa.eval()
    fa(h, pe, None, cache=DynamicCache(config=model.config))
    assert fa.decode_calls == 1


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe", "olmoe", "mixtral"])
def test_biased_or_windowed_layers_are_not_fused(tiny_model, family):
    """Biased projections (no shared weight buffer), Qwen3-MoE's and Mixtral's sliding window (Mixtral's from its
    config: then its text model's step is not taken either), OLMoE's clip_qkv: every call runs the original."""
    i = _full_attention_index(tiny_model)
    hf = tiny_model.model.layers[i].self_attn
    fa = FusedAttention(copy.deepcopy(hf))  # (a copy: the shared buffer re-points the weights)
    assert fa._w_qkv is not None and fa._gated == (family == "qwen3_5_moe") and fa._whole == (family == "olmoe")
    cfg = copy.deepcopy(tiny_model.config)
    cfg.attention_bias = True
    if family != "mixtral":  # (Mixtral's projections never have a bias)
        assert FusedAttention(type(hf)(cfg, i))._w_qkv is None
    if family != "qwen3_5_moe":
        cfg = copy.deepcopy(tiny_model.config)
        cfg.attention_bias = False
        if family in ("qwen3_moe", "mixtral"):
            cfg.sliding_window = 4
        else:
            cfg.clip_qkv = 8.0
        assert FusedAttention(type(hf)(cfg, i))._w_qkv is None
        if family == "mixtral":
            text = copy.deepcopy(tiny_model.model)
            text.config = cfg
            assert FusedTextModel(text)._types is None  # no fused step: the sliding-window mask is not its mask
