"""Pilot tests of `localmoe chat` as people use it (issue #27, the chat side): the input live from the first frame
(messages queued while the model loads or replies, Esc and /cancel taking them back), only ctrl+q quitting, ctrl+c
cancelling, /stats for people, commands confirming in the conversation (and showing their value alone), the
sampling commands, /model switching models inside the chat, /sessions renaming and deleting, the layout at 80x24.
A thinking model's reasoning: test_chat_reasoning.py.

Every app runs the real Engine on the tiny checkpoints of conftest, loaded through a real loader callback (a
threading.Event holds a load back where a test types during it). Nothing here mocks the loader or the model.
"""

from __future__ import annotations

import gc
import re
import sqlite3
import threading
import weakref
from dataclasses import fields
from pathlib import Path

import pytest
from chat_pilot_support import (
    LONG,
    OLMOE,
    QWEN,
    SHORT,
    SMALL,
    Loader,
    db,
    events,
    hint,
    long_copy,
    ready,
    screen_text,
    streaming,
)
from test_tui import replies, sync, type_and_send, wait_for

from localmoe.engine.engine import Engine
from localmoe.events import GenerationSettings
from localmoe.tui.app import ChatApp
from localmoe.tui.history import HistoryStore
from localmoe.tui.sessions import SessionPicker
from localmoe.tui.stats_view import measured, seconds
from localmoe.tui.status_line import wrap_parts
from localmoe.tui.widgets import INPUT_HINT, ChatInput, LoadingView, MessageView, StatusBar


@pytest.fixture(scope="module")
def engine(hub_cache) -> Engine:
    return Engine.load(QWEN, device="cpu", sparsity=0.0)


@pytest.fixture(scope="module")
def long_engine(src_dir, tmp_path_factory) -> Engine:
    folder = long_copy(src_dir / "qwen3_moe", tmp_path_factory.mktemp("long") / "tiny-long")
    engine = Engine.load(str(folder), device="cpu", sparsity=0.0)
    engine.eos_ids = set()  # a sampled end-of-text token would end a reply the test means to act on while it streams
    return engine


# 1. the input is live from the first frame -----------------------------------------------------------------------


@sync
async def test_typing_during_the_load_is_kept_and_queued_until_ready(tmp_path):
    gate = threading.Event()
    loader = Loader(gate)
    app = ChatApp(load=loader, model_label="tiny", settings=SHORT, db_path=db(tmp_path))
    async with app.run_test(size=SMALL) as pilot:
        assert isinstance(app.focused, ChatInput) and app.query_one("#main").current == "loading"
        await pilot.press(*"q is not quit")  # a q typed during the load goes into the input
        assert app.is_running and app.query_one(ChatInput).text == "q is not quit"
        await pilot.press("enter")
        assert [q.text for q in app.queue] == ["q is not quit"] and app.query_one(ChatInput).text == ""
        await pilot.press(*"second", "enter")
        queued = str(app.query_one(LoadingView).query_one("#queued").render())
        assert "Queued: q is not quit" in queued and "Queued: second" in queued
        assert "2 queued" in hint(app)
        await pilot.press("escape")  # on an empty input: the last queued message comes back to be edited
        assert [q.text for q in app.queue] == ["q is not quit"] and app.query_one(ChatInput).text == "second"
        await pilot.press("ctrl+c")  # nothing to cancel: a plain-text hint, no markup
        assert app.notices[-1] == "Press ctrl+q to quit." and app.is_running
        gate.set()
        await wait_for(pilot, lambda: app.reply is None and replies(app) and replies(app)[-1].status == "ok", 60)
        assert [(t.role, t.status) for t in app.turns] == [("user", "ok"), ("assistant", "ok")]
        assert app.turns[0].content == "q is not quit" and not app.queue
        assert app.query_one(ChatInput).text == "second"  # what was taken back is still there, unsent
    store = HistoryStore(db(tmp_path))
    assert [(m.role, m.content) for m in store.messages(store.last_session().id)][0] == ("user", "q is not quit")
    store.close()
    assert loader.calls == [None]


