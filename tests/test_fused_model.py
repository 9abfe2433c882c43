"""Tests of localmoe/decode/text_model.py: Qwen3.5-MoE's text model (and Qwen3-MoE's, where parametrised by
`family`) with transformers' glue around the decoder layers cut to 4 launches on the one-token StaticCache step, on a
tiny random model (CPU, TRITON_INTERPRET=1); and the launches inside a fused Qwen3-MoE, Mixtral or GraniteMoE
decoder layer (and around GraniteMoE's: its embedding_multiplier).

The fused step hands the layers what transformers hands them, so greedy decode with it installed equals the same
install without it bit for bit, and transformers' unfused model within the whole-model tolerance of test_fused;
its cos/sin table rows are transformers' rotary values; install / uninstall keep the state_dict; prefill, a
DynamicCache and other unusual calls run the original module; the launches around the layers drop (counted with a
TorchDispatchMode: aten ops that launch a kernel, plus Triton launches).
Shape legend: P prompt tokens, H hidden, V vocab, L static cache length.
"""

import copy
import inspect
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import test_fused  # noqa: E402

from localmoe.decode import replacements, sdpa  # noqa: E402
from localmoe.decode.text_model import FusedTextModel  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0" else "cpu"
_run = test_fused._run  # greedy prefill + decode steps -> (logits [1+steps, V], tokens)
# the fixtures, shared with test_fused
tiny_text_model, tiny_qwen3_moe, tiny_mixtral, tiny_granitemoe, tiny_model = (
    test_fused.tiny_text_model,
    test_fused.tiny_qwen3_moe,
    test_fused.tiny_mixtral,
    test_fused.tiny_granitemoe,
    test_fused.tiny_model,
)
TEXT = "Qwen3_5MoeTextModel"


def _prompt(model, P=5, seed=11):
    return torch.randint(0, model.config.vocab_size, (1, P), generator=torch.Generator().manual_seed(seed)).to(DEV)


def _installed(ref, exclude=()):
    model = copy.deepcopy(ref)
    done = replacements.install(model, DEV, force=True, exclude=exclude)
    return model, done


def _cache_kw(model) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _static_prefill(model, prompt, extra=2):
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=prompt.shape[1] + extra)
    model(input_ids=prompt, use_cache=True, **{_cache_kw(model): cache})
    return cache


@pytest.mark.parametrize(
    "family,dtype",
    [("qwen3_5_moe", torch.float32), ("qwen3_5_moe", torch.bfloat16), ("qwen3_moe", torch.float32)],
    ids=["fp32", "bf16", "qwen3_moe-fp32"],
)
@torch.no_grad()
def test_decode_equals_transformers(tiny_model, family, dtype):
    """Greedy prefill + a few decode steps on a StaticCache: the fused text model takes every decode step (not the
    prefill), and through it the fused DeltaNet, attention kernel, MoE block and decoder layers; logits equal the same
    install without it exactly, transformers' unfused model as in test_fused (whose logits test runs a DynamicCache)."""
    steps = 2  # the first reads the prefill's state, the second a fused step's (interpreter time)
    ref = copy.deepcopy(tiny_model).to(DEV, dtype)
    text = type(ref.model).__name__
    prompt = _prompt(ref)
    want, want_toks = _run(ref, "static", prompt, steps)
    base, done0 = _installed(ref, exclude=(text,))
    same, same_toks = _run(base, "static", prompt, steps)
    model, done = _installed(ref)
    assert done == {**done0, text: 1} and isinstance(model.model, FusedTextModel)
    calls0 = sdpa.decode_calls
    got, toks = _run(model, "static", prompt, steps)
    assert model.model.decode_calls == steps
    cfg = model.config
    layers = [m.decode_calls for m in model.modules() if isinstance(m, replacements.FusedDecoderLayer)]
    assert layers == [steps] * cfg.num_hidden_layers  # both residual adds fused on every decode step
    blocks = [m.decode_calls for m in model.modules() if isinstance(m, replacements.FusedSparseMoeBlock)]
    assert blocks == [steps] * cfg.num_hidden_layers
    if family == "qwen3_5_moe":
        n_linear = sum(t == "linear_attention" for t in cfg.layer_types)
        deltanets = [m.decode_calls for m in model.modules() if isinstance(m, replacements.FusedGatedDeltaNet)]
        assert deltanets == [steps] * n_linear  # every decode step took the fused path, prefill did not
        assert sdpa.decode_calls - calls0 == steps * (cfg.num_hidden_layers - n_linear)  # decode attention kernel
    torch.testing.assert_close(got, same, rtol=0, atol=0)  # the layers got exactly transformers' inputs
    assert toks == same_toks
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(got, want, **tol)
    assert toks == want_toks


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe"])
@torch.no_grad()
def test_angle_table_is_transformers_rotary(tiny_model, family):
    """Row p of the table is the original rotary module's (cos, sin) for position p alone (Qwen3.5: its 3 mrope axes),
    bit for bit (fp32 and bf16); the mask is transformers' causal mask for the cache; the output has transformers'
    class and cache."""
    from transformers.masking_utils import create_causal_mask

    ref = copy.deepcopy(tiny_model).to(DEV)
    model, _ = _installed(ref)
    tm = model.model
    prompt = _prompt(model)
    cache = _static_prefill(model, prompt, extra=3)
    h = tm.embed_tokens(prompt[:, :1])
    kw = _cache_kw(tm._hf)
    out = tm(input_ids=prompt[:, :1], use_cache=True, **{kw: cache})
    assert tm.decode_calls == 1
    L, dtype, _ = tm._table[0]  # built by the step: (L, dtype, device)
    assert (L, dtype) == (prompt.shape[1] + 3, torch.float32)
    for x in (h, h.to(torch.bfloat16)):
        table = tm._angles(x, L)[0]  # [2, L, ROT]
        for p in range(L):
            ids = torch.tensor([[p]], device=DEV)
            cos, sin = tm.rotary_emb(x, ids.expand(3, 1, 1) if family == "qwen3_5_moe" else ids)  # [1, 1, ROT]
            assert torch.equal(table[0, p], cos[0, 0]) and torch.equal(table[1, p], sin[0, 0])
    assert tm._table[0][1] == torch.bfloat16  # rebuilt for the new dtype
    pos = cache.get_seq_length()
    want = create_causal_mask(
        config=tm.config, inputs_embeds=h, attention_mask=None, **{kw: cache}, position_ids=pos.view(1, 1)
    )
    assert torch.equal(want, (tm._table[2] <= pos).view(1, 1, 1, L))
    hf_out = tm._hf(input_ids=prompt[:, 1:2], use_cache=True, **{kw: cache})  # the original module, same call
    assert type(out) is type(hf_out) and out.last_hidden_state.shape == (1, 1, tm.config.hidden_size)
    assert out[kw] is cache and hf_out[kw] is cache


