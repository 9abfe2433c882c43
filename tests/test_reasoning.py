"""Thinking models: the streaming `<think>…</think>` splitter (reasoning.py), the engine's channels and thinking
switch on `localmoe-test/tiny-think` (Qwen3's template shape, a scripted reply: tiny_models.THINK_SCRIPT), prompt
reuse across turns that carry reasoning, and `run`'s --show-reasoning / --think / --json.

Choices where the issue was silent: only a block that opens the reply counts as reasoning (a `<think>` later in an
answer is text); newlines are trimmed as Qwen3's template trims a past turn's reasoning_content and content; a
reasoning block cut off (length, cancel) stays reasoning; `--show-reasoning` writes to stderr (dimmed and marked
with a bar on a terminal, exact elsewhere), and without it the stats line says how many reasoning tokens were left
out; `--think` on a model without the switch is a note, not an error; `--raw --think` is refused.
"""

from __future__ import annotations

import json

import pytest
import tiny_models
from cli_support import on_terminal
from conftest import repo_id

from localmoe.cli.main import main
from localmoe.engine.engine import Engine
from localmoe.engine.reasoning import ReasoningSplitter, opens_reasoning, split
from localmoe.events import GenerationSettings

THINK = tiny_models.THINK_REPO

SPLIT_CASES = [  # (id, reply text, starts inside the block, reasoning, answer)
    ("qwen3", "<think>\nWhy?\n</think>\n\nOK", False, "Why?", "OK"),
    ("no-block", "Just an answer.\n\nTwo paragraphs.", False, "", "Just an answer.\n\nTwo paragraphs."),
    ("whitespace-before-block", "\n <think>a</think>b", False, "a", "b"),
    ("opened-in-prompt", "\nr1\nr2\n</think>\n\nans", True, "r1\nr2", "ans"),
    ("empty-block", "<think>\n\n</think>\n\nOK", False, "", "OK"),
    ("cut-off-in-reasoning", "<think>still thinking\n", False, "still thinking", ""),
    ("partial-close-at-end", "<think>x</thi", False, "x</thi", ""),
    (
        "think-later-is-text",
        "Answer <think>not reasoning</think> end",
        False,
        "",
        "Answer <think>not reasoning</think> end",
    ),
    ("tag-like-start", "<thinking about it", False, "", "<thinking about it"),
    ("lone-angle", "<", False, "", "<"),
    ("leading-spaces-kept", "  hi", False, "", "  hi"),
    ("newlines-inside-kept", "<think>a\n\nb</think>c\n\nd", False, "a\n\nb", "c\n\nd"),
    ("newlines-before-close-then-more", "<think>a\n\nb\n</think>\nc", False, "a\n\nb", "c"),
    ("second-close-is-text", "<think>a</think>b</think>c", False, "a", "b</think>c"),
    ("empty", "", False, "", ""),
]


@pytest.mark.parametrize(
    ("text", "inside", "reasoning", "answer"), [c[1:] for c in SPLIT_CASES], ids=[c[0] for c in SPLIT_CASES]
)
@pytest.mark.parametrize("piece", [0, 1, 3], ids=["whole", "by-char", "by-3"])
def test_splitter(text, inside, reasoning, answer, piece):
    """The same split whether the text comes whole, one character at a time (tags split across pieces) or in
    threes."""
    s = ReasoningSplitter(in_reasoning=inside)
    pieces = [text] if piece == 0 else [text[i : i + piece] for i in range(0, len(text), piece)]
    parts = [p for chunk in pieces for p in s.push(chunk)] + s.flush()
    assert all(t for _, t in parts)  # no empty pieces
    got = ("".join(t for c, t in parts if c == "reasoning"), "".join(t for c, t in parts if c == "answer"))
    assert got == (reasoning, answer)
    assert split(text, inside) == (reasoning, answer)


