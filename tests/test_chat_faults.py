"""Fault tests of `localmoe chat` (issue #20), each table naming its cases: the history database failing (read-only,
disk full with SQLite's own rollback, corrupt or unopenable file) and signals during a reply (SIGTERM, SIGHUP: partial
reply saved, clean exit, terminal restored; kill -9: at most the last second lost). Output safety is
test_chat_output_safety.py, conversations longer than the context test_chat_context.py; what they share
chat_faults_support.py.

The app runs the real Engine on the tiny checkpoints of conftest: in-process through Textual's pilot, or as the
`localmoe chat` command in a pseudo-terminal for the signal cases. Faults are real SQLite failures (a connection
capped with `PRAGMA max_page_count`, a read-only connection, files that are not databases).
"""

from __future__ import annotations

import os
import signal
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from chat_faults_support import (
    SETTINGS,
    ChatInPty,
    db_path,
    exchange,
    fill_disk,
    make_long_dir,
    rows,
    seed,
    status_text,
    tiny_engine,
    unfill_disk,
    warnings,
)
from test_tui import SIZE, replies, sync, type_and_send

from localmoe.engine.engine import Engine
from localmoe.tui.app import ChatApp
from localmoe.tui.history import HistoryError, HistoryStore
from localmoe.tui.widgets import MessageView


@pytest.fixture(scope="module")
def engine(hub_cache) -> Engine:
    return tiny_engine()


@pytest.fixture(scope="module")
def long_dir(src_dir, tmp_path_factory) -> Path:
    return make_long_dir(src_dir, tmp_path_factory)


# -- database faults --------------------------------------------------------------------------------------------------

ROOT = os.geteuid() == 0
as_user = pytest.mark.skipif(ROOT, reason="file permissions do not bind root")


@dataclass
class DbFault:
    """before(path): before the app starts; during(app, path): after a first saved exchange; recover(app, path):
    makes writing possible again (None: the app's own retry, a fresh connection, gets past the fault)."""

    before: Callable | None = None
    during: Callable | None = None
    recover: Callable | None = None
    keeps_file: bool = False  # the database file must come out of the failure byte for byte as it was


def _read_only(path: Path) -> None:
    path.chmod(0o444)
    path.parent.chmod(0o555)


def _writable(app, path: Path) -> None:
    path.parent.chmod(0o755)
    path.chmod(0o644)


def _reopen_read_only(app, path: Path) -> None:
    app.store._db.close()
    app.store._db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)


def _corrupt(path: Path) -> None:
    path.write_bytes(b"this is not an SQLite database\n" * 64)


def _directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _unreadable(path: Path) -> None:
    path.chmod(0o000)


DB_FAULTS = {
    "read-only-data-dir": pytest.param(DbFault(before=_read_only, recover=_writable, keeps_file=True), marks=as_user),
    "read-only-reopen-mid-session": DbFault(during=_reopen_read_only),
    "disk-full-mid-session-auto-rollback": DbFault(
        during=lambda app, path: fill_disk(app.store._db), recover=lambda app, path: unfill_disk(app.store._db)
    ),
    "corrupt-file-at-start": DbFault(before=_corrupt, recover=lambda app, path: path.unlink(), keeps_file=True),
    "directory-in-place-of-file": DbFault(before=_directory, recover=lambda app, path: path.rmdir()),
    "unreadable-file-at-start": pytest.param(
        DbFault(before=_unreadable, recover=_writable, keeps_file=True), marks=as_user
    ),
}


