"""Qwen3.5's Gated DeltaNet for more than one token (prefill, prompt pieces, uncached calls): transformers'
`Qwen3_5MoeGatedDeltaNet.forward` written out, with its chunked delta rule on CUDA in `kernels/delta_rule_chunk.py`
(the intra-chunk phase batched over all chunks, the chunk scan in one Triton launch; transformers' torch fallback
loops over 64-token chunks in Python) and elsewhere that file's torch reference (transformers' function op for op,
so a CPU prefill equals transformers' bit for bit). With `FusedGatedDeltaNet.prefill_prepare == "split"` (CUDA) the
layer is lean in launches: the four input projections as one GEMM split into views (the decode step's joined
weight), g and beta in one launch (`kernels/delta_rule_inputs.gate_beta`), the rule's split intra-chunk phase, and the
gated norm in one launch (`kernels/rmsnorm`, kind "gated").

The cache is left as transformers leaves it, in 5.17 to 5.25 alike: the initial recurrent state is the layer's
when `has_previous_state[0]` is set before the call (5.2x `get_recurrent_state`, 5.17 `has_previous_state`), the
conv state goes through the cache's own `update_conv_state` (which pads a short prompt, prepends the previous window
on a second piece, keeps the whole past when recording it, and sets `has_previous_state`), and the final state
through `update_recurrent_state`.

`deltanet_prefill` returns None where it does not apply and the caller runs transformers' module: one token (the
caller's cached step or transformers' recurrent path), an activation other than SiLU, packed sequences
(`cu_seq_lens_q` / `seq_idx`), a mask that is not 2-D [B, T], a conv1d with accelerate hooks, a cache layer without
the LinearAttention attributes, a layer recording its last recurrent states for a later `crop` (transformers 5.25's
`activate_past_recording(recurrent_states_to_keep=n)`, assisted decoding; localmoe never asks for it).

Shape legend: B batch, T tokens, H hidden, C conv channels, K conv width, H_k / H_v key / value heads, d_k / d_v
head dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from localmoe.kernels.delta_rule_chunk import chunk_gated_delta_rule, chunk_gated_delta_rule_ref, kernel_available
from localmoe.kernels.delta_rule_inputs import gate_beta
from localmoe.kernels.rmsnorm import rmsnorm

_PACKED = ("cu_seq_lens_q", "cu_seq_lens_k", "seq_idx")


def _cache_layer(cache, layer_idx: int):
    """The cache's LinearAttention layer `layer_idx`, or None when it is not one (both transformers versions)."""
    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx >= len(layers):
        return None
    layer = layers[layer_idx]
    needed = ("has_previous_state", "recurrent_states", "conv_states")
    if not all(hasattr(layer, a) for a in needed) or not isinstance(layer.has_previous_state, dict):
        return None
    if not (hasattr(cache, "update_conv_state") and hasattr(cache, "update_recurrent_state")):
        return None
    return layer


def deltanet_prefill(mod: nn.Module, hidden_states: torch.Tensor, cache, attention_mask, kwargs: dict):
    """`Qwen3_5MoeGatedDeltaNet.forward(hidden_states, cache, attention_mask)` for T > 1 on module `mod` (the
    FusedGatedDeltaNet, whose children and parameters are transformers' own). hidden_states [B, T, H] ->
    [B, T, H], the cache updated as transformers updates it; None where this does not apply (module docstring)."""
    B, T = hidden_states.shape[:2]
    if T < 2 or mod.activation not in ("silu", "swish") or any(kwargs.get(n) is not None for n in _PACKED):
        return None
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape != (B, T)):
        return None
    if getattr(mod.conv1d, "_hf_hook", None) is not None:  # accelerate offloading: transformers fires its hook
        return None
    layer = None
    if cache is not None:
        layer = _cache_layer(cache, mod.layer_idx)
        if layer is None:
            return None
        if getattr(layer, "record_past", False) and getattr(layer, "recurrent_states_to_keep", None):
            return None  # transformers 5.25 records the last steps' recurrent states one by one: its module does
    if attention_mask is not None:  # transformers' apply_mask_to_padding_states
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    initial = None
    if layer is not None and layer.has_previous_state.get(0, False):  # read before update_conv_state sets it
        initial = layer.recurrent_states[0]
    lean = kernel_available(hidden_states) and mod.prefill_prepare == "split"  # few launches (FusedGatedDeltaNet)
    w_in = mod.joined_in() if lean else None
    if w_in is not None:  # one GEMM, split into views
        mixed_qkv, z, b, a = torch.split(F.linear(hidden_states, w_in), mod._in_sizes, dim=-1)
    else:
        mixed_qkv, z = mod.in_proj_qkv(hidden_states), mod.in_proj_z(hidden_states)
        b, a = mod.in_proj_b(hidden_states), mod.in_proj_a(hidden_states)  # [B, T, H_v]
    mixed_qkv = mixed_qkv.transpose(1, 2)  # [B, C, T]
    z = z.reshape(B, T, -1, mod.head_v_dim)
    if cache is not None:  # [B, C, T + the previous window on a second piece]; the conv state written
        mixed_qkv = cache.update_conv_state(mixed_qkv, mod.layer_idx, conv_kernel_size=mod.conv_kernel_size)
    weight = mod.conv1d.weight.squeeze(1)  # [C, K]; transformers' causal_conv1d_fn
    x = F.conv1d(
        mixed_qkv.to(weight.dtype),
        weight.unsqueeze(1),
        mod.conv1d.bias,
        padding=weight.shape[-1] - 1,
        groups=mixed_qkv.shape[1],
    )[:, :, : mixed_qkv.shape[-1]]
    x = F.silu(x).to(mixed_qkv.dtype)
    if cache is not None:  # drop the previous window's positions
        x = x[:, :, -T:]
    x = x.transpose(1, 2)  # [B, T, C]
    q, k, v = torch.split(x, [mod.key_dim, mod.key_dim, mod.value_dim], dim=-1)
    q = q.reshape(B, T, -1, mod.head_k_dim)  # [B, T, H_k, d_k]: the chunk rule serves H_v / H_k heads from each
    k = k.reshape(B, T, -1, mod.head_k_dim)
    v = v.reshape(B, T, -1, mod.head_v_dim)
    if lean:  # one launch for both (8 as torch ops)
        g, beta = gate_beta(a, b, mod.A_log, mod.dt_bias)
    else:
        beta = b.sigmoid()
        g = -mod.A_log.float().exp() * F.softplus(a.float() + mod.dt_bias)
    kw = dict(initial_state=initial, output_final_state=cache is not None, use_qk_l2norm_in_kernel=True)
    if kernel_available(q):
        core, last = chunk_gated_delta_rule(
            q, k, v, g, beta, prepare=mod.prefill_prepare, precision=mod.prefill_precision, **kw
        )
    else:
        core, last = chunk_gated_delta_rule_ref(q, k, v, g, beta, **kw)
    if cache is not None:
        cache.update_recurrent_state(last, mod.layer_idx)
    core, z = core.reshape(-1, mod.head_v_dim), z.reshape(-1, mod.head_v_dim)
    if lean and getattr(mod.norm, "activation", None) in ("silu", "swish"):  # the gated norm in one launch (~10)
        core = rmsnorm(core, mod.norm.weight, mod.norm.variance_epsilon, kind="gated", z=z)
    else:
        core = mod.norm(core, z)
    return mod.out_proj(core.reshape(B, T, -1))
