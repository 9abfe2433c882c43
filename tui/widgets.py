"""Widgets of `localmoe chat`: the multi-line prompt input, one view per chat message (streamed
Markdown), the status bar, the loading and error views, and the session picker.

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
from textual.screen import ModalScreen
from textual.widgets import Label, Markdown, OptionList, ProgressBar, Static, TextArea
from textual.widgets.markdown import MarkdownStream
from textual.widgets.option_list import Option

from localmoe.events import EngineStats
from localmoe.safe_text import for_line, for_terminal
from localmoe.tui.history import STATUS_MARKERS, SessionInfo, open_fence, with_marker

INPUT_HINT = "Enter send · ctrl+j newline · Esc cancel · /help · ctrl+p palette · ctrl+q quit"
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
    """One chat message: a role label and a Markdown body that can be streamed into.

    `content` is the exact text (what is stored and sent to the model); what is shown is that text through
    `for_terminal`. While streaming, a fragment ending in a control sequence that may continue in the next
    fragment is held back until it is complete (it shows nothing either way)."""

    ROLE_LABELS = {"user": "You", "assistant": "Assistant", "system": "System", "note": "localmoe"}

    def __init__(self, role: str, content: str = "", status: str = "ok", label: str | None = None) -> None:
        super().__init__(classes=f"message {role}" + (f" {status}" if status != "ok" else ""))
        self.role = role
        self.content = content
        self.status = status
        self._label = label or self.ROLE_LABELS.get(role, role)
        self._stream: MarkdownStream | None = None
        self._held = ""  # raw tail not shown yet: a control sequence that may go on in the next fragment
        self.shown = ""  # the Markdown source streamed so far (safe text)

    def compose(self) -> ComposeResult:
        yield Label(plain(self._label), classes="role")
        shown = for_terminal(self.content)
        if self.role == "user":  # a typed newline is a line break, not a Markdown soft break
            shown = shown.replace("\n", "  \n")
        self.shown = shown
        yield Markdown(with_marker(shown, self.status))

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    def start_stream(self) -> None:
        self.add_class("streaming")
        self._stream = Markdown.get_stream(self.markdown)

    @staticmethod
    def split_safe(pending: str) -> tuple[str, str]:
        """(safe text to show now, raw tail to hold back): the tail from the last sequence introducer when it
        shows nothing yet (an escape sequence a later fragment may complete)."""
        starts = [m.start() for m in _INTRODUCERS.finditer(pending)]
        if starts and not for_terminal(pending[starts[-1]:]):
            return for_terminal(pending[:starts[-1]]), pending[starts[-1]:]
        return for_terminal(pending), ""

    async def write(self, text: str) -> None:
        """Append a fragment of the reply; only the last Markdown block is re-parsed."""
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
            await self.markdown.append(tail)


def format_status(model: str, device: str, stats: EngineStats | None) -> str:
    """One line of figures for the status bar (model and device names made safe)."""
    parts = [for_line(model), for_line(device)]
    if stats is not None:
        parts.append(f"{stats.decode_tok_s:.1f} tok/s")
        cached = f" ({stats.reused_prompt_tokens} cached)" if stats.reused_prompt_tokens else ""
        parts.append(f"{stats.prompt_tokens} in{cached} / {stats.generated_tokens} out")
        parts.append(f"sparsity {stats.sparsity_realized:.0%}/{stats.sparsity_target:.0%}")
        parts.append(f"GPU {stats.peak_gpu_mem_gb:.1f}G")
        if stats.cache_hit_rate is not None:
            parts.append(f"cache {stats.cache_hit_rate:.0%}")
        if stats.h2d_bytes_per_token is not None:
            parts.append(f"host→GPU {stats.h2d_bytes_per_token / 1e6:.0f} MB/tok")
    return " · ".join(p for p in parts if p)


class StatusBar(Static):
    """The live status line under the conversation; a warning (e.g. history not saved) leads it."""

    def show(self, model: str, device: str, stats: EngineStats | None, warning: str = "") -> None:
        line = format_status(model, device, stats)
        if warning:
            line = f"⚠ {for_line(warning)} · {line}"
        self.set_class(bool(warning), "warning")
        self.update(Content(line))


class LoadingView(Vertical):
    """Shown while the model downloads, loads and calibrates: one line per finished stage, a bar for the current one."""

    STAGE_TITLES = {"download": "Downloading weights", "load": "Loading the model", "calibrate": "Calibrating sparsity"}

    def __init__(self, model_label: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model_label = model_label
        self.stage = ""
        self._finished: list[str] = []

    def compose(self) -> ComposeResult:
        yield Label(plain(f"Starting {self.model_label}"), classes="title")
        yield Static("", id="done-stages")
        yield Label("Preparing…", id="stage")
        yield ProgressBar(total=None, show_eta=False, id="progress")

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
    from localmoe.errors import LocalmoeError

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


class ErrorView(Vertical, can_focus=True):
    """A failure the user must act on: the error text and what to do about it."""

    BINDINGS = [("r", "app.retry_load", "Retry"), ("q", "app.quit", "Quit")]

    def compose(self) -> ComposeResult:
        yield Label("localmoe could not start the chat", classes="title")
        yield Static("", id="error-text")
        yield Static("", id="error-hint")
        yield Label("r retry · q quit", classes="keys")

    def show(self, text: str, hint: str) -> None:
        self.query_one("#error-text", Static).update(Content(for_terminal(text)))
        self.query_one("#error-hint", Static).update(Content(for_terminal(hint)))


class SessionPicker(ModalScreen[int | None]):
    """Pick a saved conversation to resume (Enter), or Esc to go back."""

    BINDINGS = [("escape", "dismiss_none", "Back")]

    def __init__(self, sessions: list[SessionInfo]) -> None:
        super().__init__()
        self.sessions = sessions

    def compose(self) -> ComposeResult:
        with Vertical(id="picker"):
            yield Label("Saved conversations — Enter resumes, Esc goes back", classes="title")
            options = [
                Option(plain(f"#{s.id}  {s.title or '(empty)'}  · {s.message_count} msgs · {s.model}"), id=str(s.id))
                for s in self.sessions
            ]
            yield OptionList(*options) if options else Label("No saved conversations yet.")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(int(event.option.id or 0))

    def action_dismiss_none(self) -> None:
        self.dismiss(None)
