"""The Qwen3.5 / Qwen3-MoE / OLMoE / Mixtral / GraniteMoE / DeepSeek-V2 / GPT-OSS decoder layer for decode, whose
norms and residual adds ride in neighbouring kernels (the mixer's input GEMV, moe_front, the experts' or the shared
expert's last launch); a prompt piece runs the layer's arithmetic with the fused norms (`prefill_norms`, on by
default) and its children's own prefill paths. Installed by `localmoe.decode.replacements`; the MoE block it drives
is decode/moe_layer.py's.

Shape legend: B batch, T tokens, H hidden.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from localmoe.decode.attention import FusedAttention
from localmoe.decode.deltanet import FusedGatedDeltaNet
from localmoe.decode.mla import FusedMLA
from localmoe.decode.moe_layer import BLOCK_NAMES, FusedSparseMoeBlock
from localmoe.decode.ops import FusedRMSNorm
from localmoe.kernels.rmsnorm import rmsnorm


class FusedDecoderLayer(nn.Module):
    """Qwen3.5-MoE / Qwen3-MoE / OLMoE / Mixtral / GraniteMoE / DeepSeek-V2 decoder layer whose one-token call has no
    launch of its own: the input RMSNorm goes into the mixer's input GEMV (FusedGatedDeltaNet / FusedAttention /
    FusedMLA `input_norm=`); when the experts run `sparse_fused` (`FusedSparseMoeBlock.takes_front`) the rest is
    `moe_front` (with the shared expert, if any; DeepSeek-V2's fp32 router, its ungated shared experts in sparse_fused's
    shared programs, so only over dense, unquantized experts) + `sparse_fused` (with the residual in its tail); else
    (experts off that path, GPT-OSS's biased router) the mixer's output + residual go into the post-attention RMSNorm's
    launch and the MoE output + residual into the shared expert's last kernel (without a shared expert: one add launch).
    Only when its norm and MoE block are localmoe's fused modules and the call is one token on their device; other
    one-token calls run transformers' layer arithmetic with this layer's (fused) children, and more tokens (prefill) the
    original layer, whose children are the originals, or, with `prefill_norms` on and both norms localmoe's, the same
    arithmetic with the fused norms (the input norm one launch, the residual add and post-attention norm one) and the
    children's own prefill paths. GraniteMoE: both branches scaled by `residual_multiplier` before their residual adds
    (module docstring)."""

    # Prefill through the fused norms: ~11 launches a layer fewer than transformers' RMSNorms and residual add (the
    # tiny models of tests/test_fused_model.py); the numerics are the decode step's (fp32 inside one
    # kernel, not torch's op by op). On by default: 1.02x TTFT alone (`bench/staging_ab.py --prefill-norms`, H100,
    # int4 at --vram 16, 2048 tokens); `bench/prefill_check.py` passed with all four prefill switches on.
    prefill_norms = True

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
        self._moe_name = next((n for n in BLOCK_NAMES if isinstance(getattr(hf, n, None), nn.Module)), "mlp")
        self._scale = float(getattr(hf, "residual_multiplier", 1.0))  # GraniteMoE's; 1 for the others
        self.decode_calls = 0

    @property
    def _moe(self) -> nn.Module:
        """The MoE block child (`mlp`, or GraniteMoE's `block_sparse_moe`)."""
        return getattr(self, self._moe_name)

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        """A branch's output as transformers adds it to the residual: `h * residual_multiplier` (GraniteMoE)."""
        return h if self._scale == 1.0 else h * self._scale

    def _fusable(self, h: torch.Tensor) -> bool:
        return (
            isinstance(self.post_attention_layernorm, FusedRMSNorm)
            and isinstance(self._moe, FusedSparseMoeBlock)
            and self._moe._fusable(h)
            and (self._scale == 1.0 or not self._moe.has_shared)
        )

    def _prefill_fused(self, h: torch.Tensor) -> bool:
        """Whether a call of more than one token runs this layer's arithmetic with its fused norms (`prefill_norms`)."""
        norms = (self.input_layernorm, self.post_attention_layernorm)
        return self.prefill_norms and h.dim() == 3 and all(isinstance(n, FusedRMSNorm) for n in norms)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):  # [B, T, H]
        prefill = hidden_states.dim() != 3 or hidden_states.shape[0] * hidden_states.shape[1] != 1
        if prefill and not self._prefill_fused(hidden_states):
            return self._hf(hidden_states, *args, **kwargs)  # prefill: the original layer
        a = self._sig.bind(hidden_states, *args, **kwargs).arguments
        extra = dict(a.pop(self._var_kw, {})) if self._var_kw else {}
        cache = a.get(self._cache_kw)
        for name in ("cache", "past_key_values"):  # the model may pass the other name (transformers 5.17's GPT-OSS)
            other = extra.pop(name, None)
            cache = other if cache is None else cache
        self.decode_calls += not prefill
        if isinstance(getattr(self, "linear_attn", None), FusedGatedDeltaNet):  # the input norm inside its GEMV
            h = self.linear_attn(
                hidden_states, cache, attention_mask=a.get("attention_mask"), input_norm=self.input_layernorm, **extra
            )
        elif getattr(self, "block_type", None) == "linear_attention":
            h = self.linear_attn(
                self.input_layernorm(hidden_states), cache, attention_mask=a.get("attention_mask"), **extra
            )
        else:  # GraniteMoE's layer takes position_ids in **kwargs
            position_ids = a["position_ids"] if "position_ids" in a else extra.pop("position_ids", None)
            attn, h = self.self_attn, hidden_states
            norm_kw = {"input_norm": self.input_layernorm} if isinstance(attn, (FusedAttention, FusedMLA)) else {}
            if not norm_kw:
                h = self.input_layernorm(hidden_states)
            h, _ = attn(
                hidden_states=h,
                attention_mask=a.get("attention_mask"),
                position_ids=position_ids,
                position_embeddings=a.get("position_embeddings"),
                **{_kw(attn, "cache", "past_key_values"): cache},
                **norm_kw,
                **extra,
            )
        norm, moe = self.post_attention_layernorm, self._moe
        if self._fusable(hidden_states) and moe.takes_front(h):  # sparse decode: 2 launches from here (GraniteMoE's
            return moe.step_front(h, hidden_states, norm, self._scale)  # scales inside moe_front)
        h = self._scaled(h)  # (GraniteMoE: 1 launch)
        if not self._fusable(hidden_states):  # prefill, or e.g. the MoE block left out of the table: transformers'
            if prefill:  # layer's arithmetic, with this layer's children (fused where they are)
                hn, s = _add_norm(h, hidden_states, norm)
            else:
                s = hidden_states + h
                hn = norm(s)
            m = moe(hn)
            return s + self._scaled(m[0] if isinstance(m, tuple) else m)
        h, residual = _add_norm(h, hidden_states, norm)
        if moe.has_shared:  # the residual add in the shared expert's last kernel
            return moe.step(h, residual)[0]
        return residual + self._scaled(moe.step(h)[0])


def _kw(module: nn.Module, *names: str) -> str:
    """The first of `names` that `module.forward` takes (transformers renamed cache arguments between versions)."""
    params = inspect.signature(module.forward).parameters
    return next((n for n in names if n in params), names[-1])


@torch.compiler.disable
def _add_norm(h, residual, norm: FusedRMSNorm):
    """(norm(residual + h), residual + h) in one launch."""
    return rmsnorm(h, norm.weight, norm.eps, norm.kind, residual=residual)
