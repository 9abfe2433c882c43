"""Full attention for a prompt piece (more than one token of one sequence) in few launches: `FusedAttention`'s
prefill when `FusedAttention.prefill_fused` is on (the default). transformers' module makes ~40 launches
a Qwen3.5 attention layer for a piece (three projections, the norms and RoPE op by op, the gate's copy, the cache's
update, the core, the gate); here: the q|k|v projections as one GEMM (the decode step's joined weight), the norms,
RoPE, the gate's de-interleave and a StaticLayer's k/v write in one launch (`kernels/qk_norm_rope_rows.py`), the core
(transformers' AttentionInterface, as the module calls it), the sigmoid gate (Qwen3.5) and o_proj. Same arithmetic
and roundings as the module's but for the GEMM's summation order (the norms and RoPE rounded op by op as torch
rounds them). Other caches take the k/v through `cache.update`, as the module does.

Owns `attention_prefill(mod, ...)`; `mod` is a FusedAttention whose `_prefill_ok` holds (the caller checks: no
sinks, a core of `_CORES`, one sequence, the angles as [1, T, ROT] rows). Imports torch, transformers' attention
registry, decode/ops' static_layer and the rows kernel.

Shape legend: T tokens, H hidden, Hq / Hkv heads, D head dim, ROT rotary dims, L cache length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from localmoe.decode.ops import static_layer
from localmoe.kernels.qk_norm_rope_rows import qk_norm_rope_rows


@torch.compiler.disable  # Triton launches stay opaque to dynamo
def attention_prefill(mod, hidden_states, position_embeddings, attention_mask, cache, kwargs: dict):
    """hidden_states [1, T, H] -> (out [1, T, H], the core's attention weights | None), as transformers' module."""
    _, T, H = hidden_states.shape
    D, Hq, Hkv = mod.head_dim, mod.num_heads, mod.num_kv_heads
    cos, sin = (t.reshape(T, -1) for t in position_embeddings)  # [T, ROT]
    qkv = F.linear(hidden_states.reshape(T, H), mod._w_qkv)  # [T, Hq*QW + 2*Hkv*D]
    layer = static_layer(cache, mod.layer_idx, Hkv, D, D, hidden_states) if cache is not None else None
    normed = mod._kind != "none"
    q, k, v, gate = qk_norm_rope_rows(
        qkv,
        mod.q_norm.weight if normed else None,
        mod.k_norm.weight if normed else None,
        cos,
        sin,
        mod._eps,
        num_q_heads=Hq,
        num_kv_heads=Hkv,
        kind=mod._kind,
        gated=mod._gated,
        kv_cache=(layer.keys[0], layer.values[0], layer.cumulative_length) if layer is not None else None,
        whole=mod._whole,
        head_dim=D,
    )
    if layer is not None:  # k and v written at the layer's position by the same launch, the position advanced
        key, value = layer.keys, layer.values  # [1, Hkv, L, D], as StaticLayer.update returns them
    else:
        key, value = k.view(1, T, Hkv, D).transpose(1, 2), v.view(1, T, Hkv, D).transpose(1, 2)
        if cache is not None and mod._cache_kw == "cache":  # exactly as the module calls it (5.2x / 5.17)
            key, value = cache.update(key, value, mod.layer_idx, kwargs=kwargs)
        elif cache is not None:
            key, value = cache.update(key, value, mod.layer_idx)
    query = q.view(1, T, Hq, D).transpose(1, 2)  # [1, Hq, T, D], as transformers' query_states
    core = ALL_ATTENTION_FUNCTIONS[mod.config._attn_implementation]
    out, weights = core(mod, query, key, value, attention_mask, dropout=0.0, scaling=mod.scaling, **kwargs)
    out = out.reshape(1, T, -1).contiguous()  # [1, T, Hq*D]
    if gate is not None:
        out = out * torch.sigmoid(gate.reshape(1, T, -1))
    return mod.o_proj(out), weights
