"""Output safety of `localmoe chat` (issue #20): nothing shown carries control sequences it did not write itself.

Every widget is checked with model output, history, model folder names, errors, pastes and exports carrying escape
sequences or markup (the hostile tiny engine of chat_faults_support.py), in-process through Textual's pilot, and the
bytes the real `localmoe chat` writes to a pseudo-terminal.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from chat_faults_support import (
    CONTROL_CHARS,
    HOSTILE_NAME,
    OSC_TITLE,
    SETTINGS,
    ChatInPty,
    clean,
    db_path,
    exchange,
    make_hostile_dir,
    seed,
    status_text,
    tiny_engine,
)
from test_tui import SIZE, sync, type_and_send, wait_for
from textual.app import App, ComposeResult
from textual.widgets import Label, OptionList

from localmoe.engine.engine import Engine
from localmoe.tui.app import ChatApp
from localmoe.tui.history import HistoryStore
from localmoe.tui.widgets import ChatInput, LoadingView, MessageView


@pytest.fixture(scope="module")
def engine(hub_cache) -> Engine:
    return tiny_engine()


@pytest.fixture(scope="module")
def hostile_dir(src_dir, tmp_path_factory) -> Path:
    return make_hostile_dir(src_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def hostile_engine(hostile_dir) -> Engine:
    return Engine.load(str(hostile_dir), device="cpu", sparsity=0.0)


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
