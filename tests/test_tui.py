"""Tests of the `localmoe chat` app (localmoe.tui) driven by a scripted engine through Textual's pilot.

`ScriptedEngine` implements the ChatEngine protocol of localmoe.events without torch. The
snapshot tests (tests/__snapshots__/test_tui/) fix the terminal size and the engine's figures
so they render the same on any machine. `chat_exchange` is the hook for an end-to-end test
against a real `localmoe.engine.engine.Engine`.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from localmoe.events import ChatEngine, EngineStats, GenerationSettings, ProgressFn, TokenEvent
from localmoe.tui.app import ChatApp
from localmoe.tui.history import HistoryStore
from localmoe.tui.widgets import ChatInput, MessageView, StatusBar

SIZE = (100, 30)
FIXED_STATS = dict(
    prompt_tokens=12,
    prefill_tok_s=250.0,
    decode_tok_s=42.5,
    sparsity_target=0.5,
    sparsity_realized=0.48,
    peak_gpu_mem_gb=7.25,
    cache_hit_rate=0.9,
)


class ScriptedEngine:
    """A fake ChatEngine: streams `reply` a word at a time; hang_after=N blocks after N words until cancel()."""

    def __init__(
        self,
        reply: str = "Hello **there**! Here is code:\n\n```python\nprint('hi')\n```\n",
        *,
        hang_after: int | None = None,
        fail_with: Exception | None = None,
        delay: float = 0.002,
    ) -> None:
        self.model_name = "fake/moe-tiny"
        self.device = "cuda:0"
        self.reply, self.hang_after, self.fail_with, self.delay = reply, hang_after, fail_with, delay
        self._cancel = threading.Event()
        self._stats = EngineStats(**FIXED_STATS)
        self.calls: list[list[dict]] = []
        self.sparsity_calls: list[float] = []

    @property
    def stats(self) -> EngineStats:
        return self._stats

    def cancel(self) -> None:
        self._cancel.set()

    def set_sparsity(self, sparsity: float, progress: ProgressFn | None = None) -> None:
        for i in range(3):
            if progress:
                progress("calibrate", i + 1, 3)
        self.sparsity_calls.append(sparsity)
        self._stats.sparsity_target = sparsity

    def chat(self, messages: Sequence[dict], settings: GenerationSettings) -> Iterator[TokenEvent]:
        self.calls.append([dict(m) for m in messages])
        self._cancel.clear()
        self._stats.generated_tokens, self._stats.finish_reason = 0, ""
        words = self.reply.split(" ")
        for i, word in enumerate(words):
            if self.hang_after is not None and i == self.hang_after:
                self._cancel.wait(timeout=20)  # the test fails rather than hangs if cancel never comes
            if self._cancel.is_set():
                self._stats.finish_reason = "cancelled"
                return
            if self.fail_with is not None and i == 2:
                raise self.fail_with
            time.sleep(self.delay)
            self._stats.generated_tokens = i + 1
            yield TokenEvent(token_id=i, text=word if i == len(words) - 1 else word + " ", index=i)
        self._stats.finish_reason = "stop"


async def wait_for(pilot, predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await pilot.pause(0.02)


def replies(app: ChatApp) -> list[MessageView]:
    return [v for v in app.query(MessageView) if v.role == "assistant"]


async def type_and_send(pilot, text: str) -> None:
    prompt = pilot.app.query_one(ChatInput)
    prompt.text = text
    await pilot.press("enter")


async def chat_exchange(
    engine: ChatEngine, prompt: str, db_path: Path, timeout: float = 120.0
) -> tuple[str, EngineStats]:
    """E2E hook: send `prompt` to `engine` through the app; returns (reply text, engine stats).

    Works with any ChatEngine, e.g. `localmoe.engine.engine.Engine` on a tiny model.
    """
    app = ChatApp(engine=engine, db_path=db_path)
    async with app.run_test(size=SIZE) as pilot:
        await type_and_send(pilot, prompt)
        await wait_for(pilot, lambda: app.reply is None and replies(app), timeout)
        return replies(app)[-1].content, engine.stats


def sync(test):
    """Run an async test with asyncio.run (no pytest-asyncio needed)."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))

    return wrapper


def make_app(tmp_path: Path, engine: ScriptedEngine | None = None, **kwargs) -> ChatApp:
    return ChatApp(engine=engine or ScriptedEngine(), db_path=tmp_path / "chats.sqlite3", **kwargs)


def stored(tmp_path: Path) -> list[tuple[str, str, str]]:
    store = HistoryStore(tmp_path / "chats.sqlite3")
    last = store.last_session()
    rows = [(m.role, m.content, m.status) for m in store.messages(last.id)] if last else []
    store.close()
    return rows


