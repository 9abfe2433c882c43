"""Incremental detokenisation for streaming replies (the Engine's TokenEvent text)."""

from __future__ import annotations


class Detokenizer:
    """Incremental text for streaming: decodes only a short window of recent ids per token (not the whole reply),
    and holds text back while the window ends inside a multi-byte character."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # window start: ids before it are already emitted
        self.read = 0  # ids decoded into emitted text

    def push(self, token_id: int) -> str:
        if self.tok is None:  # a random-weight bench engine: ids only
            return ""
        self.ids.append(token_id)
        done = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        text = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=True)
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done):]
