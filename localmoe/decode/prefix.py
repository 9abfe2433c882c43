"""Prompt reuse across a chat's turns: the part of a prompt the cache already holds is not prefilled again.

A chat's next prompt repeats the conversation so far. Attention layers store keys and values by position, so the
positions below what two prompts share stay valid in the cache. A recurrent layer (Gated DeltaNet: conv and
recurrent state) keeps ONE state, which the rest of the prefill and the decoding move past that point. So
`PromptReuse` keeps a copy of the recurrent layers' state at a point the engine names, `stable` (`repeated_prefix`:
for a chat, the whole prompt when the template renders the next turn right after it, else the history without the
generation header), and when a prompt starts with exactly those tokens it rewinds the cache there: attention layers
back to that length, recurrent layers to the copy. A sliding-window layer (GPT-OSS: its last W positions, a ring in
the CUDA-graph step, decode/sliding.py) is like a recurrent one: the decoding past `stable` overwrites the rows it
would need, so its rows and counters are copied at `stable` too (W rows a layer: MBs, not the history's GBs) and put
back whole. Only the rest of the prompt is prefilled; with the copy at the prompt's end its logits are kept too, so
the same prompt again (regenerate) runs nothing.

Caches: transformers' StaticCache (the CUDA-graph decoder's; rewound in place, so the captured graph keeps its
addresses) and DynamicCache (eager decoding), with their sliding-window layers. A cache with a layer it does not
know (quantized, offloaded, ...) is never rewound: its prompt is prefilled whole.

Shape legend: P = prompt tokens, L = tokens reused from the cache, S = `stable`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from localmoe.decode.sliding import RING

# a recurrent layer's state (transformers 5.17 to 5.25 LinearAttention layers): tensors or dicts of tensors / flags,
# and from 5.25 the layer's token count (a Qwen3.5 cache's `get_seq_length()`)
_STATE_ATTRS = (
    "cumulative_length_linear",
    "conv_states",
    "recurrent_states",
    "has_previous_state",
    "is_conv_states_initialized",
    "is_recurrent_states_initialized",
)
# a sliding-window layer's state: its rows (transformers' order, or the fused step's ring: `RING`) and counters
_WINDOW_ATTRS = ("keys", "values", "cumulative_length", "cumulative_length_int", "is_initialized", RING)
_WINDOW = ("StaticSlidingWindowLayer", "DynamicSlidingWindowLayer")
_UNSUPPORTED = ("Quantized", "Indexed", "Dummy", "Offloaded")


def _kinds(layer) -> set[str] | None:
    """{"recurrent", "window", "static", "dynamic"} parts of a cache layer, or None for a layer that cannot be
    rewound."""
    names = {c.__name__ for c in type(layer).__mro__}
    if any(u in n for n in names for u in _UNSUPPORTED):
        return None
    if type(layer).__name__ in _WINDOW:
        return {"window"}
    if any("Sliding" in n for n in names):  # another windowed layer: its rows are not known here
        return None
    kinds = set()
    if hasattr(layer, "conv_states") or hasattr(layer, "recurrent_states"):
        if getattr(layer, "record_past", False):  # conv states that grow until cropped: not a fixed state
            return None
        kinds.add("recurrent")
    if "StaticLayer" in names:
        if not isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
            return None
        kinds.add("static")
    elif "DynamicLayer" in names:
        kinds.add("dynamic")
    return kinds or None


def _copy(v, device):
    if isinstance(v, torch.Tensor):
        return v.detach().to(device if device is not None else v.device, copy=True)
    if isinstance(v, dict):
        return {k: _copy(x, device) for k, x in v.items()}
    return v


def _state(layer, device) -> dict | None:
    """A recurrent or sliding-window layer's attributes to copy (None: the layer's positions stay as written)."""
    kinds = _kinds(layer)
    if "window" in kinds:  # unmarked: transformers' row order (the mark is put back with the rows)
        return {n: _copy(getattr(layer, n, False), device) for n in _WINDOW_ATTRS if n == RING or hasattr(layer, n)}
    if "recurrent" in kinds:
        return {n: _copy(getattr(layer, n), device) for n in _STATE_ATTRS if hasattr(layer, n)}
    return None


def _put(live, saved, home):
    """saved into live: in place where the tensor exists with the same shape (captured graphs keep its address),
    else a copy on `home` (the device the live state is on)."""
    if isinstance(saved, torch.Tensor):
        if isinstance(live, torch.Tensor) and live.shape == saved.shape and live.dtype == saved.dtype:
            live.copy_(saved)
            return live
        return saved.to(home if home is not None else saved.device, copy=True)
    if isinstance(saved, dict):
        out = live if isinstance(live, dict) else {}
        for k in [k for k in out if k not in saved]:
            del out[k]
        for k, x in saved.items():
            out[k] = _put(out.get(k), x, home)
        return out
    return saved


@dataclass
class _Copy:
    tokens: tuple[int, ...]  # the S prompt tokens the cache held when the copy was taken
    states: list[dict | None]  # per cache layer: its recurrent attributes after them, or None
    logits: torch.Tensor | None  # [V] of position S - 1 when S ended a prefill (the same prompt again)


class PromptReuse:
    """The prompt prefixes a cache can be rewound to, and the recurrent state after each. One per cache object.

    Invariant: every copy's tokens are a prefix of what the cache last prefilled (positions below stay as written);
    a prefill drops the copies its prompt does not start with. At most MAX_COPIES (the longest kept)."""

    MAX_COPIES = 2  # a turn's prompt end, and the same conversation with its reply (`Engine.prepare_next_turn`)

    def __init__(self, host_copy: bool = False):
        self.host_copy = host_copy  # keep the state copies in host memory (offloading: VRAM is the experts')
        self._cache = None  # the cache object the copies belong to
        self._copies: list[_Copy] = []  # shortest first
        self.reused = 0  # tokens the last prefill took from the cache

    @property
    def tokens(self) -> tuple[int, ...]:
        """The longest prefix kept (() when none)."""
        return self._copies[-1].tokens if self._copies else ()

    def forget(self) -> None:
        self._cache, self._copies = None, []

    def _match(self, ids: Sequence[int]) -> _Copy | None:
        """The longest copy `ids` starts with, leaving a token to prefill or holding the logits."""
        for c in reversed(self._copies):
            L = len(c.tokens)
            if (len(ids) > L or (len(ids) == L and c.logits is not None)) and tuple(ids[:L]) == c.tokens:
                return c
        return None

    def reusable(self, cache, ids: Sequence[int]) -> int:
        """L, the prompt tokens `cache` can be rewound to (0: prefill the whole prompt). L < P, or L = P when that
        copy kept the last position's logits (the same prompt again: nothing to prefill)."""
        c = self._match(ids) if cache is not None and cache is self._cache else None
        if c is None:
            return 0
        L = len(c.tokens)
        layers = getattr(cache, "layers", None)
        if not layers or len(layers) != len(c.states):
            return 0
        for layer in layers:
            kinds = _kinds(layer)
            if kinds is None:
                return 0
            if "dynamic" in kinds and (getattr(layer, "keys", None) is None or layer.keys.shape[-2] < L):
                return 0
            if "static" in kinds and int(layer.cumulative_length) < L:
                return 0
        if any(saved is None for layer, saved in zip(layers, c.states) if "window" in _kinds(layer)):
            return 0
        return L

    def rewind(self, cache, ids: Sequence[int]) -> tuple[int, torch.Tensor | None]:
        """Put `cache` back to the state after the longest kept prefix of `ids` (`reusable` said there is one) and
        drop the copies `ids` does not start with -> (L, that copy's logits or None)."""
        c = self._match(ids)
        L = len(c.tokens)
        for layer, saved in zip(cache.layers, c.states):
            kinds = _kinds(layer)
            if "static" in kinds:
                layer.cumulative_length.fill_(L)  # positions >= L are overwritten by the prefill that follows
            if "dynamic" in kinds:
                layer.keys = layer.keys[..., :L, :]
                layer.values = layer.values[..., :L, :]
            if saved is not None:
                home = getattr(layer, "device", None)
                for name, v in saved.items():
                    setattr(layer, name, _put(getattr(layer, name, None), v, home))
        self._copies = [x for x in self._copies if tuple(ids[: len(x.tokens)]) == x.tokens]
        return L, c.logits

    def save(self, cache, tokens: Sequence[int], logits: torch.Tensor | None = None) -> None:
        """Remember `cache` as it is after `tokens` (the prefill stands exactly there), and `logits` [V] of the last
        of them if given."""
        layers = getattr(cache, "layers", None)
        if not layers or any(_kinds(layer) is None for layer in layers):
            self.forget()
            return
        if cache is not self._cache:
            self._copies = []
        dev = torch.device("cpu") if self.host_copy else None
        states = [_state(layer, dev) for layer in layers]
        tokens = tuple(tokens)
        keep = [x for x in self._copies if len(x.tokens) < len(tokens)]
        self._copies = keep + [_Copy(tokens, states, None if logits is None else _copy(logits, None))]
        self._copies = self._copies[-self.MAX_COPIES :]
        self._cache = cache


