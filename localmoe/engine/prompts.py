"""What the engine makes of a tokenizer: loading it, its chat template's thinking switch (`enable_thinking`, passed to
every render through `TemplateArgs`), whether it is a thinking model (its reasoning tags, or OpenAI's harmony format:
`harmony`, from its `<|channel|>` and `<|message|>` tokens, never from a model name) and a reply's reasoning splitter,
harmony's stop tokens, and the check that text given to it is valid Unicode.
"""

from __future__ import annotations

from collections.abc import Sequence

from localmoe.engine.reasoning import (
    CHANNEL,
    CLOSE,
    HARMONY_STOPS,
    MARKERS,
    MESSAGE,
    OPEN,
    HarmonySplitter,
    ReasoningSplitter,
    opens_reasoning,
)
from localmoe.errors import RuntimeFailure, UsageError


class TemplateArgs:
    """A tokenizer whose apply_chat_template gets extra template variables (enable_thinking), so that decode/prefix.py's
    renders (the prompt, the next turn's, the reply's) all see the same thinking switch."""

    def __init__(self, tokenizer, **kwargs):
        self._tokenizer, self._kwargs = tokenizer, kwargs

    def apply_chat_template(self, *args, **kwargs):
        return self._tokenizer.apply_chat_template(*args, **{**self._kwargs, **kwargs})

    def __call__(self, *args, **kwargs):
        return self._tokenizer(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def load_tokenizer(path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as e:
        raise RuntimeFailure(f"cannot load the tokenizer from {path}: {str(e).splitlines()[0]}") from None


HARMONY = (CHANNEL, MESSAGE)  # the reasoning "tags" of a harmony model: its replies go through HarmonySplitter


def token_id(tokenizer, token: str) -> int | None:
    """The id of `token` when it is one token of `tokenizer` (not the unknown token), else None."""
    if tokenizer is None:
        return None
    try:
        i = tokenizer.convert_tokens_to_ids(token)
    except Exception:  # noqa: BLE001 - a tokenizer that cannot say: not one of its tokens
        return None
    return i if isinstance(i, int) and i >= 0 and i != tokenizer.unk_token_id else None


def harmony(tokenizer) -> bool:
    """The tokenizer speaks OpenAI's harmony format (gpt-oss): `<|channel|>` and `<|message|>` are tokens."""
    return token_id(tokenizer, CHANNEL) is not None and token_id(tokenizer, MESSAGE) is not None


def marker_ids(tokenizer) -> set[int]:
    """A harmony tokenizer's message markers (the special tokens a reply's text keeps for its split), else none."""
    if not harmony(tokenizer):
        return set()
    return {i for i in (token_id(tokenizer, t) for t in MARKERS) if i is not None}


def stop_ids(tokenizer) -> set[int]:
    """Tokens that end a reply beside the checkpoint's EOS ids: harmony's `<|return|>` and `<|call|>`."""
    if not harmony(tokenizer):
        return set()
    return {i for i in (token_id(tokenizer, t) for t in HARMONY_STOPS) if i is not None}


EFFORTS = ("low", "medium", "high")  # gpt-oss's reasoning efforts (its template's `reasoning_effort`)


def takes_effort(tokenizer) -> bool:
    """Whether the chat template reads a `reasoning_effort` variable (gpt-oss's harmony template)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(template.values())
    return isinstance(template, str) and "reasoning_effort" in template


def thinking(tokenizer) -> tuple[bool, tuple[str, str] | None]:
    """(the chat template has the `enable_thinking` switch, the reasoning tags of a thinking model or None; HARMONY
    for a harmony model): a thinking model's replies are split into reasoning and answer (reasoning.py)."""
    if harmony(tokenizer):
        return False, HARMONY
    template = getattr(tokenizer, "chat_template", None)
    template = (
        template if isinstance(template, str) else " ".join(template.values()) if isinstance(template, dict) else ""
    )
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    tags = (OPEN, CLOSE) if (OPEN in vocab and CLOSE in vocab) or CLOSE in template else None
    return "enable_thinking" in template, tags


def splitter(
    tokenizer, tags: tuple[str, str] | None, prompt_ids: Sequence[int]
) -> ReasoningSplitter | HarmonySplitter | None:
    """A thinking model's reasoning splitter, starting inside the block when the prompt leaves one open; a harmony
    model's, starting where its prompt leaves off (inside the header its generation prompt opens)."""
    if tags is None or tokenizer is None:
        return None
    tail = tokenizer.decode(list(prompt_ids[-64:]), skip_special_tokens=False)
    if tags == HARMONY:
        return HarmonySplitter.after(tail)
    open_tag, close_tag = tags
    return ReasoningSplitter(
        in_reasoning=opens_reasoning(tail, open_tag, close_tag), open_tag=open_tag, close_tag=close_tag
    )


def check_unicode(text, what: str) -> None:
    """Text a tokenizer can take: a str without lone surrogates (undecodable bytes smuggled in by surrogateescape),
    which tokenizers reject with a TypeError."""
    if not isinstance(text, str):
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UsageError(
            f"{what} is not valid text (an undecodable byte or lone surrogate at character {e.start}): give UTF-8 text"
        ) from None
