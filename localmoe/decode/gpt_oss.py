"""GPT-OSS's decode step on localmoe's fused path: its RMSNorm as a fused norm, and its text model (embedding ->
alternating sliding-window / full-attention decoder layers -> final norm) for the one-token StaticCache step inside
the CUDA graph. Installed by `localmoe.decode.replacements`; the attention (learned sinks, biases, the window) is
`attention.FusedAttention`'s GPT-OSS path, the layer `decoder_layer.FusedDecoderLayer`, the MoE block (router with a
bias) `moe_layer.FusedSparseMoeBlock`.

GptOssRMSNorm computes (w · x̂).to(x.dtype), x̂ = x·rsqrt(mean(x²)+eps) in fp32, the product in fp32 (its weight is
kept fp32: `_keep_in_fp32_modules`): one rounding, not the "standard" kind's two (x̂ rounded first) and never fp32
out. localmoe's "zero_centred" kind computes (x̂ · (1 + w')).to(x.dtype), the same when 1 + w' == w exactly: w' =
w - 1 in fp32 is exact for every weight of bf16 precision (|w| >= 2^-15 or 0), so the fused norm hands the kernels
(rmsnorm, the GEMV's norm prologue, moe_front) w' and keeps transformers' Parameter registered as its `weight`
(state_dict, `.to()` unchanged). A weight where 1 + (w - 1) != w keeps transformers' module.

The text model's step is FusedTextModel's (embedding, one cos|sin gather from the original rotary module's table,
the final norm) with GPT-OSS's two masks: full attention (key index <= position, over the StaticCache's L rows) and
sliding attention over each sliding layer's W ring rows (row r holds a token when r <= position: localmoe keeps
transformers' StaticSlidingWindowLayer as a ring, `localmoe.decode.sliding`): 5 launches around the layers. The
position is the first full-attention layer's position tensor (transformers' own GptOssModel reads the first layer's,
a sliding layer's host count, so it cannot be captured). Every other call runs the original module, with the sliding
layers put back in transformers' layout before it and into the ring after it.

Shape legend: H hidden, L static cache length, W sliding-window ring rows, ROT/2 GPT-OSS's angles per position.
"""

from __future__ import annotations

import torch
from torch import nn

from localmoe.decode import sinks
from localmoe.decode.ops import FusedRMSNorm
from localmoe.decode.sliding import RING, to_ring, to_transformers
from localmoe.decode.text_model import FusedTextModel, full_static_layer

_TYPES = {"full_attention", "sliding_attention"}


class FusedGptOssRMSNorm(FusedRMSNorm):
    """GptOssRMSNorm as localmoe's zero-centred norm with weight w - 1 (module docstring); `weight` is that fp32
    tensor (remade when transformers' Parameter changes), the Parameter stays registered under the same name."""

    def __init__(self, hf: nn.Module):
        super().__init__(hf, "zero_centred")
        self._shifted: tuple[tuple, torch.Tensor] | None = None

    @property
    def weight(self) -> torch.Tensor:
        w = self._parameters.get("weight")
        if w is None:  # (while FusedRMSNorm's __init__ registers it)
            raise AttributeError("weight")
        key = (w.data_ptr(), w.dtype, w.device, w._version)
        if self._shifted is None or self._shifted[0] != key:
            with torch.no_grad():
                self._shifted = (key, w.detach().float() - 1.0)
        return self._shifted[1]


def exact_shift(weight: torch.Tensor) -> bool:
    """Whether 1 + (w - 1) == w in fp32 for every element (FusedGptOssRMSNorm is then transformers' norm)."""
    w = weight.detach().float()
    return bool(torch.equal(1.0 + (w - 1.0), w)) if w.device.type != "meta" else False


def gpt_oss_norm(hf: nn.Module) -> nn.Module:
    """The replacement table's maker for GptOssRMSNorm: the fused norm when its weight shifts exactly, else `hf`."""
    return FusedGptOssRMSNorm(hf) if exact_shift(hf.weight) else hf


class FusedGptOssModel(FusedTextModel):
    """GptOssModel whose one-token StaticCache step is 5 launches around the decoder layers (module docstring)."""

    def __init__(self, hf: nn.Module):
        super().__init__(hf)
        n = self.config.num_hidden_layers
        types = list(getattr(self.config, "layer_types", None) or [])[:n]
        ok = len(types) == n and set(types) <= _TYPES and "full_attention" in types
        self._types = types if ok else None
        self._full = types.index("full_attention") if ok else None

    def forward(self, *args, **kwargs):
        step = self._step_inputs(args, kwargs)
        if step is not None:
            return self._step(*step)
        cache = kwargs.get(self._cache_kw, kwargs.get("past_key_values"))
        to_transformers(cache)  # transformers' modules see their own layout
        try:
            return self._hf(*args, **kwargs)
        finally:
            to_ring(cache)

    implementations = ("eager", sinks.NAME, "sdpa", "localmoe_sdpa")  # GPT-OSS: "localmoe_sinks"; any mask is read

    def _step_cache(self, cache, device):
        """(the first full-attention layer's position tensor, L) when every sliding layer is a ring; else None."""
        layer = full_static_layer(cache, self._full, device)
        if layer is None or not self._rings_ok(cache):
            return None
        return layer.cumulative_length, layer.keys.shape[2]

    def _rings_ok(self, cache) -> bool:
        """Every sliding layer of the cache a ring of one width W <= L (`sliding.RING`)."""
        layers = cache.layers
        if len(layers) < len(self._types):
            return False
        slid = [layers[i] for i, t in enumerate(self._types) if t == "sliding_attention"]
        if not all(type(x).__name__ == "StaticSlidingWindowLayer" and getattr(x, RING, False) for x in slid):
            return False
        return len({x.keys.shape[2] for x in slid}) <= 1

    def _step(self, x, cache, pos, L, extra):
        """x input_ids [1, 1] or inputs_embeds [1, 1, H]; pos the position tensor [] -> transformers' output."""
        self.decode_calls += 1
        h = self.embed_tokens(x) if not x.is_floating_point() else x  # [1, 1, H]: 1 launch
        angles, kv = self._angles(h, L)  # [2, L, ROT/2], [L]
        cs = angles.index_select(1, pos.view(1))  # [2, 1, ROT/2]: 1 launch
        rope = (cs[0:1], cs[1:2])
        slid = [cache.layers[i] for i, t in enumerate(self._types) if t == "sliding_attention"]
        W = slid[0].keys.shape[2] if slid else L
        masks = {
            "full_attention": (kv <= pos).view(1, 1, 1, L),  # 1 launch
            "sliding_attention": (kv[:W] <= pos).view(1, 1, 1, W),  # ring rows holding a token: 1 launch
        }
        for i, layer in enumerate(self.layers[: self.config.num_hidden_layers]):
            h = layer(
                h,
                position_embeddings=rope,
                attention_mask=masks[self._types[i]],
                position_ids=pos.view(1, 1),
                **{self._cache_kw: cache},
                use_cache=True,
                **extra,
            )
        h = self.norm(h)  # 1 launch
        return self._out(last_hidden_state=h, **{self._out_cache: cache})
