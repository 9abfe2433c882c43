"""Tests of the chat history store (localmoe.tui.history): messages, sessions, export, and
schema migrations, including opening a database written by the v1 schema."""

from __future__ import annotations

import sqlite3

import pytest

from localmoe.safe_text import is_clean
from localmoe.tui.history import (
    SCHEMA_VERSION,
    HistoryError,
    HistoryStore,
    StoredMessage,
    close_fence,
    default_db_path,
    open_fence,
)

V1_SCHEMA = """
CREATE TABLE sessions (id INTEGER PRIMARY KEY, title TEXT NOT NULL DEFAULT '', model TEXT NOT NULL DEFAULT '',
                       created_at REAL NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE messages (id INTEGER PRIMARY KEY, session_id INTEGER NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
                       role TEXT NOT NULL, content TEXT NOT NULL, created_at REAL NOT NULL);
CREATE INDEX messages_by_session ON messages(session_id, id);
PRAGMA user_version = 1;
"""


def test_default_path_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_db_path() == tmp_path / "localmoe" / "chats.sqlite3"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert default_db_path().parts[-4:] == (".local", "share", "localmoe", "chats.sqlite3")


def test_messages_are_committed_and_visible_to_another_connection(tmp_path):
    path = tmp_path / "sub" / "chats.sqlite3"
    store = HistoryStore(path)
    sid = store.new_session("tiny-moe", system="Be terse.")
    store.add_message(sid, "user", "What is   2+2?\nQuick.")
    store.add_message(sid, "assistant", "4", "cancelled")
    # a second connection (as after a killed process) sees both rows without any close()
    other = HistoryStore(path)
    assert [(m.role, m.content, m.status) for m in other.messages(sid)] == [
        ("user", "What is   2+2?\nQuick.", "ok"),
        ("assistant", "4", "cancelled"),
    ]
    info = other.last_session()
    assert (info.id, info.title, info.system, info.message_count) == (sid, "What is 2+2? Quick.", "Be terse.", 2)
    store.close()
    other.close()


def test_sessions_most_recent_first_and_delete(tmp_path):
    store = HistoryStore(tmp_path / "c.sqlite3")
    a = store.new_session("m")
    store.add_message(a, "user", "first")
    b = store.new_session("m")
    mid = store.add_message(b, "user", "second")
    assert [s.id for s in store.sessions()] == [b, a]
    store.add_message(a, "user", "again")
    assert store.last_session().id == a
    store.delete_message(mid)
    assert store.messages(b) == []
    assert store.session(999) is None


def test_export_markdown_marks_cancelled(tmp_path):
    store = HistoryStore(tmp_path / "c.sqlite3")
    sid = store.new_session("tiny-moe", system="Sys.")
    store.add_message(sid, "user", "Hi")
    store.add_message(sid, "assistant", "Hel", "cancelled")
    md = store.export_markdown(sid)
    assert md.startswith("# Hi\n") and "`tiny-moe`" in md
    assert "## System\n\nSys.\n" in md and "## User\n\nHi\n" in md
    assert "## Assistant\n\nHel\n\n*[cancelled]*" in md
    with pytest.raises(HistoryError):
        store.export_markdown(sid + 1)


def test_v1_database_is_migrated_keeping_history(tmp_path):
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(V1_SCHEMA)
    db.execute("INSERT INTO sessions (id, title, model, created_at, updated_at) VALUES (1, 'old', 'm', 1.0, 2.0)")
    db.execute("INSERT INTO messages (session_id, role, content, created_at) VALUES (1, 'user', 'hello', 1.0)")
    db.execute("INSERT INTO messages (session_id, role, content, created_at) VALUES (1, 'assistant', 'hi!', 1.5)")
    db.commit()
    db.close()

    store = HistoryStore(path)
    assert store.schema_version == SCHEMA_VERSION > 1
    assert [(m.content, m.status) for m in store.messages(1)] == [("hello", "ok"), ("hi!", "ok")]
    info = store.last_session()
    assert (info.title, info.system, info.message_count) == ("old", None, 2)
    store.add_message(1, "assistant", "more", "error")  # new columns usable after migration
    store.close()
    assert HistoryStore(path).schema_version == SCHEMA_VERSION  # reopening is a no-op


def test_newer_schema_is_refused_not_clobbered(tmp_path):
    path = tmp_path / "new.sqlite3"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(HistoryError, match="newer"):
        HistoryStore(path)


def test_unwritable_location_is_a_history_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(HistoryError):
        HistoryStore(blocker / "chats.sqlite3")


def test_streamed_reply_is_updated_in_place_and_exported_interrupted(tmp_path):
    """The reply in flight is one row, rewritten as it grows; found still 'streaming' it exports as interrupted,
    with the code block it was cut off in closed before the marker."""
    store = HistoryStore(tmp_path / "c.sqlite3")
    sid = store.new_session("m")
    store.add_message(sid, "user", "code please")
    mid = store.add_message(sid, "assistant", "", "streaming")
    store.update_message(mid, "```python\nprint(", "streaming")
    other = HistoryStore(tmp_path / "c.sqlite3")  # as after kill -9
    assert [(m.content, m.status) for m in other.messages(sid)][-1] == ("```python\nprint(", "streaming")
    md = other.export_markdown(sid)
    assert "## Assistant\n\n```python\nprint(\n```\n\n*[interrupted]*\n" in md
    other.close()
    store.close()