@pytest.mark.parametrize("fault", list(DB_FAULTS.values()), ids=list(DB_FAULTS))
@sync
async def test_database_fault_keeps_conversation(fault, engine, tmp_path):
    """No traceback, the typed messages and replies stay in memory and on screen, one warning and a status-bar
    mark while the history cannot be written, /export works from memory, ctrl+q asks twice before dropping unsaved
    messages, and once writing works again everything is saved in order."""
    path = db_path(tmp_path)
    seed(path)
    if fault.before:
        fault.before(path)
    original = path.read_bytes() if fault.keeps_file else None
    app = ChatApp(engine=engine, settings=SETTINGS, db_path=path)
    try:
        async with app.run_test(size=SIZE) as pilot:
            if fault.during:
                await exchange(pilot, app, "first, saved")
                assert app.history_error == "" and all(t.saved for t in app.turns)
                fault.during(app, path)
            reply = await exchange(pilot, app, "typed while failing")
            assert app.return_code is None and reply.status == "ok"
            assert "typed while failing" in [t.content for t in app.turns]
            assert any(v.role == "user" and v.content == "typed while failing" for v in app.query(MessageView))
            assert len(warnings(app)) == 1
            if fault.recover is not None:
                assert "history not saved" in status_text(app)
                await exchange(pilot, app, "again while failing")
                assert len(warnings(app)) == 1  # once, not per write
                assert not app.turns[-1].saved
                await type_and_send(pilot, f"/export {tmp_path / 'kept.md'}")
                kept = (tmp_path / "kept.md").read_text()
                assert "typed while failing" in kept and "again while failing" in kept
                await pilot.press("ctrl+q")  # unsaved: the first ctrl+q only warns
                await pilot.pause()
                assert app.return_code is None and any("not saved" in n for n in app.notices)
                if original is not None:
                    assert path.read_bytes() == original  # never clobbered
                fault.recover(app, path)
            await exchange(pilot, app, "after it works again")
            assert app.history_error == "" and any("saved again" in n for n in app.notices)
            assert "history not saved" not in status_text(app)
            shown = [(t.role, t.content, t.status) for t in app.turns]
            session = app.session_id
            await pilot.press("ctrl+q")
        assert app.return_code == 0
    finally:
        if path.parent.exists():
            path.parent.chmod(0o755)
        if path.is_file():
            path.chmod(0o644)
    assert rows(path, session) == shown
    contents = [c for _, c, _ in shown]
    assert contents[::2][-2:] == [
        "typed while failing" if fault.recover is None else "again while failing",
        "after it works again",
    ]


def _store_fault_disk_full(store: HistoryStore) -> Callable[[], None]:
    fill_disk(store._db)
    return lambda: unfill_disk(store._db)


def _store_fault_read_only(store: HistoryStore) -> Callable[[], None]:
    writable = store._db
    store._db = sqlite3.connect(f"file:{store.path}?mode=ro", uri=True, isolation_level=None)

    def undo():
        store._db.close()
        store._db = writable

    return undo


STORE_WRITES = {
    "add_message": lambda s, sid, mid: s.add_message(sid, "user", "x" * 600),
    "update_message": lambda s, sid, mid: s.update_message(mid, "y" * 6000, "ok"),
    "new_session": lambda s, sid, mid: s.new_session("m" * 3000, "s" * 3000),
    "set_system": lambda s, sid, mid: s.set_system(sid, "z" * 6000),
    "delete_message": lambda s, sid, mid: s.delete_message(mid),
}
STORE_FAULTS = {"disk-full": _store_fault_disk_full, "read-only": _store_fault_read_only}
STORE_CASES = [
    (f, w) for f in STORE_FAULTS for w in STORE_WRITES if not (f == "disk-full" and w == "delete_message")
]  # a delete frees space


@pytest.mark.parametrize("fault,write", STORE_CASES, ids=[f"{f}-{w}" for f, w in STORE_CASES])
def test_store_write_failure_is_one_history_error(fault, write, tmp_path):
    """A failed write raises HistoryError with SQLite's reason (not a second error from ROLLBACK after SQLite
    rolled back by itself), leaves no transaction open, and the store writes again once the fault is gone."""
    store = HistoryStore(tmp_path / "c.sqlite3")
    sid = store.new_session("m")
    mid = store.add_message(sid, "user", "hello")
    undo = STORE_FAULTS[fault](store)
    with pytest.raises(HistoryError) as err:
        STORE_WRITES[write](store, sid, mid)
    assert isinstance(err.value.__cause__, sqlite3.Error)
    assert "rollback" not in str(err.value) and ("full" in str(err.value) or "readonly" in str(err.value))
    assert not store._db.in_transaction
    undo()
    STORE_WRITES[write](store, sid, mid)
    store.add_message(sid, "assistant", "still works")
    assert store.messages(sid)[-1].content == "still works"
    store.close()