@sync
async def test_enter_during_a_reply_queues_esc_takes_back_ctrl_c_cancels(long_engine, tmp_path):
    app = ChatApp(engine=long_engine, settings=LONG, db_path=db(tmp_path))
    async with app.run_test(size=SMALL) as pilot:
        await type_and_send(pilot, "hello")
        await streaming(pilot, app)
        await type_and_send(pilot, "next one")
        assert [q.text for q in app.queue] == ["next one"]
        queued = app.queue[0].view
        assert queued.status == "queued" and "queued" in str(queued.query_one(".role").render())
        conversation = list(app.query_one("#conversation").children)
        assert conversation.index(queued) > conversation.index(app.reply.view)  # below the reply in flight
        assert "Esc cancels" in hint(app) and "1 queued" in hint(app)
        await type_and_send(pilot, "/temp")  # a command's line goes above the queued message
        conversation = list(app.query_one("#conversation").children)
        assert conversation.index(app.query(".event").last()) < conversation.index(queued)
        await pilot.press("escape")  # empty input: the queued message comes back, the reply goes on
        assert not app.queue and app.query_one(ChatInput).text == "next one" and app.reply is not None
        await pilot.press("enter")
        assert [q.text for q in app.queue] == ["next one"]
        first = app.reply
        await pilot.press("ctrl+c")  # cancels the reply; the queued message is sent next
        await wait_for(pilot, lambda: first.turn.status == "cancelled" and len(app.turns) == 4, 60)
        assert app.turns[2].content == "next one"  # sent as soon as the reply before it ended
        sent = app.turns[2].view
        assert sent.status == "ok" and str(sent.query_one(".role").render()) == "You"
        await type_and_send(pilot, "/cancel")
        await wait_for(pilot, lambda: app.reply is None)
        await type_and_send(pilot, "/new")
        await type_and_send(pilot, "hello")  # a reply known to run to its token limit
        await streaming(pilot, app)
        await type_and_send(pilot, "dropped")
        await type_and_send(pilot, "/cancel")
        await wait_for(pilot, lambda: app.reply is None)
        assert events(app)[-1] == "· Reply cancelled, 1 queued message dropped."
        assert [t.content for t in app.turns if t.role == "user"] == ["hello"]
        assert not app.query(".queued")
        await type_and_send(pilot, "/cancel")
        assert events(app)[-1] == "· Nothing to cancel."


@sync
async def test_only_ctrl_q_quits(engine, tmp_path):
    app = ChatApp(engine=engine, settings=SHORT, db_path=db(tmp_path))
    async with app.run_test(size=SMALL) as pilot:
        await pilot.press("q", "Q", "escape", "ctrl+c")
        assert app.is_running and app.query_one(ChatInput).text == "qQ"
        assert app.notices == ["Press ctrl+q to quit."]  # plain text: Textual's own hint carries [b] markup
        app.query_one(ChatInput).select_all()
        await pilot.press("ctrl+c")  # with a selection in the input: copy, as in any editor
        assert app.clipboard == "qQ" and len(app.notices) == 1
        await pilot.press("ctrl+q")
    assert app.return_code == 0


# 2. /stats for people ----------------------------------------------------------------------------------------------

DURATION = re.compile(r"^(—|\d+ ms|\d+\.\d s|\d+ s|\d+ min \d+ s)$")


@sync
async def test_stats_are_written_for_people(engine, tmp_path):
    app = ChatApp(load=Loader(), model_label="tiny", settings=SHORT, db_path=db(tmp_path))
    async with app.run_test(size=SMALL) as pilot:
        await ready(pilot, app)
        await type_and_send(pilot, "/stats")
        before = app.query(MessageView).last().markdown.source
        assert "Last reply: **none yet**" in before
        await type_and_send(pilot, "hello")
        await wait_for(pilot, lambda: app.reply is None and replies(app), 60)
        await type_and_send(pilot, "/stats")
        text = app.query(MessageView).last().markdown.source
    rows = dict(line[2:].split(": ", 1) for line in text.splitlines() if line.startswith("- "))
    assert "None" not in text and not any("_" in label for label in rows)  # no raw keys
    for label in ("Load time", "Time to first token", "Reply time"):
        assert DURATION.match(rows[label].strip("*")), (label, rows[label])
    assert rows["Expert cache"] == "**all experts resident**"
    assert rows["Last reply"].startswith("**8 tokens, it reached the token limit")
    assert (
        rows["Sampling"]
        == "**greedy (temperature 0) · "
        + ("no repetition penalty · " if hasattr(SHORT, "repetition_penalty") else "")
        + "at most 8 tokens**"
    )
    stats = app.engine.stats
    for name in ("load_s", "ttft_s", "wall_s"):  # the engine's figures when it has them, else "—"
        value = getattr(stats, name, None)
        label = {"load_s": "Load time", "ttft_s": "Time to first token", "wall_s": "Reply time"}[name]
        assert rows[label] == f"**{measured(value)}**"
    assert [seconds(v) for v in (None, 0.38, 2.44, 31.2, 72)] == ["—", "380 ms", "2.4 s", "31 s", "1 min 12 s"]
    assert measured(0.0) == measured(None) == "—"  # not measured


