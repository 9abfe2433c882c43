"""What the chat pilot tests share (test_chat_polish.py, test_chat_reasoning.py): the terminal size and generation
settings they use, the tiny checkpoints, a long-context copy of one, the chat's loader callback over Engine.load, and
helpers reading the screen, the hint and the event lines, and waiting for the model to be ready or to stream.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

from conftest import repo_id
from test_tui import wait_for

from localmoe.engine.engine import Engine
from localmoe.events import GenerationSettings
from localmoe.tui.app import ChatApp
from localmoe.tui.widgets import MessageView

SMALL = (80, 24)
SHORT = GenerationSettings(max_new_tokens=8)
# with long_engine: the context's ~8000 tokens, 25 s or more on a CPU: time to act while it streams (every test cancels
# it; 3000 tokens ran out under torch 2.15 on a loaded 2-core machine while the queue test still acted on the reply)
LONG = GenerationSettings(max_new_tokens=16000)
QWEN = repo_id("qwen3_moe")
OLMOE = repo_id("olmoe")


def long_copy(src: Path, folder: Path) -> Path:
    """The checkpoint at `src` with 16384 positions (same weights): replies long enough to act on while they stream."""
    shutil.copytree(src, folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 16384
    (folder / "config.json").write_text(json.dumps(config))
    return folder


class Loader:
    """The chat's loader callback over Engine.load: `load(progress)` loads QWEN, `load(progress, model=NAME)` NAME;
    `gate` (when given) holds every load back until set. Records the models asked for."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate
        self.calls: list[str | None] = []

    def __call__(self, progress, model: str | None = None) -> Engine:
        self.calls.append(model)
        if self.gate is not None:
            assert self.gate.wait(60), "the test never released the load"
        return Engine.load(model or QWEN, device="cpu", sparsity=0.0, progress=progress)


def db(tmp_path: Path) -> Path:
    return tmp_path / "chats.sqlite3"


def screen_text(app: ChatApp) -> str:
    """What the terminal shows, as text (one line per row)."""
    strips = app.screen._compositor.render_strips()
    return "\n".join("".join(seg.text for seg in strip).rstrip() for strip in strips)


def hint(app: ChatApp) -> str:
    return str(app.query_one("#hint").render())


def events(app: ChatApp) -> list[str]:
    return [str(w.render()) for w in app.query(".event")]


async def ready(pilot, app: ChatApp, timeout: float = 60.0) -> None:
    await wait_for(
        pilot,
        lambda: app.engine is not None and app.query_one("#main").current == "chat" and app.query(MessageView),
        timeout,
    )
    await pilot.pause()


async def streaming(pilot, app: ChatApp) -> None:
    await wait_for(pilot, lambda: app.reply is not None and len(app.reply.view.content) > 3, 60)
