"""Chat history for `localmoe chat`: the SQLite store of sessions and messages.

Owns the database file (`$XDG_DATA_HOME/localmoe/chats.sqlite3`), its schema and the
migrations between schema versions (tracked in `PRAGMA user_version`), and the Markdown
export of a session. Every write is committed at once, so a killed process keeps all
that was written. Pure stdlib; no Textual here.
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

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
]
SCHEMA_VERSION = len(MIGRATIONS)

STATUS_MARKERS = {"cancelled": "*[cancelled]*", "error": "*[error]*"}


class HistoryError(RuntimeError):
    """The history database cannot be opened or upgraded."""


def default_db_path() -> Path:
    """`$XDG_DATA_HOME/localmoe/chats.sqlite3`, defaulting to `~/.local/share/localmoe/`."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "localmoe" / "chats.sqlite3"


@dataclass(frozen=True)
class StoredMessage:
    id: int
    role: str
    content: str
    status: str = "ok"

    def as_chat(self) -> dict:
        return {"role": self.role, "content": self.content}


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
        try:
            if str(path) != ":memory:":
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(path), isolation_level=None, timeout=5.0)
            self._db.execute("PRAGMA foreign_keys = ON")
            self.migrate()
        except (OSError, sqlite3.Error) as exc:
            raise HistoryError(f"cannot open chat history {path}: {exc}") from exc

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
                self._db.execute("ROLLBACK")
                raise

    def close(self) -> None:
        self._db.close()

    # sessions -----------------------------------------------------------------------------

    def new_session(self, model: str, system: str | None = None) -> int:
        now = time.time()
        cur = self._db.execute(
            "INSERT INTO sessions (model, system, created_at, updated_at) VALUES (?, ?, ?, ?)",
            (model, system, now, now),
        )
        return int(cur.lastrowid)

    def set_system(self, session_id: int, system: str | None) -> None:
        self._db.execute("UPDATE sessions SET system = ? WHERE id = ?", (system, session_id))

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

    def add_message(self, session_id: int, role: str, content: str, status: str = "ok") -> int:
        """Append one message (committed on return); the first user message titles the session."""
        now = time.time()
        self._db.execute("BEGIN IMMEDIATE")
        try:
            cur = self._db.execute(
                "INSERT INTO messages (session_id, role, content, status, created_at) VALUES (?, ?, ?, ?, ?)",
                (session_id, role, content, status, now),
            )
            self._db.execute("UPDATE sessions SET updated_at = ? WHERE id = ?", (now, session_id))
            if role == "user":
                title = " ".join(content.split())[:60]
                self._db.execute("UPDATE sessions SET title = ? WHERE id = ? AND title = ''", (title, session_id))
            self._db.execute("COMMIT")
        except sqlite3.Error:
            self._db.execute("ROLLBACK")
            raise
        return int(cur.lastrowid)

    def delete_message(self, message_id: int) -> None:
        self._db.execute("DELETE FROM messages WHERE id = ?", (message_id,))

    def messages(self, session_id: int) -> list[StoredMessage]:
        rows = self._db.execute(
            "SELECT id, role, content, status FROM messages WHERE session_id = ? ORDER BY id", (session_id,)
        ).fetchall()
        return [StoredMessage(*row) for row in rows]

    # export -------------------------------------------------------------------------------

    def export_markdown(self, session_id: int) -> str:
        """The session as a Markdown document: a heading per message, cancelled/failed replies marked."""
        info = self.session(session_id)
        if info is None:
            raise HistoryError(f"no chat session {session_id}")
        stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime(info.updated_at))
        out = [f"# {info.title or 'Chat'}", "", f"*localmoe chat with `{info.model}`, {stamp}*", ""]
        if info.system:
            out += ["## System", "", info.system, ""]
        for msg in self.messages(session_id):
            out += [f"## {msg.role.capitalize()}", "", msg.content]
            if msg.status in STATUS_MARKERS:
                out += ["", STATUS_MARKERS[msg.status]]
            out.append("")
        return "\n".join(out)