# 3. commands confirm in the conversation -------------------------------------------------------------------------


@sync
async def test_commands_confirm_in_the_conversation_and_show_values(engine, tmp_path):
    engine.set_sparsity(0.0)
    app = ChatApp(engine=engine, settings=SHORT, db_path=db(tmp_path))
    has_penalty = "repetition_penalty" in {f.name for f in fields(GenerationSettings)}
    async with app.run_test(size=SMALL) as pilot:
        await pilot.pause()
        for text in (
            "/temp",
            "/temp 0.7",
            "/topp",
            "/topp 0.9",
            "/topk 40",
            "/penalty 1.1",
            "/penalty",
            "/sparsity",
            "/think",
            "/model",
        ):
            await type_and_send(pilot, text)
        await type_and_send(pilot, "/sparsity 0.5")
        await wait_for(pilot, lambda: not app.busy and app.event_lines[-1].startswith("Sparsity target 50%"), 60)
        lines = app.event_lines
        assert lines[:5] == [
            "Temperature 0 (greedy). /temp T changes it.",
            "Temperature 0.7, was 0.",
            "Top-p 1 (off). /topp P changes it.",
            "Top-p 0.9, was 1.",
            "Top-k 40, was 0.",
        ]
        if has_penalty:
            assert lines[5:7] == ["Repetition penalty 1.1, was 1.", "Repetition penalty 1.1. /penalty R changes it."]
            assert app.settings.repetition_penalty == 1.1
        else:
            assert lines[5:7] == ["Repetition penalty: not available with this localmoe version."] * 2
        assert lines[7] == "Sparsity target 0%. /sparsity S changes it (0 = dense)."
        assert lines[8] == "localmoe-test/tiny-qwen3_moe has no thinking mode: /think does nothing here."
        assert lines[9].startswith("Model: localmoe-test/tiny-qwen3_moe on cpu. /model NAME switches")
        assert (app.settings.temperature, app.settings.top_p, app.settings.top_k) == (0.7, 0.9, 40)
        assert engine.sparsity == 0.5
        assert [str(w.render()) for w in app.query(".event")] == [f"· {line}" for line in lines]
        for bad in ("/topk 2.5", "/topp 0", "/penalty -1", "/temp hot", "/think maybe", "/t 1"):
            await type_and_send(pilot, bad)  # refused with the reason; the text stays to be fixed
            assert app.query_one(ChatInput).text == bad
        assert app.notices[-1] == "unknown command /t (/think, /temp, /topp, /topk?)"
        app.query_one(ChatInput).clear()
        await type_and_send(pilot, "hi")  # the new settings reach the real engine: a sampled reply
        await wait_for(pilot, lambda: app.reply is None and replies(app), 60)
        assert replies(app)[-1].status == "ok" and engine.stats.sparsity_target == 0.5
        await type_and_send(pilot, "/help")
        assert "/think" not in app.query(MessageView).last().markdown.source  # no thinking mode: not offered
    engine.set_sparsity(0.0)


# 4. /model switches models inside the chat -------------------------------------------------------------------------