def render_chat(tokenizer, messages: Sequence[dict], header: bool) -> list[int]:
    """Token ids of `messages` through the chat template (`header`: with the generation header)."""
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=header, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def repeated_prefix(tokenizer, messages: Sequence[dict], ids: list[int]) -> int:
    """S for a chat prompt `ids` (messages rendered with the generation header): how many of its first tokens the next
    turn's prompt will repeat. The whole prompt when the template renders the next turn (a reply, then a user
    message) right after exactly these tokens: the state at the prompt's end is kept, nothing extra to run. Else the
    conversation without the generation header (thinking templates render a past reply without the header's
    opening): the prefill stops there once to keep it. 0 when neither is a prefix of the prompt."""
    try:
        after = render_chat(
            tokenizer, [*messages, {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "And?"}], False
        )
        if after[: len(ids)] == ids:
            return len(ids)
        hist = render_chat(tokenizer, messages, False)
    except Exception:  # noqa: BLE001 - a template that cannot render these: no reuse, nothing else changes
        return 0
    # the history's last token may merge with the header in the prompt's tokenization: keep it out
    n = len(hist) - 1
    return n if 0 < n < len(ids) and hist[:n] == ids[:n] else 0


def reply_prefix(tokenizer, messages: Sequence[dict]) -> list[int]:
    """The tokens every next prompt of a conversation starts with, its last message the reply: the conversation
    rendered with any following user message, up to where that message's text begins (less one token, which may
    merge with it). [] when the template cannot tell."""
    try:
        a, b = (render_chat(tokenizer, [*messages, {"role": "user", "content": t}], True) for t in ("Yes.", "No!"))
    except Exception:  # noqa: BLE001 - a template that cannot render these: nothing to prepare
        return []
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return a[: max(n - 1, 0)]


