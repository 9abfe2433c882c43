"""Tests of GPT-OSS's fused decode step (localmoe/decode/gpt_oss.py, sliding.py, attention.py's GPT-OSS path and the
GPT-OSS pieces of kernels/qk_norm_rope.py and router_topk.py) on a tiny random GptOss model built from transformers'
GptOssConfig (CPU, TRITON_INTERPRET=1): greedy decode on a StaticCache equals transformers' own modules for a prompt
longer than the sliding window (both layer types; the ring's roll exercised, the prompt not a multiple of the
window) and for one crossing it while decoding; the ring layout against transformers' StaticSlidingWindowLayer; the
kernels' GPT-OSS options against transformers' functions; the launches of a decode step.

Shape legend: P prompt tokens, W sliding window, Hq / Hkv query / key-value heads, D head dim, E experts.
"""

import copy
import inspect
import os
from functools import partial

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import test_fused_model  # noqa: E402
from transformers import GptOssConfig, GptOssForCausalLM, StaticCache  # noqa: E402
from transformers.models.gpt_oss import modeling_gpt_oss as hf_gpt_oss  # noqa: E402

from localmoe.decode import replacements  # noqa: E402
from localmoe.decode.gpt_oss import FusedGptOssModel, FusedGptOssRMSNorm  # noqa: E402
from localmoe.decode.sliding import RING, to_ring, to_transformers  # noqa: E402
from localmoe.kernels.qk_norm_rope import qk_norm_rope  # noqa: E402
from localmoe.kernels.router_topk import router_topk  # noqa: E402

DEV = test_fused_model.DEV
W = 4  # the sliding window


@pytest.fixture(scope="module")
def tiny_gpt_oss():
    """2 layers (sliding, full), 2 q heads / 1 kv head of 16 (the GEMVs' programs take the interpreter's time),
    4 experts top-2, YaRN; random weights of bf16 precision (norms around 1, biases and sinks non-zero)."""
    config = GptOssConfig(
        hidden_size=64,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=2,
        vocab_size=32,
        sliding_window=W,
        max_position_embeddings=512,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 16,
            "rope_theta": 150000.0,
        },
    )
    torch.manual_seed(0)
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.2) if "norm" in name else p.normal_(0.0, 0.5 if "bias" in name or "sinks" in name else 0.2)
            p.copy_(p.to(torch.bfloat16).float())
    assert config.layer_types == ["sliding_attention", "full_attention"]
    return model.to(DEV)


def _run(model, P, steps, seed=1):
    """Greedy prefill of P random tokens + `steps` decode steps on a StaticCache -> (logits [1+steps, V], tokens)."""
    prompt = torch.randint(0, model.config.vocab_size, (1, P), generator=torch.Generator().manual_seed(seed))
    cache = StaticCache(config=model.config, max_cache_len=P + steps + 1)
    kw = {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}  # 5.17
    out = model(input_ids=prompt.to(DEV), use_cache=True, **kw)
    logits = [out.logits[0, -1].float()]
    for _ in range(steps):
        ids = logits[-1].argmax().view(1, 1)
        logits.append(model(input_ids=ids, use_cache=True, **kw).logits[0, -1].float())
    return torch.stack(logits), [int(x.argmax()) for x in logits], cache


@pytest.mark.parametrize(
    "P,steps,dtype", [(13, 3, torch.float32), (3, 2, torch.bfloat16)], ids=["fp32-P13", "bf16-P3-crossing"]
)
@torch.no_grad()
def test_greedy_decode_equals_transformers(tiny_gpt_oss, P, steps, dtype):
    """Every decode step fused (text model, both layers' attention: the sliding one on its ring); tokens equal
    transformers' eager modules; fp32 logits within 1e-4; bf16 logits (this random model amplifies bf16 rounding:
    transformers' own bf16 logits are up to ~4 off its fp32 ones) no further from the fp32 model's than
    transformers' bf16 logits are, within a quarter more."""
    ref = copy.deepcopy(tiny_gpt_oss).to(dtype)
    want, want_toks, _ = _run(ref, P, steps)
    model = copy.deepcopy(ref)
    done = replacements.install(model, DEV, force=True)
    assert {k: done.get(k) for k in ("GptOssModel", "GptOssAttention", "GptOssMLP", "GptOssRMSNorm")} == {
        "GptOssModel": 1,
        "GptOssAttention": 2,
        "GptOssMLP": 2,
        "GptOssRMSNorm": 5,
    }
    assert isinstance(model.model, FusedGptOssModel) and isinstance(model.model.norm, FusedGptOssRMSNorm)
    got, toks, cache = _run(model, P, steps)
    assert model.model.decode_calls == steps
    assert [layer.self_attn.decode_calls for layer in model.model.layers] == [steps, steps]
    assert getattr(cache.layers[0], RING) and int(cache.layers[0].cumulative_length) == P + steps
    assert toks == want_toks
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    else:
        exact = _run(tiny_gpt_oss, P, steps)[0]
        assert (got - exact).abs().max() <= 1.25 * (want - exact).abs().max() + 0.05
    assert replacements.uninstall(model) and isinstance(model.model, hf_gpt_oss.GptOssModel)