# -- signals ----------------------------------------------------------------------------------------------------------


def stream_reply(chat: ChatInPty, updates: int = 2, timeout: float = 60.0) -> list[tuple[float, str]]:
    """Send a message and watch the reply's row until its text has been written `updates` times while streaming.
    Returns the (time, content) samples at each change."""
    chat.wait_for_output(b"Chatting")
    os.write(chat.master, b"hello\r")
    samples: list[tuple[float, str]] = []
    end = time.monotonic() + timeout
    while len([c for _, c in samples if c]) < updates:
        assert time.monotonic() < end, f"reply not streamed: {samples}"
        chat.pump(0.05)
        row = chat.reply_row()
        if row is not None:
            assert row[1] == "streaming", f"the reply ended before the signal: {row}"
            if not samples or row[0] != samples[-1][1]:
                samples.append((time.monotonic(), row[0]))
    return samples


def restores_terminal(out: bytes) -> bool:
    """The output leaves the alternate screen and turns mouse reporting and bracketed paste off after turning them
    on."""
    return all(
        out.rfind(off) > out.rfind(on) >= 0
        for on, off in [
            (b"\x1b[?1049h", b"\x1b[?1049l"),
            (b"\x1b[?1000h", b"\x1b[?1000l"),
            (b"\x1b[?1003h", b"\x1b[?1003l"),
            (b"\x1b[?2004h", b"\x1b[?2004l"),
        ]
    )


SIGNAL_CASES = {
    "sigterm-during-reply": (signal.SIGTERM, 128 + signal.SIGTERM),
    "sighup-during-reply": (signal.SIGHUP, 128 + signal.SIGHUP),
    "kill-9-during-reply": (signal.SIGKILL, -signal.SIGKILL),
}


@pytest.mark.parametrize("signum,code", list(SIGNAL_CASES.values()), ids=list(SIGNAL_CASES))
def test_signal_during_reply(signum, code, long_dir, engine, tmp_path):
    """SIGTERM/SIGHUP mid-reply: the partial reply is saved (interrupted), the exit is clean and the terminal is
    restored. kill -9: the database holds the reply as streamed up to about a second before; the next
    `--continue` shows it as interrupted."""
    chat = ChatInPty(long_dir, tmp_path / "data", "--max-new-tokens", "3000")
    try:
        samples = stream_reply(chat, updates=2 if signum != signal.SIGKILL else 3)
        chat.pump(0.3)
        os.kill(chat.proc.pid, signum)
        assert chat.wait_exit() == code
    finally:
        chat.kill()
    out = bytes(chat.out)
    content, status = chat.reply_row()
    assert content.startswith(samples[-1][1]) and len(content) >= len(samples[-1][1]) > 0
    if signum == signal.SIGKILL:
        assert status == "streaming"
        # the row was rewritten again and again while the reply streamed, each time with more of it (the app writes
        # at most once per SAVE_INTERVAL as tokens arrive; the wall-clock gaps follow the machine's load, not the app:
        # a starved two-core CI run once went 5 s between tokens, so they are not asserted)
        texts = [c for _, c in samples if c]
        assert len(texts) >= 3 and all(b.startswith(a) and len(b) > len(a) for a, b in zip(texts, texts[1:])), samples
        shown = resume_shows_interrupted(engine, chat.db, content)
        assert shown
        return
    assert status == "interrupted"
    assert b"Traceback" not in out
    assert restores_terminal(out), out[-600:]


def resume_shows_interrupted(engine, path: Path, content: str) -> bool:
    async def resume():
        app = ChatApp(engine=engine, settings=SETTINGS, db_path=path, continue_last=True)
        async with app.run_test(size=SIZE) as pilot:
            await pilot.pause()
            last = replies(app)[-1]
            assert last.content == content and last.status == "interrupted"
            assert last.markdown.source.endswith("*[interrupted]*")
            assert app.turns[-1].saved
        return True

    import asyncio

    ok = asyncio.run(resume())
    store = HistoryStore(path)
    assert store.messages(store.last_session().id)[-1].status == "interrupted"
    store.close()
    return ok
