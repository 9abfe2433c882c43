"""Fused decode kernels in place of transformers modules: ONE table, applied explicitly at load time.

The modules live in `ops` (FusedLinear, FusedRMSNorm), `deltanet` (FusedGatedDeltaNet), `attention`
(FusedAttention), `mla` (FusedMLA), `moe_layer` (FusedSparseMoeBlock), `decoder_layer` (FusedDecoderLayer) and
`text_model` (FusedTextModel), all in localmoe/decode/; this module owns the table and `install` / `uninstall`.

`REPLACEMENTS` maps a transformers class name to the localmoe module that replaces it for decode. `install(model)`
walks `model.named_modules()` once and, for every module whose class is in the table, puts the localmoe module in
its parent's slot. The replacement registers the very same Parameter / child-module objects under the same names
(state_dict keys, `.to()`, tied weights unchanged) and keeps the original module (unregistered) for every call it
does not fuse. No transformers `forward` is patched; `uninstall(model)` puts the originals back.

It acts only on CUDA models (the kernels are Triton; on CPU transformers' modules stay) unless `force=True`
(tests, which run the kernels under TRITON_INTERPRET=1).

    transformers class             localmoe module          what one call becomes
    Qwen3_5MoeTextModel            FusedTextModel           one token on a StaticCache, every layer fused: 4
                                                               launches around the layers (embedding, cos|sin
                                                               gathered from a table made by the original rotary
                                                               module, the causal mask, the final norm; was 25 on
                                                               the H200, 35B step 2874 -> 2724 µs); other calls run
                                                               the original module
    Linear (torch.nn, any family)  FusedLinear              one row, no bias: kernels/gemv.py (lm_head 474 -> ~230
                                                               µs on the H200); more rows: F.linear
    Qwen3_5MoeDecoderLayer         FusedDecoderLayer        one token: input norm inside the mixer's input GEMV;
                                                               mixer; then, when the experts run sparse_fused (the
                                                               sparse path, and sparsity 0 at threshold 0), 2
                                                               launches: kernels/moe_front.py (residual add, norm,
                                                               router top-k, the shared expert) and sparse_fused
                                                               (routed experts) with the residual add in its tail
                                                               (was norm + router + experts + shared expert's 2 = 5);
                                                               else the norm with the residual add, then the block
    Qwen3_5MoeRMSNorm              FusedRMSNorm(zero_centred)  1 launch (was ~8 kernels incl. dtype round trips)
    Qwen3MoeRMSNorm, OlmoeRMSNorm,
    MixtralRMSNorm, DeepseekV2RMSNorm,
    GraniteMoeRMSNorm              FusedRMSNorm(standard)      1 launch
    Qwen3_5MoeGatedDeltaNet        FusedGatedDeltaNet          cached T=1 step: 1 input GEMV (the 4 projections'
                                                               weights share one buffer) + 1 launch
                                                               (conv1d update, gates, l2norm, delta rule, gated
                                                               RMSNorm) + out_proj (was ~60 kernels); T>1 (prefill,
                                                               prompt pieces): transformers' forward around localmoe's
                                                               chunked delta rule (kernels/delta_rule_chunk.py), also
                                                               when a FusedDecoderLayer hands the prefill to its
                                                               original layer (`install` points that layer's
                                                               linear_attn at the fused module)
    Qwen3_5MoeAttention            FusedAttention           cached T=1 step: 1 q|k|v GEMV (one weight buffer) + 1
                                                               launch on a static cache (q/k norms, partial RoPE,
                                                               the k/v write and the attention core, the sigmoid
                                                               gate in its combine: decode_attention_qk) + o_proj:
                                                               3 launches (was 28 with the fused Linears and norms);
                                                               prefill and uncached calls run the original module
    DeepseekV2DecoderLayer         FusedDecoderLayer        one token: the input norm inside FusedMLA's q|kv_a GEMV,
                                                               residual add + post-attention norm 1 launch, the MoE
                                                               output's residual add in the shared experts' kernel
    DeepseekV2Moe                  FusedSparseMoeBlock      one token: router 1 launch (fp32 weight; greedy or
                                                               group-limited), routed_scaling_factor 1 multiply
                                                               when != 1, shared experts + the add 2 launches
    DeepseekV2Attention            FusedMLA                 cached T=1 step absorbed over the compressed latent
                                                               cache: q|kv_a 1 GEMV, norm + ropes + latent write +
                                                               W_UK 1, core 2 (kernels/mla_decode.py; W_UV in the
                                                               combine), o_proj: 5 launches (transformers expands
                                                               the whole cache through kv_b_proj each step)
    Qwen3_5MoeSparseMoeBlock       FusedSparseMoeBlock      one token: router 1 launch (GEMV, softmax, top-k, renorm,
                                                               casts; was ~6) -> the block's own `experts` (localmoe's
                                                               LocalExperts, unchanged) -> shared expert 2 launches
                                                               (gate|up+silu·mul+sigmoid gate; down+scale+add; was ~10);
                                                               a prompt piece with `prefill_fused` (on): router
                                                               GEMM + top-k 2, shared expert 3 + its add inside the
                                                               experts' last launch (was 15)
    Qwen3MoeSparseMoeBlock,
    OlmoeSparseMoeBlock            FusedSparseMoeBlock      one token: router 1 launch -> `experts` (no shared expert)
                                                               more tokens (prefill) run the original block (with
                                                               `prefill_fused`: the router's GEMM + top-k, 2 launches)
    DeaMoeSparseMoeBlock,          FusedSparseMoeBlock      one token: group-limited router 1 launch (router_topk's
    DeaMoeQwen35SparseMoeBlock                                 department mode) -> DepartmentExperts (its Triton
                                                               kernel) -> the twin's shared expert 2 launches
    DeaMoeQwen35TextModel,         FusedTextModel,          as Qwen3.5's: DeaMoE's Qwen3.5 twin shares the decoder
    DeaMoeQwen35DecoderLayer       FusedDecoderLayer
    DeaMoeModel,                   FusedTextModel,          as Qwen3-MoE's (localmoe-tiny-deamoe, deamoe-7b: Qwen3-MoE's
    DeaMoeDecoderLayer             FusedDecoderLayer           decoder with the DeaMoE block)
    Qwen3MoeModel                  FusedTextModel           as Qwen3_5MoeTextModel: 4 launches around the layers (the
                                                               rotary table from position ids [1, L]; every layer
                                                               full attention; no sliding window)
    Qwen3MoeDecoderLayer           FusedDecoderLayer        one token: input norm inside the q|k|v GEMV; attention;
                                                               then, when the experts run sparse_fused, 2 launches:
                                                               moe_front (residual add, norm, router top-k; no shared
                                                               expert) and sparse_fused with the residual add in its
                                                               tail; else the norm with the residual add, the block,
                                                               an add. Layers with a dense MLP (mlp_only_layers):
                                                               transformers' arithmetic around the fused children
    Qwen3MoeAttention              FusedAttention           cached T=1 step as Qwen3.5's, without the gate and with
                                                               RoPE over the whole head: q|k|v GEMV, the core with
                                                               the standard norms, RoPE and the k/v write inside,
                                                               o_proj: 3 launches (was 22 with the fused Linears
                                                               and norms; also DeaMoE's attention)
    OlmoeModel, OlmoeDecoderLayer, as Qwen3-MoE's; OLMoE's q/k norms span the whole q / k projection (qk_norm_rope's
    OlmoeAttention                 `whole` mode: each program reduces over its whole row); clip_qkv: not fused
    MixtralModel,                  FusedTextModel,          as Qwen3-MoE's; the attention has no q/k norms
    MixtralDecoderLayer,           FusedDecoderLayer,          (kind "none": RoPE and the k/v write inside the core's
    MixtralAttention,              FusedAttention,             launch); the router softmax -> top-k -> renormalise (its
    MixtralSparseMoeBlock          FusedSparseMoeBlock         weights in x's dtype, transformers keeps them fp32: equal
                                                               in fp32, one bf16 rounding apart in bf16). A config with
                                                               a `sliding_window`: the attention and the text model run
                                                               the original modules (their masks / core windows are not
                                                               the fused step's); the block stays fused
    GraniteMoeModel,               FusedTextModel,          as Mixtral's, with Granite's multipliers:
    GraniteMoeDecoderLayer,        FusedDecoderLayer,          embedding_multiplier 1 launch after the embedding (5
    GraniteMoeAttention,           FusedAttention,             around the layers); attention_multiplier is the
    GraniteMoeMoE                  FusedSparseMoeBlock         attention's `scaling` (no launch); residual_multiplier m:
                                                               the attention output · m (1 launch, transformers' op)
                                                               before moe_front, and m folded into the k top-k weights
                                                               (1 launch) before sparse_fused adds residual + Σ
                                                               (w_i·m)·expert_i (transformers: residual + (Σ
                                                               w_i·expert_i)·m; equal up to fp32 rounding). Its router
                                                               (top-k of the logits, softmax over the k) is the
                                                               renormalised softmax top-k; the block is the layer's
                                                               `block_sparse_moe`, its router `router`. logits_scaling
                                                               is the LM head's (GraniteMoeForCausalLM), not replaced
    GptOssModel                    FusedGptOssModel         as Qwen3MoeModel with the two masks (full; sliding over
                                                               each sliding layer's ring of W rows): 5 launches
                                                               around the layers (40 unfused); the sliding layers of
                                                               the StaticCache kept as rings between transformers'
                                                               calls (localmoe.decode.sliding)
    GptOssDecoderLayer             FusedDecoderLayer        one token: input norm in the q|k|v GEMV, attention 4,
                                                               residual add + norm 1, router 1, experts, add 1
    GptOssAttention                FusedAttention           q|k|v GEMV, qk_norm_rope (biases, half-width angles,
                                                               the k/v write, a ring row on sliding layers), the core
                                                               with sinks and window, o_proj (bias): 4 (37 with the
                                                               fused Linears and norms)
    GptOssMLP                      FusedSparseMoeBlock      router (+ bias; top-k, softmax over k) 1 launch, experts
    GptOssRMSNorm                  FusedGptOssRMSNorm       (w·x̂).to(x.dtype) as zero_centred with w - 1 (exact for
                                                               bf16-precision weights; else not replaced)
    A GPT-OSS decoder layer's decode step (tests/test_fused_gpt_oss.py::test_decode_step_launches; the experts
    apart): 49 launches with transformers' modules (sliding layer; 48 full), 37 with the fused norms, Linears and
    MoE block alone -> 7 (q|k|v GEMV with the input norm, qk_norm_rope, the core, o_proj, residual add + norm,
    router, the MoE output's add).
    A Qwen3-MoE decoder layer's decode step (StaticCache, localmoe_sdpa, LocalExperts on sparse_fused; counted on the
    CPU with the interpreter, tests/test_fused_model.py::test_qwen3_moe_layer_launches): 28 launches with the fused
    norms, Linears and MoE block alone (3 norms, 3 projections, RoPE 10, cache update 5, core, o_proj, 2 residual
    adds, router, experts) -> 6 (q|k|v GEMV with the input norm, qk_norm_rope with the k/v write, the core, o_proj,
    moe_front, sparse_fused); with transformers' modules only, 55. OLMoE's: the same 28 -> 6 (53 unfused). Mixtral's
    (tests/test_fused_model.py::test_layer_launches, as are GraniteMoE's): 26 (no q/k norms) -> the same 6 (43
    unfused); GraniteMoE's: 28 (+ the two residual_multiplier multiplies) -> 8 (43 unfused). Around the layers:
    Mixtral 23 -> 4, GraniteMoE 24 -> 5 (the embedding_multiplier multiply).

Besides the table, `install` switches models on transformers' "sdpa" attention to localmoe's "localmoe_sdpa"
(localmoe/decode/sdpa.py: one-token decode attention whose time follows the tokens so far), registered through
transformers' AttentionInterface; it reports it as "sdpa attention" and `exclude` takes that name too.

The MoE block replacement keeps the block's children (`gate`, `experts`, `shared_expert`, `shared_expert_gate`) as
the very same objects, so localmoe's LocalExperts (sparsity τ, offloading cache, kept-neuron stats) is what runs.
It does not call the router module, so transformers' `output_router_logits` recorder (a hook on the router class)
sees nothing on fused decode steps; localmoe never asks for router logits.

Shape legend: B batch, T tokens, H hidden, C conv channels, H_v value heads, d_v value head dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from localmoe.decode import sdpa
from localmoe.decode.attention import FusedAttention
from localmoe.decode.decoder_layer import FusedDecoderLayer
from localmoe.decode.deltanet import FusedGatedDeltaNet
from localmoe.decode.gpt_oss import FusedGptOssModel, gpt_oss_norm
from localmoe.decode.mla import FusedMLA
from localmoe.decode.moe_layer import FusedSparseMoeBlock
from localmoe.decode.ops import FusedLinear, FusedRMSNorm
from localmoe.decode.text_model import FusedTextModel


@dataclass(frozen=True)
class Replacement:
    make: Callable[[nn.Module], nn.Module]
    note: str


def _norm(kind: str) -> Callable[[nn.Module], nn.Module]:
    return lambda hf: FusedRMSNorm(hf, kind)


# THE table: transformers class name -> how localmoe replaces it for decode.
REPLACEMENTS: dict[str, Replacement] = {
    "Qwen3_5MoeTextModel": Replacement(
        FusedTextModel,
        "T=1 on a StaticCache: embedding, cos|sin gather, mask, final norm: 4 launches; other calls unchanged",
    ),
    "Qwen3_5MoeDecoderLayer": Replacement(
        FusedDecoderLayer,
        "T=1: residual adds fused into the post-attention norm and the shared expert's kernel; prefill unchanged",
    ),
    "Qwen3_5MoeRMSNorm": Replacement(_norm("zero_centred"), "x̂·(1+w), one launch"),
    "Qwen3_5MoeGatedDeltaNet": Replacement(
        FusedGatedDeltaNet, "cached T=1 step fused (conv, gates, delta rule, gated norm); T>1: chunk scan 1 launch"
    ),
    "Qwen3_5MoeAttention": Replacement(
        FusedAttention, "cached T=1 step: q|k|v 1 GEMV, norms + RoPE 1 launch; prefill unchanged"
    ),
    "Qwen3_5MoeSparseMoeBlock": Replacement(
        FusedSparseMoeBlock,
        "T=1: router 1 launch, experts unchanged, shared expert + add 2 launches; prefill unchanged",
    ),
    "Qwen3MoeSparseMoeBlock": Replacement(FusedSparseMoeBlock, "T=1: router 1 launch, experts unchanged"),
    "DeaMoeSparseMoeBlock": Replacement(FusedSparseMoeBlock, "T=1: group-limited router 1 launch, experts unchanged"),
    "DeaMoeModel": Replacement(FusedTextModel, "as Qwen3MoeModel (its forward)"),
    "DeaMoeDecoderLayer": Replacement(
        FusedDecoderLayer, "as Qwen3MoeDecoderLayer: moe_front (group-limited, the slots) + the department kernel"
    ),
    "DeaMoeQwen35TextModel": Replacement(FusedTextModel, "as Qwen3_5MoeTextModel"),
    "DeaMoeQwen35DecoderLayer": Replacement(FusedDecoderLayer, "as Qwen3_5MoeDecoderLayer"),
    "DeaMoeQwen35SparseMoeBlock": Replacement(
        FusedSparseMoeBlock, "T=1: group-limited router 1 launch, experts unchanged, shared expert + add 2 launches"
    ),
    "OlmoeSparseMoeBlock": Replacement(FusedSparseMoeBlock, "T=1: router 1 launch, experts unchanged"),
    "Qwen3MoeModel": Replacement(
        FusedTextModel, "as Qwen3_5MoeTextModel (rotary ids [1, L], every layer full attention)"
    ),
    "Qwen3MoeDecoderLayer": Replacement(
        FusedDecoderLayer, "T=1: moe_front (no shared expert) + sparse_fused with the residual add; prefill unchanged"
    ),
    "Qwen3MoeAttention": Replacement(
        FusedAttention, "cached T=1 step: q|k|v 1 GEMV, norms + full RoPE + k/v write 1 launch; prefill unchanged"
    ),
    "OlmoeModel": Replacement(FusedTextModel, "as Qwen3MoeModel"),
    "OlmoeDecoderLayer": Replacement(FusedDecoderLayer, "as Qwen3MoeDecoderLayer"),
    "OlmoeAttention": Replacement(FusedAttention, "as Qwen3MoeAttention, q/k norms over the whole projections"),
    "MixtralModel": Replacement(FusedTextModel, "as Qwen3MoeModel; config.sliding_window set: not taken"),
    "MixtralDecoderLayer": Replacement(FusedDecoderLayer, "as Qwen3MoeDecoderLayer"),
    "MixtralAttention": Replacement(
        FusedAttention, "as Qwen3MoeAttention without q/k norms (RoPE + k/v write 1 launch); sliding window: not fused"
    ),
    "MixtralSparseMoeBlock": Replacement(FusedSparseMoeBlock, "T=1: router 1 launch (renormalised), experts unchanged"),
    "GraniteMoeModel": Replacement(FusedTextModel, "as Qwen3MoeModel, + embedding_multiplier 1 launch"),
    "GraniteMoeDecoderLayer": Replacement(
        FusedDecoderLayer, "as Qwen3MoeDecoderLayer, + residual_multiplier 2 launches (attention output, top-k weights)"
    ),
    "GraniteMoeAttention": Replacement(FusedAttention, "as MixtralAttention; attention_multiplier as the scale"),
    "GraniteMoeMoE": Replacement(
        FusedSparseMoeBlock, "T=1: router (top-k, softmax over k) 1 launch, experts unchanged"
    ),
    "DeepseekV2Model": Replacement(
        FusedTextModel, "as Qwen3MoeModel; freqs_cis (complex) gathered from the table in place of cos|sin"
    ),
    "DeepseekV2DecoderLayer": Replacement(
        FusedDecoderLayer,
        "T=1: input norm inside MLA's q|kv_a GEMV, residual add + norm 1 launch, the MoE output's add in the shared "
        "experts' kernel; dense-MLP layers: transformers' arithmetic",
    ),
    "DeepseekV2Moe": Replacement(
        FusedSparseMoeBlock,
        "T=1: router (fp32 weight, group-limited top-k) 1 launch, experts unchanged, shared experts + add 2 launches",
    ),
    "DeepseekV2Attention": Replacement(
        FusedMLA,
        "cached T=1 step absorbed over the compressed cache (W_UK, W_UV folded; core 2 launches); prefill unchanged",
    ),
    "GptOssModel": Replacement(
        FusedGptOssModel,
        "T=1 on a StaticCache: embedding, cos|sin gather, full + sliding masks, final norm: 5 launches; sliding layers "
        "kept as rings (localmoe.decode.sliding)",
    ),
    "GptOssDecoderLayer": Replacement(
        FusedDecoderLayer, "T=1: input norm in the q|k|v GEMV, residual add + norm 1 launch, router, experts, add"
    ),
    "GptOssAttention": Replacement(
        FusedAttention,
        "cached T=1 step: q|k|v 1 GEMV, biases + RoPE + k/v write 1 launch, core with sinks and window 1, o_proj",
    ),
    "GptOssMLP": Replacement(FusedSparseMoeBlock, "T=1: router (+ bias; top-k, softmax over k) 1 launch, experts"),
    "GptOssRMSNorm": Replacement(gpt_oss_norm, "(w·x̂).to(x.dtype) as zero_centred with w - 1, one launch"),
    "Linear": Replacement(FusedLinear, "one row: localmoe's GEMV (tuned per shape); else F.linear"),
    "Qwen3MoeRMSNorm": Replacement(_norm("standard"), "w·x̂, one launch"),
    "OlmoeRMSNorm": Replacement(_norm("standard"), "w·x̂, one launch"),
    "MixtralRMSNorm": Replacement(_norm("standard"), "w·x̂, one launch"),
    "DeepseekV2RMSNorm": Replacement(_norm("standard"), "w·x̂, one launch"),
    "GraniteMoeRMSNorm": Replacement(_norm("standard"), "w·x̂, one launch"),
}
ATTENTION = "sdpa attention"  # `install`'s name for the attention core switch (localmoe.decode.sdpa), not a class
_FUSED_TYPES = (
    FusedRMSNorm,
    FusedGatedDeltaNet,
    FusedAttention,
    FusedMLA,
    FusedSparseMoeBlock,
    FusedDecoderLayer,
    FusedLinear,
    FusedTextModel,
)


def _model_device(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _set_child(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, new)


def install(
    model: nn.Module, device: torch.device | str | None = None, *, force: bool = False, exclude: tuple[str, ...] = ()
) -> dict[str, int]:
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
    for module in model.modules():  # a fused layer's prefill runs its original layer: give that one the fused
        if not isinstance(module, FusedDecoderLayer):  # DeltaNet, attention and MoE block (their prefill paths)
            continue
        if isinstance(getattr(module, "linear_attn", None), FusedGatedDeltaNet):
            module._hf.linear_attn = module.linear_attn
        if isinstance(getattr(module, "self_attn", None), FusedAttention):
            module._hf.self_attn = module.self_attn
        if isinstance(module._moe, FusedSparseMoeBlock):
            setattr(module._hf, module._moe_name, module._moe)
    if ATTENTION not in exclude and sdpa.install(model):  # the attention core, by implementation name
        done[ATTENTION] = 1
    return done


def uninstall(model: nn.Module) -> int:
    """Put the original transformers modules back; returns how many were restored."""
    n = int(sdpa.uninstall(model))
    for name, module in list(model.named_modules()):
        if isinstance(module, _FUSED_TYPES) and name:
            _set_child(model, name, module._hf)
            n += 1
    return n


def installed(model: nn.Module) -> int:
    return sum(isinstance(m, _FUSED_TYPES) for m in model.modules())
