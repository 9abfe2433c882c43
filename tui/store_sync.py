"""The history side of `localmoe chat` (mixed into ChatApp): writing the conversation to the history store as it
happens, keeping it in memory when the database cannot be written, and resuming a saved session.

Nothing shown is lost: each message is committed when it is shown, and the reply in flight is stored as it
streams (status 'streaming', its text updated at most once per SAVE_INTERVAL and at its end). When the database
cannot be written (read-only, disk full, corrupt) the conversation stays in memory, one warning is shown, the
status bar says so, and every later write retries what is missing, in order. A reply's reasoning is stored in its
own column, apart from the answer.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass

from localmoe.tui.history import HistoryError, HistoryStore
from localmoe.tui.widgets import ChatInput, MessageView

SAVE_INTERVAL = 1.0  # seconds between writes of the reply in flight (a kill -9 loses at most this much)


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
    reasoning: str = ""  # a thinking model's reasoning before this reply's answer


def _reopen_after(exc: BaseException) -> bool:
    """Whether a write failure may be gone with a new connection: SQLite keeps a file it opened read-only so for
    good, and a journal it could not create or an I/O error may have been fixed since (a full disk has not; the
    connection retries as it is)."""
    code = getattr(exc.__cause__, "sqlite_errorcode", None)
    return code is not None and code & 0xFF in (sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN, sqlite3.SQLITE_IOERR)


class StoreSyncMixin:
    """ChatApp's history: relies on its store, session_id, turns, system, model_label and notify."""

    def _open_store(self) -> bool:
        try:
            self.store = HistoryStore(self._db_path)
        except HistoryError as exc:
            self.store = None
            self._history_failed(exc)
            return False
        return True

    def _close_store(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None

    def _sync(self) -> bool:
        """Write to the history what it lacks, oldest first: pending deletions, the session, its system prompt and
        model, then each message not saved (new ones appended, changed ones updated). Stops at the first failure and
        keeps everything in memory for the next try. True when the history holds the whole conversation."""
        self._last_save = time.monotonic()
        unsaved = [t for t in self.turns if not t.saved]
        if not unsaved and not self._pending_deletes and not self._system_dirty and not self._model_dirty:
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
                self._system_dirty = self._model_dirty = False
            if self._system_dirty and self.session_id is not None:
                store.set_system(self.session_id, self.system)
                self._system_dirty = False
            if self._model_dirty and self.session_id is not None:
                store.set_model(self.session_id, self.model_label)
            self._model_dirty = False
            for turn in unsaved:
                if turn.id:
                    store.update_message(turn.id, turn.content, turn.status, turn.reasoning or None)
                else:
                    turn.id = store.add_message(
                        self.session_id, turn.role, turn.content, turn.status, turn.reasoning or None
                    )
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
            self.notify(
                f"{exc}. This conversation is kept in memory and saved when the history can be written "
                "again; /export FILE writes it out.",
                severity="warning",
                timeout=12,
            )
        self.refresh_status()

    def may_drop_conversation(self, again: str) -> bool:
        """True unless this conversation has messages the history could not save; then warn the first time (asking
        for `again` to confirm)."""
        if all(t.saved for t in self.turns) or self._sync() or self._drop_confirmed:
            return True
        self._drop_confirmed = True
        self.notify(
            f"This conversation is not saved: /export FILE keeps it; {again} again drops it.",
            severity="warning",
            timeout=10,
        )
        return False

    async def clear_conversation(self) -> None:
        """An empty conversation (the queued messages stay queued, shown again)."""
        conversation = self.query_one("#conversation")
        await conversation.remove_children()
        self.session_id, self.turns = None, []
        self._system_dirty = self._drop_confirmed = self._trim_noticed = self._model_dirty = False
        self.dropped_for_context = 0
        for item in self.queue:
            item.view = MessageView("user", item.text, "queued")
        await conversation.mount_all([item.view for item in self.queue])

    async def show_session(self, session_id: int) -> None:
        """Resume a saved conversation: its system prompt and messages become the current ones. A reply stored
        as 'streaming' was cut off (its process killed): it is shown, and saved, as interrupted."""
        try:
            info = self.store.session(session_id) if self.store is not None else None
            stored = self.store.messages(info.id) if info is not None else []
        except HistoryError as exc:
            self._history_failed(exc)
            return
        if info is None:
            self.notify(f"No saved conversation #{session_id}.", severity="error")
            return
        await self.clear_conversation()
        self.session_id, self.system = info.id, info.system
        self.turns = []
        for m in stored:
            status = "interrupted" if m.status == "streaming" else m.status
            view = MessageView(m.role, m.content, status, reasoning=m.reasoning or "")
            self.turns.append(
                Turn(m.id, m.role, m.content, status, view, saved=status == m.status, reasoning=m.reasoning or "")
            )
        self._sync()
        notes = [MessageView("system", f"System prompt: {info.system}")] if info.system else []
        conversation = self.query_one("#conversation")
        first_queued = self.queue[0].view if self.queue else None
        await conversation.mount_all(notes + [t.view for t in self.turns], before=first_queued)
        conversation.scroll_end(animate=False)
        self.query_one(ChatInput).focus()
        await self.add_event(f"Resumed #{info.id}: {info.title or '(empty)'}")
