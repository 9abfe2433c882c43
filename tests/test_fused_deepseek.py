"""DeepSeek-V2's fused decode: localmoe/decode/mla.py's attention decoded absorbed over the compressed cache
(kernels/mla_decode.py under the interpreter on the CPU) and its MoE block as FusedSparseMoeBlock (fp32 router,
group-limited top-k, routed_scaling_factor, shared experts without a gate). Greedy prefill + cached decode steps
equal transformers' unfused model (static and dynamic caches, with and without q_lora_rank; fp32); the fused steps
are taken on every decode step, the original modules on the prefill."""

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import test_fused  # noqa: E402
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM  # noqa: E402

from localmoe.decode import replacements  # noqa: E402
from localmoe.decode.mla import FusedMLA  # noqa: E402

DEV = test_fused.DEV


def _tiny(q_lora_rank=None, **kw):
    kw = {"n_group": 1, "topk_group": 1, "n_shared_experts": 1, **kw}
    cfg = DeepseekV2Config(
        vocab_size=96, hidden_size=64, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=q_lora_rank, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, max_position_embeddings=64, **kw,
    )  # fmt: skip
    torch.manual_seed(0)
    return test_fused.nontrivial(DeepseekV2ForCausalLM(cfg)).eval()


@pytest.mark.parametrize(
    "q_lora_rank, cache_kind, dtype",
    [(None, "static", torch.float32), (24, "dynamic", torch.float32)],  # the second: group-limited, scaled
    ids=["lite-static", "q_lora-dynamic"],  # (bf16: the kernel's test; the model in bf16 on the GPU check)
)
@torch.no_grad()
def test_absorbed_decode_equals_transformers(q_lora_rank, cache_kind, dtype):
    group = dict(topk_method="group_limited_greedy", n_group=2, topk_group=1, routed_scaling_factor=1.5)
    ref = _tiny(q_lora_rank, **(group if q_lora_rank else {})).to(DEV, dtype)
    prompt = torch.randint(3, 90, (1, 6), generator=torch.Generator().manual_seed(5)).to(DEV)
    want, want_toks = test_fused._run(ref, cache_kind, prompt, steps=2)  # (the second step reads the first's write)
    model = copy.deepcopy(ref)
    done = replacements.install(model, DEV, force=True)
    assert done["DeepseekV2Attention"] == 2 and done["DeepseekV2Moe"] == 1  # (layer 0: a dense MLP)
    assert done["DeepseekV2DecoderLayer"] == 2 and done["DeepseekV2Model"] == 1
    got, got_toks = test_fused._run(model, cache_kind, prompt, steps=2)
    # the fused text model (freqs_cis from its table) took the static cache's steps; a dynamic cache: the original
    assert model.model.decode_calls == (2 if cache_kind == "static" else 0)
    mla = [m for m in model.modules() if isinstance(m, FusedMLA)]
    assert [m.decode_calls for m in mla] == [2, 2]  # every decode step, not the prefill
    assert [m.static_writes for m in mla] == ([2, 2] if cache_kind == "static" else [0, 0])  # mla_rope_write
    blocks = [m for m in model.modules() if isinstance(m, replacements.FusedSparseMoeBlock)]
    assert [b.decode_calls for b in blocks] == [2]  # the fp32 router, the shared experts without a gate
    layers = [m for m in model.modules() if isinstance(m, replacements.FusedDecoderLayer)]
    assert [m.decode_calls for m in layers] == [2, 2]  # (layer 0: transformers' arithmetic around its dense MLP)
    assert got_toks == want_toks
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    assert replacements.uninstall(model) > 0
    assert not any(isinstance(m, FusedMLA) for m in model.modules())


def _local_experts(model, sparsity: float) -> list:
    """The MoE layers' transformers experts swapped for LocalExperts (same weights), τ at the `sparsity` quantile of
    |act| on random inputs, the sparse path on when sparsity > 0 (threshold 0 otherwise: the dense tail)."""
    from localmoe.experts.expert_weights import ExpertWeights
    from localmoe.experts.local_experts import LocalExperts

    out, gen = [], torch.Generator().manual_seed(5)
    for i, layer in enumerate(model.model.layers):
        old = getattr(layer.mlp, "experts", None)
        if old is None:  # layer 0: a dense MLP
            continue
        E, two_i, H = old.gate_up_proj.shape
        I = two_i // 2
        new = LocalExperts(E, H, I, model.config.hidden_act, i)
        gu = old.gate_up_proj.detach()
        new.weights = ExpertWeights(
            gu[:, :I].contiguous(), gu[:, I:].contiguous(), old.down_proj.detach().mT.contiguous()
        )
        xs = torch.randn(64, H, generator=gen).to(gu.device, gu.dtype)
        g = new.act_fn(torch.einsum("th,eih->eti", xs, new.weights.w_gate).float()).abs().reshape(E, -1)
        new.tau = torch.quantile(g, max(sparsity, 0.3), dim=1).float()
        new.kept = torch.zeros((), dtype=torch.int64)
        new.max_sparse_tokens, new.sparse_enabled = 1, sparsity > 0
        layer.mlp.experts = new
        out.append(new)
    return out


