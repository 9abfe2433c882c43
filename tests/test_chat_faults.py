"""Fault tests of `localmoe chat` (issue #20), each table naming its cases: the history database failing (read-only,
disk full with SQLite's own rollback, corrupt or unopenable file), signals during a reply (SIGTERM, SIGHUP: partial
reply saved, clean exit, terminal restored; kill -9: at most the last second lost), output safety of every widget
(model output, history, model folder names, errors, exports carrying escape sequences or markup) and conversations
longer than the model's context.

The app runs the real Engine on the tiny checkpoints of conftest: in-process through Textual's pilot, or as the
`localmoe chat` command in a pseudo-terminal for the signal cases. Faults are real SQLite failures (a connection
capped with `PRAGMA max_page_count`, a read-only connection, files that are not databases).
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import shutil
import signal
import sqlite3
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import tiny_models
from conftest import repo_id
from test_tui import SIZE, replies, sync, type_and_send, wait_for
from textual.app import App, ComposeResult
from textual.widgets import Label, OptionList

from localmoe.engine.engine import Engine
from localmoe.events import GenerationSettings
from localmoe.safe_text import is_clean
from localmoe.tui.app import ChatApp, context_limit, fit_to_context
from localmoe.tui.history import HistoryError, HistoryStore
from localmoe.tui.widgets import ChatInput, LoadingView, MessageView, StatusBar

SETTINGS = GenerationSettings(max_new_tokens=8)
OSC_TITLE = "\x1b]0;pwned\x07"
# What a hostile checkpoint's tokenizer decodes its last 28 ids to (tiny_models' Greek letters): terminal control
# sequences of every kind, C0/C1 controls, a bidi override, and Textual/Rich markup (which must show as text). The
# tiny model's first greedy tokens for "hello" are mostly id 108: the ninth entry, which carries all three kinds.
HOSTILE_TOKENS = [
    "[b]",
    "[/]",
    "\x1b[2J",
    "\x9b31m",
    "[red]",
    "\x1b]2;pwned\x1b\\",
    "\x1b[?1049l",
    "\x07",
    f"[/]{OSC_TITLE}[b]\x9b2J",
    "[/b]",
    "\x1bc",
    "\x1b]8;;http://evil\x1b\\",
    "\u202e",
    "\x1b[31m",
    "[link=http://x]",
    "\x9d0;pwned\x07",
    "\x1b[5n",
    "\r",
    "\x1bP+q\x1b\\",
    "[@click=app.quit]",
    "\x08",
    "\x1b_apc\x1b\\",
    "\x7f",
    "[bold magenta]",
    "\x1b[?1000h",
    "\x1b[H",
    "[/red]",
    "\x1b]52;c;cHduZWQ=\x07",
]
HOSTILE_NAME = f"evil{OSC_TITLE}[bold]model"  # a folder name: no "/" in it, so no closing tag
CONTROL_CHARS = [chr(c) for c in range(0x20) if chr(c) not in "\n\t"] + ["\x7f", "\x9b", "\x9d", "\u202e"]


def clean(text: str) -> bool:
    return is_clean(text) and not any(c in text for c in CONTROL_CHARS)


# -- checkpoints and engines ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(hub_cache) -> Engine:
    return Engine.load(repo_id("qwen3_moe"), device="cpu", sparsity=0.0)


def hostile_tokenizer():
    """tiny_models' character tokenizer with its 28 Greek letters decoding to HOSTILE_TOKENS instead."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base = tiny_models.char_tokenizer()
    vocab = dict(base.get_vocab())
    greek = sorted((i, t) for t, i in vocab.items() if i >= tiny_models.VOCAB - len(HOSTILE_TOKENS))
    assert len(greek) == len(HOSTILE_TOKENS) and all(len(t) == 1 and t > "\u0370" for _, t in greek)
    for (i, letter), hostile in zip(greek, HOSTILE_TOKENS):
        del vocab[letter]
        vocab[hostile] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(tiny_models.SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>", bos_token=None, pad_token="<|endoftext|>"
    )
    fast.chat_template = tiny_models.CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="module")
