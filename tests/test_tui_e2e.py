"""The chat app end to end with a real Engine on a tiny model: the reply streamed into the app is exactly what
the engine generates for the same conversation, and it is stored in the history database."""

from __future__ import annotations

import asyncio

from conftest import repo_id
from localmoe.engine import Engine
from localmoe.events import GenerationSettings
from localmoe.tui.history import HistoryStore
from test_tui import chat_exchange


def test_chat_with_real_tiny_model(tmp_path):
    engine = Engine.load(repo_id("qwen3_moe"), device="cpu", sparsity=0.5)
    db = tmp_path / "chats.sqlite3"
    reply, stats = asyncio.run(chat_exchange(engine, "hello experts", db))
    assert stats.generated_tokens > 0 and stats.sparsity_target == 0.5
    expected = "".join(ev.text for ev in engine.chat([{"role": "user", "content": "hello experts"}],
                                                     GenerationSettings()))
    assert reply.strip() == expected.strip()
    store = HistoryStore(db)
    msgs = store.messages(store.last_session().id)
    store.close()
    assert [m.role for m in msgs] == ["user", "assistant"] and msgs[0].content == "hello experts"
