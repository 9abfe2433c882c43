"""The chat app end to end with a real Engine on a tiny model: the reply streamed into the app is exactly what
the engine generates for the same conversation, and it is stored in the history database."""

from __future__ import annotations

import asyncio

from conftest import repo_id
from test_tui import chat_exchange

from localmoe.engine.engine import Engine
from localmoe.events import GenerationSettings
from localmoe.tui.history import HistoryStore


def test_chat_with_real_tiny_model(tmp_path):
    engine = Engine.load(repo_id("qwen3_moe"), device="cpu", sparsity=0.5)
    db = tmp_path / "chats.sqlite3"
    reply, stats = asyncio.run(chat_exchange(engine, "hello experts", db))
    assert stats.generated_tokens > 0 and stats.sparsity_target == 0.5
    expected = "".join(
        ev.text for ev in engine.chat([{"role": "user", "content": "hello experts"}], GenerationSettings())
    )
    assert reply.strip() == expected.strip()
    store = HistoryStore(db)
    msgs = store.messages(store.last_session().id)
    store.close()
    assert [m.role for m in msgs] == ["user", "assistant"] and msgs[0].content == "hello experts"


def test_second_turn_prefills_only_the_new_message(tmp_path):
    """While the user types, the app lets the engine take the reply into its cache: the second turn's prompt is all
    cached but its new message, and the reply is what prefilling the whole conversation gives."""
    from test_tui import SIZE, replies, type_and_send, wait_for

    from localmoe.tui.app import ChatApp

    engine = Engine.load(repo_id("qwen3_5_moe"), device="cpu", sparsity=0.0)

    async def two_turns():
        app = ChatApp(engine=engine, db_path=tmp_path / "chats.sqlite3")
        async with app.run_test(size=SIZE) as pilot:
            await type_and_send(pilot, "hello experts")
            await wait_for(pilot, lambda: app.reply is None and replies(app), 120.0)
            first = replies(app)[-1].content
            # the app's prepare_next_turn (its decode thread, after the reply) has kept the conversation with it
            await wait_for(pilot, lambda: len(engine._eager_reuse.tokens) > engine.stats.prompt_tokens, 120.0)
            await type_and_send(pilot, "and sparsity?")
            await wait_for(pilot, lambda: app.reply is None and len(replies(app)) == 2, 120.0)
            return first, replies(app)[-1].content, engine.stats

    first, second, stats = asyncio.run(two_turns())
    assert stats.prompt_tokens - stats.reused_prompt_tokens < len("and sparsity?") + 16
    fresh = Engine.load(repo_id("qwen3_5_moe"), device="cpu", sparsity=0.0)
    msgs = [
        {"role": "user", "content": "hello experts"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "and sparsity?"},
    ]
    assert second.strip() == "".join(ev.text for ev in fresh.chat(msgs, GenerationSettings())).strip()