def test_export_is_safe_to_cat(tmp_path):
    store = HistoryStore(tmp_path / "c.sqlite3")
    sid = store.new_session("m\x1b]0;title\x07", system="s\x1b[2J")
    store.add_message(sid, "user", "hi\x1b]0;pwned\x07 [b]")
    store.add_message(sid, "assistant", "\x9b31mred\u202e")
    md = store.export_markdown(sid)
    assert md.startswith("# hi [b]\n") and "`m`" in md and "## System\n\ns\n" in md and "\nred\n" in md
    assert is_clean(md) and "\x1b" not in md
    store.close()


FENCES = {
    "none": ("text", "", "text"),
    "backticks-open": ("```py\nx", "```", "```py\nx\n```"),
    "longer-fence-needs-as-long": ("````\n```\nx\n", "````", "````\n```\nx\n````"),
    "tildes-open": ("~~~\nx", "~~~", "~~~\nx\n~~~"),
    "closed": ("```\nx\n```", "", "```\nx\n```"),
    "inline-backticks-not-a-fence": ("``` `x` ```", "", "``` `x` ```"),
    "indented-four-is-code-not-fence": ("    ```\nx", "", "    ```\nx"),
}


@pytest.mark.parametrize("text,fence,closed", list(FENCES.values()), ids=list(FENCES))
def test_open_fence(text, fence, closed):
    assert open_fence(text) == fence and close_fence(text) == closed


V2_SCHEMA = V1_SCHEMA.replace(
    "PRAGMA user_version = 1;",
    """
ALTER TABLE sessions ADD COLUMN system TEXT;
ALTER TABLE messages ADD COLUMN status TEXT NOT NULL DEFAULT 'ok';
PRAGMA user_version = 2;
""",
)


def test_v2_database_gains_a_reasoning_column(tmp_path):
    path = tmp_path / "v2.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(V2_SCHEMA)
    db.execute("INSERT INTO sessions (id, title, model, created_at, updated_at) VALUES (1, 'old', 'm', 1.0, 2.0)")
    db.execute(
        "INSERT INTO messages (session_id, role, content, status, created_at) "
        "VALUES (1, 'assistant', 'hi', 'cancelled', 1.0)"
    )
    db.commit()
    db.close()
    store = HistoryStore(path)
    assert store.schema_version == SCHEMA_VERSION == 3
    assert store.messages(1) == [StoredMessage(1, "assistant", "hi", "cancelled", None)]
    store.close()


def test_reasoning_is_stored_apart_sent_back_and_exported_apart(tmp_path):
    store = HistoryStore(tmp_path / "c.sqlite3")
    sid = store.new_session("thinker")
    store.add_message(sid, "user", "2+2?")
    mid = store.add_message(sid, "assistant", "", "streaming", reasoning="Two and")
    store.update_message(mid, "4", "ok", "Two and two\x1b]0;x\x07 make four.\n```\nopen")
    store.update_message(mid, "4.", "ok")  # reasoning None: kept as it is
    msgs = store.messages(sid)
    assert (msgs[-1].content, msgs[-1].reasoning) == ("4.", "Two and two\x1b]0;x\x07 make four.\n```\nopen")
    assert msgs[-1].as_chat() == {"role": "assistant", "content": "4.", "reasoning_content": msgs[-1].reasoning}
    assert msgs[0].as_chat() == {"role": "user", "content": "2+2?"}
    md = store.export_markdown(sid)
    assert (
        "## Assistant\n\n<details><summary>Reasoning</summary>\n\nTwo and two make four.\n```\nopen\n```\n\n"
        "</details>\n\n4.\n"
    ) in md and is_clean(md)
    store.close()


def test_sessions_are_renamed_deleted_and_switch_models(tmp_path):
    store = HistoryStore(tmp_path / "c.sqlite3")
    a = store.new_session("m1")
    store.add_message(a, "user", "first   question\nhere")
    b = store.new_session("m1")
    store.add_message(b, "user", "other")
    assert store.rename_session(a, "  My\ttalk\x1b[2J  ") == "My talk\x1b[2J"
    assert store.session(a).title == "My talk\x1b[2J"  # one line; shown through safe_text where it is shown
    assert store.rename_session(a, "x" * 80) == "x" * 60
    assert store.rename_session(a, "   ") == "first question here"  # empty: back to the first message's
    store.set_model(a, "m2")
    assert store.session(a).model == "m2"
    assert store.delete_session(a) is True and store.session(a) is None and store.messages(a) == []
    assert store.delete_session(a) is False
    assert [s.id for s in store.sessions()] == [b]
    store.close()
