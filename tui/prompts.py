"""What `localmoe chat` sends its engine: conversations fitted to the context, and the calls that carry the
thinking switch (`/think on|off`) to engines that have one.

The thinking switch is the chat template's `enable_thinking`: `think=None` leaves it to the template's default.
An engine that has no such parameter (or a model without a thinking mode) is called as before, so the app works
with every engine that implements localmoe.events.ChatEngine.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator, Sequence

from localmoe.events import GenerationSettings, TokenEvent


def accepts(fn: Callable | None, name: str) -> bool:
    """Whether `fn` takes a keyword argument `name` (or **kwargs)."""
    if fn is None:
        return False
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def supports_thinking(engine: object) -> bool:
    return bool(getattr(engine, "supports_thinking", False))


def _think_kwargs(fn: Callable | None, think: bool | None) -> dict:
    return {"think": think} if think is not None and accepts(fn, "think") else {}


def encode(engine: object, messages: Sequence[dict], think: bool | None = None) -> list[int]:
    fn = engine.encode_chat
    return fn(messages, **_think_kwargs(fn, think))


def chat(
    engine, messages: Sequence[dict], settings: GenerationSettings, think: bool | None = None
) -> Iterator[TokenEvent]:
    """engine.chat with the thinking switch: as `think=` when chat takes it, else as the settings' `think` field
    when GenerationSettings has one, else not at all."""
    if think is not None and not accepts(engine.chat, "think"):
        if "think" in {f.name for f in dataclasses.fields(settings)}:
            settings = dataclasses.replace(settings, think=think)
        think = None
    return engine.chat(messages, settings, **_think_kwargs(engine.chat, think))


def prepare_next_turn(engine: object, messages: Sequence[dict], think: bool | None = None) -> None:
    prepare = getattr(engine, "prepare_next_turn", None)
    if prepare is not None:
        prepare(messages, **_think_kwargs(prepare, think))


def context_limit(engine: object) -> int:
    """Tokens a prompt and its reply may take together: the engine's context, capped by the model's positions
    (0 when the engine does not say)."""
    limit = int(getattr(engine, "context", 0) or 0)
    positions = int(getattr(engine, "max_positions", 0) or 0)
    if positions:
        limit = min(limit, positions) if limit else positions
    return limit


def fit_to_context(
    engine: object, messages: Sequence[dict], max_new_tokens: int, think: bool | None = None
) -> tuple[list[dict], int]:
    """`messages` without their oldest turns, so that the prompt leaves room for a reply within the context:
    the system prompt and the newest messages are kept, the last (new user) message always; what is kept starts
    at a user message (templates want user/assistant turns in order). Room for the reply: max_new_tokens, at most
    a quarter of the context. Returns (messages to send, how many were left out); an engine without
    `encode_chat` or a context size is given everything."""
    messages = list(messages)
    limit = context_limit(engine)
    if getattr(engine, "encode_chat", None) is None or limit <= 0 or not messages:
        return messages, 0
    budget = limit - max(1, min(int(max_new_tokens), limit // 4))
    head = messages[:1] if messages[0].get("role") == "system" else []
    history = messages[len(head) :]

    def fits(start: int) -> bool:
        return len(encode(engine, head + history[start:], think)) <= budget

    try:
        if fits(0):
            return messages, 0
        starts = [i for i, m in enumerate(history) if i > 0 and m.get("role") == "user"]
        if not starts:
            return messages, 0
        lo, hi = 0, len(starts) - 1
        while lo < hi:  # the fewest messages left out: fits() only gets truer as the start moves on
            mid = (lo + hi) // 2
            if fits(starts[mid]):
                hi = mid
            else:
                lo = mid + 1
    except Exception:  # noqa: BLE001
        return messages, 0  # (no chat template, ...): the engine reports it when asked to chat
    return head + history[starts[lo] :], starts[lo]
