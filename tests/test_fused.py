"""Tests of localmoe/decode/replacements.py: the fused modules are exactly equivalent to transformers' on a tiny
Qwen3.5-MoE (and, where parametrised by `family`, a tiny Qwen3-MoE, OLMoE, Mixtral or GraniteMoE (with Granite 3.1's
multipliers): fixture `tiny_model`).

Full-model logits with and without `install(..., force=True)` over a prompt (prefill: fused RMSNorms, original
DeltaNet and MoE blocks) and several cached decode steps (the fused DeltaNet step and MoE block: router, experts,
shared expert), with a DynamicCache and a StaticCache (the engine's CUDA-graph cache); the same with localmoe's
LocalExperts in every block and the sparse path on (τ set as localmoe.experts.thresholds.apply does). Qwen3-MoE and
OLMoE
blocks (no shared expert; renormalised or not) one token at a time. Triton runs under TRITON_INTERPRET=1 on the CPU.
Shape legend: P prompt tokens, V vocab.
"""

import copy
import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import tiny_models  # noqa: E402

from localmoe.decode import replacements, sdpa

STEPS = 2  # cached decode steps after the prefill (2: the first reads the state the prefill left, the second
# the state a fused step wrote; interpreter time)
# CPU + interpreter by default (conftest sets TRITON_INTERPRET=1); TRITON_INTERPRET=0 on a GPU runs compiled kernels
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0" else "cpu"


def _tiny(family: str):
    """The family's tiny model (tests/tiny_models.py; Qwen3.5: its text model) with non-trivial norms and gates."""
    from transformers import AutoModelForCausalLM

    full, _ = tiny_models.build(family)
    cfg = getattr(full.config, "text_config", full.config)
    if family == "granitemoe":  # Granite 3.1's kinds of values (head dim 8 here: attention_multiplier 1/D)
        cfg.embedding_multiplier, cfg.residual_multiplier, cfg.attention_multiplier = 12.0, 0.22, 0.125
        cfg.logits_scaling = 6.0
    torch.manual_seed(7)
    return nontrivial(AutoModelForCausalLM.from_config(cfg).eval())


@pytest.fixture(scope="module")
def tiny_text_model():
    return _tiny("qwen3_5_moe")


@pytest.fixture(scope="module")
def tiny_qwen3_moe():
    return _tiny("qwen3_moe")


@pytest.fixture(scope="module")
def tiny_olmoe():
    return _tiny("olmoe")


@pytest.fixture(scope="module")
def tiny_mixtral():
    return _tiny("mixtral")


@pytest.fixture(scope="module")
def tiny_granitemoe():
    return _tiny("granitemoe")


@pytest.fixture
def tiny_model(request, family):
    """The tiny model of the test's `family` parameter (qwen3_5_moe, qwen3_moe, olmoe, mixtral, granitemoe), built
    once per module."""
    return request.getfixturevalue("tiny_text_model" if family == "qwen3_5_moe" else f"tiny_{family}")


def nontrivial(model):
    """Non-trivial norm weights and DeltaNet gates (init gives zeros / ones) of a Qwen3.5-style model, in place
    (Qwen3-MoE's and OLMoE's standard w·x̂ norms: around 1, as trained ones are)."""
    gen = torch.Generator().manual_seed(3)
    standard = model.config.model_type in ("qwen3_moe", "olmoe", "mixtral", "granitemoe")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                one = standard or ".linear_attn.norm." in name
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (1.0 if one else 0.0))
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(torch.rand(p.shape, generator=gen))
    return model


def _run(model, cache_kind, prompt, steps=STEPS):
    """Greedy prefill + `steps` cached decode steps; returns (logits [1+steps, V] fp32, tokens)."""
    from transformers import DynamicCache, StaticCache

    P = prompt.shape[1]
    if cache_kind == "static":
        cache = StaticCache(config=model.config, max_cache_len=P + steps + 1)
    else:
        cache = DynamicCache(config=model.config)
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=prompt, cache_position=torch.arange(P, device=DEV), use_cache=True, **{kw: cache})
    return _greedy_steps(model, {kw: cache}, [out.logits[0, -1].float()], P, steps)


