"""Widgets of `localmoe chat`: the multi-line prompt input, one view per chat message (streamed
Markdown), the status bar, the loading and error views, and the session picker.

They hold no engine or database state: the app feeds them text and figures.
"""

from __future__ import annotations

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
from localmoe.tui.history import STATUS_MARKERS, SessionInfo

INPUT_HINT = "Enter send · ctrl+j newline · Esc cancel · /help · ctrl+p palette · ctrl+q quit"
NEWLINE_KEYS = ("ctrl+j", "shift+enter", "alt+enter")


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


class MessageView(Vertical):
    """One chat message: a role label and a Markdown body that can be streamed into."""

    ROLE_LABELS = {"user": "You", "assistant": "Assistant", "system": "System", "note": "localmoe"}

    def __init__(self, role: str, content: str = "", status: str = "ok", label: str | None = None) -> None:
        super().__init__(classes=f"message {role}")
        self.role = role
        self.content = content
        self.status = status
        self._label = label or self.ROLE_LABELS.get(role, role)
        self._stream: MarkdownStream | None = None

    def compose(self) -> ComposeResult:
        yield Label(Content(self._label), classes="role")
        # a typed newline is a line break, not a Markdown soft break
        shown = self.content.replace("\n", "  \n") if self.role == "user" else self.content
        yield Markdown(self._with_marker(shown, self.status))

    @staticmethod
    def _with_marker(content: str, status: str) -> str:
        marker = STATUS_MARKERS.get(status)
        if marker is None:
            return content
        return f"{content}\n\n{marker}" if content.strip() else marker

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    def start_stream(self) -> None:
        self.add_class("streaming")
        self._stream = Markdown.get_stream(self.markdown)

    async def write(self, text: str) -> None:
        """Append a fragment of the reply; only the last Markdown block is re-parsed."""
        self.content += text
        if self._stream is not None:
            await self._stream.write(text)

    async def finish(self, status: str, error: str = "") -> None:
        """Close the stream and mark a cancelled or failed reply."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.remove_class("streaming")
        self.status = status
        if status != "ok":
            self.add_class(status)
            tail = self._with_marker("", status)
            if error:
                tail += f" `{error}`"
            await self.markdown.append(("\n\n" if self.content.strip() else "") + tail)


def format_status(model: str, device: str, stats: EngineStats | None) -> str:
    """One line of figures for the status bar."""
    parts = [model, device]
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
    """The live status line under the conversation."""

    def show(self, model: str, device: str, stats: EngineStats | None) -> None:
        self.update(Content(format_status(model, device, stats)))


class LoadingView(Vertical):
    """Shown while the model downloads, loads and calibrates: one line per finished stage, a bar for the current one."""

    STAGE_TITLES = {"download": "Downloading weights", "load": "Loading the model", "calibrate": "Calibrating sparsity"}

    def __init__(self, model_label: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.model_label = model_label
        self.stage = ""
        self._finished: list[str] = []

    def compose(self) -> ComposeResult:
        yield Label(Content(f"Starting {self.model_label}"), classes="title")
        yield Static("", id="done-stages")
        yield Label("Preparing…", id="stage")
        yield ProgressBar(total=None, show_eta=False, id="progress")

    def update_progress(self, stage: str, done: int, total: int | None) -> None:
        if stage != self.stage:
            if self.stage:
                self._finished.append(f"✓ {self.STAGE_TITLES.get(self.stage, self.stage)}")
                self.query_one("#done-stages", Static).update("\n".join(self._finished))
            self.stage = stage
            self.query_one("#stage", Label).update(self.STAGE_TITLES.get(stage, stage.capitalize()) + "…")
        bar = self.query_one("#progress", ProgressBar)
        bar.update(total=total, progress=done)


def describe_error(exc: BaseException) -> tuple[str, str]:
    """(error text, what to do) for a failure shown in the app instead of a traceback."""
    from localmoe.errors import LocalmoeError

    msg = str(exc).strip()
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
        self.query_one("#error-text", Static).update(Content(text))
        self.query_one("#error-hint", Static).update(Content(hint))


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
                Option(Content(f"#{s.id}  {s.title or '(empty)'}  · {s.message_count} msgs · {s.model}"), id=str(s.id))
                for s in self.sessions
            ]
            yield OptionList(*options) if options else Label("No saved conversations yet.")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(int(event.option.id or 0))

    def action_dismiss_none(self) -> None:
        self.dismiss(None)
