"""Widgets of `localmoe chat`: the multi-line prompt input, one view per chat message (streamed
Markdown, a thinking model's reasoning collapsed above the answer: reasoning_view.py), the status bar (wrapped
onto a second line, never cut, when the terminal is narrow), the loading and error views. The session picker is
in sessions.py.

They hold no engine or database state: the app feeds them text and figures. Every text they show
passes through `localmoe.safe_text` (no control sequence from model output, prompts, history or
paths reaches the terminal) and is shown as plain text, never parsed as Textual/Rich markup.
"""

from __future__ import annotations

import re

from textual import events
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.content import Content
from textual.message import Message
from textual.widgets import Label, Markdown, ProgressBar, Static, TextArea
from textual.widgets.markdown import MarkdownStream

from localmoe.errors import LocalmoeError
from localmoe.events import EngineStats
from localmoe.safe_text import for_line, for_terminal
from localmoe.tui.history import STATUS_MARKERS, open_fence, with_marker
from localmoe.tui.reasoning_view import ReasoningView
from localmoe.tui.sessions import SessionPicker  # noqa: F401  (its home before sessions.py)
from localmoe.tui.status_line import status_parts, wrap_parts

INPUT_HINT = "Enter send · ctrl+j newline · Esc cancel · /help · ctrl+q quit"
QUEUED_LABEL = "You · queued (Esc on an empty input takes it back)"
NEWLINE_KEYS = ("ctrl+j", "shift+enter", "alt+enter")
# Where a control sequence may start: ESC and the C1 introducers (CSI, OSC, DCS, SOS, PM, APC).
_INTRODUCERS = re.compile("[\x1b\x9b\x9d\x90\x98\x9e\x9f]")


def plain(text: str) -> Content:
    """One line of untrusted text as a widget label: control sequences removed, markup not parsed."""
    return Content(for_line(text))


class ChatInput(TextArea):
    """The prompt: Enter submits, ctrl+j (or shift+enter where the terminal reports it) adds a line."""

    class Submitted(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            if self.text.strip():
                self.post_message(self.Submitted(self.text))
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)

    async def _on_paste(self, event: events.Paste) -> None:
        """Pasted text goes in without control sequences (the prompt shows what will be sent)."""
        clean = for_terminal(event.text)
        if clean != event.text:
            event.stop()
            event.prevent_default()
            await super()._on_paste(events.Paste(clean))
            return
        await super()._on_paste(event)


class MessageView(Vertical):
    """One chat message: a role label and a Markdown body that can be streamed into; a reply of a thinking model
    has its reasoning above the answer (a ReasoningView, collapsed). A user message sent while the model loads or
    replies waits with status 'queued' until it is sent (mark_sent).

    `content` is the exact text (what is stored and sent to the model); what is shown is that text through
    `for_terminal`. While streaming, a fragment ending in a control sequence that may continue in the next
    fragment is held back until it is complete (it shows nothing either way)."""

    ROLE_LABELS = {"user": "You", "assistant": "Assistant", "system": "System", "note": "localmoe"}

    def __init__(
        self, role: str, content: str = "", status: str = "ok", label: str | None = None, reasoning: str = ""
    ) -> None:
        super().__init__(classes=f"message {role}" + (f" {status}" if status != "ok" else ""))
        self.role = role
        self.content = content
        self.reasoning = reasoning
        self.status = status
        self._label = label or (QUEUED_LABEL if status == "queued" else self.ROLE_LABELS.get(role, role))
        self._stream: MarkdownStream | None = None
        self._held = ""  # raw tail not shown yet: a control sequence that may go on in the next fragment
        self.shown = ""  # the Markdown source streamed so far (safe text)

    def compose(self) -> ComposeResult:
        yield Label(plain(self._label), classes="role")
        if self.reasoning:
            yield ReasoningView(self.reasoning)
        shown = for_terminal(self.content)
        if self.role == "user":  # a typed newline is a line break, not a Markdown soft break
            shown = shown.replace("\n", "  \n")
        self.shown = shown
        yield Markdown(with_marker(shown, self.status))

    @property
    def markdown(self) -> Markdown:
        return self.query_one("MessageView > Markdown", Markdown)

    @property
    def reasoning_view(self) -> ReasoningView | None:
        found = self.query(ReasoningView)
        return found.first() if found else None

    def mark_sent(self) -> None:
        """A queued message is being sent now."""
        self.remove_class("queued")
        self.status = "ok"
        self._label = self.ROLE_LABELS["user"]
        self.query_one(".role", Label).update(plain(self._label))

    async def write_reasoning(self, text: str) -> None:
        """Append a fragment of the reply's reasoning (the block is made on its first fragment)."""
        self.reasoning += text
        view = self.reasoning_view
        if view is None:
            view = ReasoningView(streaming=True)
            await self.mount(view, before=self.markdown)
        await view.write(text)

    def start_stream(self) -> None:
        self.add_class("streaming")
        self._stream = Markdown.get_stream(self.markdown)

    @staticmethod
    def split_safe(pending: str) -> tuple[str, str]:
        """(safe text to show now, raw tail to hold back): the tail from the last sequence introducer when it
        shows nothing yet (an escape sequence a later fragment may complete)."""
        starts = [m.start() for m in _INTRODUCERS.finditer(pending)]
        if starts and not for_terminal(pending[starts[-1] :]):
            return for_terminal(pending[: starts[-1]]), pending[starts[-1] :]
        return for_terminal(pending), ""

    async def write(self, text: str) -> None:
        """Append a fragment of the reply's answer; only the last Markdown block is re-parsed."""
        view = self.reasoning_view
        if view is not None and view.streaming:
            await view.finish()
        self.content += text
        safe, self._held = self.split_safe(self._held + text)
        self.shown += safe
        if self._stream is not None and safe:
            await self._stream.write(safe)

    async def finish(self, status: str, error: str = "") -> None:
        """Close the stream and mark a cancelled, failed or interrupted reply (closing a code block left open)."""
        if self._held:
            safe, self._held = for_terminal(self._held), ""
            self.shown += safe
            if self._stream is not None and safe:
                await self._stream.write(safe)
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        if self.reasoning_view is not None:
            await self.reasoning_view.finish()
        self.remove_class("streaming", self.status)
        self.status = status
        if status != "ok":
            self.add_class(status)
            tail = ""
            fence = open_fence(self.shown)
            if fence:
                tail += ("" if self.shown.endswith("\n") else "\n") + fence
            if self.shown.strip():
                tail += "\n\n"
            tail += STATUS_MARKERS.get(status, f"*[{status}]*")
            if error:
                tail += " `" + for_line(error).replace("`", "'") + "`"
            body = self.query("MessageView > Markdown")
            if body:  # none when the app closes while the reply ends (its widgets are being removed)
                await body.first(Markdown).append(tail)