@pytest.mark.parametrize(
    ("prompt_end", "opens"),
    [
        ("<|im_start|>assistant\n", False),
        ("<|im_start|>assistant\n<think>\n", True),
        ("assistant\n<think>\n\n</think>\n\n", False),
        ("<think>a</think> user text <think>", True),
        ("", False),
    ],
    ids=["header", "opened", "closed-empty", "reopened", "nothing"],
)
def test_opens_reasoning(prompt_end, opens):
    assert opens_reasoning(prompt_end) is opens


@pytest.fixture(scope="module")
def think(hub_cache):
    return Engine.load(THINK, device="cpu", sparsity=0.0)


def _reply(engine, messages, think=None, settings=None):
    evs = list(engine.chat(messages, settings or engine.default_settings(), think=think))
    return evs, (
        "".join(e.text for e in evs if e.channel == "reasoning"),
        "".join(e.text for e in evs if e.channel == "answer"),
    )


HI = [{"role": "user", "content": "hi"}]
REPLY_CASES = [  # (id, think, reasoning, answer, tokens)
    ("template-default-thinks", None, tiny_models.THINK_REASONING, tiny_models.THINK_ANSWER, 9),
    ("think-on", True, tiny_models.THINK_REASONING, tiny_models.THINK_ANSWER, 9),
    ("think-off", False, "", tiny_models.THINK_ANSWER, 2),
]


@pytest.mark.parametrize(
    ("switch", "reasoning", "answer", "tokens"), [c[1:] for c in REPLY_CASES], ids=[c[0] for c in REPLY_CASES]
)
def test_engine_channels(think, switch, reasoning, answer, tokens):
    """The reply's events by channel, the tags never in the text, every token (its id, its index) in the events;
    the checkpoint's sampling defaults (Qwen3's) give the scripted reply too."""
    assert think.supports_thinking and think.default_settings().temperature == 0.6
    evs, got = _reply(think, HI, switch)
    assert got == (reasoning, answer) and think.stats.finish_reason == "stop"
    assert sorted({e.index for e in evs}) == list(range(tokens)) == list(range(think.stats.generated_tokens))
    assert not any("think>" in e.text for e in evs)
    ids = [next(e.token_id for e in evs if e.index == i) for i in range(tokens)]
    assert think.tokenizer.decode(ids) == ("<think>Why?</think>\n\nOK" if reasoning else "OK")
    if reasoning:
        first = [e for e in evs if e.index == 0]
        assert [(e.channel, e.text) for e in first] == [("reasoning", "")]  # <think>: thinking from the first token


def test_template_that_opens_the_block(think):
    """A template whose generation prompt ends inside `<think>` (Qwen3.5's, when thinking): the reply starts as
    reasoning."""
    original = think.tokenizer.chat_template
    think.tokenizer.chat_template = original.replace(
        "{{ '<|im_start|>assistant\\n' }}", "{{ '<|im_start|>assistant\\n<think>' }}"
    )
    try:
        assert think.tokenizer.decode(think.encode_chat(HI)).endswith("assistant\n<think>")
        evs, got = _reply(think, HI, settings=GenerationSettings())
    finally:
        think.tokenizer.chat_template = original
    assert got == (tiny_models.THINK_REASONING, tiny_models.THINK_ANSWER) and evs[0].channel == "reasoning"


def test_think_switch_reaches_the_template(think, hub_cache):
    on, off = think.encode_chat(HI, think=True), think.encode_chat(HI, think=False)
    assert think.tokenizer.decode(off).endswith("<think>\n\n</think>\n\n") and off[: len(on)] == on
    assert think.encode_chat(HI) == on  # the template's default: thinking
    plain = Engine.load(repo_id("qwen3_moe"), device="cpu", sparsity=0.0)
    assert not plain.supports_thinking and plain.reasoning_tags is None
    assert plain.encode_chat(HI, think=False) == plain.encode_chat(HI)  # no switch: ignored


