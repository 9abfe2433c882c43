"""DeepSeek-V2's multi-head latent attention (MLA) for a cached one-token decode step, absorbed over the compressed
cache as the DeepSeek-V2 paper describes. Installed by `localmoe.decode.replacements` in place of transformers'
`DeepseekV2Attention`; prefill and every other call run that module.

transformers already caches MLA's latents (per position: the normalised compressed KV c [C] as the layer's keys and
the rotary key k_pe [R] as its values, one "head"), but its module expands the whole cache through kv_b_proj on every
step. Here W_UK and W_UV, row blocks of kv_b_proj's weight [Hq·(Dn + Dv), C], are absorbed (no copy):

    q_lat[h] = q_nope[h] · W_UK[h]           [Hq, Dn] x [Hq, Dn, C] -> [Hq, C]   (kernels/mla_absorb.py)
    o_lat    = softmax((q_lat·cᵀ + q_pe·k_peᵀ) · scale) · c                        (kernels/mla_decode.py)
    o[h]     = o_lat[h] · W_UV[h]ᵀ            [Hq, C] x [Hq, C, Dv] -> [Hq, Dv]  (the core's second launch)

which equals q_nope·k_nopeᵀ with k_nope = c·W_UKᵀ and o = p·(c·W_UVᵀ), the expanded form, up to rounding. Bytes per
step and layer: L·(C + R) cached elements instead of L·Hq·(Dn + Dv) expanded ones written and read again.

Launches per decode call on a StaticCache (q_lora_rank None, DeepSeek-V2-Lite): q|kv_a GEMV 1 (the two projections
share one buffer; the decoder layer's input norm inside, `input_norm=`), kv_a_layernorm + both ropes + the latents'
write and W_UK 1 (kernels/mla_rope_write.py), the core 2 (the position advanced by the first, W_UV inside the
second), o_proj 1: 5. Other caches: the norm, transformers' rotary embedding (~8) and the cache's update instead of
the one launch.

Shape legend: Hq heads, Dn / R / Dv the no-rope query, rope and value head dims, C kv_lora_rank, L cache length.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb

from localmoe.decode.ops import concat_rows, linear_1, norm_eps, one_row, static_layer, takes_norm
from localmoe.kernels.mla_absorb import absorb
from localmoe.kernels.mla_decode import mla_decode
from localmoe.kernels.mla_rope_write import mla_rope_write


class FusedMLA(nn.Module):
    """transformers' DeepseekV2Attention whose cached one-token call (batch 1) is absorbed (module docstring); other
    calls (prefill, no cache, batch > 1, a padding mask, training) run the original module, kept unregistered as
    `_hf`."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        object.__setattr__(self, "_hf", hf)  # prefill / unsupported calls, and uninstall
        for name, child in hf.named_children():  # q_proj | q_a_proj, q_a_layernorm, q_b_proj, kv_a_*, kv_b_proj
            self.add_module(name, child)
        for k, v in vars(hf).items():  # layer_idx, num_heads, the head dims, kv_lora_rank, scaling, ...
            if not k.startswith("_") and k != "training" and isinstance(v, (str, int, float, bool)):
                setattr(self, k, v)
        self.training = hf.training
        self.config = hf.config
        self.q_lora_rank = hf.q_lora_rank  # None: q_proj; else q_a_proj -> q_a_layernorm -> q_b_proj
        params = inspect.signature(hf.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers 5.2x / 5.17
        self.decode_calls = 0  # absorbed steps taken (eager calls; a CUDA graph replay does not count)
        self.static_writes = 0  # of which through mla_rope_write into a StaticLayer
        self._w_in, self._in_sizes = concat_rows([self._q_in(), self.kv_a_proj_with_mqa])

    def _q_in(self) -> nn.Module:
        return self.q_proj if self.q_lora_rank is None else self.q_a_proj

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [Hq, Dn, C], W_UV [Hq, Dv, C]): views of kv_b_proj's weight, no copy."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    def _fusable(self, h: torch.Tensor, attention_mask, cache) -> bool:
        if cache is None or self.training or h.dim() != 3 or h.shape[0] != 1 or h.shape[1] != 1:
            return False
        if attention_mask is not None and attention_mask.dim() != 4:  # a padding mask: the original module
            return False
        w = self.kv_b_proj.weight
        if w.dtype != h.dtype or w.device != h.device or getattr(self.kv_b_proj, "bias", None) is not None:
            return False
        return not (torch.is_grad_enabled() and (h.requires_grad or w.requires_grad))

    def _joint(self) -> torch.Tensor | None:
        """The q|kv_a weight buffer, None when the projections no longer share it (moved or replaced since install)."""
        w = self._w_in
        if w is not None and self._q_in().weight.data_ptr() != w.data_ptr():
            self._w_in = w = None
        return w

    def _project(self, h: torch.Tensor, input_norm=None) -> tuple[torch.Tensor, torch.Tensor]:
        """h [1, 1, H] -> (q [1, 1, Hq·(Dn + R)], kv_a output [1, 1, C + R]); `input_norm` (see forward) inside the
        joint GEMV."""
        w = self._joint()
        if w is not None:
            out = linear_1(h, w, input_norm) if one_row(h, w) else F.linear(h, w)
            q, ckv = out.split(self._in_sizes, dim=-1)
        else:
            q, ckv = self._q_in()(h), self.kv_a_proj_with_mqa(h)
        if self.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        return q, ckv

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        cache=None,
        position_embeddings=None,
        *,
        past_key_values=None,
        input_norm=None,
        **kwargs,
    ):
        """hidden_states [B, T, H] -> ([B, T, H], None), as transformers' module. `input_norm` (the decoder layer's
        input RMSNorm; localmoe's FusedDecoderLayer only) is applied to hidden_states first: inside the q|kv_a GEMV
        on the absorbed step, else as its own module call."""
        cache = cache if cache is not None else past_key_values
        fusable = self._fusable(hidden_states, attention_mask, cache)
        w = self._joint() if fusable and input_norm is not None else None
        if input_norm is not None and not (
            w is not None and one_row(hidden_states, w) and takes_norm(input_norm, hidden_states)
        ):
            hidden_states, input_norm = input_norm(hidden_states), None
        if not fusable:
            return self._hf(
                hidden_states, attention_mask, position_embeddings=position_embeddings, **{self._cache_kw: cache},
                **kwargs,
            )  # fmt: skip
        self.decode_calls += 1
        Hq, Dn, R, C = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
        q, ckv = self._project(hidden_states, input_norm)
        static = static_layer(cache, self.layer_idx, 1, C, R, hidden_states)
        w_uk, w_uv = self._absorbed()
        if static is not None and static.cumulative_length.dtype == torch.int64:
            # norm, ropes, the write and W_UK: 1 launch; the core: 2 (its split advances the position)
            self.static_writes += 1
            norm = self.kv_a_layernorm
            keys, values = static.keys[0, 0], static.values[0, 0]  # [L, C], [L, R]
            pos = static.cumulative_length
            q_pe, q_lat = mla_rope_write(
                q.view(Hq, Dn + R), ckv.view(C + R), norm.weight, norm_eps(norm),
                torch.view_as_real(position_embeddings).view(R // 2, 2), keys, values, pos, Dn, w_uk=w_uk,
                advance=False,
            )  # fmt: skip
            out = mla_decode(q_lat, q_pe, keys, values, pos.view(1), self.scaling, w_uv=w_uv, advance=True)
            return self.o_proj(out.view(1, 1, Hq * self.v_head_dim)), None
        q = q.view(1, 1, Hq, Dn + R).transpose(1, 2)  # [1, Hq, 1, Dn + R], as transformers' q
        q_nope, q_pe = torch.split(q, [Dn, R], dim=-1)
        c, k_pe = torch.split(ckv, [C, R], dim=-1)
        c = self.kv_a_layernorm(c).view(1, 1, 1, C)
        q_pe, k_pe = apply_rotary_emb(q_pe, k_pe.view(1, 1, 1, R), position_embeddings.to(q_pe.device))
        if self._cache_kw == "cache":  # exactly as the original calls it (transformers 5.2x / 5.17)
            keys, values = cache.update(c, k_pe, self.layer_idx, kwargs=kwargs)  # [1, 1, L, C], [1, 1, L, R]
        else:
            keys, values = cache.update(c, k_pe, self.layer_idx)
        q_pe = q_pe.reshape(Hq, R).contiguous()
        n = _valid_length(cache, self.layer_idx, keys)
        q_lat = absorb(q_nope.reshape(Hq, Dn), w_uk)  # [Hq, C]
        out = mla_decode(q_lat, q_pe, keys[0, 0], values[0, 0], n, self.scaling, w_uv=w_uv)  # [Hq, Dv]: o_lat · W_UVᵀ
        return self.o_proj(out.view(1, 1, Hq * self.v_head_dim)), None


def _valid_length(cache, layer_idx: int, keys: torch.Tensor) -> torch.Tensor:
    """The number of cached positions the token attends to, as a device int tensor: a StaticLayer's
    `cumulative_length` (already advanced by its update; the rest of its L rows are empty), else every row."""
    layers = getattr(cache, "layers", None)
    layer = layers[layer_idx] if layers is not None and layer_idx < len(layers) else None
    pos = getattr(layer, "cumulative_length", None) if type(layer).__name__ == "StaticLayer" else None
    if isinstance(pos, torch.Tensor) and pos.numel() == 1 and pos.device == keys.device:
        return pos.reshape(1)
    return torch.full((1,), keys.shape[-2], dtype=torch.int64, device=keys.device)