@torch.no_grad()
def test_ring_layout_round_trip(tiny_gpt_oss):
    """After transformers' update of P = 7 > W positions its sliding layer holds positions 3..6 in rows 0..3; as a
    ring, position p sits in row p % W and the position tensor is P; back again, transformers' layout."""
    cache = StaticCache(config=tiny_gpt_oss.config, max_cache_len=10)
    keys = torch.arange(7.0, device=DEV).view(1, 1, 7, 1).expand(1, 1, 7, 16).contiguous()
    cache.update(keys, keys + 100, 0)
    layer = cache.layers[0]
    rows = lambda t: t[0, 0, :, 0].tolist()  # noqa: E731
    assert rows(layer.keys) == [3, 4, 5, 6] and int(layer.cumulative_length) != 7  # (transformers leaves it stale)
    assert to_ring(cache) == 1 and to_ring(cache) == 0
    assert rows(layer.keys) == [4, 5, 6, 3] and rows(layer.values) == [104, 105, 106, 103]
    assert int(layer.cumulative_length) == 7 and getattr(layer, RING)
    assert to_transformers(cache) == 1 and rows(layer.keys) == [3, 4, 5, 6] and not getattr(layer, RING)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.no_grad()
def test_kernel_options_equal_transformers(dtype):
    """qk_norm_rope with GPT-OSS's biases, half-width angles and a ring write equals F.linear's bias + transformers'
    apply_rotary_pos_emb bit for bit; router_topk with a bias equals GptOssTopKRouter; the fused norm GptOssRMSNorm
    (fp32 weight, as transformers keeps it)."""
    gen = torch.Generator().manual_seed(5)
    Hq, Hkv, D = 6, 2, 16
    qkv = torch.randn((Hq + 2 * Hkv) * D, generator=gen).to(DEV, dtype)
    bias = torch.randn(qkv.numel(), generator=gen).to(DEV, dtype)
    angle = torch.rand(D // 2, generator=gen) * 3
    cos, sin = (f(angle).mul(1.1).to(DEV, dtype) for f in (torch.cos, torch.sin))
    kc, vc = torch.zeros(2, Hkv, W, D, dtype=dtype, device=DEV)
    pos = torch.tensor(9, device=DEV)
    q, k, v, _ = qk_norm_rope(
        qkv, None, None, cos, sin, 0.0, num_q_heads=Hq, num_kv_heads=Hkv, kind="none", gated=False, head_dim=D,
        bias=bias, half_angles=True, kv_cache=(kc, vc, pos), ring=True,
    )  # fmt: skip
    x = qkv + bias
    want_q, want_k = hf_gpt_oss.apply_rotary_pos_emb(
        x[: Hq * D].view(1, Hq, 1, D), x[Hq * D : (Hq + Hkv) * D].view(1, Hkv, 1, D), cos[None, None], sin[None, None]
    )
    # bit for bit in bf16 and on the CPU; compiled fp32 may contract x*cos - y*sin into one FMA (1 ulp)
    exact = dtype == torch.bfloat16 or torch.device(DEV).type == "cpu"
    same = torch.equal if exact else partial(torch.allclose, rtol=2e-7, atol=1e-6)
    assert same(q, want_q[0, :, 0]) and same(k, want_k[0, :, 0])
    assert torch.equal(v, x[(Hq + Hkv) * D :].view(Hkv, D))
    assert int(pos) == 10 and torch.equal(kc[:, 9 % W], k) and torch.equal(vc[:, 9 % W], v)
    assert not kc[:, [0, 2, 3]].any()

    config = GptOssConfig(hidden_size=40, num_local_experts=6, num_experts_per_tok=2)
    router = hf_gpt_oss.GptOssTopKRouter(config).to(DEV)
    for p in router.parameters():
        p.data = torch.randn(p.shape, generator=gen).to(DEV, dtype)
    h = torch.randn(1, 40, generator=gen).to(DEV, dtype)
    want_logits, want_w, want_i = router(h)
    logits, w, i = router_topk(h, router.weight, 2, True, bias=router.bias)
    assert torch.equal(i, want_i)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-5)

    norm = hf_gpt_oss.GptOssRMSNorm(40, eps=1e-5).to(DEV)
    norm.weight.data = torch.randn(40, generator=gen).to(DEV, torch.bfloat16).float()
    fused = FusedGptOssRMSNorm(norm)
    assert fused.weight.dtype == torch.float32 and fused._parameters["weight"] is norm.weight
    assert torch.equal(fused(h), norm(h))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="counts Triton launches of the interpreter")