def _greedy_steps(model, cache_kw: dict, logits: list, P: int, steps: int):
    """`steps` greedy one-token calls after a P-token prompt whose last logits end `logits`: (logits, tokens)."""
    toks = [int(logits[-1].argmax())]
    for i in range(steps):
        ids = torch.tensor([[toks[-1]]], device=DEV)
        out = model(input_ids=ids, cache_position=torch.tensor([P + i], device=DEV), use_cache=True, **cache_kw)
        logits.append(out.logits[0, -1].float())
        toks.append(int(logits[-1].argmax()))
    return torch.stack(logits), toks


# (a StaticCache, the engine's, through the fused text model: test_fused_model.test_decode_equals_transformers, with the
# same tolerance and per-module decode counts; uninstall after a static run: its test_install_uninstall_round_trip)
@pytest.mark.parametrize("cache_kind", ["dynamic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.no_grad()
def test_full_model_logits_equal(tiny_text_model, cache_kind, dtype):
    ref_model = copy.deepcopy(tiny_text_model).to(DEV, dtype)
    prompt = torch.randint(0, ref_model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(11)).to(DEV)
    want, want_toks = _run(ref_model, cache_kind, prompt)

    model = copy.deepcopy(ref_model)
    n_lin = sum(type(m) is torch.nn.Linear for m in model.modules())
    done = replacements.install(model, DEV, force=True)
    cfg = model.config
    n_linear = sum(t == "linear_attention" for t in cfg.layer_types)
    assert done == {
        "Qwen3_5MoeRMSNorm": 2 * cfg.num_hidden_layers + 1 + 2 * (cfg.num_hidden_layers - n_linear),
        "Qwen3_5MoeGatedDeltaNet": n_linear,
        "Qwen3_5MoeSparseMoeBlock": cfg.num_hidden_layers,
        "Qwen3_5MoeDecoderLayer": cfg.num_hidden_layers,
        "Linear": n_lin,
        replacements.ATTENTION: 1,
        "Qwen3_5MoeAttention": cfg.num_hidden_layers - n_linear,
        "Qwen3_5MoeTextModel": 1,
    }
    assert model.config._attn_implementation == "localmoe_sdpa"
    assert isinstance(model.lm_head, replacements.FusedLinear)
    assert set(model.state_dict()) == set(ref_model.state_dict())  # same names, same tensors
    calls0 = sdpa.decode_calls
    got, toks = _run(model, cache_kind, prompt)
    steps = [m.decode_calls for m in model.modules() if isinstance(m, replacements.FusedGatedDeltaNet)]
    assert steps == [STEPS] * n_linear  # every decode step took the fused path, prefill did not
    blocks = [m.decode_calls for m in model.modules() if isinstance(m, replacements.FusedSparseMoeBlock)]
    assert blocks == [STEPS] * cfg.num_hidden_layers
    assert sdpa.decode_calls - calls0 == STEPS * (cfg.num_hidden_layers - n_linear)  # decode attention kernel
    layers = [m.decode_calls for m in model.modules() if isinstance(m, replacements.FusedDecoderLayer)]
    assert layers == [STEPS] * cfg.num_hidden_layers  # both residual adds fused on every decode step
    # fp32: localmoe's GEMVs (FusedLinear) sum in another order than cuBLAS / torch's CPU kernels; logits are O(1)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(got, want, **tol)
    assert toks == want_toks

    assert replacements.uninstall(model) == sum(done.values())
    assert replacements.installed(model) == 0
    again, _ = _run(model, cache_kind, prompt)
    torch.testing.assert_close(again, want, rtol=0, atol=0)


def test_cpu_model_is_left_alone(tiny_text_model):
    model = copy.deepcopy(tiny_text_model)
    assert replacements.install(model) == {}
    assert replacements.installed(model) == 0


def test_same_parameter_objects(tiny_text_model):
    model = copy.deepcopy(tiny_text_model)
    before = dict(model.named_parameters())
    replacements.install(model, force=True)
    after = dict(model.named_parameters())
    assert before.keys() == after.keys()
    assert all(before[k] is after[k] for k in before)


def test_other_family_norm_module():
    """The standard-kind entry matches Qwen3-MoE's RMSNorm module (fp32, bit-close)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    norm = Qwen3MoeRMSNorm(48, eps=1e-6).to(DEV)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48))
    holder = torch.nn.Sequential(norm)
    assert replacements.install(holder, force=True) == {"Qwen3MoeRMSNorm": 1}
    x = torch.randn(3, 48).to(DEV)
    torch.testing.assert_close(holder[0](x), norm(x), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# MoE block with localmoe's LocalExperts, sparse path on
# ---------------------------------------------------------------------------------------------------------------
def moe_block(layer):
    """A decoder layer's MoE block: `mlp`, GraniteMoE's `block_sparse_moe`."""
    return getattr(layer, "mlp", None) or layer.block_sparse_moe


def _with_local_experts(model, sparsity=0.3):
    """Swap every block's transformers experts for localmoe's LocalExperts (same weights) and turn the sparse path on
    the way localmoe.experts.thresholds.apply does (τ per expert: the `sparsity` quantile of |act(x·W_gate)| on random
    x)."""
    from localmoe.experts.expert_weights import ExpertWeights
    from localmoe.experts.local_experts import LocalExperts

    cfg = model.config
    gen = torch.Generator().manual_seed(5)
    out = []
    for i, layer in enumerate(model.model.layers):
        old = moe_block(layer).experts
        E, two_i, H = old.gate_up_proj.shape
        I = two_i // 2
        new = LocalExperts(E, H, I, cfg.hidden_act, i)
        gu = old.gate_up_proj.detach()
        new.weights = ExpertWeights(
            w_gate=gu[:, :I].contiguous(),
            w_up=gu[:, I:].contiguous(),
            w_down_t=old.down_proj.detach().transpose(1, 2).contiguous(),
        )
        xs = torch.randn(64, H, generator=gen).to(gu.device, gu.dtype)
        g = new.act_fn(torch.einsum("th,eih->eti", xs, new.weights.w_gate).float()).abs().reshape(E, -1)
        new.tau = torch.quantile(g, sparsity, dim=1).float()
        new.kept = torch.zeros((), dtype=torch.int64)
        new.max_sparse_tokens = 1
        new.sparse_enabled = True
        moe_block(layer).experts = new
        out.append(new)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.no_grad()
def test_full_model_local_experts_sparse(tiny_text_model, dtype):
    ref_model = copy.deepcopy(tiny_text_model).to(DEV, dtype)
    ref_experts = _with_local_experts(ref_model)
    prompt = torch.randint(0, ref_model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(12)).to(DEV)
    want, want_toks = _run(ref_model, "static", prompt)
    ref_kept = [int(m.kept) for m in ref_experts]

    model = copy.deepcopy(ref_model)
    experts = [layer.mlp.experts for layer in model.model.layers]
    for m in experts:
        m.reset_counters()
    done = replacements.install(model, DEV, force=True)
    assert done["Qwen3_5MoeSparseMoeBlock"] == model.config.num_hidden_layers
    assert [layer.mlp.experts for layer in model.model.layers] == experts  # the very same LocalExperts objects
    assert all(isinstance(layer.mlp, replacements.FusedSparseMoeBlock) for layer in model.model.layers)
    got, toks = _run(model, "static", prompt)
    assert [m.decode_calls for m in model.modules() if isinstance(m, replacements.FusedSparseMoeBlock)] == [
        STEPS
    ] * model.config.num_hidden_layers
    kept, seen = [int(m.kept) for m in experts], [m.seen for m in experts]
    assert all(0 < k < s for k, s in zip(kept, seen))  # the sparse path ran on every decode step, and dropped neurons
    if dtype == torch.float32:  # the GEMVs' accumulation order differs from torch's in the last bits; logits O(1)
        assert kept == ref_kept
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert toks == want_toks
    else:  # on CUDA the decoder tail keeps the shared expert in fp32: a few borderline neurons flip
        assert all(abs(k - r) <= max(2, 0.03 * r) for k, r in zip(kept, ref_kept)), (kept, ref_kept)
        _bf16_close(got, want, toks, want_toks)
    replacements.uninstall(model)
    assert [layer.mlp.experts for layer in model.model.layers] == experts


@pytest.mark.parametrize(
    "family,sparsity,dtype,in_front",
    [
        ("qwen3_5_moe", 0.3, torch.float32, True),
        ("qwen3_5_moe", 0.0, torch.float32, True),
        # (bf16 at threshold 0, and bf16 with the shared expert in the tail, run the kernels of the cases kept:
        # dropped for suite time, 51 s)
        ("qwen3_5_moe", 0.3, torch.bfloat16, True),
        ("qwen3_5_moe", 0.3, torch.float32, False),
        ("qwen3_moe", 0.0, torch.float32, True),
        ("qwen3_moe", 0.5, torch.float32, True),
        ("olmoe", 0.0, torch.float32, True),
        ("mixtral", 0.0, torch.float32, True),
        ("mixtral", 0.5, torch.float32, True),
        ("granitemoe", 0.0, torch.float32, True),
        ("granitemoe", 0.5, torch.float32, True),
    ],
    ids=[
        "sparse-fp32",
        "dense-fp32",
        "sparse-bf16",
        "sparse-fp32-shared-in-tail",
        "qwen3_moe-dense-fp32",
        "qwen3_moe-sparse-fp32",
        "olmoe-dense-fp32",
        "mixtral-dense-fp32",
        "mixtral-sparse-fp32",
        "granitemoe-dense-fp32",
        "granitemoe-sparse-fp32",
    ],
)
@torch.no_grad()
def test_full_model_front_and_tail(tiny_model, family, dtype, sparsity, in_front):
    """The decoder layers run two launches from the mixer's output on: moe_front (residual add, norm, router; Qwen3.5:
    the shared gate, and the shared expert into the experts' workspace) and sparse_fused with the residual in its tail
    (sparsity 0: threshold 0, against transformers' own model and experts); `shared_in_front=False`: the shared expert
    in sparse_fused's launch instead. Sparse: against the same LocalExperts run eagerly (the unfused layers)."""
    sparse = sparsity > 0
    steps = STEPS
    ref_model = copy.deepcopy(tiny_model).to(DEV, dtype)
    prompt = torch.randint(0, ref_model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(12)).to(DEV)
    if not sparse:  # transformers' model as it is, experts included
        want, want_toks = _run(ref_model, "static", prompt, steps)
    for m in _with_local_experts(ref_model, sparsity if sparse else 0.3):
        m.sparse_enabled = sparse
    if sparse:
        want, want_toks = _run(ref_model, "static", prompt, steps)
    model = copy.deepcopy(ref_model)
    experts = [moe_block(layer).experts for layer in model.model.layers]
    for m in experts:
        m.reset_counters()
        m.kernel_on_cpu = DEV == "cpu"  # the Triton path under the interpreter, as on a GPU
        assert m.dense_tail  # sparsity off: threshold 0 in the same kernel (the default; not dense_experts)
    replacements.install(model, DEV, force=True)
    blocks = [m for m in model.modules() if isinstance(m, replacements.FusedSparseMoeBlock)]
    for b in blocks:
        b.shared_in_front = in_front
    got, toks = _run(model, "static", prompt, steps)
    assert [b.front_calls for b in blocks] == [steps] * model.config.num_hidden_layers
    assert model.model.decode_calls == steps  # the fused text model (FusedTextModel) took every decode step
    assert all(m.decode_calls == steps for m in model.modules() if isinstance(m, replacements.FusedAttention))
    if sparse:
        assert all(0 < int(m.kept) < m.seen for m in experts)
    else:
        assert all(int(m.kept) == 0 and m.seen == 0 for m in experts)  # the dense path is not counted as sparse
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert toks == want_toks
    else:
        _bf16_close(got, want, toks, want_toks)


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
@torch.no_grad()
def test_full_model_front_and_tail_int4(tiny_text_model, sparse):
    """int4 experts (`--experts int4`) in the fused decoder layer: sparse_fused's 4-bit mode (the Triton kernel, on
    the CPU under the interpreter) gives the logits of the torch path on the same dequantized weights."""
    ref_model = copy.deepcopy(tiny_text_model).to(DEV, torch.float32)
    for m in _with_local_experts(ref_model):
        m.weights = m.weights.to_int4()
        m.sparse_enabled = sparse
    prompt = torch.randint(0, ref_model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(13)).to(DEV)
    want, want_toks = _run(ref_model, "static", prompt)
    model = copy.deepcopy(ref_model)
    experts = [layer.mlp.experts for layer in model.model.layers]
    for m in experts:
        m.reset_counters()
        m.kernel_on_cpu = DEV == "cpu"
    replacements.install(model, DEV, force=True)
    got, toks = _run(model, "static", prompt)
    assert all(b.front_calls == STEPS for b in model.modules() if isinstance(b, replacements.FusedSparseMoeBlock))
    assert all((0 < int(m.kept) < m.seen) if sparse else m.seen == 0 for m in experts)
    # On a GPU the kernel sums each output over its programs with atomics, in no fixed order: 2e-4 seen on the H200
    tol = 1e-4 if DEV == "cpu" else 1e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert toks == want_toks


def _bf16_close(got, want, toks, want_toks):
    """bf16 decode against transformers: the kernels keep g·u and the shared expert in fp32 where transformers
    rounds to bf16 four times, and the random tiny model amplifies that step after step. The prefill and first
    decode step's logits agree within 3%; greedy tokens agree, or first differ where the reference's top two logits
    were within a bf16 rounding step of each other."""
    for i in range(2):
        assert float((got[i] - want[i]).norm() / want[i].norm()) < 3e-2, f"step {i}"
    same = next((i for i, (a, b) in enumerate(zip(toks, want_toks)) if a != b), None)
    if same is not None:
        top2 = want[same].topk(2).values
        assert float(top2[0] - top2[1]) < 0.1, f"token {same} differs without a near tie"


@pytest.mark.parametrize(
    "family,norm", [("qwen3_moe", True), ("olmoe", False), ("mixtral", True), ("granitemoe", True)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.no_grad()
def test_block_without_shared_expert(family, norm, dtype):
    """Qwen3-MoE / OLMoE / Mixtral / GraniteMoE blocks: the fused one-token call equals the original block; more
    tokens delegate. (Mixtral's and GraniteMoE's routers always renormalise: `norm` True; GraniteMoE's router is
    `router`, its block the layer's `block_sparse_moe`.)"""
    model, _ = tiny_models.build(family)
    cfg = model.config
    cfg.norm_topk_prob = norm
    block_cls = type(moe_block(model.model.layers[0]))
    torch.manual_seed(3)
    block = block_cls(cfg).to(DEV, dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    holder = torch.nn.Sequential(block)
    assert replacements.install(holder, force=True) == {block_cls.__name__: 1}
    fb = holder[0]
    assert isinstance(fb, replacements.FusedSparseMoeBlock) and fb.experts is block.experts and not fb.has_shared
    assert fb.norm_topk_prob == norm
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for seed in range(4):
        x = torch.randn(1, 1, cfg.hidden_size, generator=torch.Generator().manual_seed(seed)).to(DEV, dtype)
        torch.testing.assert_close(fb(x), block(x), **tol)
    assert fb.decode_calls == 4
    x = torch.randn(1, 5, cfg.hidden_size).to(DEV, dtype)
    torch.testing.assert_close(fb(x), block(x), **tol)  # prefill: `prefill` (router GEMM + top-k launch)
    assert fb.decode_calls == 4


@torch.no_grad()
def test_install_exclude(tiny_text_model):
    """With the MoE block left out, decode still runs the layer's fused children (the decoder layer does
    transformers' arithmetic around them), and the logits equal the unfused model's."""
    model = copy.deepcopy(tiny_text_model).to(DEV)
    done = replacements.install(model, DEV, force=True, exclude=("Qwen3_5MoeSparseMoeBlock",))
    assert "Qwen3_5MoeSparseMoeBlock" not in done and done["Qwen3_5MoeGatedDeltaNet"] > 0
    assert not any(isinstance(m, replacements.FusedSparseMoeBlock) for m in model.modules())
    prompt = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(4)).to(DEV)
    want, want_toks = _run(copy.deepcopy(tiny_text_model).to(DEV), "static", prompt, steps=2)
    got, toks = _run(model, "static", prompt, steps=2)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert toks == want_toks
    layers = [m for m in model.modules() if isinstance(m, replacements.FusedDecoderLayer)]
    assert layers and all(m.decode_calls == 2 for m in layers)
    assert all(m.decode_calls == 2 for m in model.modules() if isinstance(m, replacements.FusedGatedDeltaNet))
