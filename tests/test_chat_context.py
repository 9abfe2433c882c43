"""Conversations longer than the model's context in `localmoe chat` (issue #20): the oldest turns are left out of the
prompt (prompts.fit_to_context), and fit_to_context's cases.
"""

from __future__ import annotations

import pytest
from chat_faults_support import (
    SETTINGS,
    db_path,
    exchange,
    seed,
    tiny_engine,
)
from test_tui import SIZE, sync

from localmoe.engine.engine import Engine
from localmoe.tui.app import ChatApp, context_limit, fit_to_context


@pytest.fixture(scope="module")
def engine(hub_cache) -> Engine:
    return tiny_engine()


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