@torch.no_grad()
def test_decode_step_launches(tiny_gpt_oss, monkeypatch):
    """The launches of one fused decode step, counted on the CPU (aten ops that compute, Triton launches): a sliding
    layer's attention is the q|k|v GEMV with the input norm, qk_norm_rope (biases, RoPE, the ring write), the core
    with sinks, o_proj (its bias: F.linear), then the residual add + post-attention norm, the router with its bias,
    the experts (here transformers' dense GptOssExperts), the residual add; around the layers 5 launches. No host
    sync."""
    ref = copy.deepcopy(tiny_gpt_oss)
    model = copy.deepcopy(ref)
    replacements.install(model, DEV, force=True)
    layer = test_fused_model._count_step(model, monkeypatch, warm=True, layer=0)
    before = test_fused_model._count_step(ref, monkeypatch, layer=0)
    glue = test_fused_model._count_step(model, monkeypatch, warm=True)
    print(f"\nGPT-OSS sliding layer: {len(before.ops)} -> {len(layer.ops)}: {layer.ops}\nglue: {glue.ops}")
    assert layer.syncs == 0 and glue.syncs == 0
    head = ["triton:_gemv_kernel", "triton:_qk_norm_rope_kernel", "triton:_split_kernel", "addmm.default"]
    assert layer.ops[:6] == [*head, "triton:_rmsnorm_kernel", "triton:_router_topk_kernel"]
    assert layer.ops[-1] == "add.Tensor"
    assert glue.ops == ["embedding.default", "index_select.default", "le.Tensor", "le.Tensor", "triton:_rmsnorm_kernel"]


@pytest.mark.skipif(DEV != "cuda", reason="CUDA graphs: GPU with compiled kernels only (bench/gpu_release_check.sh)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.no_grad()
def test_cuda_graph_decode_equals_transformers(tiny_gpt_oss, dtype):
    """The fused step captured once in a CUDA graph (warm-ups and capture on one prompt, as decode/graph.py does),
    the cache reset and prefilled again, then 24 replays past the window (the rings wrap 6 times): the greedy tokens
    equal transformers' eager modules (fp32; bf16 its eager fused path's), the logits within the eager test's
    tolerances."""
    P, steps = 13, 24
    ref = copy.deepcopy(tiny_gpt_oss).to(dtype)
    if dtype == torch.float32:  # torch's CUDA grouped GEMM is bf16 only: transformers' fp32 path copies from the host
        ref.set_experts_implementation("batched_mm")  # inside the capture (torch 2.11); batched_mm syncs nothing
    want, want_toks, _ = _run(ref, P, steps)
    model = copy.deepcopy(ref)
    replacements.install(model, DEV)
    eager, eager_toks, _ = _run(model, P, steps)
    prompt = torch.randint(0, model.config.vocab_size, (1, P), generator=torch.Generator().manual_seed(1)).to(DEV)
    cache = StaticCache(config=model.config, max_cache_len=P + steps + 1)
    kw = {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}  # 5.17
    ids = torch.zeros((1, 1), dtype=torch.long, device=DEV)
    model(input_ids=prompt, use_cache=True, **kw)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            model(input_ids=ids, use_cache=True, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        logits = model(input_ids=ids, use_cache=True, **kw).logits[0, -1]
    cache.reset()
    got = [model(input_ids=prompt, use_cache=True, **kw).logits[0, -1].float()]
    for _ in range(steps):
        ids.copy_(got[-1].argmax().view(1, 1))
        graph.replay()
        got.append(logits.float().clone())
    got = torch.stack(got)
    toks = [int(x.argmax()) for x in got]
    assert toks == eager_toks
    torch.testing.assert_close(got, eager, rtol=1e-3, atol=1e-3)
    if dtype == torch.float32:
        assert toks == want_toks
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