@torch.no_grad()
def test_install_uninstall_round_trip(tiny_text_model):
    ref = copy.deepcopy(tiny_text_model).to(DEV)
    prompt = _prompt(ref, seed=3)
    want, _ = _run(ref, "static", prompt, steps=2)
    model = copy.deepcopy(ref)
    hf_text = model.model
    before = dict(model.named_parameters())
    done = replacements.install(model, DEV, force=True)
    after = dict(model.named_parameters())
    assert before.keys() == after.keys() and all(before[k] is after[k] for k in before)
    assert set(model.state_dict()) == set(ref.state_dict())
    tm = model.model
    assert tm._hf is hf_text and tm.layers is hf_text.layers and tm.embed_tokens is hf_text.embed_tokens
    assert tm.rotary_emb is hf_text.rotary_emb and "_hf" not in dict(tm.named_children())
    assert isinstance(tm.norm, replacements.FusedRMSNorm) and hf_text.norm is tm.norm  # prefill keeps its fused norm
    assert replacements.uninstall(model) == sum(done.values()) and replacements.installed(model) == 0
    assert model.model is hf_text and set(model.state_dict()) == set(ref.state_dict())
    assert type(hf_text.norm) is type(ref.model.norm)  # the fused final norm was in the original's slot too
    again, _ = _run(model, "static", prompt, steps=2)
    torch.testing.assert_close(again, want, rtol=0, atol=0)