class StatusBar(Static):
    """The live status under the conversation; a warning (e.g. history not saved) leads it. When the figures do
    not fit the width, they go on a second line (breaking between figures); past two lines the last are left
    out."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.parts: list[str] = []

    def show(self, model: str, device: str, stats: EngineStats | None, warning: str = "") -> None:
        parts = status_parts(model, device, stats)
        if warning:
            parts.insert(0, f"⚠ {for_line(warning)}")
        self.set_class(bool(warning), "warning")
        self.parts = parts
        self._lay_out()

    @property
    def line(self) -> str:
        return " · ".join(self.parts)

    def _lay_out(self) -> None:
        width = self.content_size.width or (self.app.size.width - 2 if self.is_attached else 0) or 78
        self.update(Content("\n".join(wrap_parts(self.parts, max(10, width)))))

    def on_resize(self) -> None:
        self._lay_out()


class LoadingView(Vertical):
    """Shown while the model downloads, loads and calibrates: one line per finished stage, a bar for the current one."""

    STAGE_TITLES = {"download": "Downloading weights", "load": "Loading the model", "calibrate": "Calibrating sparsity"}

    def __init__(self, model_label: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model_label = model_label
        self.heading = f"Starting {model_label}"
        self.stage = ""
        self._finished: list[str] = []

    def compose(self) -> ComposeResult:
        yield Label(plain(self.heading), classes="title")
        yield Static("", id="done-stages")
        yield Label("Preparing…", id="stage")
        yield ProgressBar(total=None, show_eta=False, id="progress")
        yield Static("", id="queued")

    def reset(self, title: str) -> None:
        """Show a new load from its start (e.g. `/model` switching models)."""
        self.heading, self.stage, self._finished = title, "", []
        self.query_one(".title", Label).update(plain(title))
        self.query_one("#done-stages", Static).update("")
        self.query_one("#stage", Label).update("Preparing…")
        self.query_one("#progress", ProgressBar).update(total=None, progress=0)

    def show_queued(self, texts: list[str]) -> None:
        """The messages typed meanwhile, sent once the model is ready."""
        lines = [f"Queued: {for_line(t)}" for t in texts]
        if lines:
            lines.append("(sent when the model is ready; Esc on an empty input takes the last back)")
        self.query_one("#queued", Static).update(Content("\n".join(lines)))

    def update_progress(self, stage: str, done: int, total: int | None) -> None:
        if stage != self.stage:
            if self.stage:
                self._finished.append(f"✓ {self.STAGE_TITLES.get(self.stage, self.stage)}")
                self.query_one("#done-stages", Static).update("\n".join(self._finished))
            self.stage = stage
            self.query_one("#stage", Label).update(plain(self.STAGE_TITLES.get(stage, stage.capitalize()) + "…"))
        bar = self.query_one("#progress", ProgressBar)
        bar.update(total=total, progress=done)


def describe_error(exc: BaseException) -> tuple[str, str]:
    """(error text, what to do) for a failure shown in the app instead of a traceback."""

    msg = for_terminal(str(exc)).strip()
    if msg.startswith("localmoe: error:"):
        text = msg
    elif isinstance(exc, LocalmoeError):  # already says what is wrong and what to do
        return f"localmoe: error: {msg}", ""
    else:
        text = f"localmoe: error: {type(exc).__name__}: {msg}".rstrip(": ")
    low = f"{type(exc).__name__} {msg}".lower()
    if "out of memory" in low or "outofmemory" in low:
        hint = "The model does not fit in memory: try a smaller model, another dtype, or a higher sparsity."
    elif any(w in low for w in ("connection", "timeout", "resolve", "offline", "gated", "401", "403")):
        hint = "Check network access to the Hugging Face Hub (and your token for gated models), or use a cached model."
    elif "cuda" in low or "device" in low:
        hint = "Check the GPU driver, or pick another device with --device (see `localmoe chat --help`)."
    else:
        hint = "Check the model name and options (`localmoe chat --help`), then retry."
    return text, hint


class ErrorView(Vertical):
    """A failure the user must act on: the error text and what to do about it. Its keys are the app's (the input
    stays live below it, so letters typed here go there: no single letter quits)."""

    KEYS = "ctrl+r retry · /model NAME loads another model · ctrl+q quit"

    def compose(self) -> ComposeResult:
        yield Label("localmoe could not start the chat", classes="title")
        yield Static("", id="error-text")
        yield Static("", id="error-hint")
        yield Label(self.KEYS, classes="keys")

    def show(self, text: str, hint: str) -> None:
        self.query_one("#error-text", Static).update(Content(for_terminal(text)))
        self.query_one("#error-hint", Static).update(Content(for_terminal(hint)))
