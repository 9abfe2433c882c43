"""Chat history for `localmoe chat`: the SQLite store of sessions and messages.

Owns the database file (`$XDG_DATA_HOME/localmoe/chats.sqlite3`), its schema and the
migrations between schema versions (tracked in `PRAGMA user_version`), and the Markdown
export of a session (a reply's reasoning marked apart from its answer). Sessions can be renamed and
deleted. Every write is committed at once, so a killed process keeps all
that was written. A reply is stored while it streams (status 'streaming', its text updated
as it grows); a row still 'streaming' when read back by a later process was cut off by a
crash or kill and is shown as interrupted. Every database failure is raised as
HistoryError (the app keeps the conversation in memory and retries). Exports pass all
text through `localmoe.safe_text`, so the file is safe to `cat`. Pure stdlib; no Textual here.
"""

from __future__ import annotations

import functools
import re
import sqlite3
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from localmoe.paths import data_root
from localmoe.safe_text import for_line, for_terminal

# MIGRATIONS[i] takes a database from schema version i to i + 1. Append, never edit.
MIGRATIONS: list[list[str]] = [
    [  # v1: sessions and their messages
        """CREATE TABLE sessions (
            id INTEGER PRIMARY KEY,
            title TEXT NOT NULL DEFAULT '',
            model TEXT NOT NULL DEFAULT '',
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL)""",
        """CREATE TABLE messages (
            id INTEGER PRIMARY KEY,
            session_id INTEGER NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
            role TEXT NOT NULL,
            content TEXT NOT NULL,
            created_at REAL NOT NULL)""",
        "CREATE INDEX messages_by_session ON messages(session_id, id)",
    ],
    [  # v2: per-session system prompt, per-message outcome (ok / cancelled / error)
        "ALTER TABLE sessions ADD COLUMN system TEXT",
        "ALTER TABLE messages ADD COLUMN status TEXT NOT NULL DEFAULT 'ok'",
    ],
    [  # v3: a reply's reasoning (a thinking model's <think> block), kept apart from its answer; NULL when none
        "ALTER TABLE messages ADD COLUMN reasoning TEXT",
    ],
]
SCHEMA_VERSION = len(MIGRATIONS)

# Message status: "ok", "cancelled" (Esc, ctrl+q), "error", "interrupted" (SIGTERM/SIGHUP, or found 'streaming' by
# a later process: the one writing it was killed), "streaming" (the reply in flight). No migration: a free-text column.
STATUS_MARKERS = {
    "cancelled": "*[cancelled]*",
    "error": "*[error]*",
    "interrupted": "*[interrupted]*",
    "streaming": "*[interrupted]*",
}

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")


class HistoryError(RuntimeError):
    """The history database cannot be opened, upgraded, read or written (the cause is chained)."""


def _db_call(method):
    """Any sqlite3 failure inside `method` is raised as HistoryError (the transaction, if any, rolled back)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except sqlite3.Error as exc:
            self._rollback()
            raise HistoryError(f"chat history {self.path}: {exc}") from exc

    return wrapper


def open_fence(markdown: str) -> str:
    """The fence (e.g. "```") that closes a code block left open at the end of `markdown`; "" when none is open."""
    opened = ""
    for line in markdown.split("\n"):
        m = _FENCE.match(line)
        if m is None:
            continue
        fence, rest = m.groups()
        if not opened:
            if not (fence[0] == "`" and "`" in rest):  # a backtick fence's info string holds no backtick
                opened = fence
        elif fence[0] == opened[0] and len(fence) >= len(opened) and not rest.strip():
            opened = ""
    return opened


def close_fence(markdown: str) -> str:
    """`markdown` with a code block left open at its end closed (a reply cut off inside a fence)."""
    fence = open_fence(markdown)
    if not fence:
        return markdown
    return f"{markdown}{'' if markdown.endswith(chr(10)) else chr(10)}{fence}"


def with_marker(content: str, status: str) -> str:
    """A message's Markdown as shown and exported: an open fence closed, then the status marker if any."""
    marker = STATUS_MARKERS.get(status)
    if marker is None:
        return content
    return f"{close_fence(content)}\n\n{marker}" if content.strip() else marker


def reasoning_block(reasoning: str) -> list[str]:
    """A reply's reasoning as exported: a collapsed HTML <details> block (GitHub and most Markdown viewers fold it;
    as plain text it still reads apart from the answer), its own code blocks closed."""
    text = close_fence(for_terminal(reasoning).strip()).replace("</details>", "&lt;/details&gt;")
    return ["<details><summary>Reasoning</summary>", "", text, "", "</details>", ""]


