"""What the chat fault tests share (test_chat_faults.py, test_chat_output_safety.py, test_chat_context.py): the tiny
engines (a plain one, one whose tokenizer decodes to escape sequences and markup in a folder whose name carries them,
one with a long context), the history database helpers (seeding, reading rows back, a real disk-full fault) and
`ChatInPty`, `localmoe chat` in a pseudo-terminal.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import shutil
import sqlite3
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import tiny_models
from conftest import repo_id
from test_tui import replies, type_and_send, wait_for

from localmoe.engine.engine import Engine
from localmoe.events import GenerationSettings
from localmoe.safe_text import is_clean
from localmoe.tui.app import ChatApp
from localmoe.tui.history import HistoryStore
from localmoe.tui.widgets import MessageView, StatusBar

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


# -- checkpoints and engines (each test module's fixtures call these) ------------------------------------------------


def tiny_engine() -> Engine:
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


def make_hostile_dir(src_dir: Path, tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE in a folder whose name carries an OSC title and markup, with a tokenizer whose greedy
    output is made of escape sequences and markup."""
    folder = tmp_path_factory.mktemp("hostile") / HOSTILE_NAME
    shutil.copytree(src_dir / "qwen3_moe", folder)
    for f in folder.glob("tokenizer*"):
        f.unlink()
    hostile_tokenizer().save_pretrained(folder)
    return folder


def make_long_dir(src_dir: Path, tmp_path_factory) -> Path:
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
