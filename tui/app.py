"""The `localmoe chat` Textual app and its CLI entry point `run_chat`.

Owns the chat flow: loading the engine behind the loading view, sending a prompt,
streaming the reply from a worker thread into a Markdown view, cancelling with Esc,
committing every message to the history store, and the slash commands. The engine is
any `ChatEngine` (localmoe.events); tests pass a scripted one as `engine=`.

Nothing shown is lost: each message is committed when it is shown, and the reply in flight
is stored as it streams (status 'streaming', its text updated at most once per SAVE_INTERVAL
and at its end). When the database cannot be written (read-only, disk full, corrupt) the
conversation stays in memory, one warning is shown, the status bar says so, and every later
write retries what is missing, in order. SIGTERM and SIGHUP (run_chat) save the partial reply
and end the app normally, which restores the terminal. A conversation longer than the model's
context is sent without its oldest turns (fit_to_context).
"""

from __future__ import annotations

import asyncio
import signal
import sqlite3
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
from localmoe.safe_text import for_line, for_terminal
from localmoe.tui.commands import ChatCommands, CommandError, CommandsMixin, parse_command
from localmoe.tui.history import HistoryError, HistoryStore, default_db_path
from localmoe.tui.widgets import INPUT_HINT, ChatInput, ErrorView, LoadingView, MessageView, StatusBar, describe_error

LoadFn = Callable[[ProgressFn], ChatEngine]
SAVE_INTERVAL = 1.0  # seconds between writes of the reply in flight (a kill -9 loses at most this much)
EXIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # end the app normally: partial reply saved, terminal restored


def _reopen_after(exc: BaseException) -> bool:
    """Whether a write failure may be gone with a new connection: SQLite keeps a file it opened read-only so for
    good, and a journal it could not create or an I/O error may have been fixed since (a full disk has not; the
    connection retries as it is)."""
    code = getattr(exc.__cause__, "sqlite_errorcode", None)
    return code is not None and code & 0xFF in (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_IOERR)


def context_limit(engine: object) -> int:
    """Tokens a prompt and its reply may take together: the engine's context, capped by the model's positions
    (0 when the engine does not say)."""
    limit = int(getattr(engine, "context", 0) or 0)
    positions = int(getattr(engine, "max_positions", 0) or 0)
    if positions:
        limit = min(limit, positions) if limit else positions
    return limit


