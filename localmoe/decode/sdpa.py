"""Decode attention through transformers' own extension point: the "localmoe_sdpa" attention implementation.

transformers (v5) picks each attention layer's core by `config._attn_implementation` from `AttentionInterface`,
and builds its masks from `AttentionMaskInterface`. `install(model)` registers "localmoe_sdpa" in both and switches
a model from "sdpa" to it: masks are built exactly as for "sdpa", prefill and every call it does not take run
transformers' `sdpa_attention_forward`, and a one-query-token call (decode, batch 1) runs
`kernels/decode_attention.py`, whose time follows the tokens so far instead of the static cache's length (SDPA read
all 8192 positions of the default context every step: ~1.4 ms of a Qwen3.5-35B step on the H200). Projections,
norms, RoPE and the cache update stay transformers' code; no forward is patched. `uninstall(model)` switches back.

Shape legend: B batch, Hq / Hkv query / KV heads, q query tokens, L cache length, Dk / Dv head dims.
"""

from __future__ import annotations

import torch

from localmoe.kernels.decode_attention import decode_attention
from localmoe.kernels.decode_attention_qk import decode_attention_qk
from localmoe.kernels.tuning import tuned

NAME = "localmoe_sdpa"
decode_calls = 0  # one-token calls taken by the kernel (eager calls; a CUDA graph replay does not count)
_registered: set[str] = set()


def register(name: str, fn) -> None:
    """`fn` as attention implementation `name` in transformers' AttentionInterface, with sdpa's boolean masks
    (once a process; also localmoe.decode.sinks')."""
    if name in _registered:
        return
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)
    _registered.add(name)


def switch(model, old: str, new: str, fn=None) -> bool:
    """Switch a model's attention implementation from `old` to `new` (registering `fn` as `new` first when given);
    True when switched."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != old:
        return False
    if fn is not None:
        register(new, fn)
    model.set_attn_implementation(new)
    return model.config._attn_implementation == new


def takes(query, key, value, attention_mask, dropout, kwargs) -> bool:
    """One query token of one sequence, plain softmax attention, a boolean mask over the cache (or none)."""
    if query.shape[0] != 1 or query.shape[2] != 1 or dropout or key.shape[0] != 1:
        return False
    if any(kwargs.get(k) is not None for k in ("sliding_window", "softcap", "s_aux", "position_bias")):
        return False
    if key.dtype != query.dtype or value.dtype != query.dtype or query.device.type == "meta":
        return False
    if query.shape[1] % key.shape[1] or key.stride(-1) != 1 or value.stride(-1) != 1:
        return False
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool or attention_mask.shape[-1] != key.shape[2]:
            return False
        if attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
            return False
    return True


def localmoe_attention(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None, **kwargs
):
    """AttentionInterface function: query [B,Hq,q,Dk], key [B,Hkv,L,Dk], value [B,Hkv,L,Dv], mask [B,1,q,L] bool
    or None -> (out [B,q,Hq,Dv], None), as `sdpa_attention_forward` returns."""
    if not takes(query, key, value, attention_mask, dropout, kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    return decode(query, key, value, attention_mask, scaling), None


@torch.compiler.disable
def decode(query, key, value, attention_mask, scaling, gate=None):
    """The one-token call `takes` accepted -> out [1, 1, Hq, Dv]; with `gate` [Hq, Dv] (Qwen3.5's output gate) the
    result is out · sigmoid(gate), in the same launches (localmoe.decode.attention)."""
    global decode_calls
    decode_calls += 1
    mask = None if attention_mask is None else attention_mask[0, 0, 0]  # [L]
    _, Hq, _, Dk = query.shape
    kw = tuned(query, "decode_attention", f"Hq{Hq}_Hkv{key.shape[1]}_D{Dk}")  # chunk, block_l, num_warps, prefetch
    out = decode_attention(query[0, :, 0], key[0], value[0], mask, scaling, gate=gate, **kw)  # [Hq, Dv]
    return out.view(1, 1, *out.shape)


@torch.compiler.disable
def decode_qk(qkv, key, value, position, attention_mask, scaling, kwargs, **qk):
    """localmoe.decode.attention's one-token step from its q|k|v projection: q/k norm + RoPE, the k/v write into a
    static layer's key / value [1, Hkv, L, D] at `position` (advanced) and the core in one launch
    (`decode_attention_qk`; `qk`: qk_norm_rope's norm and head arguments) -> out [Hq, D], or None when `takes`
    would not take the call (then the caller runs the two launches)."""
    global decode_calls
    Hq, D = qk["num_q_heads"], key.shape[-1]
    query = qkv.reshape(-1)[: Hq * D].view(1, Hq, 1, D)  # the query's shape, dtype and device, for `takes`
    if not takes(query, key, value, attention_mask, 0.0, kwargs):
        return None
    decode_calls += 1
    mask = None if attention_mask is None else attention_mask[0, 0, 0]  # [L]
    kw = tuned(query, "decode_attention", f"Hq{Hq}_Hkv{key.shape[1]}_D{D}")
    return decode_attention_qk(qkv, key[0], value[0], position, mask, scaling, **qk, **kw)


def install(model) -> bool:
    """Switch a model that uses "sdpa" to "localmoe_sdpa"; True when switched."""
    return switch(model, "sdpa", NAME, localmoe_attention)


def uninstall(model) -> bool:
    return switch(model, NAME, "sdpa")
