"""The text model of Qwen3.5-MoE, Qwen3-MoE, OLMoE, Mixtral, GraniteMoE and DeepSeek-V2 (embedding -> decoder layers ->
final norm) for the one-token cached decode step, with transformers' glue around the layers cut to 4 launches
(GraniteMoE: 5, its `embedding_multiplier` one multiply after the embedding, as transformers does it; its
`logits_scaling` is the LM head's, outside this module). Installed by `localmoe.decode.replacements`; every other call
runs transformers' module.

On the CUDA-graph decode step every decoder layer is localmoe's FusedDecoderLayer; what transformers' text model
does around them was 25 small kernels on the H200 (transformers 5.17): the embedding, mrope's cos/sin (inv_freq
product, cos, sin, scaling, recomposition, casts), position-id arithmetic (aranges, adds), the causal mask over the
static cache, the final norm (Qwen3-MoE's, OLMoE's, Mixtral's, GraniteMoE's: the same without mrope). Here 4: the
embedding, ONE gather of (cos, sin) for the position from a table (DeepSeek-V2: of its complex freqs_cis, which
its rotary module returns in place of the pair), the boolean causal mask (key index <= position:
transformers' sdpa mask for one query over a StaticCache), the final norm. Measured at Qwen3.5-35B-A3B shapes
(random bf16 weights, sparsity 0.85): 246 -> 225 kernels per step, graph decode 2874 -> 2724 µs
per step (348 -> 367 tok/s).

The table holds transformers' own values: made once (lazily, on the first such call; again when the cache length,
the dtype or the device changes) by calling the model's ORIGINAL rotary module on positions 0..L-1, so row p is what
transformers computes for position p. The position is the cache's own device tensor: the first full-attention
StaticLayer's `cumulative_length`, which `cache.get_seq_length()` returns up to transformers 5.24 (from 5.25 a
Qwen3.5 cache returns its first linear-attention layer's count, which the fused DeltaNet step advances as
transformers does, so the two stay equal); the `cache_position` keyword is passed on to the layers as transformers
passes it, and ignored as transformers ignores it. It is never read on the host, so the step stays capturable.

Taken: input_ids [1, 1] (or inputs_embeds [1, 1, H]); no attention_mask / position_ids; a transformers StaticCache
already holding the prompt; use_cache; no hidden-state / attention / router-logit outputs; sdpa / localmoe_sdpa
attention; a position-independent RoPE (not dynamic / longrope); no sliding window (Mixtral with
`config.sliding_window` set: the original module, as its masks differ); every layer a
FusedDecoderLayer. The layers get
what transformers passes them: the same mask (full attention; FusedAttention hands it to the decode-attention
kernel, which skips the static cache's unused tail by it, so it cannot be dropped), None for the linear-attention
layers (transformers' one-token value), cos/sin of the same values and shape, the same keywords.
Other calls run the original module (`_hf`) as they did before this module was installed: a child swapped in this
module's slot later (install puts the fused final norm there) is put in the original's slot too; uninstall puts the
original back in both.

Shape legend: B batch, T tokens, H hidden, L static cache length, ROT rotary dims.
"""

from __future__ import annotations

import inspect
import re
import sys

import torch
from torch import nn

from localmoe.decode.decoder_layer import FusedDecoderLayer

_CORES = ("sdpa", "localmoe_sdpa")  # attention implementations whose mask is transformers' boolean sdpa_mask
_OUTPUT_FLAGS = ("output_hidden_states", "output_attentions", "output_router_logits")
_PASSED = {"cache_position", *_OUTPUT_FLAGS}  # keywords the fused call takes (passed on to the layers, as transformers)