def render_markdown(title: str, model: str, updated_at: float, system: str | None, messages: Iterable[tuple]) -> str:
    """A conversation as Markdown, every text made safe for a terminal: (role, content, status[, reasoning]) per
    message; a reply's reasoning goes before its answer, marked apart (reasoning_block)."""
    stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(updated_at))
    model = for_line(model).replace("`", "'")
    out = [f"# {for_line(title) or 'Chat'}", "", f"*localmoe chat with `{model}`, {stamp}*", ""]
    if system:
        out += ["## System", "", close_fence(for_terminal(system)), ""]
    for role, content, status, *rest in messages:
        reasoning = rest[0] if rest else None
        out += [f"## {for_line(role).capitalize()}", ""]
        if reasoning and reasoning.strip():
            out += reasoning_block(reasoning)
        out.append(close_fence(with_marker(for_terminal(content), status)))
        out.append("")
    return "\n".join(out)


def title_of(content: str) -> str:
    """A session's title: its first user message on one line, at most 60 characters."""
    return " ".join(content.split())[:60]


def default_db_path() -> Path:
    """`$XDG_DATA_HOME/localmoe/chats.sqlite3`, defaulting to `~/.local/share/localmoe/`."""
    return data_root() / "chats.sqlite3"


@dataclass(frozen=True)
class StoredMessage:
    id: int
    role: str
    content: str
    status: str = "ok"
    reasoning: str | None = None  # a thinking model's reasoning before this reply's answer

    def as_chat(self) -> dict:
        msg = {"role": self.role, "content": self.content}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning  # the chat template decides where past reasoning goes
        return msg


@dataclass(frozen=True)
class SessionInfo:
    id: int
    title: str
    model: str
    system: str | None
    updated_at: float
    message_count: int