@pytest.mark.parametrize("switch", [None, False], ids=["thinking", "not-thinking"])
@pytest.mark.parametrize("prepare", [False, True], ids=["turns", "prepared"])
def test_turns_with_reasoning_reuse_the_prompt(think, switch, prepare):
    """Past reasoning goes back as reasoning_content and the template renders it as it wants (Qwen3's: not for
    turns before the last user message); a turn reuses the cache the turn before left (or prepare_next_turn made),
    with the tokens of prefilling every turn whole."""

    def conversation():
        msgs, out = list(HI), []
        for text in ("more", "again"):
            evs, (reasoning, answer) = _reply(think, msgs, switch)
            out.append(([e.token_id for e in evs], think.stats.reused_prompt_tokens))
            reply = {"role": "assistant", "content": answer}
            if reasoning:
                reply["reasoning_content"] = reasoning
            msgs = msgs + [reply]
            if prepare:
                think.prepare_next_turn(msgs, think=switch)
            msgs = msgs + [{"role": "user", "content": text}]
        return out

    think.reuse_prompts = True
    with_reuse = conversation()
    think.reuse_prompts = False
    try:
        whole = conversation()
    finally:
        think.reuse_prompts = True
    assert [t for t, _ in with_reuse] == [t for t, _ in whole]
    assert with_reuse[1][1] > 0 and all(r == 0 for _, r in whole)


# -- run -------------------------------------------------------------------------------------------------------
def _run(capsys, *argv):
    code = main(list(argv))
    cap = capsys.readouterr()
    return code, cap.out, cap.err


RUN_CASES = [  # (id, extra argv, stdout, what stderr starts with, in the stats line)
    ("answer-only", [], "OK\n", "[localmoe-test/tiny-think on cpu]", "reasoning 5 tok not shown"),
    ("show-reasoning-piped", ["--show-reasoning"], "OK\n", "Why?\n[localmoe-test/tiny-think", "decode"),
    ("no-think", ["--no-think"], "OK\n", "[localmoe-test/tiny-think on cpu]", "decode"),
    ("think", ["--think", "--temperature", "0"], "OK\n", "[localmoe-test/tiny-think on cpu]", "not shown"),
]


@pytest.mark.parametrize(
    ("extra", "out", "err_start", "stats"), [c[1:] for c in RUN_CASES], ids=[c[0] for c in RUN_CASES]
)
def test_run_prints_the_answer(capsys, extra, out, err_start, stats):
    code, got, err = _run(capsys, "run", THINK, "hi", *extra)
    assert code == 0 and got == out and err.startswith(err_start) and stats in err.splitlines()[-1]
    assert ("not shown" in err) == (stats == "reasoning 5 tok not shown" or "not shown" == stats)


@pytest.mark.parametrize(
    ("extra", "text", "reasoning", "tokens"),
    [([], "OK", "Why?", 9), (["--no-think"], "OK", "", 2), (["--show-reasoning"], "OK", "Why?", 9)],
    ids=["thinking", "no-think", "show-reasoning-ignored"],
)
def test_run_json_carries_both(capsys, extra, text, reasoning, tokens):
    code, out, err = _run(capsys, "run", THINK, "hi", "--json", *extra)
    obj = json.loads(out)
    assert code == 0 and err == "" and (obj["text"], obj["reasoning"]) == (text, reasoning)
    assert len(obj["token_ids"]) == tokens == obj["stats"]["generated_tokens"]


def test_show_reasoning_on_a_terminal():
    """On a terminal the reasoning is dimmed, each line marked, and ended by a newline before the answer."""
    code, seen = on_terminal(["run", THINK, "hi", "--show-reasoning", "--quiet"])
    text = seen.decode()
    assert code == 0 and "\x1b[2m\u2502 Why?\x1b[22m\r\nOK\r\n" in text


def test_think_flag_notes(capsys):
    code, out, err = _run(capsys, "run", repo_id("qwen3_moe"), "hi", "--think", "--max-new-tokens", "2")
    assert code == 0 and err.startswith(
        "localmoe: note: localmoe-test/tiny-qwen3_moe's chat template has no thinking switch: --think does nothing"
    )
    code, out, err = _run(capsys, "run", THINK, "hi", "--raw", "--no-think")
    assert code == 2 and "--raw sends the prompt without the chat template, which is what --no-think sets" in err
