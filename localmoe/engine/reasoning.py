"""A thinking model's reply split, as it streams, into its reasoning (`<think>…</think>`) and its answer.

Qwen3 and Qwen3.5 reply with a reasoning block first: `<think>\\n…\\n</think>\\n\\n` then the answer. Some templates
open the block inside the generation prompt (the reply starts inside the reasoning: `in_reasoning=True`); with
thinking off a template closes an empty block in the prompt and the reply is all answer; a model may also emit no
block at all. `ReasoningSplitter.push(text)` takes the reply's text piece by piece (as detokenised, tags possibly
split across pieces) and returns [(channel, text)], channel "reasoning" or "answer", the tags removed; `flush()`
returns what it held back once the reply ends.

What counts: only a block that opens the reply (after whitespace) is reasoning; `<think>` later in an answer is
text. Newlines are trimmed as Qwen3's chat template trims a past reply's `reasoning_content` and content: leading
and trailing newlines of the reasoning, leading newlines of the answer after `</think>`. A reply without a block
comes back exactly as it was given. Pure Python; imports nothing from localmoe.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
REASONING, ANSWER = "reasoning", "answer"


def _tail_prefix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag` (0 when none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplitter:
    def __init__(self, in_reasoning: bool = False, open_tag: str = OPEN, close_tag: str = CLOSE):
        self.open, self.close = open_tag, close_tag
        self.state = REASONING if in_reasoning else "start"  # "start": not yet known whether a block opens
        self.buf = ""  # text held back
        self.lead = in_reasoning  # at the start of reasoning or of the answer after it: leading newlines dropped
        self.saw_block = in_reasoning

    @property
    def channel(self) -> str:
        """The channel of the text being streamed now ("answer" until a block opens)."""
        return REASONING if self.state == REASONING else ANSWER

    def push(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self.buf += text
        while True:
            if self.state == "start":
                stripped = self.buf.lstrip()
                if stripped.startswith(self.open):
                    self.state, self.lead, self.saw_block = REASONING, True, True
                    self.buf = stripped[len(self.open) :]
                    continue
                if self.open.startswith(stripped):  # nothing yet, or the tag so far: wait
                    return out
                self.state = ANSWER
                continue
            if self.state == REASONING:
                i = self.buf.find(self.close)
                if i >= 0:
                    self._emit(out, REASONING, self.buf[:i].rstrip("\n"))
                    self.state, self.lead = ANSWER, True
                    self.buf = self.buf[i + len(self.close) :]
                    continue
                keep = _tail_prefix(self.buf, self.close)
                head = self.buf[: len(self.buf) - keep]
                body = head.rstrip("\n")  # newlines that may come right before the closing tag: held too
                self._emit(out, REASONING, body)
                self.buf = self.buf[len(body) :]
                return out
            self._emit(out, ANSWER, self.buf)  # the answer
            self.buf = ""
            return out

    def flush(self) -> list[tuple[str, str]]:
        """The reply ended: what was held back, as text of the channel it was held in."""
        out: list[tuple[str, str]] = []
        text, self.buf = self.buf, ""
        if self.state == REASONING:
            self._emit(out, REASONING, text.rstrip("\n"))
        else:
            self.lead = False if self.state == "start" else self.lead
            self._emit(out, ANSWER, text)
        return out

    def _emit(self, out: list, channel: str, text: str) -> None:
        if self.lead:
            text = text.lstrip("\n")
            if not text:
                return
            self.lead = False
        if text:
            if out and out[-1][0] == channel:
                out[-1] = (channel, out[-1][1] + text)
            else:
                out.append((channel, text))


def opens_reasoning(prompt_text: str, open_tag: str = OPEN, close_tag: str = CLOSE) -> bool:
    """Whether a prompt (its end, detokenised) leaves a reasoning block open: the reply starts inside it."""
    i = prompt_text.rfind(open_tag)
    return i >= 0 and i > prompt_text.rfind(close_tag)


def split(text: str, in_reasoning: bool = False) -> tuple[str, str]:
    """A whole reply -> (reasoning, answer)."""
    s = ReasoningSplitter(in_reasoning)
    parts = s.push(text) + s.flush()
    return ("".join(t for c, t in parts if c == REASONING), "".join(t for c, t in parts if c == ANSWER))