def fit_to_context(engine: object, messages: Sequence[dict], max_new_tokens: int) -> tuple[list[dict], int]:
    """`messages` without their oldest turns, so that the prompt leaves room for a reply within the context:
    the system prompt and the newest messages are kept, the last (new user) message always; what is kept starts
    at a user message (templates want user/assistant turns in order). Room for the reply: max_new_tokens, at most
    a quarter of the context. Returns (messages to send, how many were left out); an engine without
    `encode_chat` or a context size is given everything."""
    messages = list(messages)
    encode = getattr(engine, "encode_chat", None)
    limit = context_limit(engine)
    if encode is None or limit <= 0 or not messages:
        return messages, 0
    budget = limit - max(1, min(int(max_new_tokens), limit // 4))
    head = messages[:1] if messages[0].get("role") == "system" else []
    history = messages[len(head):]

    def fits(start: int) -> bool:
        return len(encode(head + history[start:])) <= budget

    try:
        if fits(0):
            return messages, 0
        starts = [i for i, m in enumerate(history) if i > 0 and m.get("role") == "user"]
        if not starts:
            return messages, 0
        lo, hi = 0, len(starts) - 1
        while lo < hi:  # the fewest messages left out: fits() only gets truer as the start moves on
            mid = (lo + hi) // 2
            if fits(starts[mid]):
                hi = mid
            else:
                lo = mid + 1
    except Exception:  # noqa: BLE001
        return messages, 0  # (no chat template, ...): the engine reports it when asked to chat
    return head + history[starts[lo]:], starts[lo]


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


class ContextTrimmed(Message):
    def __init__(self, reply_id: int, dropped: int) -> None:
        super().__init__()
        self.reply_id, self.dropped = reply_id, dropped


@dataclass
class Turn:
    """A message of the current session and the view showing it. id 0: not in the database yet; saved: the
    database holds this content and status."""

    id: int
    role: str
    content: str
    status: str
    view: MessageView | None = None
    saved: bool = False


@dataclass
class Reply:
    """The reply in flight (its turn is the last of ChatApp.turns, status 'streaming')."""

    id: int
    view: MessageView
    turn: Turn
    cancel_requested: bool = False


class ChatApp(CommandsMixin, App[int]):
    """Terminal chat over a ChatEngine. Give `engine=` (ready) or `load=` (called in a thread)."""

    CSS_PATH = "app.tcss"
    TITLE = "localmoe chat"
    COMMANDS = App.COMMANDS | {ChatCommands}
    BINDINGS = [Binding("escape", "cancel_reply", "Cancel reply", priority=True, show=False)]

    def __init__(self, *, engine: ChatEngine | None = None, load: LoadFn | None = None, model_label: str = "",
                 settings: GenerationSettings | None = None, sparsity: float | None = None,
                 system: str | None = None, continue_last: bool = False, db_path: Path | str | None = None,
                 handle_signals: bool = False) -> None:
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
        self._handle_signals = handle_signals
        self.history_error = ""  # why the history is not saved now ("" when all is saved or retried fine)
        self._pending_deletes: list[int] = []  # messages to delete (a regenerated reply) once the database allows
        self._system_dirty = False  # the session's system prompt changed and is not saved yet
        self._last_save = 0.0
        self._drop_confirmed = False  # an unsaved conversation may be dropped (/new, /sessions, quit asked twice)
        self.dropped_for_context = 0  # oldest messages left out of the last prompt
        self._trim_noticed = False
        self.notices: list[str] = []  # every notification shown, as shown

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
        if self._handle_signals:
            loop = asyncio.get_running_loop()
            for signum in EXIT_SIGNALS:
                loop.add_signal_handler(signum, self.exit_on_signal, signum)
        self._open_store()
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
        last = None
        if self._continue_last and self.store is not None:
            try:
                last = self.store.last_session()
            except HistoryError as exc:
                self._history_failed(exc)
        if last is not None:
            await self.show_session(last.id)
        else:
            device = f" on {self.engine.device}" if self.engine is not None and self.engine.device else ""
            if getattr(self.engine, "experts_format", "full") == "int4":
                device += " with 4-bit experts"
            label = for_line(self.model_label).replace("`", "'")
            await self.add_note(f"Chatting with `{label}`{for_line(device)}. Type `/help` for commands.")
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
        if parsed is None and not self.can_start():
            return  # the typed text stays in the input
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
        self.turns.append(Turn(0, "user", text, "ok", view))
        self._drop_confirmed = False
        self._sync()
        await self.start_reply()

    async def start_reply(self) -> None:
        self._reply_counter += 1
        messages = self.context()
        view = MessageView("assistant")
        await self.query_one("#conversation").mount(view)
        view.start_stream()
        turn = Turn(0, "assistant", "", "streaming", view)
        self.turns.append(turn)
        self.reply = Reply(self._reply_counter, view, turn)
        self._sync()  # the reply's row exists from its start: what streams is saved as it comes
        self.query_one("#conversation", VerticalScroll).anchor()
        self.refresh_status()
        self._spawn(self._decode_thread, self._reply_counter, messages, self.settings)

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
            messages, dropped = fit_to_context(self.engine, messages, settings.max_new_tokens)
            if dropped:
                self._post(ContextTrimmed(reply_id, dropped))
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
        reply = self.reply
        if reply is not None and reply.id == msg.reply_id:
            await reply.view.write(msg.text)
            reply.turn.content, reply.turn.saved = reply.view.content, False
            if time.monotonic() - self._last_save >= SAVE_INTERVAL:
                self._sync()
            self.refresh_status()

    def on_context_trimmed(self, msg: ContextTrimmed) -> None:
        self.dropped_for_context = msg.dropped
        if not self._trim_noticed:
            self._trim_noticed = True
            self.notify(f"Oldest {msg.dropped} messages left out to fit the context "
                        f"({context_limit(self.engine)} tokens).", timeout=8)

    async def on_reply_done(self, msg: ReplyDone) -> None:
        reply = self.reply
        if reply is None or reply.id != msg.reply_id:
            return
        self.reply = None
        cancelled = reply.cancel_requested or msg.reason == "cancelled"
        status = "error" if msg.error else "cancelled" if cancelled else "ok"
        text = msg.text if len(msg.text) >= len(reply.view.content) else reply.view.content
        await reply.view.finish(status, msg.error)
        reply.turn.content, reply.turn.status, reply.turn.saved = text, status, False
        self._sync()
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
        """Quit; a reply in flight is cancelled and its partial text saved first. With messages the history could
        not save, the first ctrl+q only warns (/export keeps them)."""
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

    def _stop_reply(self, status: str) -> None:
        """End the reply in flight now (the engine is told to stop) and save what it has shown, as `status`."""
        reply = self.reply
        if reply is None:
            return
        self.reply = None
        if self.engine is not None:
            self.engine.cancel()
        reply.turn.content, reply.turn.status, reply.turn.saved = reply.view.content, status, False
        self._sync()

    def _close_store(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None

    # history ---------------------------------------------------------------------------------

    def _open_store(self) -> bool:
        try:
            self.store = HistoryStore(self._db_path)
        except HistoryError as exc:
            self.store = None
            self._history_failed(exc)
            return False
        return True

    def _sync(self) -> bool:
        """Write to the history what it lacks, oldest first: pending deletions, the session, its system prompt,
        then each message not saved (new ones appended, changed ones updated). Stops at the first failure and keeps
        everything in memory for the next try. True when the history holds the whole conversation."""
        self._last_save = time.monotonic()
        unsaved = [t for t in self.turns if not t.saved]
        if not unsaved and not self._pending_deletes and not self._system_dirty:
            return True
        if self.store is None and not self._open_store():
            return False
        store = self.store
        try:
            while self._pending_deletes:
                store.delete_message(self._pending_deletes[0])
                self._pending_deletes.pop(0)
            if unsaved and self.session_id is None:
                self.session_id = store.new_session(self.model_label, self.system)
                self._system_dirty = False
            if self._system_dirty and self.session_id is not None:
                store.set_system(self.session_id, self.system)
                self._system_dirty = False
            for turn in unsaved:
                if turn.id:
                    store.update_message(turn.id, turn.content, turn.status)
                else:
                    turn.id = store.add_message(self.session_id, turn.role, turn.content, turn.status)
                turn.saved = True
        except HistoryError as exc:
            if _reopen_after(exc):  # a fresh connection sees permissions or files fixed since
                self._close_store()
            self._history_failed(exc)
            return False
        if self.history_error:
            self.history_error = ""
            self.notify("Chat history saved again.")
            self.refresh_status()
        return True

    def _history_failed(self, exc: BaseException) -> None:
        """The history cannot be read or written: warn once (until it works again), mark the status bar."""
        first = not self.history_error
        self.history_error = "history not saved"
        if first:
            self.notify(f"{exc}. This conversation is kept in memory and saved when the history can be written "
                        "again; /export FILE writes it out.", severity="warning", timeout=12)
        self.refresh_status()

    def may_drop_conversation(self, again: str) -> bool:
        """True unless this conversation has messages the history could not save; then warn the first time (asking
        for `again` to confirm)."""
        if all(t.saved for t in self.turns) or self._sync() or self._drop_confirmed:
            return True
        self._drop_confirmed = True
        self.notify(f"This conversation is not saved: /export FILE keeps it; {again} again drops it.",
                    severity="warning", timeout=10)
        return False

    # helpers ---------------------------------------------------------------------------------

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
            bar.show(self.model_label, device, stats, self.history_error)
        for hint in self.query("#hint").results(Label):
            hint.update(state or INPUT_HINT)
            hint.set_class(bool(state), "busy")

    def notify(self, message: str, *, markup: bool = False, title: str = "", **kwargs) -> None:
        """Notifications carry user, model and error text: control sequences removed, no markup unless asked for."""
        message, title = for_terminal(str(message)), for_line(title)
        self.notices.append(message)
        super().notify(message, markup=markup, title=title, **kwargs)

    async def add_note(self, markdown: str, role: str = "note") -> None:
        await self.query_one("#conversation").mount(MessageView(role, markdown))


def run_chat(load: LoadFn, *, model_label: str, settings: GenerationSettings, sparsity: float | None,
             system: str | None, continue_last: bool, db_path: Path | None = None) -> int:
    """Run `localmoe chat`: load the engine behind the loading view, then chat. Returns the exit code."""
    app = ChatApp(load=load, model_label=model_label, settings=settings, sparsity=sparsity,
                  system=system, continue_last=continue_last, db_path=db_path, handle_signals=True)
    try:
        app.run()
    except Exception as exc:  # a UI failure must still end with a message, not a traceback
        print(for_line(describe_error(exc)[0]))
        return 1
    return app.return_code or 0