@sync
async def test_model_switch_keeps_the_conversation_and_frees_the_old_engine(tmp_path):
    loader = Loader()
    app = ChatApp(load=loader, model_label="tiny", settings=SHORT, db_path=db(tmp_path))
    async with app.run_test(size=SMALL) as pilot:
        await ready(pilot, app)
        await type_and_send(pilot, "hello experts")
        await wait_for(pilot, lambda: app.reply is None and replies(app), 60)
        old = weakref.ref(app.engine)
        await type_and_send(pilot, "/topk 5")  # a setting changed in the chat stays with the next model
        loader.gate = threading.Event()
        await type_and_send(pilot, f"/model {OLMOE}")
        await wait_for(pilot, lambda: app.query_one("#main").current == "loading")
        title = str(app.query_one(LoadingView).query_one(".title").render())
        assert title == f"Switching to {OLMOE}" and app.engine is None
        await type_and_send(pilot, "and now?")  # typed during the switch: queued, sent by the new model
        loader.gate.set()
        await wait_for(pilot, lambda: app.reply is None and len(replies(app)) == 2, 60)
        gc.collect()
        assert old() is None  # the first engine was let go before the second loaded
        assert OLMOE in app.engine.model_name and loader.calls == [None, OLMOE]
        assert (app.settings.top_k, app.settings.max_new_tokens) == (5, 8)
        assert any(
            line.startswith(f"Now chatting with {OLMOE} on cpu. The conversation (2 messages) stays")
            for line in app.event_lines
        )
        stats = app.engine.stats  # the new model read the whole conversation: nothing of it was cached
        assert stats.reused_prompt_tokens == 0 and stats.prompt_tokens > len("and now?") + 20
        assert [t.content for t in app.turns if t.role == "user"] == ["hello experts", "and now?"]
        assert OLMOE in str(app.query_one(StatusBar).render())
        session = app.session_id
    store = HistoryStore(db(tmp_path))
    assert OLMOE in store.session(session).model and len(store.messages(session)) == 4
    store.close()


@sync
async def test_model_switch_needs_a_loader_and_a_failed_one_can_be_retried(engine, tmp_path):
    app = ChatApp(engine=engine, settings=SHORT, db_path=db(tmp_path))
    async with app.run_test(size=SMALL) as pilot:
        await type_and_send(pilot, f"/model {OLMOE}")
        assert app.event_lines[-1].startswith("This chat cannot load another model") and app.engine is engine
    app = ChatApp(load=Loader(), model_label="tiny", settings=SHORT, db_path=db(tmp_path))
    async with app.run_test(size=SMALL) as pilot:
        await ready(pilot, app)
        await type_and_send(pilot, "/model localmoe-test/no-such-model")
        await wait_for(pilot, lambda: app.query_one("#main").current == "error", 60)
        assert "no-such-model" in str(app.query_one("#error-text").render())
        await type_and_send(pilot, "/stats")  # needs a model: refused, kept in the input
        assert app.query_one(ChatInput).text == "/stats"
        app.query_one(ChatInput).clear()
        await type_and_send(pilot, f"/model {QWEN}")
        await wait_for(pilot, lambda: app.engine is not None and app.query_one("#main").current == "chat", 60)
        assert app.engine.model_name == QWEN


# 5. /sessions renames and deletes ------------------------------------------------------------------------------------


def seed_sessions(path: Path) -> list[int]:
    store = HistoryStore(path)
    ids = []
    for title in ("older talk", "newer talk"):
        sid = store.new_session("tiny")
        store.add_message(sid, "user", title)
        store.add_message(sid, "assistant", "answer")
        ids.append(sid)
    store.close()
    return ids


def titles(path: Path) -> dict[int, str]:
    con = sqlite3.connect(path)
    try:
        return dict(con.execute("SELECT id, title FROM sessions"))
    finally:
        con.close()


@sync
async def test_sessions_rename_and_delete_with_confirmation(engine, tmp_path):
    older, newer = seed_sessions(db(tmp_path))
    app = ChatApp(engine=engine, settings=SHORT, db_path=db(tmp_path), continue_last=True)
    async with app.run_test(size=SMALL) as pilot:
        await pilot.pause()
        assert app.session_id == newer
        await type_and_send(pilot, "/sessions")
        await pilot.pause()
        picker = app.screen
        assert isinstance(picker, SessionPicker) and "r rename · d delete" in picker.keys_line
        await pilot.press("down", "r")  # the older one
        box = picker.query_one("#picker-rename")
        assert box.has_focus and box.value == "older talk"
        box.value = ""
        await pilot.press(*"Q about [b]MoE[/b]", "enter")  # a q while renaming is a letter of the title
        assert titles(db(tmp_path))[older] == "Q about [b]MoE[/b]"
        assert "Q about [b]MoE[/b]" in str(picker.query_one("SessionList").get_option_at_index(1).prompt)
        await pilot.press("d")
        assert f"Delete #{older}" in picker.keys_line and "y deletes" in picker.keys_line
        await pilot.press("n")  # any other key keeps it
        assert older in titles(db(tmp_path)) and "Kept" in picker.keys_line
        await pilot.press("d", "y")
        assert older not in titles(db(tmp_path)) and "Deleted" in picker.keys_line
        await pilot.press("d", "y")  # the open conversation: deleted, and the screen starts a new one
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.session_id is None and not app.turns)
        assert titles(db(tmp_path)) == {} and app.event_lines[-1].startswith(f"Conversation #{newer} deleted")
        assert app.is_running