@pytest.mark.parametrize("sparsity", [0.0, 0.5], ids=["dense", "sparse"])
@pytest.mark.parametrize("q_lora_rank", [None, 24], ids=["lite-2-shared", "q_lora-grouped-scaled"])
@torch.no_grad()
def test_front_and_tail_equal_transformers(q_lora_rank, sparsity):
    """The MoE layer from the attention output on in two launches, as Qwen's: moe_front (residual add, norm, the fp32
    router's group-limited top-k) and sparse_fused with the ungated shared experts in its shared programs (weight 1),
    routed_scaling_factor folded into the routing weights and the residual add in its tail: at sparsity 0, against
    transformers' model. Sparse (the five-launch layer: router_topk, sparse_fused, the shared experts' two launches),
    against the same LocalExperts run eagerly (the unfused layers)."""
    group = dict(topk_method="group_limited_greedy", n_group=2, topk_group=1, routed_scaling_factor=1.5)
    two_shared = dict(n_shared_experts=2)  # the shared experts wider than a routed one (V2-Lite: 2 x 1408)
    ref = _tiny(q_lora_rank, **(group if q_lora_rank else two_shared)).to(DEV, torch.float32)
    prompt = torch.randint(3, 90, (1, 6), generator=torch.Generator().manual_seed(7)).to(DEV)
    if sparsity == 0:
        want, want_toks = test_fused._run(ref, "static", prompt, steps=2)
    _local_experts(ref, sparsity)
    if sparsity > 0:
        want, want_toks = test_fused._run(ref, "static", prompt, steps=2)
    model = copy.deepcopy(ref)
    experts = [m for m in model.modules() if type(m).__name__ == "LocalExperts"]
    for m in experts:
        m.kernel_on_cpu = DEV == "cpu"  # the Triton path under the interpreter, as on a GPU
    replacements.install(model, DEV, force=True)
    got, toks = test_fused._run(model, "static", prompt, steps=2)
    blocks = [m for m in model.modules() if isinstance(m, replacements.FusedSparseMoeBlock)]
    # sparse: the shared experts' own launches after sparse_fused, off the front (FusedSparseMoeBlock.takes_front)
    assert [b.front_calls for b in blocks] == [2 if sparsity == 0 else 0]
    assert [b.decode_calls for b in blocks] == [2]
    assert model.model.decode_calls == 2  # the fused text model
    assert toks == want_toks
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


@torch.no_grad()
def test_front_only_with_dense_unquantized_experts():
    """The ungated shared experts join sparse_fused's shared programs only on the dense path over plain weights:
    sparse, or with 4-bit experts (sparse_fused runs no shared programs beside them), the layer keeps its five
    launches (`takes_front` is False)."""
    model = _tiny().to(DEV, torch.float32)
    (experts,) = _local_experts(model, 0.0)
    experts.kernel_on_cpu = True
    replacements.install(model, DEV, force=True)
    (block,) = [m for m in model.modules() if isinstance(m, replacements.FusedSparseMoeBlock)]
    h = torch.randn(1, 1, 64, device=DEV)
    assert block.takes_front(h)
    experts.sparse_enabled = True
    assert not block.takes_front(h)
    experts.sparse_enabled = False
    experts.weights = experts.weights.to_int4()
    assert experts.weights.quantized and not block.takes_front(h)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="counts Triton launches of the interpreter")
@torch.no_grad()
def test_text_model_glue_launches(monkeypatch):
    """Around the decoder layers DeepSeek-V2's decode step is the fused text model's 4 launches (embedding, the
    freqs_cis row gathered from its table, the mask, the final norm); transformers' text model: its rotary module's
    complex arithmetic, the position ids and the causal mask."""
    import test_fused_model

    ref = _tiny().to(DEV)
    before = test_fused_model._count_step(
        test_fused_model._installed(ref, exclude=("DeepseekV2Model",))[0], monkeypatch
    )
    model = test_fused_model._installed(ref)[0]
    after = test_fused_model._count_step(model, monkeypatch, warm=True)  # (the first step builds the table)
    print(
        f"\nDeepSeek-V2 launches a decode step outside the layers: {len(before.ops)} -> {len(after.ops)}: {before.ops}"
    )
    assert model.model.decode_calls == 2
    assert after.ops == ["embedding.default", "index_select.default", "le.Tensor", "triton:_rmsnorm_kernel"]
    assert len(before.ops) > len(after.ops) and after.syncs == 0
