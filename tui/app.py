"""The `localmoe chat` Textual app and its CLI entry point `run_chat`.

Owns the chat flow: loading the engine behind the loading view, sending a prompt,
streaming the reply from a worker thread into a Markdown view, cancelling with Esc,
committing every message to the history store, and the slash commands. The engine is
any `ChatEngine` (localmoe.events); tests pass a scripted one as `engine=`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import ContentSwitcher, Label

from localmoe.events import ChatEngine, GenerationSettings, ProgressFn
from localmoe.tui.commands import ChatCommands, CommandError, CommandsMixin, parse_command
from localmoe.tui.history import HistoryError, HistoryStore, default_db_path
from localmoe.tui.widgets import INPUT_HINT, ChatInput, ErrorView, LoadingView, MessageView, StatusBar, describe_error

LoadFn = Callable[[ProgressFn], ChatEngine]


class Progress(Message):
    def __init__(self, stage: str, done: int, total: int | None) -> None:
        super().__init__()
        self.stage, self.done, self.total = stage, done, total


class Loaded(Message):
    def __init__(self, engine: ChatEngine | None, error: str = "", hint: str = "") -> None:
        super().__init__()
        self.engine, self.error, self.hint = engine, error, hint


class ReplyChunk(Message):
    def __init__(self, reply_id: int, text: str) -> None:
        super().__init__()
        self.reply_id, self.text = reply_id, text


class ReplyDone(Message):
    def __init__(self, reply_id: int, text: str, reason: str, error: str) -> None:
        super().__init__()
        self.reply_id, self.text, self.reason, self.error = reply_id, text, reason, error


@dataclass
class Turn:
    """A persisted message of the current session and the view showing it."""

    id: int
    role: str
    content: str
    status: str
    view: MessageView | None = None


@dataclass
class Reply:
    """The reply in flight."""

    id: int
    view: MessageView
    cancel_requested: bool = False


class ChatApp(CommandsMixin, App[int]):
    """Terminal chat over a ChatEngine. Give `engine=` (ready) or `load=` (called in a thread)."""

    CSS_PATH = "app.tcss"
    TITLE = "localmoe chat"
    COMMANDS = App.COMMANDS | {ChatCommands}
    BINDINGS = [Binding("escape", "cancel_reply", "Cancel reply", priority=True, show=False)]

    def __init__(self, *, engine: ChatEngine | None = None, load: LoadFn | None = None, model_label: str = "",
                 settings: GenerationSettings | None = None, sparsity: float | None = None,
                 system: str | None = None, continue_last: bool = False, db_path: Path | str | None = None) -> None:
        super().__init__()
        if engine is None and load is None:
            raise ValueError("ChatApp needs engine= or load=")
        self.engine = engine
        self._load = load
        self.model_label = model_label or (engine.model_name if engine is not None else "model")
        self.settings = settings or GenerationSettings()
        self._initial_sparsity = sparsity
        self.system = system or None
        self._continue_last = continue_last
        self._db_path = db_path if db_path is not None else default_db_path()
        self.store: HistoryStore | None = None
        self.session_id: int | None = None
        self.turns: list[Turn] = []
        self.reply: Reply | None = None
        self.busy = ""  # e.g. "calibrating 3/8" while /sparsity runs
        self.load_error = ""
        self._reply_counter = 0

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

    # startup ---------------------------------------------------------------------------------

    async def on_mount(self) -> None:
        try:
            self.store = HistoryStore(self._db_path)
        except HistoryError as exc:
            self.store = HistoryStore(":memory:")
            self.notify(f"{exc}; this conversation will not be saved", severity="warning", timeout=10)
        self.refresh_status()
        if self.query_one("#main", ContentSwitcher).current == "loading":
            self.start_loading()
        else:
            await self.enter_chat()

    def start_loading(self) -> None:
        self.query_one("#main", ContentSwitcher).current = "loading"
        load = self._load or (lambda progress: self.engine)
        self._spawn(self._load_thread, load, self._initial_sparsity)

    def action_retry_load(self) -> None:
        if self.load_error:
            self.load_error = ""
            self.start_loading()

    def _load_thread(self, load: LoadFn, sparsity: float | None) -> None:
        last = {"stage": "", "at": 0.0}

        def progress(stage: str, done: int, total: int | None) -> None:
            now = time.monotonic()  # downloads report per chunk: pass ~20 updates/s, and every stage change and end
            if stage != last["stage"] or done == total or now - last["at"] >= 0.05:
                last.update(stage=stage, at=now)
                self._post(Progress(stage, done, total))

        try:
            engine = load(progress)
            if sparsity is not None:
                engine.set_sparsity(sparsity, progress)
        except (Exception, SystemExit) as exc:
            self._post(Loaded(None, *describe_error(exc)))
        else:
            self._post(Loaded(engine))

    def on_progress(self, msg: Progress) -> None:
        if self.query_one("#main", ContentSwitcher).current == "loading":
            self.query_one(LoadingView).update_progress(msg.stage, msg.done, msg.total)
        else:
            self.busy = f"{msg.stage} {msg.done}/{msg.total}" if msg.total else f"{msg.stage}…"
            self.refresh_status()

    async def on_loaded(self, msg: Loaded) -> None:
        if msg.engine is None:
            self.load_error = msg.error
            self.query_one(ErrorView).show(msg.error, msg.hint)
            self.query_one("#main", ContentSwitcher).current = "error"
            self.query_one(ErrorView).focus()
            return
        self.engine, self.load_error = msg.engine, ""
        self.model_label = self.engine.model_name or self.model_label
        await self.enter_chat()

    async def enter_chat(self) -> None:
        self.query_one("#main", ContentSwitcher).current = "chat"
        self.query_one("#conversation", VerticalScroll).anchor()
        if self._continue_last and self.store is not None and (last := self.store.last_session()):
            await self.show_session(last.id)
        else:
            device = f" on {self.engine.device}" if self.engine is not None and self.engine.device else ""
            if getattr(self.engine, "experts_format", "full") == "int4":
                device += " with 4-bit experts"
            await self.add_note(f"Chatting with `{self.model_label}`{device}. Type `/help` for commands.")
            if self.system:
                await self.add_note(f"System prompt: {self.system}", role="system")
        self.refresh_status()
        self.query_one(ChatInput).focus()

    # sending and streaming -------------------------------------------------------------------

    async def on_chat_input_submitted(self, event: ChatInput.Submitted) -> None:
        text = event.text.strip()
        try:
            parsed = parse_command(text)
        except CommandError as exc:
            self.notify(str(exc), severity="error")
            return
        self.query_one(ChatInput).clear()
        if parsed is not None:
            await self.run_command(parsed)
        else:
            await self.send(text[1:] if text.startswith("//") else text)

    def can_start(self) -> bool:
        if self.engine is None:
            return False
        if self.reply is not None or self.busy:
            self.notify("Wait for the reply to finish (Esc cancels it).", severity="warning")
            return False
        return True

    async def send(self, text: str) -> None:
        if not self.can_start():
            return
        view = MessageView("user", text)
        await self.query_one("#conversation").mount(view)
        self.turns.append(Turn(self._save("user", text), "user", text, "ok", view))
        await self.start_reply()

    async def start_reply(self) -> None:
        self._reply_counter += 1
        view = MessageView("assistant")
        await self.query_one("#conversation").mount(view)
        view.start_stream()
        self.reply = Reply(self._reply_counter, view)
        self.query_one("#conversation", VerticalScroll).anchor()
        self.refresh_status()
        self._spawn(self._decode_thread, self._reply_counter, self.context(), self.settings)

    def context(self) -> list[dict]:
        """The messages for the engine: system prompt, then user/assistant turns with content."""
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        return msgs + [{"role": t.role, "content": t.content} for t in self.turns
                       if t.role == "user" or (t.role == "assistant" and t.content.strip())]

    def _decode_thread(self, reply_id: int, messages: Sequence[dict], settings: GenerationSettings) -> None:
        parts: list[str] = []
        reason, error = "", ""
        try:
            assert self.engine is not None
            for event in self.engine.chat(messages, settings):
                if event.text:
                    parts.append(event.text)
                    self._post(ReplyChunk(reply_id, event.text))
            reason = self.engine.stats.finish_reason
        except Exception as exc:
            reason, error = "error", describe_error(exc)[0].removeprefix("localmoe: error: ")
        text = "".join(parts)
        self._post(ReplyDone(reply_id, text, reason, error))
        # while the user reads and types: the engine adds this reply to its cache, so the next turn prefills only
        # the new message (an engine without it, or a failure here, just prefills more next turn)
        prepare = getattr(self.engine, "prepare_next_turn", None)
        if prepare is not None and reason in ("stop", "length") and text.strip():
            try:
                prepare([*messages, {"role": "assistant", "content": text}])
            except Exception:  # noqa: BLE001
                pass

    async def on_reply_chunk(self, msg: ReplyChunk) -> None:
        if self.reply is not None and self.reply.id == msg.reply_id:
            await self.reply.view.write(msg.text)
            self.refresh_status()

    async def on_reply_done(self, msg: ReplyDone) -> None:
        reply = self.reply
        if reply is None or reply.id != msg.reply_id:
            return
        self.reply = None
        cancelled = reply.cancel_requested or msg.reason == "cancelled"
        status = "error" if msg.error else "cancelled" if cancelled else "ok"
        text = msg.text if len(msg.text) >= len(reply.view.content) else reply.view.content
        await reply.view.finish(status, msg.error)
        self.turns.append(Turn(self._save("assistant", text, status), "assistant", text, status, reply.view))
        self.refresh_status()

    def action_cancel_reply(self) -> None:
        if self.reply is not None and self.engine is not None:
            self.reply.cancel_requested = True
            self.engine.cancel()
            self.refresh_status()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "cancel_reply":  # let Esc through to dialogs and the palette unless a reply runs
            return self.reply is not None and len(self.screen_stack) == 1
        return True

    async def action_quit(self) -> None:
        """Quit; a reply in flight is cancelled and its partial text saved first."""
        reply = self.reply
        if reply is not None:
            self.reply = None
            if self.engine is not None:
                self.engine.cancel()
            self._save("assistant", reply.view.content, "cancelled")
        if self.store is not None:
            self.store.close()
            self.store = None
        self.exit(return_code=1 if self.load_error else 0)

    # helpers ---------------------------------------------------------------------------------

    def _save(self, role: str, content: str, status: str = "ok") -> int:
        """Commit one message, creating the session on its first message; returns its id (0 if unsaved)."""
        if self.store is None:
            return 0
        if self.session_id is None:
            self.session_id = self.store.new_session(self.model_label, self.system)
        return self.store.add_message(self.session_id, role, content, status)

    def _post(self, message: Message) -> None:
        """post_message from a worker thread; silently dropped once the app has gone."""
        try:
            self.post_message(message)
        except RuntimeError:
            pass

    @staticmethod
    def _spawn(target: Callable, *args: object) -> None:
        # Daemon threads: a load or decode still running cannot hold the process open after quit.
        threading.Thread(target=target, args=args, daemon=True, name=f"localmoe-{target.__name__}").start()

    def refresh_status(self) -> None:
        """Figures in the status bar; what is running (and how to stop it) in the hint line."""
        if self.reply is not None:
            state = "● cancelling…" if self.reply.cancel_requested else "● generating… Esc cancels the reply"
        else:
            state = f"● {self.busy}" if self.busy else ""
        stats = self.engine.stats if self.engine is not None else None
        device = self.engine.device if self.engine is not None else ""
        for bar in self.query(StatusBar):  # none while the app is shutting down
            bar.show(self.model_label, device, stats)
        for hint in self.query("#hint").results(Label):
            hint.update(state or INPUT_HINT)
            hint.set_class(bool(state), "busy")

    def notify(self, message: str, *, markup: bool = False, **kwargs) -> None:
        """Notifications carry user and error text: no markup unless asked for."""
        super().notify(message, markup=markup, **kwargs)

    async def add_note(self, markdown: str, role: str = "note") -> None:
        await self.query_one("#conversation").mount(MessageView(role, markdown))


def run_chat(load: LoadFn, *, model_label: str, settings: GenerationSettings, sparsity: float | None,
             system: str | None, continue_last: bool, db_path: Path | None = None) -> int:
    """Run `localmoe chat`: load the engine behind the loading view, then chat. Returns the exit code."""
    app = ChatApp(load=load, model_label=model_label, settings=settings, sparsity=sparsity,
                  system=system, continue_last=continue_last, db_path=db_path)
    try:
        app.run()
    except Exception as exc:  # a UI failure must still end with a message, not a traceback
        print(describe_error(exc)[0])
        return 1
    return app.return_code or 0