@sync
async def test_send_streams_markdown_reply_with_status(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await type_and_send(pilot, "hello")
        await wait_for(pilot, lambda: app.reply is None and replies(app))
        reply = replies(app)[0]
        assert reply.content.startswith("Hello **there**!") and reply.status == "ok"
        assert app.query("MarkdownFence")  # the code block became a highlighted fence
        status = str(app.query_one(StatusBar).render())
        assert "42.5 tok/s" in status and "fake/moe-tiny" in status and "cache 90%" in status
        assert app.query_one(ChatInput).text == ""
    assert [r[0] for r in stored(tmp_path)] == ["user", "assistant"]


@sync
async def test_escape_cancels_hanging_stream_and_keeps_partial(tmp_path):
    engine = ScriptedEngine("one two three four five", hang_after=2)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await type_and_send(pilot, "count")
        await wait_for(pilot, lambda: app.reply is not None and app.reply.view.content == "one two ")
        assert "generating" in str(app.query_one("#hint").render())
        # the user message is committed before the reply ends, and the reply's row from its start
        rows = stored(tmp_path)
        assert rows[0] == ("user", "count", "ok") and (rows[1][0], rows[1][2]) == ("assistant", "streaming")
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.reply is None)
        reply = replies(app)[0]
        assert reply.status == "cancelled" and "[cancelled]" in reply.markdown.source
    assert stored(tmp_path)[-1] == ("assistant", "one two ", "cancelled")


@sync
async def test_text_sent_during_a_reply_is_queued_then_sent(tmp_path):
    engine = ScriptedEngine("one two three", hang_after=1)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await type_and_send(pilot, "first")
        await wait_for(pilot, lambda: app.reply is not None and app.reply.view.content)
        await type_and_send(pilot, "typed meanwhile")
        assert [q.text for q in app.queue] == ["typed meanwhile"] and app.queue[0].view.status == "queued"
        assert "1 queued" in str(app.query_one("#hint").render())
        await pilot.press("ctrl+c")  # cancels the reply; the queued message goes next
        await wait_for(pilot, lambda: len(engine.calls) == 2)
        assert engine.calls[-1][-1] == {"role": "user", "content": "typed meanwhile"}
        assert not app.queue
        engine.cancel()


@sync
async def test_engine_error_is_shown_and_saved(tmp_path):
    app = make_app(tmp_path, ScriptedEngine("a b c d", fail_with=RuntimeError("CUDA error: boom")))
    async with app.run_test(size=SIZE) as pilot:
        await type_and_send(pilot, "go")
        await wait_for(pilot, lambda: app.reply is None and replies(app))
        assert replies(app)[0].status == "error"
        assert "CUDA error: boom" in replies(app)[0].markdown.source
    assert stored(tmp_path)[-1] == ("assistant", "a b ", "error")


@sync
async def test_quit_mid_reply_saves_partial(tmp_path):
    app = make_app(tmp_path, ScriptedEngine("x y z", hang_after=1))
    async with app.run_test(size=SIZE) as pilot:
        await type_and_send(pilot, "q")
        await wait_for(pilot, lambda: app.reply is not None and app.reply.view.content)
        await pilot.press("ctrl+q")
    assert app.return_code == 0
    assert stored(tmp_path) == [("user", "q", "ok"), ("assistant", "x ", "cancelled")]


@sync
async def test_ctrl_j_adds_newline_enter_sends(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("a", "ctrl+j", "b")
        assert app.query_one(ChatInput).text == "a\nb"
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.reply is None and replies(app))
        assert app.turns[0].content == "a\nb"


@sync
async def test_commands(tmp_path):
    engine = ScriptedEngine("ok")
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await type_and_send(pilot, "/temp 0.7")
        assert app.settings.temperature == 0.7
        await type_and_send(pilot, "/system Be brief.")
        await type_and_send(pilot, "/sparsity 0.3")
        await wait_for(pilot, lambda: engine.sparsity_calls == [0.3] and not app.busy)
        await type_and_send(pilot, "/nonsense")  # reported, not a crash; the input keeps the text
        assert app.query_one(ChatInput).text == "/nonsense"
        await type_and_send(pilot, "hi")
        await wait_for(pilot, lambda: app.reply is None and replies(app))
        assert engine.calls[-1][0] == {"role": "system", "content": "Be brief."}
        await type_and_send(pilot, "/regenerate")
        await wait_for(pilot, lambda: len(engine.calls) == 2 and app.reply is None)
        assert engine.calls[0] == engine.calls[1] and len(replies(app)) == 1
        await type_and_send(pilot, f"/export {tmp_path / 'out.md'}")
        exported = (tmp_path / "out.md").read_text()
        assert "## System\n\nBe brief." in exported and "## User\n\nhi" in exported
        notes = len(app.query(".note"))
        await type_and_send(pilot, "/help")
        await type_and_send(pilot, "/stats")
        assert len(app.query(".note")) == notes + 2
        await type_and_send(pilot, "/new")
        assert app.turns == [] and app.session_id is None and not replies(app)
        await type_and_send(pilot, "/quit")
    assert app.return_code == 0
    assert [r[0] for r in stored(tmp_path)] == ["user", "assistant"]  # regenerated reply replaced the first