@torch.no_grad()
def test_fallbacks_run_the_original(tiny_text_model):
    """A DynamicCache, prefill, hidden-state outputs, an attention mask, explicit position ids, more than one token
    and a model whose decoder layers are left unfused all run transformers' module, with its results."""
    from transformers import StaticCache

    ref = copy.deepcopy(tiny_text_model).to(DEV)
    prompt = _prompt(ref, seed=5)
    P = prompt.shape[1]
    want, want_toks = _run(ref, "dynamic", prompt, steps=1)
    model, _ = _installed(ref)
    got, toks = _run(model, "dynamic", prompt, steps=1)
    assert model.model.decode_calls == 0  # every call went to the original module (`_step` not taken)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert toks == want_toks

    kw = _cache_kw(model)
    tok = prompt[:, -1:]
    calls = [
        dict(output_hidden_states=True),
        dict(attention_mask=torch.ones(1, P + 1, dtype=torch.long, device=DEV)),
        dict(position_ids=torch.tensor([[P]], device=DEV)),
    ]
    for extra in calls:
        outs = [m(input_ids=tok, **{kw: _static_prefill(m, prompt), "use_cache": True, **extra}) for m in (model, ref)]
        assert model.model.decode_calls == 0, extra
        torch.testing.assert_close(outs[0].logits, outs[1].logits, rtol=1e-4, atol=1e-4)
    cache = StaticCache(config=model.config, max_cache_len=P + 4)  # prefill on a static cache, then two tokens
    model(input_ids=prompt, use_cache=True, **{kw: cache})
    model(input_ids=prompt[:, :2], use_cache=True, **{kw: cache})
    assert model.model.decode_calls == 0

    unfused, done = _installed(ref, exclude=("Qwen3_5MoeDecoderLayer",))
    assert done[TEXT] == 1
    _run(unfused, "static", prompt, steps=1)
    assert unfused.model.decode_calls == 0


# ---------------------------------------------------------------------------------------------------------------
# launches around the decoder layers
# ---------------------------------------------------------------------------------------------------------------
_FREE = {
    "empty.memory_format",
    "empty_like.default",
    "empty_strided.default",
    "lift_fresh.default",
    "sym_size.int",
    "sym_stride.int",
    "sym_numel.default",
    "sym_storage_offset.default",
    "is_same_size.default",
    "promote_types.default",
    "_unsafe_view.default",
}  # no kernel on a GPU


class _Launches(TorchDispatchMode):
    """Kernel launches inside the text model but outside its decoder layers (`layer` None) or inside decoder layer
    `layer`: aten ops that compute (no views, allocations or metadata) and Triton launches; `syncs` counts host reads
    of device values."""

    def __init__(self, layer: int | None = None):
        super().__init__()
        self.ops, self.syncs, self.inside, self.depth, self.triton = [], 0, False, 0, 0
        self.layer, self.in_layer = layer, False

    def counting(self) -> bool:
        where = self.depth == 0 if self.layer is None else self.in_layer
        return self.inside and where and self.triton == 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._opname + "." + func._overloadname
        if self.counting() and name == "_local_scalar_dense.default":
            self.syncs += 1
        elif self.counting() and not func.is_view and name not in _FREE:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def _counted_launch(mode: _Launches):
    """The interpreter's launch, counted into `mode` (its own aten ops not counted)."""
    from triton.runtime import interpreter

    launch = interpreter.GridExecutor.__call__

    def counted(self, *args, **kwargs):
        if mode.counting():
            mode.ops.append("triton:" + self.fn.__name__)
        mode.triton += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            mode.triton -= 1

    return counted


def _count_step(model, monkeypatch, warm=False, layer=None) -> _Launches:
    """The launches outside the decoder layers (or inside decoder layer `layer`) of one decode step after a
    static-cache prefill (and, with `warm`, one uncounted decode step)."""
    from triton.runtime import interpreter

    prompt = _prompt(model, seed=9)
    cache = _static_prefill(model, prompt)
    if warm:
        model(input_ids=prompt[:, -1:], use_cache=True, **{_cache_kw(model): cache})
    mode = _Launches(layer)
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", _counted_launch(mode))
    hooks = [
        model.model.register_forward_pre_hook(lambda *_: setattr(mode, "inside", True)),
        model.model.register_forward_hook(lambda *_: setattr(mode, "inside", False)),
    ]
    for i, m in enumerate(model.model.layers):
        hooks.append(m.register_forward_pre_hook(lambda *_: setattr(mode, "depth", mode.depth + 1)))
        hooks.append(m.register_forward_hook(lambda *_: setattr(mode, "depth", mode.depth - 1)))
        if i == layer:
            hooks.append(m.register_forward_pre_hook(lambda *_: setattr(mode, "in_layer", True)))
            hooks.append(m.register_forward_hook(lambda *_: setattr(mode, "in_layer", False)))
    try:
        with mode:
            model(input_ids=prompt[:, -1:], use_cache=True, **{_cache_kw(model): cache})
    finally:
        for h in hooks:
            h.remove()
    return mode


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="counts Triton launches of the interpreter")
@torch.no_grad()
def test_glue_launches_drop(tiny_text_model, monkeypatch):
    ref = copy.deepcopy(tiny_text_model).to(DEV)
    before = _count_step(_installed(ref, exclude=(TEXT,))[0], monkeypatch)
    model = _installed(ref)[0]
    after = _count_step(model, monkeypatch, warm=True)  # (the first step builds the angle table)
    print(
        f"\nlaunches per decode step outside the decoder layers: {len(before.ops)} -> {len(after.ops)}\n"
        f"  before: {before.ops}\n  after: {after.ops}"
    )
    assert model.model.decode_calls == 2
    assert after.ops == ["embedding.default", "index_select.default", "le.Tensor", "triton:_rmsnorm_kernel"]
    assert len(before.ops) >= 20 and after.syncs == 0


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="counts Triton launches of the interpreter")
@torch.no_grad()
def test_qwen3_moe_layer_launches(tiny_qwen3_moe, monkeypatch):
    """A Qwen3-MoE decoder layer's decode step (LocalExperts at sparsity 0.5, sparse_fused on the CPU): 28 launches
    with the fused norms, Linears and MoE block alone (attention's RoPE and cache update, the residual adds:
    transformers' ops) -> 5: q|k|v GEMV with the input norm, decode attention with the q/k norms, RoPE and the k/v
    write in its launch, o_proj, moe_front, sparse_fused with the residual add in its tail."""
    ref = copy.deepcopy(tiny_qwen3_moe).to(DEV)
    for m in test_fused._with_local_experts(ref, 0.5):
        m.kernel_on_cpu = DEV == "cpu"
    new = ("Qwen3MoeModel", "Qwen3MoeDecoderLayer", "Qwen3MoeAttention")
    before = _count_step(_installed(ref, exclude=new)[0], monkeypatch, layer=1)
    after = _count_step(_installed(ref)[0], monkeypatch, warm=True, layer=1)  # (the first step builds the table)
    print(f"\nlaunches per Qwen3-MoE decoder layer: {len(before.ops)} -> {len(after.ops)}\n  before: {before.ops}")
    assert len(before.ops) == 28 and after.syncs == 0
    assert after.ops == [
        "triton:_gemv_kernel",
        "triton:_split_kernel",
        "triton:_gemv_kernel",
        "triton:_moe_front_kernel",
        "triton:_sparse_fused_kernel",
    ]


