"""Full attention for a cached one-token decode step: Qwen3.5-MoE's gated attention (partial RoPE, a sigmoid output
gate interleaved with the query in q_proj), Qwen3-MoE's (no gate, RoPE over the whole head, GQA), OLMoE's (as
Qwen3-MoE's with q/k norms over the whole projection, not per head; no clip_qkv), Mixtral's and GraniteMoE's (no q/k
norms; GraniteMoE's `attention_multiplier` is its module's `scaling`, used as it is; Mixtral with a `sliding_window`
in its config: not fused), GPT-OSS's (q|k|v|o biases, learned `sinks`, a sliding window on alternate layers, YaRN
angles of ROT/2 per position, no q/k norms; its "eager" implementation kept, the fused step calling localmoe's
kernel itself). One GEMV for
q|k|v (the three projections' weights share one buffer), then on a StaticCache with localmoe_sdpa one Triton launch
for the per-head q/k RMSNorm + RoPE, the k/v write into the cache and the attention core (localmoe_sdpa's
`decode_qk`: kernels/decode_attention_qk.py's `decode_attention_qk`; the sigmoid gate read from the projection in its
combine; kind "none": RoPE alone), and o_proj. Other caches and cores: `kernels/qk_norm_rope.py` (norms, RoPE, the
gate's de-interleave), the cache's update, the core. A prompt piece runs `attention_prefill`
(decode/attention_prefill.py) when `FusedAttention.prefill_fused` is on; every other call runs transformers' module.
Installed by `localmoe.decode.replacements`.

Launches per decode call (StaticCache, localmoe_sdpa; counted on the CPU with the interpreter), transformers' module
with localmoe's GEMV and RMSNorm children:
* Qwen3.5 28: q/k/v projections 3, the gate's copy 1, norms 2, RoPE 12 (products, rotate_half's neg and cat, sums,
  the partial-rotary cat), cache update 5, core 2, sigmoid 1, multiply 1, o_proj 1; here 3: q|k|v GEMV (with the
  decoder layer's input norm inside), the core (norms, RoPE, the k/v write into a StaticLayer's tensors and its
  position's advance, the sigmoid gate in its combine), o_proj;
* Qwen3-MoE 22: q/k/v projections 3, norms 2, RoPE 10, cache update 5, core 1, o_proj 1; here 3: q|k|v GEMV (with
  the input norm), the core (+ norms, RoPE, the k/v write), o_proj; Mixtral and GraniteMoE 20 (no norms) -> the
  same 3.
* GPT-OSS 37 on a sliding layer (36 full): q/k/v projections 3 (with their biases), RoPE 14 (GPT-OSS's chunked
  halves), cache update 6 (the sliding layer's two rolls, two index writes, two copies; full: 5), core 8 (eager:
  two bmm, scale, mask, the sinks' cat, max, sub, softmax), o_proj 1 (+ the input norm's 1 and the layer's 4 below
  it, the experts apart); here 4: q|k|v GEMV (with the input norm; the biases go into qk_norm_rope: the GEMV has
  none), qk_norm_rope (biases, RoPE on the half-width angles, the k/v write: a StaticLayer's row at the position,
  a sliding layer's ring row at position % W, `localmoe.decode.sliding`), the core (sinks and window in its
  launch), o_proj (F.linear with its bias: 1). transformers' modules alone: 49 / 48 launches per layer (the
  experts apart: tests/test_fused_gpt_oss.py).
Other caches go through `cache.update` (5 launches), other cores through transformers' gate ops (2).

Shape legend: B batch, T tokens, H hidden, Hq / Hkv query / key-value heads, D head dim, ROT rotary dims,
L cache length.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from localmoe.decode import sdpa, sinks
from localmoe.decode.attention_prefill import attention_prefill
from localmoe.decode.ops import (
    FusedLinear,
    FusedRMSNorm,
    concat_rows,
    linear_1,
    norm_eps,
    one_row,
    static_layer,
    takes_norm,
)
from localmoe.decode.sliding import RING, ring_layer
from localmoe.kernels.decode_attention import decode_attention
from localmoe.kernels.qk_norm_rope import qk_norm_rope
from localmoe.kernels.tuning import tuned

_NORM_KINDS = {"Qwen3_5MoeRMSNorm": "zero_centred", "Qwen3MoeRMSNorm": "standard", "OlmoeRMSNorm": "standard"}
_CORES = ("localmoe_sdpa", "sdpa")  # attention implementations the fused step calls (others: the original module)
# attention classes whose forward hands the core `sliding_window=config.sliding_window` (no attribute of its own)
_CONFIG_WINDOW = ("MixtralAttention",)
# GPT-OSS: learned sinks (`sinks` [Hq]), q|k|v|o biases, a window on its sliding layers, cos/sin of ROT/2 angles
_SINK_CLASSES = ("GptOssAttention",)
_SINK_CORES = (*_CORES, "eager", sinks.NAME)  # the fused step calls its own kernel: any mask is read


def _norm_kind(norm: nn.Module) -> str | None:
    if isinstance(norm, FusedRMSNorm):
        return norm.kind if norm.kind in ("zero_centred", "standard") else None
    return _NORM_KINDS.get(type(norm).__name__)


def _angles_ok(position_embeddings, h: torch.Tensor, head_dim: int, half: bool = False, rows: int = 1) -> bool:
    """(cos, sin) of one token (`rows` tokens: contiguous [..., rows, ROT]) in h's dtype and device: [..., ROT] rows,
    ROT even and <= head_dim ([..., ROT/2] with `half`, GPT-OSS's angles)."""
    if not isinstance(position_embeddings, (tuple, list)) or len(position_embeddings) != 2:
        return False
    cos, sin = position_embeddings
    if not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)) or cos.shape != sin.shape:
        return False
    n = cos.shape[-1] if cos.dim() else 0
    rot = 2 * n if half else n
    if rows > 1 and not (cos.is_contiguous() and sin.is_contiguous()):
        return False
    return (
        cos.numel() == rows * n
        and 2 <= rot <= head_dim
        and rot % 2 == 0
        and cos.stride(-1) == 1
        and sin.stride(-1) == 1
        and cos.dtype == sin.dtype == h.dtype
        and cos.device == sin.device == h.device
    )