def prefill(
    forward: Callable,
    cache,
    ids: torch.Tensor,
    *,
    stable: int,
    chunk: int,
    reuse: PromptReuse | None,
    fresh: Callable = lambda cache: cache.reset() or cache,
):
    """Prefill ids [1, P] into `cache` in pieces of at most `chunk` tokens (`piece_cuts`), starting where `reuse` can
    rewind it to (elsewise from `fresh(cache)`: the same cache reset in place by default). `forward(piece [1, n],
    start, cache) -> (cache, logits)` runs one piece at positions start..start+n-1 (cache None: it makes one). With
    `reuse`, the state after the first S = `stable` tokens is kept for the next prompt. -> (cache, logits [V] of the
    last position, L)."""
    P = ids.shape[1]
    tokens = ids[0].tolist() if reuse is not None else []
    L = reuse.reusable(cache, tokens) if reuse is not None else 0
    if L:
        L, kept_logits = reuse.rewind(cache, tokens)
    else:
        if reuse is not None:
            reuse.forget()  # the positions its copy follows are about to be overwritten
        if cache is not None:
            cache = fresh(cache)
    if L == P:  # the same prompt as the copy's: its logits, nothing to run
        logits = kept_logits.clone()
    cuts = sorted({*piece_cuts(L, P, chunk)} | ({stable} if reuse is not None and L < stable < P else set()))
    for a, b in zip(cuts, cuts[1:]):
        cache, logits = forward(ids[:, a:b], a, cache)
        if reuse is not None and b == stable:
            reuse.save(cache, tokens[:stable], logits if b == P else None)
    if reuse is not None:
        reuse.reused = L
    return cache, logits, L


def piece_cuts(start: int, end: int, chunk: int) -> list[int]:
    """Cuts of positions start..end into the fewest pieces of at most `chunk` tokens, of equal lengths (within one):
    an offloaded model's piece moves nearly every absent expert across PCIe however short it is, so 2,100 tokens go
    as 1,050 + 1,050, not 2,048 + 52. -> [start, ..., end]."""
    if end <= start:
        return [end]
    n = -(-(end - start) // chunk)
    return [start + (i * (end - start)) // n for i in range(n + 1)]