# Mixtral: Qwen3-MoE's layer without q/k norms; GraniteMoE: the same plus residual_multiplier's two multiplies (the
# attention branch; the MoE branch through the top-k weights), its attention scale attention_multiplier. Around the
# layers GraniteMoE's text model has one launch more: embedding_multiplier's multiply
_GLUE = ["embedding.default", "index_select.default", "le.Tensor", "triton:_rmsnorm_kernel"]
_LAYER_LAUNCHES = {
    "mixtral": (26, ["gemv", "split", "gemv", "moe_front", "sparse_fused"]),
    "granitemoe": (28, ["gemv", "split", "gemv", "moe_front", "sparse_fused"]),  # m inside moe_front
}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="counts Triton launches of the interpreter")
@pytest.mark.parametrize("family", ["mixtral", "granitemoe"])
@torch.no_grad()
def test_layer_launches(tiny_model, family, monkeypatch):
    """A Mixtral / GraniteMoE decoder layer's decode step (LocalExperts at sparsity 0.5, sparse_fused on the CPU), as
    test_qwen3_moe_layer_launches: with the fused norms, Linears and MoE block alone -> q|k|v GEMV with the input
    norm, decode attention with RoPE and the k/v write in its launch, o_proj, moe_front (GraniteMoE: its two
    residual_multiplier multiplies inside), sparse_fused with the residual add in its tail; around the layers the 4
    launches of test_glue_launches_drop (GraniteMoE: + embedding_multiplier's multiply)."""
    ref = copy.deepcopy(tiny_model).to(DEV)
    for m in test_fused._with_local_experts(ref, 0.5):
        m.kernel_on_cpu = DEV == "cpu"
    prefix = {"mixtral": "Mixtral", "granitemoe": "GraniteMoe"}[family]
    new = (f"{prefix}Model", f"{prefix}DecoderLayer", f"{prefix}Attention")
    before = _count_step(_installed(ref, exclude=new)[0], monkeypatch, layer=1)
    model = _installed(ref)[0]
    after = _count_step(model, monkeypatch, warm=True, layer=1)  # (the first step builds the table)
    print(f"\nlaunches per {family} decoder layer: {len(before.ops)} -> {len(after.ops)}\n  before: {before.ops}")
    n_before, want = _LAYER_LAUNCHES[family]
    assert after.syncs == 0
    assert after.ops == [op if "." in op else f"triton:_{op}_kernel" for op in want]
    assert len(before.ops) == n_before
    glue = _count_step(model, monkeypatch)  # the same model: its table is built (the same prompt, the same length)
    assert glue.ops == _GLUE[:1] + ["mul.Tensor"] * (family == "granitemoe") + _GLUE[1:]
