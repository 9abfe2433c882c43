"""Fused decode kernels in place of transformers modules: ONE table, applied explicitly at load time.

`REPLACEMENTS` maps a transformers class name to the localmoe module that replaces it for decode. `install(model)`
walks `model.named_modules()` once and, for every module whose class is in the table, puts the localmoe module in
its parent's slot. The replacement registers the very same Parameter / child-module objects under the same names
(state_dict keys, `.to()`, tied weights unchanged) and keeps the original module (unregistered) for every call it
does not fuse. No transformers `forward` is patched; `uninstall(model)` puts the originals back.

It acts only on CUDA models (the kernels are Triton; on CPU transformers' modules stay) unless `force=True`
(tests, which run the kernels under TRITON_INTERPRET=1).

    transformers class             localmoe module          what one call becomes
    Linear (torch.nn, any family)  FusedLinear              one row, no bias: kernels/gemv.py (lm_head 474 -> ~230
                                                               µs on the H200); more rows: F.linear
    Qwen3_5MoeDecoderLayer         FusedDecoderLayer        one token: its children's fused calls, with the two
                                                               residual adds inside the post-attention norm's and
                                                               the shared expert's kernels (was 2 more launches)
    Qwen3_5MoeRMSNorm              FusedRMSNorm(zero_centred)  1 launch (was ~8 kernels incl. dtype round trips)
    Qwen3MoeRMSNorm, OlmoeRMSNorm,
    MixtralRMSNorm, DeepseekV2RMSNorm,
    GraniteMoeRMSNorm              FusedRMSNorm(standard)      1 launch
    Qwen3_5MoeGatedDeltaNet        FusedGatedDeltaNet          cached T=1 step: 1 input GEMV (the 4 projections'
                                                               weights share one buffer) + 1 launch
                                                               (conv1d update, gates, l2norm, delta rule, gated
                                                               RMSNorm) + out_proj (was ~60 kernels); prefill and
                                                               uncached calls run the original module
    Qwen3_5MoeSparseMoeBlock       FusedSparseMoeBlock      one token: router 1 launch (GEMV, softmax, top-k, renorm,
                                                               casts; was ~6) -> the block's own `experts` (localmoe's
                                                               LocalExperts, unchanged) -> shared expert 2 launches
                                                               (gate|up+silu·mul+sigmoid gate; down+scale+add; was ~10)
    Qwen3MoeSparseMoeBlock,
    OlmoeSparseMoeBlock            FusedSparseMoeBlock      one token: router 1 launch -> `experts` (no shared expert)
                                                               more tokens (prefill) run the original block

Besides the table, `install` switches models on transformers' "sdpa" attention to localmoe's "localmoe_sdpa"
(localmoe/attention.py: one-token decode attention whose time follows the tokens so far), registered through
transformers' AttentionInterface; it reports it as "sdpa attention" and `exclude` takes that name too.

The MoE block replacement keeps the block's children (`gate`, `experts`, `shared_expert`, `shared_expert_gate`) as
the very same objects, so localmoe's LocalExperts (sparsity τ, offloading cache, kept-neuron stats) is what runs.
It does not call the router module, so transformers' `output_router_logits` recorder (a hook on the router class)
sees nothing on fused decode steps; localmoe never asks for router logits.

Shape legend: B batch, T tokens, H hidden, C conv channels, H_v value heads, d_v value head dim.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from localmoe import attention
from localmoe.kernels.delta_rule_step import gated_deltanet_step
from localmoe.kernels.gemv import gemv
from localmoe.kernels.rmsnorm import rmsnorm
from localmoe.kernels.router_topk import router_topk
from localmoe.kernels.shared_expert import shared_expert
from localmoe.kernels.tuning import decode_params


def _tuned(x: torch.Tensor, kernel: str, shape_key: str) -> dict:
    """Tuned launch keywords for this device and shape (kernels/tuned/*.json); {} off CUDA or when unmeasured."""
    return decode_params(torch.cuda.get_device_name(x.device), kernel, shape_key) if x.is_cuda else {}


def _one_row(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x @ weight.T is a decode GEMV localmoe's kernel takes: one row, same dtype and device, row contiguous."""
    return (x.numel() == x.shape[-1] and x.dtype == weight.dtype and x.device == weight.device
            and x.stride(-1) == 1 and weight.stride(-1) == 1 and weight.dim() == 2)


@torch.compiler.disable
def linear_1(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] with one row -> x @ weight.T [..., N] through kernels/gemv.py (launch tuned per shape)."""
    N, K = weight.shape
    kw = _tuned(x, "gemv", f"N{N}_K{K}")
    return gemv(x.reshape(1, K), weight, **kw).view(*x.shape[:-1], N)


class FusedLinear(nn.Module):
    """nn.Linear whose one-row calls (decode: lm_head, attention and DeltaNet projections) run localmoe's GEMV; every
    other call (prefill, a bias) runs F.linear. cuBLAS's GEMV read Qwen3.5's lm_head at 2.1 TB/s in the engine."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        object.__setattr__(self, "_hf", hf)
        self.weight = hf.weight  # the same Parameter (tied embeddings stay tied)
        self.bias = hf.bias
        self.in_features, self.out_features = hf.in_features, hf.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None and _one_row(x, self.weight):
            return linear_1(x, self.weight)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class FusedRMSNorm(nn.Module):
    """transformers' RMSNorm (`kind` standard or zero_centred) in one Triton launch, any number of rows."""

    def __init__(self, hf: nn.Module, kind: str):
        super().__init__()
        object.__setattr__(self, "_hf", hf)  # the original, unregistered (uninstall puts it back)
        self.weight = hf.weight  # the same Parameter
        self.eps = float(getattr(hf, "variance_epsilon", getattr(hf, "eps", 1e-6)))
        self.variance_epsilon = self.eps
        self.kind = kind

    @torch.compiler.disable  # Triton launches stay opaque to dynamo (the CUDA graph still holds them)
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., N]
        return rmsnorm(x, self.weight, self.eps, self.kind)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, kind={self.kind}"


def _decode_states(cache, layer_idx: int):
    """(conv_state [B,C,K], recurrent_state [B,H_v,d_k,d_v]) — the cache's own tensors — when this call is a cached
    single-token step in transformers' sense (the layer has a previous state and does not record the past); else
    None. Works with the LinearAttention cache layers of transformers 5.17 and 5.2x."""
    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx >= len(layers):
        return None
    layer = layers[layer_idx]
    prev = getattr(layer, "has_previous_state", None)
    if not isinstance(prev, dict) or not prev.get(0, False) or getattr(layer, "record_past", False):
        return None
    try:
        conv, rec = layer.conv_states[0], layer.recurrent_states[0]
    except (AttributeError, KeyError, IndexError, TypeError):
        return None
    if not (isinstance(conv, torch.Tensor) and isinstance(rec, torch.Tensor)):
        return None
    return conv, rec


def _concat_rows(linears: list[nn.Module]) -> tuple[torch.Tensor | None, list[int]]:
    """Bias-free Linears sharing an input: one [ΣN, H] matrix whose row blocks become the Linears' weights (each
    Parameter object stays, its data now a view: no extra memory, same values), so one GEMV does all of them.
    (None, []) when they cannot share one (bias, other dtype/device/width, not plain Linears)."""
    ws = [getattr(lin, "weight", None) for lin in linears]
    if (not all(isinstance(lin, (nn.Linear, FusedLinear)) and lin.bias is None for lin in linears)
            or len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1 or ws[0].device.type == "meta"):
        return None, []
    with torch.no_grad():
        cat = torch.cat([w.detach() for w in ws], dim=0)  # [ΣN, H]
        sizes, at = [w.shape[0] for w in ws], 0
        for w, n in zip(ws, sizes):
            w.data = cat[at:at + n]
            at += n
    return cat, sizes


class FusedGatedDeltaNet(nn.Module):
    """Qwen3.5 Gated DeltaNet whose cached single-token step is 4 projections + one fused kernel + out_proj."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        object.__setattr__(self, "_hf", hf)  # prefill / uncached calls, and uninstall
        for name, child in hf.named_children():  # in_proj_qkv/z/b/a, conv1d, norm, out_proj: the same objects
            self.add_module(name, child)
        for name, p in hf.named_parameters(recurse=False):  # dt_bias, A_log
            self.register_parameter(name, p)
        for attr in ("layer_idx", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "key_dim", "value_dim",
                     "conv_dim", "conv_kernel_size", "activation", "hidden_size", "layer_type"):
            if hasattr(hf, attr):
                setattr(self, attr, getattr(hf, attr))
        self.decode_calls = 0  # fused steps taken (eager calls; a CUDA graph replay does not count)
        self._launch: dict | None = None  # tuned launch keywords, looked up on the first fused step
        self._w_in, self._in_sizes = _concat_rows([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])

    def forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, *, cache_params=None,
                past_key_values=None, **kwargs):  # hidden_states [B, T, H]
        cache = next((c for c in (cache, cache_params, past_key_values) if c is not None), None)
        states = None
        if cache is not None and hidden_states.shape[1] == 1 and self.activation in ("silu", "swish"):
            states = _decode_states(cache, self.layer_idx)
        if states is None:  # transformers' own forward (its cache argument is the second positional in 5.17/5.2x)
            return self._hf(hidden_states, cache, attention_mask=attention_mask, **kwargs)
        if attention_mask is not None and attention_mask.dim() == 2:  # transformers' apply_mask_to_padding_states
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        self.decode_calls += 1
        B = hidden_states.shape[0]
        if self._w_in is not None and self.in_proj_qkv.weight.data_ptr() != self._w_in.data_ptr():
            self._w_in = None  # the weights were moved or replaced since install: project them one by one
        if self._w_in is not None:  # the four input projections as one GEMV, split into views (rows strided)
            h = hidden_states[:, 0]  # [B, H]
            proj = linear_1(h, self._w_in) if _one_row(h, self._w_in) else F.linear(h, self._w_in)
            mixed_qkv, z, b, a = proj.split(self._in_sizes, dim=-1)
        else:
            mixed_qkv = self.in_proj_qkv(hidden_states)[:, 0]  # [B, C]
            z = self.in_proj_z(hidden_states)[:, 0]  # [B, H_v*d_v]
            b = self.in_proj_b(hidden_states)[:, 0]  # [B, H_v]
            a = self.in_proj_a(hidden_states)[:, 0]  # [B, H_v]
        out = self._step(mixed_qkv, z, a, b, *states)  # [B, H_v*d_v]
        return self.out_proj(out.view(B, 1, -1))

    @torch.compiler.disable
    def _step(self, mixed_qkv, z, a, b, conv_state, rec_state):
        if self._launch is None:
            self._launch = _tuned(mixed_qkv, "gated_deltanet_step",
                                  f"HK{self.num_k_heads}_HV{self.num_v_heads}_D{self.head_v_dim}")
        return gated_deltanet_step(
            mixed_qkv, z, a, b, conv_state=conv_state, conv_weight=self.conv1d.weight.view(self.conv_dim, -1),
            conv_bias=self.conv1d.bias, A_log=self.A_log, dt_bias=self.dt_bias, norm_weight=self.norm.weight,
            norm_eps=self.norm.variance_epsilon, state=rec_state, num_k_heads=self.num_k_heads,
            head_k_dim=self.head_k_dim, num_v_heads=self.num_v_heads, head_v_dim=self.head_v_dim, **self._launch)


# router class -> whether it renormalises the top-k weights (None: read the router's `norm_topk_prob`)
_ROUTERS: dict[str, bool | None] = {"Qwen3_5MoeTopKRouter": True, "Qwen3MoeTopKRouter": None, "OlmoeTopKRouter": None}


class FusedSparseMoeBlock(nn.Module):
    """A softmax-top-k MoE block (Qwen3.5 with its sigmoid-gated shared expert; Qwen3-MoE / OLMoE without) whose
    one-token call is: fused router (1 launch) -> the block's `experts` module, called as transformers calls it ->
    fused shared expert (2 launches, the add into the routed output included). Other calls run the original block."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        object.__setattr__(self, "_hf", hf)  # prefill / unsupported calls, and uninstall
        for name, child in hf.named_children():  # gate, experts, [shared_expert, shared_expert_gate]: same objects
            self.add_module(name, child)
        for name, p in hf.named_parameters(recurse=False):
            self.register_parameter(name, p)
        gate = hf.gate
        norm = _ROUTERS.get(type(gate).__name__, False)
        self.norm_topk_prob = bool(getattr(gate, "norm_topk_prob", False)) if norm is None else norm
        self.top_k = int(getattr(gate, "top_k", 0))
        self._router_ok = type(gate).__name__ in _ROUTERS and isinstance(getattr(gate, "weight", None), torch.Tensor)
        se, sg = getattr(hf, "shared_expert", None), getattr(hf, "shared_expert_gate", None)
        self.has_shared = se is not None
        self._shared_ok = not self.has_shared or (
            isinstance(sg, (nn.Linear, FusedLinear)) and sg.bias is None and sg.out_features == 1
            and all(isinstance(getattr(se, n, None), (nn.Linear, FusedLinear)) and getattr(se, n).bias is None
                    for n in ("gate_proj", "up_proj", "down_proj"))
            and getattr(getattr(se, "config", None), "hidden_act", None) in ("silu", "swish"))
        self._tuple_out = False  # the original returned (hidden, router_logits): mirror it
        w = getattr(gate, "weight", None)
        self._tickets = torch.zeros(64, dtype=torch.int32, device=w.device if w is not None else "cpu")
        self.decode_calls = 0  # fused calls taken (eager calls; a CUDA graph replay does not count)
        self._launch: tuple[dict, dict] | None = None  # tuned (router, shared expert) keywords, on the first call

    def _fusable(self, h: torch.Tensor) -> bool:
        if not (self._router_ok and self._shared_ok) or h.dim() != 3 or h.shape[0] * h.shape[1] != 1:
            return False
        return h.dtype == self.gate.weight.dtype and h.device == self.gate.weight.device

    def forward(self, hidden_states: torch.Tensor):  # [B, T, H]
        if not self._fusable(hidden_states):
            out = self._hf(hidden_states)
            self._tuple_out = isinstance(out, tuple)
            return out
        y, logits = self.step(hidden_states)
        return (y, logits) if self._tuple_out else y

    def step(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None):
        """The fused one-token call (`_fusable` holds) -> (y [B, T, H], router logits); with `residual` (only with a
        shared expert) y = residual + the block's output, the add done in the shared expert's last kernel."""
        self.decode_calls += 1
        B, T, H = hidden_states.shape
        x = hidden_states.view(-1, H)
        logits, top_k_weights, top_k_index = self._route(x)
        y = self.experts(x, top_k_index, top_k_weights)
        if self.has_shared:
            y = self._shared(x, y, None if residual is None else residual.view(-1, H))
        elif residual is not None:
            raise ValueError("a residual is fused into the shared expert's kernel: this block has none")
        return y.reshape(B, T, H), logits

    @torch.compiler.disable  # Triton launches stay opaque to dynamo (the CUDA graph still holds them)
    def _route(self, x):
        if self._tickets.device != x.device:
            self._tickets = torch.zeros(64, dtype=torch.int32, device=x.device)
        if self._launch is None:
            H, E = self.gate.weight.shape[1], self.gate.weight.shape[0]
            se = self.shared_expert if self.has_shared else None
            self._launch = (_tuned(x, "router_topk", f"H{H}_E{E}_k{self.top_k}"),
                            _tuned(x, "shared_expert", f"H{H}_I{se.gate_proj.weight.shape[0]}") if se else {})
        return router_topk(x, self.gate.weight, self.top_k, self.norm_topk_prob, tickets=self._tickets,
                           **self._launch[0])

    @torch.compiler.disable
    def _shared(self, x, routed, residual=None):
        se = self.shared_expert
        return shared_expert(x, se.gate_proj.weight, se.up_proj.weight, se.down_proj.weight,
                             self.shared_expert_gate.weight, routed.to(x.dtype), residual=residual, **self._launch[1])


class FusedDecoderLayer(nn.Module):
    """Qwen3.5-MoE decoder layer whose one-token call fuses both residual adds: the mixer's output + residual into
    the post-attention RMSNorm's launch, and the MoE output + residual into the shared expert's last kernel (2 fewer
    launches per layer). Only when its norm and MoE block are localmoe's fused modules and the call is one token on
    their device; every other call (prefill) runs the original layer, whose children are the original modules."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        object.__setattr__(self, "_hf", hf)
        for name, child in hf.named_children():  # input/post norms, linear_attn | self_attn, mlp: the same objects
            self.add_module(name, child)
        for k, v in vars(hf).items():  # block_type / layer_type, hidden_size, gradient_checkpointing, ...
            if not k.startswith("_") and isinstance(v, (str, int, float, bool)):
                setattr(self, k, v)
        self._sig = inspect.signature(hf.forward)
        self._cache_kw = "cache" if "cache" in self._sig.parameters else "past_key_values"
        self._var_kw = next((n for n, p in self._sig.parameters.items() if p.kind is p.VAR_KEYWORD), None)
        self.decode_calls = 0

    def _fusable(self, h: torch.Tensor) -> bool:
        return (isinstance(self.post_attention_layernorm, FusedRMSNorm) and isinstance(self.mlp, FusedSparseMoeBlock)
                and self.mlp.has_shared and self.mlp._fusable(h))

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):  # [B, T, H]
        if not self._fusable(hidden_states):
            return self._hf(hidden_states, *args, **kwargs)
        a = self._sig.bind(hidden_states, *args, **kwargs).arguments
        extra = dict(a.pop(self._var_kw, {})) if self._var_kw else {}
        cache = a.get(self._cache_kw)
        self.decode_calls += 1
        h = self.input_layernorm(hidden_states)
        if getattr(self, "block_type", None) == "linear_attention":
            h = self.linear_attn(h, cache, attention_mask=a.get("attention_mask"), **extra)
        else:
            h, _ = self.self_attn(hidden_states=h, attention_mask=a.get("attention_mask"),
                                  position_ids=a.get("position_ids"), position_embeddings=a.get("position_embeddings"),
                                  **{_kw(self.self_attn, "cache", "past_key_values"): cache}, **extra)
        norm = self.post_attention_layernorm
        h, residual = _add_norm(h, hidden_states, norm)
        return self.mlp.step(h, residual)[0]


def _kw(module: nn.Module, *names: str) -> str:
    """The first of `names` that `module.forward` takes (transformers renamed cache arguments between versions)."""
    params = inspect.signature(module.forward).parameters
    return next((n for n in names if n in params), names[-1])


@torch.compiler.disable
def _add_norm(h, residual, norm: FusedRMSNorm):
    """(norm(residual + h), residual + h) in one launch."""
    return rmsnorm(h, norm.weight, norm.eps, norm.kind, residual=residual)


@dataclass(frozen=True)
class Replacement:
    make: Callable[[nn.Module], nn.Module]
    note: str


def _norm(kind: str) -> Callable[[nn.Module], nn.Module]:
    return lambda hf: FusedRMSNorm(hf, kind)


# THE table: transformers class name -> how localmoe replaces it for decode.
REPLACEMENTS: dict[str, Replacement] = {
    "Qwen3_5MoeDecoderLayer": Replacement(FusedDecoderLayer, "T=1: residual adds fused into the post-attention norm "
                                                             "and the shared expert's kernel; prefill unchanged"),
    "Qwen3_5MoeRMSNorm": Replacement(_norm("zero_centred"), "x̂·(1+w), one launch"),
    "Qwen3_5MoeGatedDeltaNet": Replacement(FusedGatedDeltaNet, "cached T=1 step fused (conv, gates, delta rule, "
                                                               "gated norm); prefill unchanged"),
    "Qwen3_5MoeSparseMoeBlock": Replacement(FusedSparseMoeBlock, "T=1: router 1 launch, experts unchanged, shared "
                                                                 "expert + add 2 launches; prefill unchanged"),
    "Qwen3MoeSparseMoeBlock": Replacement(FusedSparseMoeBlock, "T=1: router 1 launch, experts unchanged"),
    "OlmoeSparseMoeBlock": Replacement(FusedSparseMoeBlock, "T=1: router 1 launch, experts unchanged"),
    "Linear": Replacement(FusedLinear, "one row: localmoe's GEMV (tuned per shape); else F.linear"),
    "Qwen3MoeRMSNorm": Replacement(_norm("standard"), "w·x̂, one launch"),
    "OlmoeRMSNorm": Replacement(_norm("standard"), "w·x̂, one launch"),
    "MixtralRMSNorm": Replacement(_norm("standard"), "w·x̂, one launch"),
    "DeepseekV2RMSNorm": Replacement(_norm("standard"), "w·x̂, one launch"),
    "GraniteMoeRMSNorm": Replacement(_norm("standard"), "w·x̂, one launch"),
}
ATTENTION = "sdpa attention"  # `install`'s name for the attention core switch (localmoe.attention), not a class
_FUSED_TYPES = (FusedRMSNorm, FusedGatedDeltaNet, FusedSparseMoeBlock, FusedDecoderLayer, FusedLinear)


def _model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _set_child(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, new)


def install(model: nn.Module, device: torch.device | str | None = None, *, force: bool = False,
            exclude: tuple[str, ...] = ()) -> dict[str, int]:
    """Swap every module whose class is in REPLACEMENTS (and not in `exclude`) for its fused localmoe module. Returns
    {class name: count} (empty when nothing was done). Only on CUDA (`device`, else the model's parameters' device)
    unless `force`."""
    dev = torch.device(device) if device is not None else _model_device(model)
    if dev.type != "cuda" and not force:
        return {}
    done: dict[str, int] = {}
    for name, module in list(model.named_modules()):
        cls = type(module).__name__
        rep = REPLACEMENTS.get(cls)
        if rep is None or not name or cls in exclude:
            continue
        _set_child(model, name, rep.make(module))
        done[cls] = done.get(cls, 0) + 1
    if ATTENTION not in exclude and attention.install(model):  # the attention core, by implementation name
        done[ATTENTION] = 1
    return done


def uninstall(model: nn.Module) -> int:
    """Put the original transformers modules back; returns how many were restored."""
    n = int(attention.uninstall(model))
    for name, module in list(model.named_modules()):
        if isinstance(module, _FUSED_TYPES) and name:
            _set_child(model, name, module._hf)
            n += 1
    return n


def installed(model: nn.Module) -> int:
    return sum(isinstance(m, _FUSED_TYPES) for m in model.modules())