def _output_class(hf: nn.Module):
    """The ModelOutput class the original forward returns (MoeModelOutputWithPast in transformers 5.2x,
    Qwen3_5MoeModelOutputWithPast in 5.17; the annotation of 5.17 names its base), read from its `return` statement
    and looked up where that forward is defined; None when not found (then the fused call is never taken)."""
    fn = type(hf).forward
    try:
        names = re.findall(r"return\s+(\w+)\(", inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    # the name as the forward's own module sees it (a class may borrow another's forward: DeaMoE's Qwen3.5 twin)
    scope = vars(sys.modules.get(getattr(fn, "__module__", None)) or sys.modules[type(hf).__module__])
    cls = scope.get(names[-1]) if names else None
    fields = getattr(cls, "__dataclass_fields__", {})
    return cls if "last_hidden_state" in fields and ("cache" in fields or "past_key_values" in fields) else None


class FusedTextModel(nn.Module):
    """Qwen3.5-MoE's / Qwen3-MoE's / OLMoE's / Mixtral's / GraniteMoE's / DeepSeek-V2's text model whose one-token
    StaticCache step is 4 launches around the decoder layers (see the module docstring). Other calls run the original
    module, kept unregistered as `_hf`."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        object.__setattr__(self, "_hf", hf)  # prefill / unsupported calls, and uninstall
        for name, child in hf.named_children():  # embed_tokens, layers, norm, rotary_emb: the same objects
            self.add_module(name, child)
        for name, p in hf.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for k, v in vars(hf).items():  # gradient_checkpointing, padding_idx, vocab_size, ...
            if not k.startswith("_") and k != "training" and isinstance(v, (str, int, float, bool)):
                setattr(self, k, v)
        self.training = hf.training
        self.config = hf.config
        self._sig = inspect.signature(hf.forward)
        self._cache_kw = "cache" if "cache" in self._sig.parameters else "past_key_values"  # transformers 5.2x / 5.17
        self._out = _output_class(hf)
        self._out_cache = (
            "cache" if self._out is not None and "cache" in self._out.__dataclass_fields__ else "past_key_values"
        )
        self._types = _layer_types(self.config)  # each layer's mask kind; None: not a model this step runs
        self._full = self._types.index("full_attention") if self._types and "full_attention" in self._types else None
        self._embed_scale = float(getattr(hf, "embedding_multiplier", 1.0))  # GraniteMoE's; 1 for the others
        self._mrope = hasattr(self.rotary_emb, "mrope_section")  # Qwen3.5: position ids [3, B, T] (text, h, w)
        self._table: tuple[tuple, torch.Tensor, torch.Tensor] | None = None  # (key, [2, L, ROT] cos|sin, arange(L))
        self.decode_calls = 0  # fused steps taken (eager calls; a CUDA graph replay does not count)

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        hf = self.__dict__.get("_hf")
        if hf is not None and isinstance(value, nn.Module) and name in hf._modules:
            setattr(hf, name, value)  # a child swapped after install (the fused final norm): the original's slot too

    implementations = _CORES  # the attention implementations the fused step runs under

    def forward(self, *args, **kwargs):
        step = self._step_inputs(args, kwargs)
        if step is None:
            return self._hf(*args, **kwargs)
        return self._step(*step)

    def _step_inputs(self, args, kwargs):
        """(h [1, 1, H] or input_ids [1, 1], cache, position [], L, kwargs for the layers) when this call is the
        one-token StaticCache step; else None."""
        try:
            a = self._sig.bind(*args, **kwargs).arguments
        except TypeError:
            return None
        extra = dict(a.pop("kwargs", {}))
        cache = a.pop(self._cache_kw, None)
        if cache is None and self._cache_kw == "cache":  # transformers 5.2x still takes the old name
            cache = extra.pop("past_key_values", None)
        ids, embeds = a.pop("input_ids", None), a.pop("inputs_embeds", None)
        if a.pop("use_cache", None) is not True or any(v is not None for v in a.values()):  # attention_mask, ...
            return None
        if self.training or self._out is None or self._full is None or not set(extra) <= _PASSED:
            return None
        if any(extra.get(k, getattr(self.config, k, False)) for k in _OUTPUT_FLAGS):
            return None
        if not getattr(self.config, "return_dict", True) or not self._shapes_ok(ids, embeds):
            return None
        rope = getattr(self.rotary_emb, "rope_type", None)
        if not isinstance(rope, str) or "dynamic" in rope or rope == "longrope":
            return None  # the angles depend on more than the position (transformers' dynamic_rope_update)
        if getattr(self.config, "_attn_implementation", None) not in self.implementations:
            return None
        n = self.config.num_hidden_layers
        if len(self.layers) < n or not all(isinstance(m, FusedDecoderLayer) for m in self.layers[:n]):
            return None
        found = self._step_cache(cache, (ids if ids is not None else embeds).device)
        if found is None:
            return None
        return (ids if embeds is None else embeds), cache, *found, extra

    def _step_cache(self, cache, device):
        """(the position tensor [], L) of the StaticCache the step decodes into; None when it is not one."""
        L = _static_length(cache, self._full, device)
        return None if L is None else (cache.layers[self._full].cumulative_length, L)

    def _shapes_ok(self, ids, embeds) -> bool:
        if (ids is None) == (embeds is None):
            return False
        if ids is not None:
            return ids.dim() == 2 and ids.shape == (1, 1) and not ids.is_floating_point()
        return embeds.dim() == 3 and embeds.shape[:2] == (1, 1)

    def _step(self, x, cache, pos, L, extra):
        """x input_ids [1, 1] or inputs_embeds [1, 1, H]; pos the cache's position tensor [] -> transformers' output
        with last_hidden_state [1, 1, H] and the cache."""
        self.decode_calls += 1
        h = self.embed_tokens(x) if not x.is_floating_point() else x  # [1, 1, H]: 1 launch
        if self._embed_scale != 1.0:  # GraniteMoE: inputs_embeds * embedding_multiplier (ids or embeds): 1 launch
            h = h * self._embed_scale
        angles, kv = self._angles(h, L)  # [2, L, ROT] (cos|sin) or [1, L, ROT / 2] (complex), [L]
        cs = angles.index_select(1, pos.view(1))  # [2 or 1, 1, ROT or ROT / 2]: 1 launch
        # as transformers' rotary module returns them: cos, sin [B=1, T=1, ROT]; DeepSeek-V2: freqs_cis [1, 1, ROT / 2]
        rope = (cs[0:1], cs[1:2]) if cs.shape[0] == 2 else cs
        masks = {
            "full_attention": (kv <= pos).view(1, 1, 1, L),  # [B, 1, T, L] bool: 1 launch
            "linear_attention": None,
        }
        types = self._types
        for i, layer in enumerate(self.layers[: self.config.num_hidden_layers]):
            h = layer(
                h,
                position_embeddings=rope,
                attention_mask=masks[types[i]],
                position_ids=pos.view(1, 1),
                **{self._cache_kw: cache},
                use_cache=True,
                **extra,
            )
        h = self.norm(h)  # 1 launch (FusedRMSNorm)
        return self._out(last_hidden_state=h, **{self._out_cache: cache})

    @torch.compiler.disable  # built eagerly, outside any compiled or captured region's steady state
    def _angles(self, h: torch.Tensor, L: int) -> tuple[torch.Tensor, torch.Tensor]:
        """([2, L, ROT] cos|sin of positions 0..L-1 in h's dtype, or DeepSeek-V2's [1, L, ROT / 2] complex freqs_cis
        (its rotary module returns one tensor), and arange(L)), from the ORIGINAL rotary module as transformers' text
        model calls it (Qwen3.5: mrope position ids [3, 1, L]; else [1, L]); made once per (L, dtype, device)."""
        key = (L, h.dtype, h.device)
        if self._table is None or self._table[0] != key:
            with torch.no_grad():
                kv = torch.arange(L, device=h.device)
                ids = kv.view(1, 1, L).expand(3, 1, L) if self._mrope else kv.view(1, L)
                out = self.rotary_emb(h, ids)  # (cos, sin) [1, L, ROT] each, or freqs_cis [1, L, ROT / 2]
                table = torch.stack([out[0][0], out[1][0]]) if isinstance(out, tuple) else out
                self._table = (key, table.contiguous(), kv)
        return self._table[1], self._table[2]


def _layer_types(config) -> list[str] | None:
    """Each layer's attention kind: Qwen3.5's `layer_types` (full / linear attention), or every layer full attention
    for a config without them and without a sliding window (Qwen3-MoE, OLMoE); None otherwise (sliding windows, other
    kinds: their masks are not the one this step builds)."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types is None and getattr(config, "sliding_window", None) is None:
        types = ["full_attention"] * n
    types = list(types or [])[:n]
    return types if len(types) == n and set(types) <= {"full_attention", "linear_attention"} else None


def full_static_layer(cache, full: int, device):
    """The full-attention StaticLayer `full` of a plain transformers StaticCache, initialised, with its integer
    position tensor on `device`; else None."""
    if type(cache).__name__ != "StaticCache" or type(cache).__module__ != "transformers.cache_utils":
        return None
    layers = getattr(cache, "layers", None)
    if layers is None or full >= len(layers) or type(layers[full]).__name__ != "StaticLayer":
        return None
    layer = layers[full]
    pos, keys = getattr(layer, "cumulative_length", None), getattr(layer, "keys", None)
    if not (
        getattr(layer, "is_initialized", False) and isinstance(pos, torch.Tensor) and isinstance(keys, torch.Tensor)
    ):
        return None
    if pos.numel() != 1 or pos.is_floating_point() or pos.device != device or keys.dim() != 4:
        return None
    return layer


def _static_length(cache, full: int, device) -> int | None:
    """L when `cache`'s first full-attention layer (index `full`, the layer transformers sizes the mask by) is a
    `full_static_layer` whose position tensor is the one transformers reads (`cache.get_seq_length()`), or, from
    transformers 5.25 on, where that is the first layer's own token count (a Qwen3.5 linear-attention layer's
    `cumulative_length_linear`, kept equal by the layers' steps); else None."""
    layer = full_static_layer(cache, full, device)
    if layer is None:
        return None
    seen = cache.get_seq_length()
    if seen is not layer.cumulative_length and seen is not getattr(cache.layers[0], "cumulative_length_linear", None):
        return None
    L, offset = layer.get_mask_sizes(1)
    return L if offset == 0 and layer.keys.shape[2] == L else None