class HistoryStore:
    """Sessions and messages in one SQLite file; `path=":memory:"` for a throwaway store."""

    def __init__(self, path: Path | str) -> None:
        self.path = path
        self._db: sqlite3.Connection | None = None
        try:
            if str(path) != ":memory:":
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(path), isolation_level=None, timeout=5.0)
            self._db.execute("PRAGMA foreign_keys = ON")
            self.migrate()
        except HistoryError:
            self.close()
            raise
        except (OSError, sqlite3.Error) as exc:
            self.close()
            raise HistoryError(f"cannot open chat history {path}: {exc}") from exc

    def _rollback(self) -> None:
        """End a failed transaction. SQLite may have rolled it back itself (disk full, I/O error): no second failure."""
        if self._db is None or not self._db.in_transaction:
            return
        try:
            self._db.execute("ROLLBACK")
        except sqlite3.Error:
            pass

    @property
    def schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def migrate(self) -> None:
        """Bring the file up to SCHEMA_VERSION, one transaction per step."""
        version = self.schema_version
        if version > SCHEMA_VERSION:
            raise HistoryError(
                f"chat history {self.path} has schema v{version}, newer than this localmoe (v{SCHEMA_VERSION}); "
                "upgrade localmoe"
            )
        for step in range(version, SCHEMA_VERSION):
            self._db.execute("BEGIN IMMEDIATE")
            try:
                for statement in MIGRATIONS[step]:
                    self._db.execute(statement)
                self._db.execute(f"PRAGMA user_version = {step + 1}")
                self._db.execute("COMMIT")
            except sqlite3.Error:
                self._rollback()
                raise

    def close(self) -> None:
        if self._db is not None:
            try:
                self._db.close()
            except sqlite3.Error:
                pass

    # sessions -----------------------------------------------------------------------------

    @_db_call
    def new_session(self, model: str, system: str | None = None) -> int:
        now = time.time()
        cur = self._db.execute(
            "INSERT INTO sessions (model, system, created_at, updated_at) VALUES (?, ?, ?, ?)",
            (model, system, now, now),
        )
        return int(cur.lastrowid)

    @_db_call
    def set_system(self, session_id: int, system: str | None) -> None:
        self._db.execute("UPDATE sessions SET system = ? WHERE id = ?", (system, session_id))

    @_db_call
    def set_model(self, session_id: int, model: str) -> None:
        """The model the session continues with (`/model` switched it)."""
        self._db.execute("UPDATE sessions SET model = ?, updated_at = ? WHERE id = ?", (model, time.time(), session_id))

    @_db_call
    def rename_session(self, session_id: int, title: str) -> str:
        """Give the session a title (one line, at most 60 characters; an empty title goes back to the first user
        message's). Returns the title stored."""
        title = title_of(title)
        if not title:
            first = self._db.execute(
                "SELECT content FROM messages WHERE session_id = ? AND role = 'user' ORDER BY id LIMIT 1", (session_id,)
            ).fetchone()
            title = title_of(first[0]) if first else ""
        self._db.execute("UPDATE sessions SET title = ? WHERE id = ?", (title, session_id))
        return title

    @_db_call
    def delete_session(self, session_id: int) -> bool:
        """Delete the session and its messages (one transaction). False when there was no such session."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            self._db.execute("DELETE FROM messages WHERE session_id = ?", (session_id,))
            cur = self._db.execute("DELETE FROM sessions WHERE id = ?", (session_id,))
            self._db.execute("COMMIT")
        except sqlite3.Error:
            self._rollback()
            raise
        return cur.rowcount > 0

    @_db_call
    def sessions(self, limit: int = 100) -> list[SessionInfo]:
        """Most recently used first."""
        rows = self._db.execute(
            """SELECT s.id, s.title, s.model, s.system, s.updated_at, COUNT(m.id)
               FROM sessions s LEFT JOIN messages m ON m.session_id = s.id
               GROUP BY s.id ORDER BY s.updated_at DESC, s.id DESC LIMIT ?""",
            (limit,),
        ).fetchall()
        return [SessionInfo(*row) for row in rows]

    def session(self, session_id: int) -> SessionInfo | None:
        return next((s for s in self.sessions(limit=-1) if s.id == session_id), None)

    def last_session(self) -> SessionInfo | None:
        found = self.sessions(limit=1)
        return found[0] if found else None

    # messages -----------------------------------------------------------------------------

    @_db_call
    def add_message(
        self, session_id: int, role: str, content: str, status: str = "ok", reasoning: str | None = None
    ) -> int:
        """Append one message (committed on return); the first user message titles the session."""
        now = time.time()
        self._db.execute("BEGIN IMMEDIATE")
        try:
            cur = self._db.execute(
                "INSERT INTO messages (session_id, role, content, status, reasoning, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (session_id, role, content, status, reasoning, now),
            )
            self._db.execute("UPDATE sessions SET updated_at = ? WHERE id = ?", (now, session_id))
            if role == "user":
                self._db.execute(
                    "UPDATE sessions SET title = ? WHERE id = ? AND title = ''", (title_of(content), session_id)
                )
            self._db.execute("COMMIT")
        except sqlite3.Error:
            self._rollback()
            raise
        return int(cur.lastrowid)

    @_db_call
    def update_message(self, message_id: int, content: str, status: str, reasoning: str | None = None) -> None:
        """Replace a message's text and status (the reply in flight as it grows, then its outcome), and its
        reasoning unless `reasoning` is None."""
        now = time.time()
        self._db.execute("BEGIN IMMEDIATE")
        try:
            self._db.execute(
                "UPDATE messages SET content = ?, status = ?, reasoning = COALESCE(?, reasoning) WHERE id = ?",
                (content, status, reasoning, message_id),
            )
            self._db.execute(
                "UPDATE sessions SET updated_at = ? WHERE id = (SELECT session_id FROM messages WHERE id = ?)",
                (now, message_id),
            )
            self._db.execute("COMMIT")
        except sqlite3.Error:
            self._rollback()
            raise

    @_db_call
    def delete_message(self, message_id: int) -> None:
        self._db.execute("DELETE FROM messages WHERE id = ?", (message_id,))

    @_db_call
    def messages(self, session_id: int) -> list[StoredMessage]:
        rows = self._db.execute(
            "SELECT id, role, content, status, reasoning FROM messages WHERE session_id = ? ORDER BY id", (session_id,)
        ).fetchall()
        return [StoredMessage(*row) for row in rows]

    # export -------------------------------------------------------------------------------

    def export_markdown(self, session_id: int) -> str:
        """The session as a Markdown document: a heading per message, cancelled/failed/interrupted replies marked,
        code blocks left open closed, control sequences removed (safe to `cat`)."""
        info = self.session(session_id)
        if info is None:
            raise HistoryError(f"no chat session {session_id}")
        return render_markdown(
            info.title,
            info.model,
            info.updated_at,
            info.system,
            ((m.role, m.content, m.status, m.reasoning) for m in self.messages(session_id)),
        )