def hostile_dir(src_dir, tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE in a folder whose name carries an OSC title and markup, with a tokenizer whose greedy
    output is made of escape sequences and markup."""
    folder = tmp_path_factory.mktemp("hostile") / HOSTILE_NAME
    shutil.copytree(src_dir / "qwen3_moe", folder)
    for f in folder.glob("tokenizer*"):
        f.unlink()
    hostile_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hostile_engine(hostile_dir) -> Engine:
    return Engine.load(str(hostile_dir), device="cpu", sparsity=0.0)


@pytest.fixture(scope="module")
def long_dir(src_dir, tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE with 4096 positions (same weights): a reply long enough to signal it mid-stream."""
    folder = tmp_path_factory.mktemp("long") / "tiny-long"
    shutil.copytree(src_dir / "qwen3_moe", folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 4096
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# -- helpers ----------------------------------------------------------------------------------------------------------


def db_path(tmp_path: Path) -> Path:
    return tmp_path / "data" / "chats.sqlite3"


def seed(
    path: Path,
    title: str = "",
    model: str = "tiny",
    system: str | None = None,
    messages: list[tuple[str, str, str]] = (("user", "old question", "ok"), ("assistant", "old answer", "ok")),
):
    store = HistoryStore(path)
    sid = store.new_session(model, system)
    for role, content, status in messages:
        store.add_message(sid, role, content, status)
    if title:
        store._db.execute("UPDATE sessions SET title = ? WHERE id = ?", (title, sid))
    store.close()
    return sid


def rows(path: Path, session_id: int) -> list[tuple[str, str, str]]:
    db = sqlite3.connect(path)
    try:
        return db.execute(
            "SELECT role, content, status FROM messages WHERE session_id = ? ORDER BY id", (session_id,)
        ).fetchall()
    finally:
        db.close()


async def exchange(pilot, app: ChatApp, text: str, timeout: float = 60.0) -> MessageView:
    before = len(replies(app))
    await type_and_send(pilot, text)
    await wait_for(pilot, lambda: app.reply is None and len(replies(app)) == before + 1, timeout)
    return replies(app)[-1]


def status_text(app: ChatApp) -> str:
    return str(app.query_one(StatusBar).render())


def warnings(app: ChatApp) -> list[str]:
    return [n for n in app.notices if "kept in memory" in n]


def fill_disk(db: sqlite3.Connection) -> None:
    """Disk full, for real: cap the connection at the pages the file has, then fill them with small rows (SQLite
    rolls a transaction back by itself when it hits the cap)."""
    filler = db.execute("INSERT INTO sessions (title, model, created_at, updated_at) VALUES ('', 'filler', 0, 0)")
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    db.execute(f"PRAGMA max_page_count = {pages}")
    try:
        while True:
            db.execute(
                "INSERT INTO messages (session_id, role, content, created_at) VALUES (?, 'f', 'f', 0)",
                (filler.lastrowid,),
            )
    except sqlite3.OperationalError as exc:
        assert "full" in str(exc)


def unfill_disk(db: sqlite3.Connection) -> None:
    db.execute("PRAGMA max_page_count = 1073741823")


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


class ChatInPty:
    """`localmoe chat MODEL` in a pseudo-terminal of 100x30, its output collected."""

    def __init__(self, model: Path, data_home: Path, *extra: str) -> None:
        self.db = data_home / "localmoe" / "chats.sqlite3"
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
        env = dict(os.environ, XDG_DATA_HOME=str(data_home), TERM="xterm-256color")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "localmoe", "chat", str(model), "--device", "cpu", "--sparsity", "0", *extra],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            start_new_session=True,
            close_fds=True,
        )
        os.close(slave)
        self.master = master
        self.out = bytearray()

    def pump(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            ready, _, _ = select.select([self.master], [], [], 0.02)
            if ready:
                try:
                    chunk = os.read(self.master, 65536)
                except OSError:  # the child has gone
                    return
                if not chunk:
                    return
                self.out.extend(chunk)

    def wait_for_output(self, needle: bytes, timeout: float = 90.0) -> None:
        end = time.monotonic() + timeout
        while needle not in self.out:
            assert self.proc.poll() is None, f"chat exited: {bytes(self.out[-2000:])!r}"
            assert time.monotonic() < end, f"no {needle!r} on screen: {bytes(self.out[-2000:])!r}"
            self.pump(0.05)

    def reply_row(self) -> tuple[str, str] | None:
        """(content, status) of the newest assistant message in the database, None before there is one."""
        if not self.db.exists():
            return None
        db = sqlite3.connect(self.db, timeout=5.0)
        try:
            row = db.execute(
                "SELECT content, status FROM messages WHERE role = 'assistant' ORDER BY id DESC LIMIT 1"
            ).fetchone()
        except sqlite3.OperationalError:  # locked for a moment by the writer
            return None
        finally:
            db.close()
        return row

    def wait_exit(self, timeout: float = 30.0) -> int:
        end = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < end:
            self.pump(0.05)
        self.pump(0.2)
        if self.proc.poll() is None:
            self.proc.kill()
            raise AssertionError("chat did not exit")
        os.close(self.master)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


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


# -- output safety ----------------------------------------------------------------------------------------------------


def screen_is_clean(app: App) -> bool:
    """No control character in what the terminal is sent for the whole screen (as a screenshot renders it)."""
    svg = app.export_screenshot()
    return not any(c in svg for c in CONTROL_CHARS)


def widget_texts(app: App) -> list[str]:
    texts = [v.markdown.source for v in app.query(MessageView)]
    texts += [str(label.render()) for label in app.query(Label)]
    texts += [status_text(app)] + list(app.notices)
    return texts


async def safety_model_output(pilot, app, ctx):
    reply = await exchange(pilot, app, "hello")
    assert "\x1b" in reply.content, "precondition: the hostile checkpoint's reply carries escape sequences"
    assert clean(reply.markdown.source) and clean(reply.shown)
    assert "[" in reply.shown  # markup shown as text (and "[/]" did not crash the app)
    stored = HistoryStore(ctx["db"])
    assert stored.messages(app.session_id)[-1].content == reply.content  # the exact text is kept
    stored.close()


async def safety_model_dir_name(pilot, app, ctx):
    await pilot.pause()
    assert "evil" in status_text(app) and "[bold]model" in status_text(app)
    assert "Chatting with `evil[bold]model`" in app.query(MessageView).first().markdown.source
    title = str(app.query_one(LoadingView).query_one(".title", Label).render())
    assert title.startswith("Starting /") and title.endswith("evil[bold]model")


async def safety_error_text(pilot, app, ctx):
    reply = await exchange(pilot, app, "x" * 600)  # longer than the model's context alone: the engine refuses it
    assert reply.status == "error" and "takes at most" in reply.markdown.source
    assert "evil[bold]model" in reply.markdown.source


async def safety_history(pilot, app, ctx):
    await pilot.pause()
    sources = [v.markdown.source for v in app.query(MessageView)]
    assert any("[/] and [b]bold" in s for s in sources) and any("System prompt: sys" in s for s in sources)
    await type_and_send(pilot, "/sessions")
    await pilot.pause()
    options = app.screen.query_one(OptionList)
    prompts = [str(options.get_option_at_index(i).prompt) for i in range(options.option_count)]
    assert prompts and all(clean(p) for p in prompts) and "title [/]" in prompts[0]
    assert screen_is_clean(app)
    await pilot.press("escape")


async def safety_system_prompt(pilot, app, ctx):
    await type_and_send(pilot, "/system")
    await pilot.pause()
    notes = [v.markdown.source for v in app.query(MessageView) if "System prompt" in v.markdown.source]
    assert len(notes) == 2 and all("be [b]brief[/]" in n for n in notes)


async def safety_paste(pilot, app, ctx):
    from textual import events

    prompt = app.query_one(ChatInput)
    prompt.focus()
    prompt.post_message(events.Paste(f"pasted{OSC_TITLE} \x1b[31mred[/]"))
    await pilot.pause()
    assert prompt.text == "pasted red[/]"


async def safety_load_error(pilot, app, ctx):
    await wait_for(pilot, lambda: app.query_one("#main").current == "error")
    shown = str(app.query_one("#error-text").render())
    assert shown.startswith("localmoe: error:") and "evil[bold]model/model" in shown and "corrupt" in shown


async def safety_export(pilot, app, ctx):
    await pilot.pause()
    target = ctx["tmp"] / f"out{OSC_TITLE}.md"
    await type_and_send(pilot, f"/export {target}")
    await pilot.pause()
    exported = target.read_text()
    assert clean(exported) and "[/] and [b]bold" in exported
    # the cancelled reply's open fence is closed before its marker: the next heading is not inside the code
    assert "print(1)\n```\n\n*[cancelled]*\n\n## User\n\nnext" in exported
    shown = [v.markdown.source for v in app.query(MessageView) if v.status == "cancelled"]
    assert shown == ["```python\nprint(1)\n```\n\n*[cancelled]*"]
    assert screen_is_clean(app)


HISTORY = dict(
    title=f"{OSC_TITLE}title [/]",
    model=HOSTILE_NAME,
    system=f"sys{OSC_TITLE}\x1b[2J",
    messages=[
        ("user", f"q\x1b[31m [/] and [b]bold{OSC_TITLE}", "ok"),
        ("assistant", "```python\nprint(1)", "cancelled"),
        ("user", "next", "ok"),
        ("assistant", "\x1b[?1049lhidden\x9b2J [red]x[/red]", "ok"),
    ],
)

SAFETY_CASES = {
    # name: (run, engine kind, app options, seed the history)
    "model-output-osc-csi-markup": (safety_model_output, "hostile", {}, False),
    "model-dir-name-in-status-note-loading": (safety_model_dir_name, "hostile-load", {}, False),
    "error-text-names-hostile-model": (safety_error_text, "hostile", {}, False),
    "history-messages-title-system-sessions": (safety_history, "plain", {"continue_last": True}, True),
    "system-prompt": (safety_system_prompt, "plain", {"system": f"be [b]brief[/]{OSC_TITLE}\x9b2J"}, False),
    "pasted-text": (safety_paste, "plain", {}, False),
    "load-error-text": (safety_load_error, "load-error", {}, False),
    "export-file-and-cancelled-fence": (safety_export, "plain", {"continue_last": True}, True),
}


@pytest.mark.parametrize("case", list(SAFETY_CASES), ids=list(SAFETY_CASES))
@sync
async def test_output_safety(case, engine, hostile_engine, hostile_dir, tmp_path):
    """Text from the model, the history, folder names and errors reaches no widget with a control sequence, and
    markup in it is shown as text (never parsed, never a crash)."""
    run, kind, options, seeded = SAFETY_CASES[case]
    path = db_path(tmp_path)
    if seeded:
        seed(path, **HISTORY)
    if kind == "hostile-load":
        app = ChatApp(
            load=lambda progress: hostile_engine,
            model_label=str(hostile_dir),
            settings=SETTINGS,
            db_path=path,
            **options,
        )
    elif kind == "load-error":  # the hostile folder with its weights file corrupt: the loader names the path
        broken = tmp_path / HOSTILE_NAME
        shutil.copytree(hostile_dir, broken)
        for weights in broken.glob("*.safetensors"):
            weights.write_bytes(b"not safetensors" * 8)
        app = ChatApp(
            load=lambda progress: Engine.load(str(broken), device="cpu", sparsity=0.0),
            model_label=str(broken),
            db_path=path,
            **options,
        )
    else:
        app = ChatApp(
            engine=hostile_engine if kind == "hostile" else engine, settings=SETTINGS, db_path=path, **options
        )
    async with app.run_test(size=SIZE) as pilot:
        await run(pilot, app, {"db": path, "tmp": tmp_path})
        await pilot.pause()
        assert all(clean(t) for t in widget_texts(app)), [t for t in widget_texts(app) if not clean(t)]
        assert screen_is_clean(app)


def test_terminal_bytes_carry_no_model_sequences(hostile_dir, tmp_path):
    """The real command in a terminal: the hostile model's name and output never put their sequences (window
    title, clipboard, screen clear) on the wire."""
    chat = ChatInPty(hostile_dir, tmp_path / "data", "--max-new-tokens", "40")
    try:
        chat.wait_for_output(b"Chatting")
        os.write(chat.master, b"hello\r")
        end = time.monotonic() + 60
        while (chat.reply_row() or ("", ""))[1] not in ("ok", "error"):
            assert time.monotonic() < end
            chat.pump(0.1)
        chat.pump(0.5)
        os.kill(chat.proc.pid, signal.SIGTERM)
        chat.wait_exit()
    finally:
        chat.kill()
    out = bytes(chat.out)
    assert b"\x1b" in chat.reply_row()[0].encode()  # precondition: the reply had sequences
    for seq in [OSC_TITLE, "\x1b]2;pwned", "\x1b]52;", "\x1b]8;;http://evil", "\x1b[2J", "\x1bc", "\x9b", "\u202e"]:
        assert seq.encode() not in out, seq


class _OneView(App):
    def compose(self) -> ComposeResult:
        yield MessageView("assistant")


STREAM_CASES = {
    # name: (fragments, status, Markdown source once finished)
    "sequence-split-across-fragments": (["a\x1b]0;pw", "ned\x07b", "\x1b[3", "1mc"], "ok", "abc"),
    "lone-escape-at-end": (["text\x1b"], "ok", "text"),
    "cancelled-inside-fence": (
        ["Code:\n\n```py\nx = 1", "\n"],
        "cancelled",
        "Code:\n\n```py\nx = 1\n```\n\n*[cancelled]*",
    ),
    "interrupted-inside-tilde-fence": (["~~~~\ny"], "interrupted", "~~~~\ny\n~~~~\n\n*[interrupted]*"),
    "closed-fence-left-alone": (["```\nz\n```\n"], "cancelled", "```\nz\n```\n\n\n*[cancelled]*"),
}


@pytest.mark.parametrize("fragments,status,want", list(STREAM_CASES.values()), ids=list(STREAM_CASES))
@sync
async def test_streamed_view_is_safe_and_closes_fences(fragments, status, want):
    app = _OneView()
    async with app.run_test(size=SIZE) as pilot:
        view = app.query_one(MessageView)
        view.start_stream()
        for fragment in fragments:
            await view.write(fragment)
            assert clean(view.shown)
        await view.finish(status)
        await pilot.pause()
        assert view.markdown.source == want and view.content == "".join(fragments)


EXPORT_CASES = {
    # name: (file there before, /export argument, file content after, what the app says: a refusal in a toast, an
    # export done in a line of the conversation)
    "existing-file-kept": ("mine", "out.md", "mine", "exists"),
    "force-overwrites": ("mine", "out.md --force", "# hello", "Exported"),
    "new-file": (None, "out.md", "# hello", "Exported"),
    "default-name-never-overwrites": ("mine", "", "mine", "Exported"),
}


@pytest.mark.parametrize("before,arg,after,notice", list(EXPORT_CASES.values()), ids=list(EXPORT_CASES))
@sync
async def test_export_never_overwrites_silently(before, arg, after, notice, engine, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app = ChatApp(engine=engine, settings=SETTINGS, db_path=db_path(tmp_path))
    async with app.run_test(size=SIZE) as pilot:
        await exchange(pilot, app, "hello")
        target = tmp_path / ("out.md" if arg else f"localmoe-chat-{app.session_id}.md")
        if before is not None:
            target.write_text(before)
        await type_and_send(pilot, f"/export {arg}".rstrip())
        await pilot.pause()
        assert target.read_text().startswith(after)
        said = app.event_lines[-1] if notice == "Exported" else app.notices[-1]
        assert notice in said
        if not arg:
            assert (tmp_path / f"localmoe-chat-{app.session_id}-2.md").read_text().startswith("# hello")


# -- context overflow -------------------------------------------------------------------------------------------------


def _long_history(turns: int, width: int = 90) -> list[tuple[str, str, str]]:
    out = []
    for i in range(turns):
        out += [("user", f"question {i} " + "q" * width, "ok"), ("assistant", f"answer {i} " + "a" * width, "ok")]
    return out


def check_prompt(engine, app: ChatApp, sent_history: list[dict]) -> None:
    """The last prompt: system prompt kept, the newest messages from a user turn on, the new message last, fewest
    left out, within the context minus room for the reply."""
    head = [{"role": "system", "content": app.system}] if app.system else []
    dropped = app.dropped_for_context
    kept = sent_history[dropped:]
    assert dropped > 0 and kept[0]["role"] == "user" and kept[-1] == sent_history[-1]
    limit = context_limit(engine)
    budget = limit - min(SETTINGS.max_new_tokens, limit // 4)
    assert engine.stats.prompt_tokens == len(engine.encode_chat(head + kept)) <= budget
    earlier = max(i for i, m in enumerate(sent_history[:dropped]) if m["role"] == "user")
    assert len(engine.encode_chat(head + sent_history[earlier:])) > budget  # leaving out fewer would not fit


def history_messages(app: ChatApp, upto: int | None = None) -> list[dict]:
    return [
        {"role": t.role, "content": t.content}
        for t in app.turns[:upto]
        if t.role == "user" or (t.role == "assistant" and t.content.strip())
    ]


async def context_long_history(pilot, app, engine):
    await pilot.pause()
    reply = await exchange(pilot, app, "new question")
    assert reply.status == "ok"
    check_prompt(engine, app, history_messages(app, -1))
    reply = await exchange(pilot, app, "and another")
    assert reply.status == "ok"
    check_prompt(engine, app, history_messages(app, -1))


async def context_grows_in_session(pilot, app, engine):
    for i in range(5):
        reply = await exchange(pilot, app, f"message {i} " + "m" * 140)
        assert reply.status == "ok"
    check_prompt(engine, app, history_messages(app, -1))


async def context_fits(pilot, app, engine):
    reply = await exchange(pilot, app, "short")
    assert reply.status == "ok" and app.dropped_for_context == 0
    assert engine.stats.prompt_tokens == len(engine.encode_chat(history_messages(app, -1)))


async def context_new_message_alone_too_long(pilot, app, engine):
    reply = await exchange(pilot, app, "y" * 700)
    assert reply.status == "error" and "takes at most" in reply.markdown.source
    assert app.turns[-2].content == "y" * 700  # kept, and saved
    reply = await exchange(pilot, app, "short again")
    assert reply.status == "ok"


CONTEXT_CASES = {
    # name: (run, app options, seeded history, notices expected)
    "long-history-on-continue": (context_long_history, {"continue_last": True}, _long_history(5), 1),
    "long-history-system-prompt-kept": (context_long_history, {"continue_last": True}, _long_history(5), 1),
    "grows-in-one-session": (context_grows_in_session, {}, None, 1),
    "fits-nothing-left-out": (context_fits, {"continue_last": True}, _long_history(1), 0),
    "new-message-alone-too-long": (context_new_message_alone_too_long, {}, None, 1),
}


@pytest.mark.parametrize("case", list(CONTEXT_CASES), ids=list(CONTEXT_CASES))
@sync
async def test_context_overflow_leaves_out_oldest(case, engine, tmp_path):
    """A conversation longer than the context (the tiny model takes 512 positions) goes on: the oldest turns are
    left out of the prompt, with one notice."""
    run, options, history, notices = CONTEXT_CASES[case]
    path = db_path(tmp_path)
    if history is not None:
        seed(path, system="Be terse." if "system" in case else None, messages=history)
    app = ChatApp(engine=engine, settings=SETTINGS, db_path=path, **options)
    async with app.run_test(size=SIZE) as pilot:
        await run(pilot, app, engine)
    assert len([n for n in app.notices if "left out to fit the context" in n]) == notices


FIT_CASES = {
    # name: (messages, max_new_tokens, dropped)
    "empty": ([], 8, 0),
    "fits": ([{"role": "user", "content": "hi"}], 8, 0),
    "drops-to-a-user-turn": (
        [{"role": "system", "content": "s"}]
        + [{"role": r, "content": r[0] * 150} for r in ["user", "assistant"] * 3]
        + [{"role": "user", "content": "new"}],
        8,
        4,
    ),
    "reply-room-capped-at-a-quarter": (
        [{"role": r, "content": r[0] * 200} for r in ["user", "assistant"]] + [{"role": "user", "content": "new"}],
        10_000,
        2,
    ),
    "keeps-the-new-message-even-alone-too-long": (
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "z" * 900},
        ],
        8,
        2,
    ),
}


@pytest.mark.parametrize("messages,max_new,dropped", list(FIT_CASES.values()), ids=list(FIT_CASES))
def test_fit_to_context(messages, max_new, dropped, engine):
    kept, n = fit_to_context(engine, messages, max_new)
    assert n == dropped
    head = messages[:1] if messages and messages[0]["role"] == "system" else []
    assert kept == head + messages[len(head) + n :]
