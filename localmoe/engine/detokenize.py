"""Incremental detokenisation for streaming replies (the Engine's TokenEvent text), stop strings found in the stream
(`StopStrings`), and the streamed text made safe for a terminal."""

from __future__ import annotations

import re
from collections.abc import Collection

from localmoe.safe_text import for_terminal


class Detokenizer:
    """Incremental text for streaming: decodes only a short window of recent ids per token (not the whole reply),
    and holds text back while the window ends inside a multi-byte character. Special tokens are skipped, but those
    in `keep`, which stay as their text (a harmony model's message markers: special tokens that its reasoning split
    reads, in order with the text)."""

    def __init__(self, tokenizer, keep: Collection[int] = ()):
        self.tok = tokenizer
        self.skip = not keep
        added = (getattr(tokenizer, "added_tokens_decoder", None) or {}) if keep else {}
        self.drop = {i for i, t in added.items() if getattr(t, "special", False)} - set(keep)
        self.ids: list[int] = []
        self.prefix = 0  # window start: ids before it are already emitted
        self.read = 0  # ids decoded into emitted text

    def push(self, token_id: int) -> str:
        if self.tok is None or token_id in self.drop:  # a random-weight bench engine: ids only
            return ""
        self.ids.append(token_id)
        done = self.tok.decode(self.ids[self.prefix : self.read], skip_special_tokens=self.skip)
        text = self.tok.decode(self.ids[self.prefix :], skip_special_tokens=self.skip)
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done) :]


class StopStrings:
    """The reply's text ended at the first stop string, streamed: `push(text)` -> the text that can be shown now.
    Text that may be the start of a stop string (a stop string spanning tokens) is held back until the next text
    shows it is not; once a stop string is complete, what comes before it is given back and `stopped` is True (the
    stop string and everything after it are dropped). `flush()` gives back what is held when the reply ends
    otherwise."""

    def __init__(self, stops=()):
        self.stops = tuple(dict.fromkeys(s for s in stops if s))
        self.held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return text
        buf = self.held + text
        ends = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if ends:
            self.held, self.stopped = "", True
            return buf[: min(ends)]
        keep = max(
            (k for s in self.stops for k in range(min(len(s) - 1, len(buf)), 0, -1) if buf.endswith(s[:k])), default=0
        )  # the longest tail that begins a stop string
        self.held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        text, self.held = self.held, ""
        return text


class TerminalStream:
    """`safe_text.for_terminal` over streamed chunks (run's stdout on a terminal): an escape sequence that a chunk
    leaves unfinished is held back until it ends, so it is dropped whole rather than showing its tail as text.

    A held sequence is given up on (dropped, as for_terminal drops an unterminated one) once it passes `max_hold`
    characters, so text after an OSC that never ends still shows. `flush()` at the end of the reply."""

    # An escape sequence still open at the end of the text: a string sequence (OSC/DCS/SOS/PM/APC) with no BEL/ST yet
    # (perhaps the ESC of its ST), a CSI with no final byte, or an ESC with no final byte.
    _OPEN = re.compile(
        r"(?:(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*\x1b?"
        r"|(?:\x1b\[|\x9b)[0-?]*[ -/]*|\x1b[ -/]*)\Z"
    )

    def __init__(self, max_hold: int = 1024):
        self.max_hold = max_hold
        self.held = ""

    def push(self, text: str) -> str:
        text = self.held + text
        self.held = ""
        if text.endswith("\r"):  # maybe the first half of \r\n, which for_terminal keeps as \n
            self.held, text = "\r", text[:-1]
        m = self._OPEN.search(text)
        if m is not None and len(text) - m.start() <= self.max_hold:
            self.held, text = text[m.start() :] + self.held, text[: m.start()]
        return for_terminal(text)

    def flush(self) -> str:
        text, self.held = self.held, ""
        return for_terminal(text)
