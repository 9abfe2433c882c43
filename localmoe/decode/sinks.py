"""Attention with learned sinks (GPT-OSS) through SDPA: the "localmoe_sinks" attention implementation.

transformers runs GPT-OSS's attention eagerly (its SDPA path has no sinks), so a prompt piece of T tokens
materialises its [Hq, T, L] scores several times over: ~2.7 GB at T 640 against an 8,192-token cache at
gpt-oss-120b's 64 heads, which the prefill reserve (experts/prefill_budget.py) has to take from the expert cache.
A sink is one more key per head whose logit is the learned s_h and whose value is zero. Given to SDPA as one more
coordinate of every query, s_h / scaling, against one more key (0, ..., 0, 1) (the real keys hold 0 there), the
softmax over [q·k, s_h] is eager's exactly and no score matrix is kept: SDPA's fused kernels take the masked call.
The head dim is padded with zeros to a multiple of 8 (the fused kernels' granularity). The sink key is shared by
every head (its per-head logit rides in the query), but keys and values are still repeated to the query heads, as
transformers' own SDPA path does for a masked call: grouped heads with a mask are not taken by every fused kernel.

`install(model)` registers the implementation in transformers' AttentionInterface (with sdpa's boolean masks in
AttentionMaskInterface) and switches a model whose attention layers carry `sinks` from "eager" to it; the loader
does so for every GPT-OSS model. One-token decode steps on CUDA are localmoe's fused kernel (decode/attention.py),
which reads either mask. No forward is patched; `uninstall(model)` switches back.

Shape legend: B batch, Hq / Hkv query / KV heads, T query tokens, L cache length, D head dim, Dp padded head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from localmoe.decode import sdpa

NAME = "localmoe_sinks"


def sinks_attention(
    module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, s_aux=None, **kwargs
) -> tuple[torch.Tensor, None]:
    """AttentionInterface function: query [B, Hq, T, D], key / value [B, Hkv, L, D], attention_mask [B, 1, T, L] bool
    (True: attend) or None (causal, the last T of L positions), s_aux [Hq] the sinks -> (out [B, T, Hq, D], None),
    what GPT-OSS's eager_attention_forward returns (its probabilities are not kept)."""
    B, Hq, T, D = query.shape
    Hkv, L = key.shape[1], key.shape[2]
    scale = float(scaling) if scaling is not None else D**-0.5
    Dp = -(-(D + 1) // 8) * 8
    q = query.new_zeros(B, Hq, T, Dp)
    q[..., :D] = query
    if s_aux is not None:
        q[..., D] = (s_aux.float() / scale).to(query.dtype)[None, :, None]
    k = key.new_zeros(B, Hkv, L + 1, Dp)
    k[:, :, :L, :D] = key
    k[:, :, L, D] = 1.0 if s_aux is not None else 0.0
    v = value.new_zeros(B, Hkv, L + 1, value.shape[-1])
    v[:, :, :L] = value
    if Hq != Hkv:
        k, v = k.repeat_interleave(Hq // Hkv, dim=1), v.repeat_interleave(Hq // Hkv, dim=1)
    if attention_mask is None:
        rows = torch.arange(T, device=query.device)[:, None] + (L - T)
        attention_mask = (torch.arange(L, device=query.device)[None, :] <= rows)[None, None]
    elif attention_mask.dtype != torch.bool:
        attention_mask = attention_mask == 0  # an additive float mask: 0 where attended
    mask = torch.ones(*attention_mask.shape[:-1], L + 1, dtype=torch.bool, device=query.device)
    mask[..., :L] = attention_mask  # the sink column always attends
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)
    return out.transpose(1, 2).contiguous(), None


def _has_sinks(model: nn.Module) -> bool:
    return any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules())


def install(model) -> bool:
    """Switch a model with sink attention layers from "eager" to "localmoe_sinks"; True when switched."""
    return _has_sinks(model) and sdpa.switch(model, "eager", NAME, sinks_attention)


def uninstall(model) -> bool:
    return sdpa.switch(model, NAME, "eager")
