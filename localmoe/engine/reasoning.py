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
comes back exactly as it was given.

GPT-OSS replies in OpenAI's harmony format: messages `<|channel|>analysis<|message|>…<|end|><|start|>assistant
<|channel|>final<|message|>…<|return|>`, whose markers are special tokens. `HarmonySplitter` reads the reply's text
decoded WITH its special tokens (detokenize.Detokenizer(keep_specials=True)): the markers stay in the text, in order
with it, so stop strings and text held back while a multi-byte character completes can never move a message's text
across a marker. `final` is the answer; `analysis`, `commentary` (tool calls are not wired: preambles and calls are
shown as reasoning) and any other channel are reasoning; a message without a channel is answer. Pure Python; imports
nothing from localmoe.
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


# -- harmony (gpt-oss) -------------------------------------------------------------------------------------------------
START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
HARMONY_STOPS = (RETURN, CALL)  # end the reply (generation_config's eos ids on the hub, with <|endoftext|>)
ANSWER_CHANNELS = ("final",)
HEADER_STARTS = ("assistant", "to=")  # what a reply's first header text begins with (after spaces)
MAX_HEADER = 256  # header text (role, recipient, channel, constraint) longer than this without a marker: not a header


def channel_of(name: str | None) -> str:
    """A harmony channel's name (None: the message has none) -> "answer" or "reasoning"."""
    return ANSWER if name is None or name in ANSWER_CHANNELS else REASONING


class HarmonySplitter:
    """A harmony reply's text (markers included) -> [(channel, text)] as ReasoningSplitter's: the messages' bodies by
    channel, the markers and headers (role, recipient, channel, constraint) removed. Markers may be split across
    pieces (a tail that may begin one is held back). `after(prompt_tail)` starts where the prompt leaves off: after
    the generation prompt's `<|start|>assistant` the reply begins inside a message header.

    States: "header" (after <|start|>: role and recipient, then after <|channel|> the channel name and after
    <|constrain|> the constraint, until <|message|>), "body" (until <|end|>, <|return|>, <|call|> or a <|start|>
    that skips the <|end|>), "between" (after a message: stray text there is answer), "plain" (the reply began with
    text that cannot be a header, such as a reply without any marker: all of it is answer, exactly as given)."""

    def __init__(self):
        self.state = "between"
        self.buf = ""  # text held back: a possible marker's beginning
        self.header = ""  # the header's text so far; the channel part after <|channel|>
        self.in_channel = False  # the header's text is now the channel part
        self.name: str | None = None  # the channel of the message being read (None: none named)
        self.fresh = False  # no marker seen in the reply yet (a first header that is not one turns "plain")
        self.gap = ""  # whitespace between messages, held: answer only if stray text follows it

    @classmethod
    def after(cls, prompt_tail: str) -> HarmonySplitter:
        """A splitter for the reply to a prompt ending in `prompt_tail` (decoded with its markers)."""
        s = cls()
        s.push(prompt_tail)
        s.buf, s.fresh = "", s.state == "between" or (s.state == "header" and not s.in_channel)
        if s.state == "header" and not s.in_channel:
            s.header = ""  # the prompt's role ("assistant"): the reply's header text starts here
        return s

    @property
    def channel(self) -> str:
        """The channel of the text being streamed now: a body's; a header's once its channel is named, "reasoning"
        before (markup is not the answer); "answer" once the reply is plain."""
        if self.state == "body":
            return channel_of(self.name)
        if self.state == "plain":
            return ANSWER
        if self.state == "header" and self.in_channel and self.header.strip():
            return channel_of(self.header.split()[0])
        return REASONING

    def push(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self.state == "plain":
            _add(out, ANSWER, text)
            return out
        self.buf += text
        while self.buf:
            if self.state == "plain":  # what was held, markers and all, is answer text
                _add(out, ANSWER, self.buf)
                self.buf = ""
                break
            hits = [(i, m) for m in MARKERS if (i := self.buf.find(m)) >= 0]
            if hits:
                i, marker = min(hits)
                head, self.buf = self.buf[:i], self.buf[i:]
                self._text(out, head)
                if self.state != "plain":
                    self.buf = self.buf[len(marker) :]
                    self._marker(marker)
                continue
            keep = max(_tail_prefix(self.buf, m) for m in MARKERS)
            head, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
            self._text(out, head)
            if self.state != "plain":
                break
        return out

    def flush(self) -> list[tuple[str, str]]:
        """The reply ended: a held tail is text of the state it was held in; a header that never became one (no
        marker in the reply) is answer; a header cut off is dropped."""
        out: list[tuple[str, str]] = []
        text, self.buf = self.buf, ""
        if self.state == "header" and self.fresh:
            _add(out, ANSWER, self.header + text)
            self.header = ""
        elif self.state != "header":
            self._text(out, text)
        return out

    def _text(self, out: list, text: str) -> None:
        """Text between markers, in the current state."""
        if not text:
            return
        if self.state == "body":
            _add(out, channel_of(self.name), text)
        elif self.state == "between":  # stray text after a message is answer (whitespace alone is not); before any
            if self.fresh:  # marker, the whole reply is
                self.state = "plain"
                _add(out, ANSWER, text)
                return
            self.gap += text
            if self.gap.strip():
                _add(out, ANSWER, self.gap)
                self.gap = ""
        elif self.state == "plain":
            _add(out, ANSWER, text)
        else:
            self.header += text
            if self.fresh and not self._may_be_header(self.header):
                self.state = "plain"
                _add(out, ANSWER, self.header)
                self.header = ""

    def _may_be_header(self, header: str) -> bool:
        """A reply's first text could still be a message header (its role when the prompt ends at `<|start|>`, a
        recipient " to=functions.f"), not plain text."""
        lead = header.lstrip(" ")
        return len(header) <= MAX_HEADER and any(w.startswith(lead) or lead.startswith(w) for w in HEADER_STARTS)

    def _marker(self, marker: str) -> None:
        self.fresh, self.gap = False, ""
        if marker == START:
            self.state, self.header, self.in_channel = "header", "", False
        elif marker == CHANNEL:
            self.state, self.header, self.in_channel = "header", "", True
        elif marker == MESSAGE:
            if self.state == "header":
                words = self.header.split()
                self.name = words[0] if self.in_channel and words else None
            elif self.state == "between":
                self.name = None
            self.state, self.header, self.in_channel = "body", "", False
        elif marker in (END, RETURN, CALL):
            self.state, self.header, self.in_channel = "between", "", False
        # CONSTRAIN: the header goes on (its text after the channel name is the constraint)


def _add(out: list, channel: str, text: str) -> None:
    if text:
        if out and out[-1][0] == channel:
            out[-1] = (channel, out[-1][1] + text)
        else:
            out.append((channel, text))


def split_harmony(text: str, prompt_tail: str = "<|start|>assistant") -> tuple[str, str]:
    """A whole harmony reply (markers included) -> (reasoning, answer)."""
    s = HarmonySplitter.after(prompt_tail)
    parts = s.push(text) + s.flush()
    return ("".join(t for c, t in parts if c == REASONING), "".join(t for c, t in parts if c == ANSWER))
