"""Pilot tests of `localmoe chat` with a thinking model's reasoning (issue #27): a resumed reply's reasoning collapsed,
expandable, sent back to the template and exported apart; a live thinking line while it streams, then collapsed; a
thinking checkpoint's reasoning streamed apart and /think switching it; past reasoning reaching the template as
`reasoning_content`; `run` with a scripted thinking model.

Every app runs the real Engine on the tiny checkpoints of conftest (chat_pilot_support.py). Nothing here mocks the
loader or the model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from chat_pilot_support import LONG, QWEN, SHORT, SMALL, db, hint, long_copy, ready, screen_text
from test_tui import replies, sync, type_and_send, wait_for
from textual.app import App, ComposeResult
from textual.widgets import Markdown

from localmoe.engine.engine import Engine
from localmoe.events import GenerationSettings
from localmoe.tui.app import ChatApp
from localmoe.tui.history import HistoryStore
from localmoe.tui.reasoning_view import ReasoningHeader, ReasoningView
from localmoe.tui.widgets import ChatInput, MessageView


@pytest.fixture(scope="module")
def engine(hub_cache) -> Engine:
    return Engine.load(QWEN, device="cpu", sparsity=0.0)


# 7. reasoning -----------------------------------------------------------------------------------------------------

REASONING = "The user greets me.\n\nI should answer **briefly**:\n\n```\nhi\n"


def seed_reasoning(path: Path) -> int:
    store = HistoryStore(path)
    sid = store.new_session(QWEN)
    store.add_message(sid, "user", "hello")
    store.add_message(sid, "assistant", "Hello! How can I help?", "ok", reasoning=REASONING)
    store.close()
    return sid


@sync
async def test_resumed_reasoning_is_collapsed_expandable_sent_back_and_exported_apart(engine, tmp_path):
    seed_reasoning(db(tmp_path))
    app = ChatApp(engine=engine, settings=SHORT, db_path=db(tmp_path), continue_last=True)
    async with app.run_test(size=SMALL) as pilot:
        await pilot.pause()
        reply = replies(app)[-1]
        view = reply.query_one(ReasoningView)
        header = view.query_one(ReasoningHeader)
        assert view.collapsed and not view.query_one("Markdown").display
        assert str(header.render()) == "▶ Reasoning · 10 words"
        assert reply.markdown.source == "Hello! How can I help?"  # the answer alone is the reply
        await pilot.click(ReasoningHeader)
        assert not view.collapsed and view.query_one("Markdown").display
        assert str(header.render()).startswith("▼") and "briefly" in view.query_one("Markdown").source
        header.focus()
        await pilot.press("enter")
        assert view.collapsed
        assert app.context()[-1] == {
            "role": "assistant",
            "content": "Hello! How can I help?",
            "reasoning_content": REASONING,
        }
        app.query_one(ChatInput).focus()
        await type_and_send(pilot, f"/export {tmp_path / 'chat.md'}")
    exported = (tmp_path / "chat.md").read_text()
    assert (
        "## Assistant\n\n<details><summary>Reasoning</summary>\n\nThe user greets me.\n\nI should answer "
        "**briefly**:\n\n```\nhi\n```\n\n</details>\n\nHello! How can I help?"
    ) in exported


class _OneReply(App):
    def compose(self) -> ComposeResult:
        yield MessageView("assistant")


@sync
async def test_streaming_reasoning_shows_a_live_thinking_line_then_collapses():
    """The view a reply streams into: reasoning fragments make a collapsed block whose header counts the words as
    they come ("thinking… N words") above one live line with the newest text; the first answer fragment ends it
    ("Reasoning · N words", live line gone) and the answer is the reply's Markdown. Control sequences and markup
    in the reasoning are shown as text, never run."""
    app = _OneReply()
    async with app.run_test(size=SMALL) as pilot:
        view = app.query_one(MessageView)
        view.start_stream()
        for fragment in ["Let me ", "think [b]hard[/b]\x1b]0;x\x07.\n", "Second line ", "of thought"]:
            await view.write_reasoning(fragment)
        await pilot.pause()
        block = view.query_one(ReasoningView)
        header, live = block.query_one(ReasoningHeader), block.query_one("#live")
        assert block.streaming and block.collapsed and live.display
        assert str(header.render()) == "▶ thinking… 8 words"
        assert str(live.render()) == "Second line of thought"
        assert "thinking" in screen_text(app) and "Second line of thought" in screen_text(app)
        await pilot.click(ReasoningHeader)  # expanded while it streams: the body follows it
        await view.write_reasoning(" still")
        assert "think [b]hard[/b]." in block.query_one(Markdown).source and "still" in block.query_one(Markdown).source
        await pilot.click(ReasoningHeader)
        await view.write("The answer")
        await view.write(" is 4.")
        await view.finish("ok")
        await pilot.pause()
        assert not block.streaming and not live.display and block.collapsed
        assert str(header.render()) == "▶ Reasoning · 9 words"
        assert view.markdown.source == "The answer is 4." and view.content == "The answer is 4."
        assert view.reasoning == "Let me think [b]hard[/b]\x1b]0;x\x07.\nSecond line of thought still"  # exact text
        assert "\x1b" not in screen_text(app)


# A thinking model on the real engine: the tiny Qwen3-MoE with a Qwen3-style template whose `enable_thinking`
# switch opens a reasoning block in the generation prompt (on, the default) or closes an empty one (off). The
# random model never closes the block itself, so with thinking on its whole reply is reasoning, and off all answer.
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and m.reasoning_content is defined and m.reasoning_content %}"
    "<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def think_engine(src_dir, tmp_path_factory) -> Engine:
    import json

    folder = long_copy(src_dir / "qwen3_moe", tmp_path_factory.mktemp("think") / "tiny-think")
    (folder / "chat_template.jinja").write_text(THINK_TEMPLATE)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    engine = Engine.load(str(folder), device="cpu", sparsity=0.0)
    if not getattr(engine, "supports_thinking", False):
        pytest.skip("this engine has no thinking switch yet (Engine.supports_thinking)")
    return engine


def direct(engine: Engine, messages: list[dict], settings: GenerationSettings, think: bool | None):
    """(reasoning, answer) the engine streams for `messages`, outside the app."""
    from localmoe.tui import prompts

    parts = {"reasoning": "", "answer": ""}
    for ev in prompts.chat(engine, messages, settings, think):
        parts[getattr(ev, "channel", "answer")] += ev.text
    return parts["reasoning"], parts["answer"]


@sync
async def test_thinking_model_reasoning_streams_apart_and_think_switches_it(think_engine, tmp_path):
    engine = think_engine
    app = ChatApp(engine=engine, settings=LONG, db_path=db(tmp_path))
    async with app.run_test(size=SMALL) as pilot:
        await pilot.pause()
        assert (
            "It can think before it answers (thinking by default; `/think on|off`)"
            in app.query(MessageView).first().markdown.source
        )
        await type_and_send(pilot, "hello")
        await wait_for(pilot, lambda: app.reply is not None and len(app.reply.view.reasoning) > 3, 60)
        assert "thinking…" in hint(app) and app.reply.view.content == ""
        block = app.reply.view.query_one(ReasoningView)
        assert block.streaming and block.collapsed and "thinking…" in str(block.query_one(ReasoningHeader).render())
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.reply is None)
        cancelled = app.turns[-1]
        assert cancelled.status == "cancelled" and cancelled.reasoning and not block.streaming
        await type_and_send(pilot, "/new")
        app.settings = SHORT
        await type_and_send(pilot, "hello")
        await wait_for(pilot, lambda: app.reply is None and len(app.turns) == 2, 60)
        thought = app.turns[-1]
        assert thought.status == "ok" and thought.reasoning and thought.content == ""
        header = str(thought.view.query_one(ReasoningHeader).render())
        assert header.startswith("▶ Reasoning · ")
        assert app.context() == [{"role": "user", "content": "hello"}]  # a reply with no answer is not sent back
        await type_and_send(pilot, "/think")
        assert app.event_lines[-1] == "Thinking: the model's default. /think on|off changes it."
        await type_and_send(pilot, "/think off")
        assert app.think is False and app.event_lines[-1].startswith("Thinking off")
        await type_and_send(pilot, "hello again")
        await wait_for(pilot, lambda: app.reply is None and len(app.turns) == 4, 60)
        plain_reply = app.turns[-1]
        assert plain_reply.content and not plain_reply.reasoning and not plain_reply.view.query(ReasoningView)
        await type_and_send(pilot, "/help")
        assert "`/think [on|off]`" in app.query(MessageView).last().markdown.source
        await type_and_send(pilot, "/stats")
        assert "- Thinking: **off**" in app.query(MessageView).last().markdown.source
        await type_and_send(pilot, f"/export {tmp_path / 'think.md'}")
        session = app.session_id
    # what the app showed is what the engine streams on each channel for the same prompts
    assert direct(engine, [{"role": "user", "content": "hello"}], SHORT, None) == (thought.reasoning, "")
    second = [{"role": "user", "content": "hello"}, {"role": "user", "content": "hello again"}]
    assert direct(engine, second, SHORT, False) == ("", plain_reply.content)  # thinking off: all answer
    store = HistoryStore(db(tmp_path))
    rows = [(m.role, m.reasoning) for m in store.messages(session)]
    store.close()
    assert rows[1] == ("assistant", thought.reasoning) and rows[3] == ("assistant", None)
    exported = (tmp_path / "think.md").read_text()
    assert "<details><summary>Reasoning</summary>" in exported and exported.count("<details>") == 1


@sync
async def test_past_reasoning_reaches_the_template_as_reasoning_content(think_engine, tmp_path):
    seed_reasoning(db(tmp_path))
    app = ChatApp(engine=think_engine, settings=SHORT, db_path=db(tmp_path), continue_last=True)
    async with app.run_test(size=SMALL) as pilot:
        await pilot.pause()
        sent = [*app.context(), {"role": "user", "content": "and then?"}]
        await type_and_send(pilot, "and then?")
        await wait_for(pilot, lambda: app.reply is None and len(app.turns) == 4, 60)
        assert app.turns[-1].status == "ok"
    assert sent[1] == {"role": "assistant", "content": "Hello! How can I help?", "reasoning_content": REASONING}
    prompt = think_engine.tokenizer.decode(think_engine.encode_chat(sent))
    at = [
        prompt.index(part)
        for part in (
            "<think>",
            "The user greets me.",
            "I should answer **briefly**:",
            "</think>",
            "Hello! How can I help?",
            "and then?",
        )
    ]
    assert at == sorted(at)  # the template put the past reasoning in its block, before that reply's answer


@sync
async def test_scripted_thinking_model_reasoning_and_answer_in_one_reply(hub_cache, tmp_path):
    """tiny_models' tiny-think (a reply scripted through its weights: "<think>Why?</think>\\n\\nOK" with thinking on,
    "OK" with it off), loaded through the loader callback: the reasoning and the answer of one reply go apart, in
    the view, the history, the next prompt and the export."""
    import tiny_models

    repo = getattr(tiny_models, "THINK_REPO", None)
    if repo is None:
        pytest.skip("tests/tiny_models.py has no thinking checkpoint yet")
    app = ChatApp(
        load=lambda progress, model=None: Engine.load(model or repo, device="cpu", progress=progress),
        model_label="tiny-think",
        settings=GenerationSettings(max_new_tokens=16),
        db_path=db(tmp_path),
    )
    async with app.run_test(size=SMALL) as pilot:
        await ready(pilot, app)
        if hasattr(app.engine, "default_settings"):  # the checkpoint's sampling (Qwen3's), under what was given
            s = app.settings
            assert (s.temperature, s.top_k, s.top_p, s.max_new_tokens) == (0.6, 20, 0.95, 16)
        if getattr(app.engine, "plan_line", ""):  # the load's notes, the VRAM plan first, in the conversation
            assert app.event_lines[0] == app.engine.plan_line
        await type_and_send(pilot, "hi")
        await wait_for(pilot, lambda: app.reply is None and len(app.turns) == 2, 60)
        reply = app.turns[-1]
        assert (reply.status, reply.reasoning, reply.content) == (
            "ok",
            tiny_models.THINK_REASONING,
            tiny_models.THINK_ANSWER,
        )
        assert reply.view.markdown.source == "OK"
        assert str(reply.view.query_one(ReasoningHeader).render()) == "▶ Reasoning · 1 word"
        assert app.context()[-1] == {"role": "assistant", "content": "OK", "reasoning_content": "Why?"}
        await type_and_send(pilot, "/think off")
        await type_and_send(pilot, "again")
        await wait_for(pilot, lambda: app.reply is None and len(app.turns) == 4, 60)
        assert (app.turns[-1].reasoning, app.turns[-1].content) == ("", "OK")
        assert not app.turns[-1].view.query(ReasoningView)
        await type_and_send(pilot, f"/export {tmp_path / 'think.md'}")
        session = app.session_id
    store = HistoryStore(db(tmp_path))
    assert [(m.content, m.reasoning) for m in store.messages(session)] == [
        ("hi", None),
        ("OK", "Why?"),
        ("again", None),
        ("OK", None),
    ]
    store.close()
    exported = (tmp_path / "think.md").read_text()
    assert "## Assistant\n\n<details><summary>Reasoning</summary>\n\nWhy?\n\n</details>\n\nOK\n" in exported