class FusedAttention(nn.Module):
    """Qwen3.5-MoE / Qwen3-MoE / OLMoE / Mixtral / GraniteMoE full attention whose cached one-token call is: q|k|v
    GEMV -> qk_norm_rope (1 launch) -> the cache's update -> the attention core (transformers' AttentionInterface)
    [-> · sigmoid(gate), Qwen3.5] -> o_proj. Other calls (prefill, no cache, batch > 1, biases, a sliding window,
    clip_qkv, other dtypes/devices or attention implementations, training) run the original module, kept
    unregistered as `_hf`.

    `fold_qk` (default on): on a StaticCache with localmoe_sdpa, the norms, RoPE and the k/v write inside the core's
    launch (`sdpa.decode_qk`); off, qk_norm_rope's launch and then the core (bench/step_ab.py A/Bs the two).
    `prefill_fused` (default on): a prompt piece of one sequence through `attention_prefill` (~11 launches a Qwen3.5
    layer where the module takes ~40; `bench/staging_ab.py --prefill-attention`: 1.02x TTFT on an H100)."""

    fold_qk = True
    prefill_fused = True

    def __init__(self, hf: nn.Module):
        super().__init__()
        object.__setattr__(self, "_hf", hf)  # prefill / unsupported calls, and uninstall
        for name, child in hf.named_children():  # q/k/v/o_proj, q_norm, k_norm: the same objects
            self.add_module(name, child)
        for name, p in hf.named_parameters(recurse=False):
            self.register_parameter(name, p)
        for k, v in vars(hf).items():  # layer_idx, head_dim, num_key_value_groups, scaling, is_causal, ...
            if not k.startswith("_") and k != "training" and isinstance(v, (str, int, float, bool)):
                setattr(self, k, v)
        self.training = hf.training  # (a new Module starts in training mode; its children are the original's)
        self.config = hf.config  # read by the attention core, as for the original
        params = inspect.signature(hf.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # transformers 5.2x / 5.17
        self.num_heads = int(hf.config.num_attention_heads)
        self.num_kv_heads = int(hf.config.num_key_value_heads)
        self.decode_calls = 0  # fused steps taken (eager calls; a CUDA graph replay does not count)
        self.prefill_calls = 0  # prompt pieces through attention_prefill
        self._kind, self._eps = self._norms(hf)
        # OLMoE: q_norm [Hq*D] / k_norm [Hkv*D] over the whole projections; per head: both [D]
        self._whole = (
            self._kind != "none" and hf.q_norm.weight.numel() == self.num_heads * self.head_dim != self.head_dim
        )
        self._sinks = type(hf).__name__ in _SINK_CLASSES and isinstance(getattr(hf, "sinks", None), torch.Tensor)
        self._window = _window(hf)
        projections = [self.q_proj, self.k_proj, self.v_proj]
        self._b_qkv = None  # [Hq*D + 2*Hkv*D] the projections' biases in one buffer (GPT-OSS)
        if self._sinks:
            self._w_qkv, self._b_qkv, sizes = _concat_biased(projections)
        else:
            self._w_qkv, sizes = concat_rows(projections)  # [Hq*QW + 2*Hkv*D, H]
        D, Hq, Hkv = self.head_dim, self.num_heads, self.num_kv_heads
        # QW = 2D: Qwen3.5's gated layout ([q_h | gate_h] per head); D: Qwen3-MoE's plain one
        self._gated = {Hq * 2 * D: True, Hq * D: False}.get(sizes[0]) if sizes[1:] == [Hkv * D, Hkv * D] else None
        if self._whole and self._gated:
            self._gated = None
        if self._gated is None or (self._window is not None and not self._sinks) or _clips(hf):
            self._w_qkv = None  # another layout, a sliding window, clipping: the original module does every call
        if self._sinks and (self._gated or self._kind != "none"):
            self._w_qkv = None

    @staticmethod
    def _norms(hf: nn.Module) -> tuple[str | None, float | None]:
        """(kind, eps) shared by q_norm and k_norm, ("none", 0.0) without either (Mixtral, GraniteMoE), or (None, None)
        when the fused kernel cannot do them."""
        qn, kn = getattr(hf, "q_norm", None), getattr(hf, "k_norm", None)
        if qn is None and kn is None:
            return "none", 0.0
        if qn is None or kn is None:
            return None, None
        kind, eps = _norm_kind(hf.q_norm), norm_eps(hf.q_norm)
        if kind is None or _norm_kind(hf.k_norm) != kind or eps is None or norm_eps(hf.k_norm) != eps:
            return None, None
        return kind, eps

    def _weights_ok(self, h: torch.Tensor) -> bool:
        """The fused paths' weights for h: the joined q|k|v weight still the projections' (x's dtype and device), the
        norms' kind and weights usable, no autograd, not training."""
        w = self._w_qkv
        if w is None or self._kind is None or self.training or h.dtype != w.dtype or h.device != w.device:
            return False
        if self.q_proj.weight.data_ptr() != w.data_ptr():  # weights moved or replaced since install
            self._w_qkv = None
            return False
        if torch.is_grad_enabled() and (h.requires_grad or self.q_proj.weight.requires_grad):
            return False  # the Triton kernels have no backward
        if self._kind != "none":
            qn, kn = self.q_norm.weight, self.k_norm.weight
            if qn.device != h.device or kn.device != h.device or qn.dtype != kn.dtype:
                return False
            if self._kind == "standard" and torch.promote_types(qn.dtype, h.dtype) != h.dtype:
                return False
        return True

    def _fusable(self, h: torch.Tensor, position_embeddings, cache) -> bool:
        if cache is None or h.dim() != 3 or h.shape[0] != 1 or h.shape[1] != 1 or not self._weights_ok(h):
            return False
        impl = getattr(self.config, "_attn_implementation", None)
        if self._sinks:
            return impl in _SINK_CORES and _angles_ok(position_embeddings, h, self.head_dim, half=True)
        return impl in _CORES and _angles_ok(position_embeddings, h, self.head_dim)

    def _prefill_ok(self, h: torch.Tensor, position_embeddings) -> bool:
        """Whether `attention_prefill` runs this call: `prefill_fused` on, several tokens of one sequence, no sinks
        (GPT-OSS's prompt runs its module), a core of `_CORES`, the angles as contiguous [1, T, ROT] rows."""
        if not self.prefill_fused or self._sinks or h.dim() != 3 or h.shape[0] != 1 or h.shape[1] < 2:
            return False
        impl = getattr(self.config, "_attn_implementation", None)
        return (
            self._weights_ok(h)
            and impl in _CORES
            and _angles_ok(position_embeddings, h, self.head_dim, rows=h.shape[1])
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings=None,
        attention_mask=None,
        cache=None,
        *,
        past_key_values=None,
        input_norm=None,
        **kwargs,
    ):
        """hidden_states [B, T, H] -> ([B, T, H], attn weights | None), as transformers' module. `input_norm` (the
        decoder layer's input RMSNorm; localmoe's FusedDecoderLayer only) is applied to hidden_states first: inside
        the q|k|v GEMV on the fused step, else as its own module call."""
        cache = cache if cache is not None else past_key_values
        fusable = self._fusable(hidden_states, position_embeddings, cache)
        if input_norm is not None and not (
            fusable and one_row(hidden_states, self._w_qkv) and takes_norm(input_norm, hidden_states)
        ):
            hidden_states, input_norm = input_norm(hidden_states), None
        if not fusable:
            if self._prefill_ok(hidden_states, position_embeddings):
                self.prefill_calls += 1
                return attention_prefill(self, hidden_states, position_embeddings, attention_mask, cache, kwargs)
            return self._hf(hidden_states, position_embeddings, attention_mask, **{self._cache_kw: cache}, **kwargs)
        if self._sinks:
            return self._sink_step(hidden_states, position_embeddings, attention_mask, cache, input_norm, kwargs)
        self.decode_calls += 1
        input_shape = hidden_states.shape[:-1]  # (1, 1)
        D, Hq, Hkv = self.head_dim, self.num_heads, self.num_kv_heads
        qkv = (
            linear_1(hidden_states, self._w_qkv, input_norm)
            if one_row(hidden_states, self._w_qkv)
            else F.linear(hidden_states, self._w_qkv)
        )  # [1, 1, Hq*QW + 2*Hkv*D]
        static = static_layer(cache, self.layer_idx, Hkv, D, D, hidden_states)
        impl = self.config._attn_implementation
        if static is not None and impl == sdpa.NAME and self.fold_qk:  # norm, RoPE, the k/v write, the core: 1 launch
            cos, sin = position_embeddings
            normed = self._kind != "none"
            out = sdpa.decode_qk(
                qkv, static.keys, static.values, static.cumulative_length, attention_mask, self.scaling, kwargs,
                q_weight=self.q_norm.weight if normed else None, k_weight=self.k_norm.weight if normed else None,
                cos=cos, sin=sin, eps=self._eps, num_q_heads=Hq, num_kv_heads=Hkv, kind=self._kind,
                gated=self._gated, whole=self._whole, head_dim=D,
            )  # fmt: skip
            if out is not None:
                return self.o_proj(out.view(*input_shape, -1)), None
        if static is not None:  # k and v written into the static cache by the same launch
            q, k, v, gate = self._norm_rope(
                qkv, *position_embeddings, kv_cache=(static.keys[0], static.values[0], static.cumulative_length)
            )
            key, value = static.keys, static.values  # [1, Hkv, L, D]; the position advanced by the same launch
        else:
            q, k, v, gate = self._norm_rope(qkv, *position_embeddings)  # [Hq, D], [Hkv, D], [Hkv, D], [Hq*D] | None
            key = k.view(1, 1, Hkv, D).transpose(1, 2)  # [1, Hkv, 1, D], as transformers' key_states
            value = v.view(1, 1, Hkv, D).transpose(1, 2)
            if self._cache_kw == "cache":  # exactly as the original calls it (transformers 5.2x / 5.17)
                key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)  # [1, Hkv, L, D]
            else:
                key, value = cache.update(key, value, self.layer_idx)
        query = q.view(1, 1, Hq, D).transpose(1, 2)  # [1, Hq, 1, D], as transformers' query_states
        if impl == sdpa.NAME and sdpa.takes(query, key, value, attention_mask, 0.0, kwargs):
            g = None if gate is None else gate.view(Hq, D)
            out = sdpa.decode(query, key, value, attention_mask, self.scaling, gate=g)
            return self.o_proj(out.reshape(*input_shape, -1)), None  # the gate applied in the core's launch
        core = ALL_ATTENTION_FUNCTIONS[impl]
        out, weights = core(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        out = out.reshape(*input_shape, -1).contiguous()  # [1, 1, Hq*D]
        if gate is not None:
            out = out * torch.sigmoid(gate.view(*input_shape, -1))
        return self.o_proj(out), weights

    def _sink_step(self, h, position_embeddings, attention_mask, cache, input_norm, kwargs):
        """GPT-OSS's fused one-token call: q|k|v GEMV (the input norm inside), biases + RoPE + the k/v write
        (qk_norm_rope, 1 launch; a ring row on a sliding layer localmoe keeps as one), the core with sinks and the
        window (decode_attention, 1), o_proj with its bias (1)."""
        self.decode_calls += 1
        D, Hq, Hkv = self.head_dim, self.num_heads, self.num_kv_heads
        qkv = linear_1(h, self._w_qkv, input_norm) if one_row(h, self._w_qkv) else F.linear(h, self._w_qkv)
        layer = static_layer(cache, self.layer_idx, Hkv, D, D, h)
        if layer is None:
            layer = ring_layer(cache, self.layer_idx, Hkv, D, h)
        ring = layer is not None and getattr(layer, RING, False)
        if layer is not None:  # k and v written into the cache by the same launch, its position advanced
            kv = (layer.keys[0], layer.values[0], layer.cumulative_length)
            q, _, _, _ = self._norm_rope(qkv, *position_embeddings, kv_cache=kv, ring=ring)
            key, value = layer.keys, layer.values  # [1, Hkv, L, D]
            if ring:
                layer.cumulative_length_int += 1  # transformers' host count (eager calls; not on graph replays)
        else:
            q, k, v, _ = self._norm_rope(qkv, *position_embeddings)
            key, value = k.view(1, Hkv, 1, D), v.view(1, Hkv, 1, D)
            if self._cache_kw == "cache":
                key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
            else:
                key, value = cache.update(key, value, self.layer_idx)
        out = self._core(q, key[0], value[0], attention_mask, ring)
        return self.o_proj(out.view(1, 1, Hq * D)), None

    @torch.compiler.disable
    def _core(self, q, key, value, attention_mask, ring: bool):
        """q [Hq, D], key / value [Hkv, L, D], transformers' mask (bool, or eager's additive float: 0 = attend) or
        localmoe's -> [Hq, D]. A ring's rows are in no position order: its mask says which hold tokens, no window and
        no prefetch (the row this step wrote need not be the last kept)."""
        mask = None
        if attention_mask is not None:
            mask = attention_mask.reshape(-1)[-key.shape[1] :]
            mask = mask if mask.dtype == torch.bool else mask == 0
        Hq, D = q.shape
        kw = tuned(q, "decode_attention", f"Hq{Hq}_Hkv{key.shape[0]}_D{D}")
        if ring:
            kw = dict(kw, prefetch=False)
        window = None if ring else self._window
        return decode_attention(q, key, value, mask, self.scaling, sinks=self.sinks, window=window, **kw)

    @torch.compiler.disable  # Triton launches stay opaque to dynamo (the CUDA graph still holds them)
    def _norm_rope(self, qkv, cos, sin, kv_cache=None, ring=False):
        normed = self._kind != "none"
        return qk_norm_rope(
            qkv,
            self.q_norm.weight if normed else None,
            self.k_norm.weight if normed else None,
            cos,
            sin,
            self._eps,
            num_q_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            kind=self._kind,
            gated=self._gated,
            kv_cache=kv_cache,
            whole=self._whole,
            head_dim=self.head_dim,
            bias=self._b_qkv,
            half_angles=self._sinks,
            ring=ring,
        )


def _window(hf: nn.Module) -> int | None:
    """The sliding window the original module hands its core: its own `sliding_window` (Qwen3-MoE's layers), or its
    config's for the classes that pass that (Mixtral); the fused step has none, so such a layer is not fused."""
    own = getattr(hf, "sliding_window", None)
    if own is None and type(hf).__name__ in _CONFIG_WINDOW:
        own = getattr(getattr(hf, "config", None), "sliding_window", None)
    return own


def _clips(hf: nn.Module) -> bool:
    """OLMoE's clip_qkv (q, k, v clamped after the norms): not in the fused kernel."""
    return getattr(getattr(hf, "config", None), "clip_qkv", None) is not None


def _concat_biased(linears: list[nn.Module]) -> tuple[torch.Tensor | None, torch.Tensor | None, list[int]]:
    """As ops.concat_rows for Linears that all have biases (GPT-OSS's q/k/v): (weights [ΣN, H], biases [ΣN], sizes),
    each Parameter's data a view of the shared buffers; (None, None, []) when they cannot share them."""
    ws = [getattr(lin, "weight", None) for lin in linears]
    bs = [getattr(lin, "bias", None) for lin in linears]
    if (
        not all(isinstance(lin, (nn.Linear, FusedLinear)) for lin in linears)
        or any(b is None or b.dtype != w.dtype or b.device != w.device for w, b in zip(ws, bs))
        or len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1
        or ws[0].device.type == "meta"
    ):
        return None, None, []
    with torch.no_grad():
        w_cat, b_cat = torch.cat([w.detach() for w in ws]), torch.cat([b.detach() for b in bs])
        sizes, at = [w.shape[0] for w in ws], 0
        for w, b, n in zip(ws, bs, sizes):
            w.data, b.data = w_cat[at : at + n], b_cat[at : at + n]
            at += n
    return w_cat, b_cat, sizes