@sync
async def test_command_palette_prefills_command(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("ctrl+p")
        await pilot.press(*"sparsity")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.query_one(ChatInput).text == "/sparsity ")


@sync
async def test_continue_last_resumes_history(tmp_path):
    engine = ScriptedEngine("first answer")
    async with make_app(tmp_path, engine, system="Pirate.").run_test(size=SIZE) as pilot:
        await type_and_send(pilot, "first question")
        await wait_for(pilot, lambda: pilot.app.reply is None and replies(pilot.app))
    app = make_app(tmp_path, engine, continue_last=True)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert [t.content for t in app.turns] == ["first question", "first answer"]
        assert app.system == "Pirate."
        await type_and_send(pilot, "second")
        await wait_for(pilot, lambda: app.reply is None and len(replies(app)) == 2)
    assert [m["content"] for m in engine.calls[-1]] == ["Pirate.", "first question", "first answer", "second"]


@sync
async def test_sessions_picker_resumes(tmp_path):
    app = make_app(tmp_path, ScriptedEngine("r"))
    async with app.run_test(size=SIZE) as pilot:
        await type_and_send(pilot, "older chat")
        await wait_for(pilot, lambda: app.reply is None and replies(app))
        first = app.session_id
        await type_and_send(pilot, "/new")
        await type_and_send(pilot, "/sessions")
        await pilot.pause()
        await pilot.press("enter")  # the only session is highlighted
        await wait_for(pilot, lambda: app.session_id == first)
        assert [t.content for t in app.turns] == ["older chat", "r"]


@sync
async def test_loading_progress_then_chat(tmp_path):
    seen = []

    def load(progress):
        for stage in ("download", "load"):
            progress(stage, 1, 2)
            progress(stage, 2, 2)
        seen.append("loaded")
        return ScriptedEngine()

    app = ChatApp(load=load, model_label="tiny", sparsity=0.25, db_path=tmp_path / "c.sqlite3")
    async with app.run_test(size=SIZE) as pilot:
        assert isinstance(app.focused, ChatInput)  # the input is live from the first frame
        await wait_for(pilot, lambda: app.query(MessageView))  # the intro note: the chat is shown
        await pilot.pause()
        assert app.query_one("#main").current == "chat" and seen == ["loaded"] and app.engine.sparsity_calls == [0.25]


@sync
async def test_load_error_is_shown_not_raised(tmp_path):
    def load(progress):
        raise SystemExit("localmoe: error: unknown model 'nope'; run `localmoe models` to list them")

    app = ChatApp(load=load, model_label="nope", db_path=tmp_path / "c.sqlite3")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.query_one("#main").current == "error")
        assert app.load_error.startswith("localmoe: error: unknown model 'nope'")
        await pilot.press("q")  # a letter never quits: it goes into the input
        assert app.query_one(ChatInput).text == "q" and app.is_running
        await pilot.press("ctrl+q")
    assert app.return_code == 1


# snapshots: fixed size, fixed engine figures, no timestamps on screen


def _no_blink(pilot) -> None:
    pilot.app.query_one(ChatInput).cursor_blink = False


def test_snapshot_empty(snap_compare, tmp_path):
    async def run_before(pilot):
        _no_blink(pilot)

    assert snap_compare(make_app(tmp_path), terminal_size=SIZE, run_before=run_before)


def test_snapshot_streaming(snap_compare, tmp_path):
    engine = ScriptedEngine(
        "Sure. Here is a **function**:\n\n```python\ndef add(a, b):\n    return a + b\n```\n\nIt adds", hang_after=14
    )
    app = make_app(tmp_path, engine)

    async def run_before(pilot):
        _no_blink(pilot)
        await type_and_send(pilot, "Write add() in Python")
        await wait_for(pilot, lambda: app.reply is not None and app.reply.view.content.endswith("It "))
        await pilot.pause(0.2)

    try:
        assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
    finally:
        engine.cancel()


def test_snapshot_load_error(snap_compare, tmp_path):
    def load(progress):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    app = ChatApp(load=load, model_label="qwen3-30b-a3b", db_path=tmp_path / "c.sqlite3")

    async def run_before(pilot):
        await wait_for(pilot, lambda: app.query_one("#main").current == "error")

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_status_line_shows_offload_figures():
    from localmoe.tui.status_line import format_status

    resident = format_status("m", "cuda:0", EngineStats(**{**FIXED_STATS, "cache_hit_rate": None}))
    assert "cache" not in resident and "MB/tok" not in resident
    line = format_status("m", "cuda:0", EngineStats(**FIXED_STATS, h2d_bytes_per_token=673.4e6))
    assert line.endswith("cache 90% · host→GPU 673 MB/tok")