# 6. 80x24 ----------------------------------------------------------------------------------------------------------


def test_status_figures_wrap_between_figures_never_cut():
    parts = [
        "localmoe-test/tiny-qwen3_moe",
        "cuda:0",
        "42.5 tok/s",
        "12 in (8 cached) / 40 out",
        "sparsity 48%/50%",
        "GPU 7.2G",
        "cache 90%",
        "host→GPU 673 MB/tok",
    ]
    lines = wrap_parts(parts, 78)
    assert all(len(line) <= 78 for line in lines) and len(lines) == 2
    assert " · ".join(lines) == " · ".join(parts)  # broken only between figures, nothing left out
    assert wrap_parts(parts, 30) == ["localmoe-test/tiny-qwen3_moe", "cuda:0 · 42.5 tok/s"]  # the least important go


@sync
async def test_layout_at_80x24_is_not_cut(long_engine, tmp_path):
    app = ChatApp(engine=long_engine, settings=LONG, db_path=db(tmp_path))
    async with app.run_test(size=SMALL) as pilot:
        await pilot.pause()
        rows = screen_text(app).splitlines()
        bar = app.query_one(StatusBar)
        shown = len(str(bar.render()).splitlines())
        assert len(rows) == 24 and rows[-1 - shown].strip() == INPUT_HINT  # the whole hint line
        assert " · ".join(row.strip() for row in rows[-shown:]) == bar.line  # the whole status, wrapped if need be
        assert "Type a message — Enter sends, /help lists commands" in rows[-2 - shown - 1]
        await type_and_send(pilot, "hello")
        await streaming(pilot, app)
        for n in range(1, 13):
            if n == 12:
                await type_and_send(pilot, f"queued {n}")
            elif n > 1:  # the message Enter posts: a key press waits twice for an idle process, which a streaming
                # reply never leaves (1 s each)
                app.query_one(ChatInput).post_message(ChatInput.Submitted(f"queued {n}"))
                await wait_for(pilot, lambda n=n: len(app.queue) == n - 1)
            assert len(hint(app)) <= 76, hint(app)  # 80 columns less the padding
        assert len(app.queue) == 11
        app.action_cancel_reply()
        await pilot.press("escape")
        await type_and_send(pilot, "/cancel")
        await wait_for(pilot, lambda: app.reply is None)
        await pilot.pause()
        text = str(bar.render())
        assert " · ".join(text.splitlines()) == bar.line  # every figure shown, on two lines at most
        assert all(len(line) <= 78 for line in text.splitlines()) and len(text.splitlines()) <= 2
        states = [app._state()]
        app.loading, app.queue = True, app.queue
        states.append(app._state())
        app.loading, app.load_error = False, "x"
        states.append(app._state())
        app.load_error = ""
        assert all(len(s) <= 76 for s in states), states


def test_snapshot_80x24_first_minute(snap_compare, hub_cache, tmp_path):
    """The chat at 80x24 after the model loaded (a fresh engine: no figures of an earlier reply), a setting changed
    and a message being typed."""
    app = ChatApp(engine=Engine.load(QWEN, device="cpu", sparsity=0.0), settings=SHORT, db_path=db(tmp_path))

    async def run_before(pilot):
        app.query_one(ChatInput).cursor_blink = False
        await type_and_send(pilot, "/temp 0.7")
        await pilot.press(*"What is a mixture of experts?")
        await pilot.pause()

    assert snap_compare(app, terminal_size=SMALL, run_before=run_before)
