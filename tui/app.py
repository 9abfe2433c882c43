"""The `localmoe chat` Textual app and its CLI entry point `run_chat`.

Owns the app: its layout (the input live from the first frame, during the load too), the keys and the status line.
Loading the engine and switching models (`/model`) is in loading.py, the conversation flow (sending, queueing,
streaming, cancelling) in replies.py, the history in store_sync.py, the slash commands in handlers.py. The engine is
any `ChatEngine` (localmoe.events): give `engine=` (ready) or `load=`, called in a thread as `load(progress)` and, to
switch models, `load(progress, model=NAME)`.

Keys: Enter sends (queues while the model loads or replies); Esc takes the last queued message back when the
input is empty, else cancels the reply in flight; ctrl+c cancels the reply (or says how to quit); only ctrl+q
and /quit quit. The history (store_sync.py) keeps every message and the reply in flight as it streams; SIGTERM and
SIGHUP (run_chat) save the partial reply and end the app normally, which restores the terminal. A conversation
longer than the model's context is sent without its oldest turns (prompts.fit_to_context).
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import threading
from collections.abc import Callable
from pathlib import Path

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.content import Content
from textual.message import Message
from textual.widgets import ContentSwitcher, Label, Static

from localmoe.events import ChatEngine, GenerationSettings
from localmoe.safe_text import for_line, for_terminal
from localmoe.tui import prompts
from localmoe.tui.commands import ChatCommands
from localmoe.tui.handlers import CommandsMixin
from localmoe.tui.history import default_db_path
from localmoe.tui.loading import LoadFn, LoadingMixin
from localmoe.tui.prompts import context_limit, fit_to_context  # noqa: F401  (imported from here by tests)
from localmoe.tui.replies import ContextTrimmed, Progress, Queued, RepliesMixin, Reply, ReplyChunk, ReplyDone  # noqa: F401
from localmoe.tui.store_sync import SAVE_INTERVAL, StoreSyncMixin, Turn  # noqa: F401
from localmoe.tui.widgets import INPUT_HINT, ChatInput, ErrorView, LoadingView, MessageView, StatusBar, describe_error

EXIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # end the app normally: partial reply saved, terminal restored
QUIT_HINT = "Press ctrl+q to quit."


class ChatApp(CommandsMixin, LoadingMixin, RepliesMixin, StoreSyncMixin, App[int]):
    """Terminal chat over a ChatEngine. Give `engine=` (ready) or `load=` (called in a thread)."""

    CSS_PATH = "app.tcss"
    TITLE = "localmoe chat"
    COMMANDS = App.COMMANDS | {ChatCommands}
    BINDINGS = [
        Binding("escape", "escape", "Cancel", priority=True, show=False),
        Binding("ctrl+c", "interrupt", "Cancel reply", priority=True, show=False),
        Binding("ctrl+r", "retry_load", "Retry", priority=True, show=False),
    ]

    def __init__(
        self,
        *,
        engine: ChatEngine | None = None,
        load: LoadFn | None = None,
        model_label: str = "",
        settings: GenerationSettings | None = None,
        sparsity: float | None = None,
        system: str | None = None,
        continue_last: bool = False,
        db_path: Path | str | None = None,
        handle_signals: bool = False,
        think: bool | None = None,
    ) -> None:
        super().__init__()
        if engine is None and load is None:
            raise ValueError("ChatApp needs engine= or load=")
        self.engine = engine
        self._load = load
        self.model_label = model_label or (engine.model_name if engine is not None else "model")
        self.settings = settings or GenerationSettings()
        # what the caller's settings set (fields off GenerationSettings' defaults) and what slash commands set: kept
        # over each engine's own defaults (its generation config: adopt_defaults)
        self._given = {
            f.name: getattr(self.settings, f.name)
            for f in dataclasses.fields(self.settings)
            if getattr(self.settings, f.name) != getattr(GenerationSettings(), f.name, None)
        }
        self.chat_overrides: dict = {}
        self.think = think if think is not None else getattr(self.settings, "think", None)  # None: template default
        self._initial_sparsity = sparsity
        self.system = system or None
        self._continue_last = continue_last
        self._db_path = db_path if db_path is not None else default_db_path()
        self.store = None
        self.session_id: int | None = None
        self.turns: list[Turn] = []
        self.queue: list[Queued] = []
        self.reply: Reply | None = None
        self.busy = ""  # e.g. "calibrate 3/8" while /sparsity runs
        self.loading = False  # a load (the first, a retry, or /model's) runs
        self.load_error = ""
        self._switch_to: str | None = None  # the model /model asked for (a retry loads it again)
        self._entered = False  # the chat has been shown once (intro note, --continue)
        self._reply_counter = 0
        self._decode_worker: threading.Thread | None = None
        self._handle_signals = handle_signals
        self.history_error = ""  # why the history is not saved now ("" when all is saved or retried fine)
        self._pending_deletes: list[int] = []  # messages to delete (a regenerated reply) once the database allows
        self._system_dirty = False  # the session's system prompt changed and is not saved yet
        self._model_dirty = False  # the session's model changed (/model) and is not saved yet
        self._last_save = 0.0
        self._drop_confirmed = False  # an unsaved conversation may be dropped (/new, /sessions, quit asked twice)
        self._queue_drop_confirmed = False
        self.dropped_for_context = 0  # oldest messages left out of the last prompt
        self._trim_noticed = False
        self.notices: list[str] = []  # every notification shown, as shown
        self.event_lines: list[str] = []  # every system line added to the conversation (add_event)

    def compose(self) -> ComposeResult:
        needs_loading = self._load is not None or self._initial_sparsity is not None
        with ContentSwitcher(initial="loading" if needs_loading else "chat", id="main"):
            yield LoadingView(self.model_label, id="loading")
            yield ErrorView(id="error")
            with Vertical(id="chat"):
                yield VerticalScroll(id="conversation")
        yield ChatInput(id="prompt", placeholder="Type a message — Enter sends, /help lists commands")
        yield Label(INPUT_HINT, id="hint")
        yield StatusBar(id="status")

    # startup and model loading ---------------------------------------------------------------

    async def on_mount(self) -> None:
        if self._handle_signals:
            loop = asyncio.get_running_loop()
            for signum in EXIT_SIGNALS:
                loop.add_signal_handler(signum, self.exit_on_signal, signum)
        self.query_one(ChatInput).focus()  # typing works from the first frame, during the load too
        self._open_store()
        self.refresh_status()
        if self.query_one("#main", ContentSwitcher).current == "loading":
            self.start_loading()
        else:
            self.adopt_defaults()
            await self.enter_chat()

    async def enter_chat(self) -> None:
        self._entered = True
        self.query_one("#main", ContentSwitcher).current = "chat"
        self.query_one("#conversation", VerticalScroll).anchor()
        last = None
        if self._continue_last and self.store is not None:
            try:
                last = self.store.last_session()
            except Exception as exc:  # noqa: BLE001  (HistoryError)
                self._history_failed(exc)
        if last is not None:
            await self.show_session(last.id)
        else:
            label = for_line(self.model_label).replace("`", "'")
            await self.add_note(
                f"Chatting with `{label}`{for_line(self._where())}. Type `/help` for commands." + self._thinking_note()
            )
            if self.system:
                await self.add_note(f"System prompt: {self.system}", role="system")
        self.refresh_status()
        self.query_one(ChatInput).focus()

    def _where(self) -> str:
        where = f" on {self.engine.device}" if self.engine is not None and self.engine.device else ""
        if getattr(self.engine, "experts_format", "full") == "int4":
            where += " with 4-bit experts"
        return where

    def _thinking_note(self) -> str:
        if not prompts.supports_thinking(self.engine):
            return ""
        state = {None: "by default", True: "on", False: "off"}[self.think]
        return f" It can think before it answers (thinking {state}; `/think on|off`)."

    # keys ------------------------------------------------------------------------------------

    async def action_escape(self) -> None:
        """Esc: the last queued message back into an empty input, else cancel the reply in flight."""
        if self.queue and not self.query_one(ChatInput).text.strip():
            await self.unqueue_last()
        elif self.reply is not None:
            self.action_cancel_reply()

    def action_interrupt(self) -> None:
        """ctrl+c: copy a selection in the input; else cancel the reply in flight; else say how to quit."""
        prompt = self.query_one(ChatInput)
        if self.focused is prompt and prompt.selected_text:
            prompt.action_copy()
        elif self.reply is not None:
            self.action_cancel_reply()
        else:
            self.notify(QUIT_HINT, timeout=4)

    def action_help_quit(self) -> None:
        self.notify(QUIT_HINT, timeout=4)  # Textual's own says it with markup; this is plain text

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "escape":  # let Esc through to dialogs, the palette and the input unless it has work here
            if len(self.screen_stack) != 1:
                return False
            return self.reply is not None or bool(self.queue and not self.query_one(ChatInput).text.strip())
        if action == "interrupt":
            return len(self.screen_stack) == 1
        if action == "retry_load":
            return bool(self.load_error) and not self.loading
        return True

    async def action_quit(self) -> None:
        """Quit; a reply in flight is cancelled and its partial text saved first. With messages still queued, or
        messages the history could not save, the first ctrl+q only warns (/export keeps the conversation)."""
        if self.queue and not self._queue_drop_confirmed:
            self._queue_drop_confirmed = True
            n = len(self.queue)
            self.notify(
                f"{n} queued message{'s' if n != 1 else ''} not sent yet: ctrl+q again quits without "
                f"{'them' if n != 1 else 'it'}.",
                severity="warning",
                timeout=10,
            )
            return
        self._stop_reply("cancelled")
        if not self.may_drop_conversation("ctrl+q"):
            return
        self._close_store()
        self.exit(return_code=1 if self.load_error else 0)

    def exit_on_signal(self, signum: int) -> None:
        """SIGTERM/SIGHUP: save the partial reply and end the app normally (Textual restores the terminal).
        Exit status 128 + signum, as a process ended by that signal reports it in a shell."""
        self._stop_reply("interrupted")
        self._sync()
        self._close_store()
        self.exit(return_code=128 + int(signum))

    # helpers ---------------------------------------------------------------------------------

    def _post(self, message: Message) -> None:
        """post_message from a worker thread; silently dropped once the app has gone."""
        try:
            self.post_message(message)
        except RuntimeError:
            pass

    @staticmethod
    def _spawn(target: Callable, *args: object) -> threading.Thread:
        # Daemon threads: a load or decode still running cannot hold the process open after quit.
        thread = threading.Thread(target=target, args=args, daemon=True, name=f"localmoe-{target.__name__}")
        thread.start()
        return thread

    def _state(self) -> str:
        """What is running, and how to stop it, for the hint line ("" when idle); at most 76 cells (80 columns)."""
        n = len(self.queue)
        queued = f"{n} queued (Esc on an empty input takes it back)" if n else ""
        if self.loading:
            return (
                f"● loading the model… {n} queued, sent when it is ready · Esc takes it back"
                if n
                else "● loading the model… Enter queues a message · ctrl+q quits"
            )
        if self.load_error:
            return "● the model did not load: ctrl+r retries · /model NAME · ctrl+q quits"
        if self.reply is not None:
            if self.reply.cancel_requested:
                return "● cancelling…"
            doing = "thinking" if self.reply.thinking else "generating"
            return f"● {doing}… Esc cancels · {queued or 'Enter queues a message'}"
        if self.busy:
            return f"● {self.busy}" + (f" · {queued}" if queued else "")
        return ""

    def refresh_status(self) -> None:
        """Figures in the status bar; what is running (and how to stop it) in the hint line."""
        state = self._state()
        stats = self.engine.stats if self.engine is not None else None
        device = self.engine.device if self.engine is not None else ""
        for bar in self.query(StatusBar):  # none while the app is shutting down
            bar.show(self.model_label, device, stats, self.history_error)
        for hint in self.query("#hint").results(Label):
            hint.update(Content(state or INPUT_HINT))
            hint.set_class(bool(state), "busy")

    def notify(self, message: str, *, markup: bool = False, title: str = "", **kwargs) -> None:
        """Notifications carry user, model and error text: control sequences removed, no markup unless asked for."""
        message, title = for_terminal(str(message)), for_line(title)
        self.notices.append(message)
        super().notify(message, markup=markup, title=title, **kwargs)

    async def _mount_message(self, widget) -> None:
        """Add to the conversation, before the queued messages (they stay last until sent)."""
        conversation = self.query_one("#conversation")
        first_queued = next((q.view for q in self.queue if q.view is not None and q.view.parent is conversation), None)
        await conversation.mount(widget, before=first_queued)

    async def add_note(self, markdown: str, role: str = "note") -> None:
        await self._mount_message(MessageView(role, markdown))

    async def add_event(self, text: str) -> None:
        """A one-line system line in the conversation: what a command did (plain text, never markup)."""
        self.event_lines.append(text)
        await self._mount_message(Static(Content("· " + for_line(text)), classes="event"))


def run_chat(
    load: LoadFn,
    *,
    model_label: str,
    settings: GenerationSettings,
    sparsity: float | None,
    system: str | None,
    continue_last: bool,
    db_path: Path | None = None,
    think: bool | None = None,
) -> int:
    """Run `localmoe chat`: load the engine behind the loading view, then chat. `load(progress)` gives the engine
    named at start; `load(progress, model=NAME)` another (`/model NAME`). Returns the exit code."""
    app = ChatApp(
        load=load,
        model_label=model_label,
        settings=settings,
        sparsity=sparsity,
        system=system,
        continue_last=continue_last,
        db_path=db_path,
        handle_signals=True,
        think=think,
    )
    try:
        app.run()
    except Exception as exc:  # a UI failure must still end with a message, not a traceback
        print(for_line(describe_error(exc)[0]))
        return 1
    return app.return_code or 0
