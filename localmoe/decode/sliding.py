"""transformers' StaticSlidingWindowLayer as a ring, for GPT-OSS's fused decode step inside a CUDA graph.

transformers keeps a sliding-window layer of a StaticCache as W = min(window, max_cache_len) rows holding the last W
positions in order, newest last: while fewer than W tokens are cached, position p sits in row p (an index_copy at
its position tensor); once full, each one-token update rolls all W rows left by one and writes row W - 1, chosen on
the host by a Python count (`cumulative_length_int`), which a captured step cannot follow (its tensor position is not
even advanced once the layer overflows). localmoe's fused step keeps the layer as a ring instead: position p in row
p % W, written in place by qk_norm_rope (`ring=True`) at the layer's own position tensor, no rows moved; attention
does not depend on the rows' order, and the step's mask (row r holds a token when r <= p) says which rows count.

The two layouts agree while at most W tokens are cached. `to_ring(cache)` (after a call that ran transformers' own
modules on the cache: the prefill) rolls each such layer's rows by N % W once N > W tokens were seen, sets its
position tensor to N and marks it (`RING`); `to_transformers(cache)` (before such a call) rolls them back and clears
the mark. Both read the layer's host count N, which the fused step advances on its eager calls; a graph replay
does not, so after replays the cache must be reset before transformers' modules see it again, or put back whole: the
engine's prefill does one or the other (its prompt reuse restores a copy of the rows, counters and mark taken where
the history ended, decode/prefix.py).

Shape legend: W ring rows, N tokens seen, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import torch

RING = "_localmoe_ring"  # set on a StaticSlidingWindowLayer whose rows are a ring (position p in row p % W)
_CLASS = "StaticSlidingWindowLayer"


def sliding_layers(cache) -> list:
    """The initialised StaticSlidingWindowLayers of a transformers cache (none for other caches)."""
    layers = getattr(cache, "layers", None) or []
    return [
        layer
        for layer in layers
        if type(layer).__name__ == _CLASS
        and getattr(layer, "is_initialized", False)
        and isinstance(getattr(layer, "keys", None), torch.Tensor)
        and isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)
    ]


@torch.no_grad()
def _roll(layer, shift: int) -> None:
    if shift:
        layer.keys.copy_(layer.keys.roll(shift, dims=2))
        layer.values.copy_(layer.values.roll(shift, dims=2))


def to_ring(cache) -> int:
    """Every sliding layer of `cache` from transformers' layout to the ring (position tensor = N, marked); returns how
    many layers were converted."""
    n = 0
    for layer in sliding_layers(cache):
        if getattr(layer, RING, False):
            continue
        seen, rows = int(layer.cumulative_length_int), layer.keys.shape[2]
        _roll(layer, seen % rows if seen > rows else 0)  # row j held position N - W + j: now row (N + j) % W
        layer.cumulative_length.fill_(seen)
        setattr(layer, RING, True)
        n += 1
    return n


def to_transformers(cache) -> int:
    """Every ring sliding layer of `cache` back to transformers' layout (unmarked); returns how many."""
    n = 0
    for layer in sliding_layers(cache):
        if not getattr(layer, RING, False):
            continue
        seen, rows = int(layer.cumulative_length_int), layer.keys.shape[2]
        _roll(layer, -(seen % rows) if seen > rows else 0)
        setattr(layer, RING, False)
        n += 1
    return n


def ring_layer(cache, layer_idx: int, heads: int, head_dim: int, h: torch.Tensor):
    """The cache's layer when it is a transformers StaticSlidingWindowLayer kept as a ring (`RING`), initialised, of
    this shape on h's device (keys / values [1, heads, W, head_dim] of h's dtype, an integer position tensor equal
    to the tokens it has seen); else None."""
    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx >= len(layers) or type(layers[layer_idx]).__name__ != "StaticSlidingWindowLayer":
        return None
    layer = layers[layer_idx]
    if not getattr(layer, RING, False) or not getattr(layer, "is_initialized", False):
        return None
    keys, values, pos = (getattr(layer, n, None) for n in ("keys", "values", "cumulative_length"))
    if not all(isinstance(t, torch.Tensor) for t in (keys, values, pos)):
        return None
    ok = all(
        t.dim() == 4
        and t.shape[:2] == (1, heads)
        and t.shape[3] == head_dim
        and t.stride(3) == 1
        and t.dtype == h.dtype
        and t.device == h.device
        for t in (keys, values)
    )
    return layer if ok and pos.numel() == 1 and pos.device == h.device and not pos.is_floating_point() else None
