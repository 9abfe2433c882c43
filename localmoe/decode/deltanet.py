"""Qwen3.5's Gated DeltaNet for a cached one-token decode step: one GEMV for its four input projections (their
weights share one buffer), one Triton launch (`kernels/delta_rule_step.py`: conv update, gates, l2norm, delta rule,
gated RMSNorm), then out_proj. Calls of more than one token (prefill, prompt pieces, with or without a cache) run
`deltanet_prefill.py`: transformers' forward written out around the chunked delta rule of
`kernels/delta_rule_chunk.py` (one Triton launch for the chunk scan on CUDA, transformers' torch function's twin
elsewhere); the few calls it declines (its docstring) and uncached single tokens run transformers' module. Installed
by `localmoe.decode.replacements`. (Under a FusedDecoderLayer a prefill runs the original decoder layer; `install`
makes this module that layer's `linear_attn`, so the engine's prefill reaches this forward.)

Shape legend: B batch, T tokens, H hidden, C conv channels, H_v value heads, d_v value head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from localmoe.decode.deltanet_prefill import deltanet_prefill
from localmoe.decode.ops import concat_rows, linear_1, one_row, takes_norm
from localmoe.kernels.delta_rule_step import gated_deltanet_step
from localmoe.kernels.tuning import tuned


def _decode_states(cache, layer_idx: int):
    """(conv_state [B,C,K], recurrent_state [B,H_v,d_k,d_v], count [] or None) — the cache's own tensors — when this
    call is a cached single-token step in transformers' sense (the layer has a previous state and does not record the
    past); else None. `count` is the layer's token count from transformers 5.25 on (`cumulative_length_linear`,
    which a Qwen3.5 cache's `get_seq_length()` reads: the step adds 1 to it, as transformers' `increase_count`
    does). Works with the LinearAttention cache layers of transformers 5.17 to 5.25."""
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
    count = getattr(layer, "cumulative_length_linear", None)
    if count is not None and not (isinstance(count, torch.Tensor) and count.device == conv.device):
        return None
    return conv, rec, count


class FusedGatedDeltaNet(nn.Module):
    """Qwen3.5 Gated DeltaNet whose cached single-token step is 4 projections + one fused kernel + out_proj, and
    whose prefill runs the chunked delta rule kernel."""

    # The chunked rule's intra-chunk phase on CUDA (delta_rule_chunk.PREPARES): "torch" (~30 launches a layer),
    # "split" (its elementwise work in one launch, its products and solves in torch: ~7, kernels/delta_rule_inputs.py;
    # deltanet_prefill then also joins the four input projections in one GEMM and runs g / beta and the gated norm as
    # one launch each: a layer's prefill ~61 launches -> ~14) or "triton" (one launch, kernels/delta_rule_prepare.py),
    # and its dots' precision (delta_rule_prepare.PRECISIONS): fp32 "ieee", or "tf32" (~5e-4 on outputs of ~0.1).
    # "split" is the default: 1.08x TTFT over "torch" (H100, Qwen3.5-35B-A3B int4 at --vram 16, a 2048-token prompt,
    # `python bench/staging_ab.py --experts int4 --vram 16 --deltanet torch/ieee,split/ieee`, session 37).
    prefill_prepare = "split"
    prefill_precision = "ieee"

    def __init__(self, hf: nn.Module):
        super().__init__()
        object.__setattr__(self, "_hf", hf)  # prefill / uncached calls, and uninstall
        for name, child in hf.named_children():  # in_proj_qkv/z/b/a, conv1d, norm, out_proj: the same objects
            self.add_module(name, child)
        for name, p in hf.named_parameters(recurse=False):  # dt_bias, A_log
            self.register_parameter(name, p)
        for attr in (
            "layer_idx",
            "num_k_heads",
            "num_v_heads",
            "head_k_dim",
            "head_v_dim",
            "key_dim",
            "value_dim",
            "conv_dim",
            "conv_kernel_size",
            "activation",
            "hidden_size",
            "layer_type",
        ):
            if hasattr(hf, attr):
                setattr(self, attr, getattr(hf, attr))
        self.decode_calls = 0  # fused steps taken (eager calls; a CUDA graph replay does not count)
        self.prefill_calls = 0  # T > 1 calls run by deltanet_prefill (not transformers' module)
        self._launch: dict | None = None  # tuned launch keywords, looked up on the first fused step
        self._w_in, self._in_sizes = concat_rows([self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a])

    def joined_in(self) -> torch.Tensor | None:
        """The four input projections' joined weight [ΣN, H] (`_in_sizes` rows each), or None: none could be made, or
        the weights were moved or replaced since install (then for good: they are projected one by one)."""
        if self._w_in is not None and self.in_proj_qkv.weight.data_ptr() != self._w_in.data_ptr():
            self._w_in = None
        return self._w_in

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache=None,
        attention_mask=None,
        *,
        cache_params=None,
        past_key_values=None,
        input_norm=None,
        **kwargs,
    ):  # hidden_states [B, T, H]
        """transformers' call; `input_norm` (the decoder layer's input RMSNorm, localmoe's FusedDecoderLayer only)
        is applied to hidden_states first: inside the input GEMV on the fused step, else as its own module call."""
        cache = next((c for c in (cache, cache_params, past_key_values) if c is not None), None)
        states = None
        if cache is not None and hidden_states.shape[1] == 1 and self.activation in ("silu", "swish"):
            states = _decode_states(cache, self.layer_idx)
        fold = (
            input_norm is not None
            and states is not None
            and attention_mask is None
            and self.joined_in() is not None
            and one_row(hidden_states[:, 0], self._w_in)
            and takes_norm(input_norm, hidden_states)
        )
        if input_norm is not None and not fold:
            hidden_states, input_norm = input_norm(hidden_states), None
        if states is None and hidden_states.shape[1] > 1:  # prefill / prompt piece: deltanet_prefill.py
            out = deltanet_prefill(self, hidden_states, cache, attention_mask, kwargs)
            if out is not None:
                self.prefill_calls += 1
                return out
        if states is None:  # transformers' own forward (its cache argument is the second positional in 5.17/5.2x)
            return self._hf(hidden_states, cache, attention_mask=attention_mask, **kwargs)
        if attention_mask is not None and attention_mask.dim() == 2:  # transformers' apply_mask_to_padding_states
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        self.decode_calls += 1
        B = hidden_states.shape[0]
        if self.joined_in() is not None:  # the four input projections as one GEMV, split into views (rows strided)
            h = hidden_states[:, 0]  # [B, H]
            proj = linear_1(h, self._w_in, input_norm) if one_row(h, self._w_in) else F.linear(h, self._w_in)
            mixed_qkv, z, b, a = proj.split(self._in_sizes, dim=-1)
        else:
            mixed_qkv = self.in_proj_qkv(hidden_states)[:, 0]  # [B, C]
            z = self.in_proj_z(hidden_states)[:, 0]  # [B, H_v*d_v]
            b = self.in_proj_b(hidden_states)[:, 0]  # [B, H_v]
            a = self.in_proj_a(hidden_states)[:, 0]  # [B, H_v]
        conv_state, rec_state, count = states
        out = self._step(mixed_qkv, z, a, b, conv_state, rec_state, count)  # [B, H_v*d_v]; count += 1 inside
        return self.out_proj(out.view(B, 1, -1))

    @torch.compiler.disable
    def _step(self, mixed_qkv, z, a, b, conv_state, rec_state, count):
        if self._launch is None:
            self._launch = tuned(
                mixed_qkv, "gated_deltanet_step", f"HK{self.num_k_heads}_HV{self.num_v_heads}_D{self.head_v_dim}"
            )
        return gated_deltanet_step(
            mixed_qkv,
            z,
            a,
            b,
            conv_state=conv_state,
            conv_weight=self.conv1d.weight.view(self.conv_dim, -1),
            conv_bias=self.conv1d.bias,
            A_log=self.A_log,
            dt_bias=self.dt_bias,
            norm_weight=self.norm.weight,
            norm_eps=self.norm.variance_epsilon,
            state=rec_state,
            count=count,
            num_k_heads=self.num_k_heads,
            head_k_dim=self.head_k_dim,
            num_v_heads=self.num_v_heads,
            head_v_dim=self.head_v_dim,
            **self._launch,
        )


# router class -> whether it renormalises the top-k weights (None: read the router's `norm_topk_prob`)
