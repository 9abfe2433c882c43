"""GPT-OSS's harmony chat format (issue #25): the streaming splitter (reasoning.HarmonySplitter), harmony found from the
tokenizer (prompts.harmony), the message markers kept by the detokenizer, `<|return|>` / `<|call|>` ending the
reply, and the scripted tiny harmony model (tests/tiny_harmony.py: gpt-oss's template, a reply with an analysis and
a final message) end to end through the engine, `run` and the chat app, whose history goes back to the template.

Choices where the issue was silent: the splitter reads the text decoded WITH special tokens (markers in order with
the text: stop strings and held-back bytes never move text across a marker); `final` is the answer, `analysis`,
`commentary` (tool calls are not wired) and unknown channels are reasoning, a message with no channel is answer; a
reply that begins with text that cannot be a header (no markers at all) is all answer, exactly as given; a header
cut off at the length limit is dropped; markup tokens count as reasoning tokens ("not shown") until a final
message's channel is named.
"""

from __future__ import annotations

import json
import shutil

import pytest
import tiny_harmony
import tiny_models
from conftest import repo_id
from test_tui import replies, sync, type_and_send, wait_for

from localmoe.cli.main import main
from localmoe.engine import prompts
from localmoe.engine.detokenize import Detokenizer
from localmoe.engine.engine import Engine
from localmoe.engine.generate import ReplyText
from localmoe.engine.reasoning import HarmonySplitter, split_harmony
from localmoe.errors import UsageError
from localmoe.events import GenerationSettings
from localmoe.tui.app import ChatApp
from localmoe.tui.history import HistoryStore
from localmoe.tui.reasoning_view import ReasoningHeader, ReasoningView

REPO = tiny_harmony.HARMONY_REPO
GEN = "<|start|>assistant"  # the generation prompt's end
A, F = "<|channel|>analysis<|message|>", "<|start|>assistant<|channel|>final<|message|>"
SPLIT_CASES = [  # (id, prompt tail, reply text, reasoning, answer)
    ("analysis-then-final", GEN, A + "Why?<|end|>" + F + "OK", "Why?", "OK"),
    ("final-only", GEN, "<|channel|>final<|message|>Just this.", "", "Just this."),
    ("missing-final", GEN, A + "only thoughts<|end|>", "only thoughts", ""),
    ("cut-in-analysis", GEN, A + "still thinking\n", "still thinking\n", ""),
    ("cut-in-final-header", GEN, A + "a<|end|><|start|>assistant<|channel|>fin", "a", ""),
    ("no-markers", GEN, "Just an answer.\n\nTwo paragraphs.", "", "Just an answer.\n\nTwo paragraphs."),
    ("lone-angle", GEN, "<", "", "<"),
    ("text-then-markers", GEN, "Hi <|channel|>x", "", "Hi <|channel|>x"),
    ("marker-like-text-in-body", GEN, "<|channel|>final<|message|>a <|b|> c", "", "a <|b|> c"),
    ("exact-whitespace", GEN, A + "\n r \n<|end|>" + F + "\n\n a \n", "\n r \n", "\n\n a \n"),
    (
        "commentary-tool-call",
        GEN,
        A + "t<|end|><|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}",
        "t{}",
        "",
    ),
    ("recipient-in-role", GEN, " to=functions.f<|channel|>commentary json<|message|>{}", "{}", ""),
    ("no-channel", GEN, "<|message|>plain message<|end|>", "", "plain message"),
    ("stray-text-after-end", GEN, A + "r<|end|> tail", "r", " tail"),
    ("prompt-opens-analysis", GEN + A, "r<|end|>" + F + "a", "r", "a"),
    ("prompt-ends-at-start", "<|start|>", "assistant<|channel|>final<|message|>a", "", "a"),
    ("plain-reply-like-a-role", GEN, "as I said", "", "as I said"),
    ("prompt-without-markers", "hello", "<|start|>assistant<|channel|>final<|message|>a", "", "a"),
    ("raw-prompt-plain-reply", "hello", " world\n\n!", "", " world\n\n!"),
]


@pytest.mark.parametrize(
    ("tail", "text", "reasoning", "answer"), [c[1:] for c in SPLIT_CASES], ids=[c[0] for c in SPLIT_CASES]
)
def test_splitter(tail, text, reasoning, answer):
    """The same split whether the reply comes whole or one character at a time (markers split across pieces)."""
    for piece in (len(text) or 1, 1):
        s = HarmonySplitter.after(tail)
        parts = [p for i in range(0, len(text), piece) for p in s.push(text[i : i + piece])] + s.flush()
        assert all(t for _, t in parts)
        got = ("".join(t for c, t in parts if c == "reasoning"), "".join(t for c, t in parts if c == "answer"))
        assert got == (reasoning, answer), piece
    assert split_harmony(text, tail) == (reasoning, answer)


def test_harmony_is_found_from_the_tokenizer():
    """From the tokenizer's <|channel|> and <|message|> tokens, whatever the model is called; its stop tokens; the
    detokenizer keeps the markers only when asked (skipping special tokens loses them)."""
    tok = tiny_harmony.harmony_tokenizer()
    assert prompts.harmony(tok) and prompts.thinking(tok) == (False, prompts.HARMONY)
    assert prompts.stop_ids(tok) == {tok.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")}
    for other in (tiny_models.char_tokenizer(), tiny_models.think_tokenizer(), None):
        assert not prompts.harmony(other) and prompts.stop_ids(other) == set()
    assert prompts.thinking(tiny_models.think_tokenizer())[1] == ("<think>", "</think>")
    ids = tok(A + "Why?<|end|>" + F + "OK", add_special_tokens=False)["input_ids"]
    ids[3:3] = [tok.convert_tokens_to_ids("<|startoftext|>")]  # a special token that is no marker: skipped
    for keep, want in (
        (set(), "analysisWhy?assistantfinalOK"),
        (prompts.marker_ids(tok), A + "Why?<|end|>" + F + "OK"),
    ):
        d = Detokenizer(tok, keep=keep)
        assert "".join(d.push(i) for i in ids) == want
    # the engine's text path on token ids: a stop string inside the final message ends it, the analysis intact
    text = ReplyText(tok, ["K"], HarmonySplitter.after(GEN))
    events = [e for i, t in enumerate(ids) for e in text.events(text.push(t), t, i)]
    events += text.flush(ids[-1], len(ids) - 1)
    assert text.stopped and [(e.channel, e.text) for e in events if e.text] == [
        ("reasoning", "W"),
        ("reasoning", "h"),
        ("reasoning", "y"),
        ("reasoning", "?"),
        ("answer", "O"),
    ]


@pytest.fixture(scope="module")
def harmony(hub_cache, tmp_path_factory) -> Engine:
    folder = tiny_harmony.save_harmony_checkpoint(tmp_path_factory.mktemp("harmony") / "tiny-harmony")
    tiny_models.place_in_hf_cache(folder, hub_cache, REPO)
    return Engine.load(REPO, device="cpu", sparsity=0.0)


HI = [{"role": "user", "content": "hi"}]


def _split(events) -> tuple[str, str]:
    return (
        "".join(e.text for e in events if e.channel == "reasoning"),
        "".join(e.text for e in events if e.channel == "answer"),
    )


def test_engine_channels_and_stop_tokens(harmony):
    """The reply by channel, no marker in any text, every token in the events; <|return|> ends it (the tiny
    generation_config leaves <|call|> out: harmony's stops are the engine's own too); a raw reply keeps its markers."""
    tok = harmony.tokenizer
    assert harmony.reasoning_tags == prompts.HARMONY and not harmony.supports_thinking
    assert prompts.stop_ids(tok) <= harmony.eos_ids
    prompt = harmony.encode_chat(HI)
    assert tok.decode(prompt, skip_special_tokens=False).endswith("<|start|>user<|message|>hi<|end|><|start|>assistant")
    events = list(harmony.generate(prompt, GenerationSettings()))
    reply = tiny_harmony.HARMONY_REPLY.removesuffix("<|return|>")
    n = len(tok(reply, add_special_tokens=False)["input_ids"])
    assert _split(events) == ("Why?", "OK") and harmony.stats.finish_reason == "stop"
    assert sorted({e.index for e in events}) == list(range(n)) == list(range(harmony.stats.generated_tokens))
    assert not any("<|" in e.text or "analysis" in e.text for e in events)
    raw = list(harmony.generate(prompt, GenerationSettings(), split_reasoning=False))
    assert "".join(e.text for e in raw) == reply and {e.channel for e in raw} == {"answer"}
    cut = list(harmony.generate(prompt, GenerationSettings(max_new_tokens=6)))  # cut inside the analysis
    assert _split(cut) == ("Why", "") and harmony.stats.finish_reason == "length"


def _run(capsys, *argv):
    code = main(list(argv))
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_run_prints_the_final_answer(harmony, capsys):
    """`run` prints the final answer alone; --show-reasoning adds the analysis on stderr; --json carries both."""
    code, out, err = _run(capsys, "run", REPO, "hi")
    assert code == 0 and out == "OK\n" and "reasoning 11 tok not shown (--show-reasoning)" in err.splitlines()[-1]
    code, out, err = _run(capsys, "run", REPO, "hi", "--show-reasoning")
    assert code == 0 and out == "OK\n" and err.startswith("Why?\n[localmoe-test/tiny-harmony on cpu]")
    code, out, err = _run(capsys, "run", REPO, "hi", "--json", "--show-reasoning")
    obj = json.loads(out)
    assert code == 0 and err == "" and (obj["text"], obj["reasoning"]) == ("OK", "Why?")
    assert len(obj["token_ids"]) == 15 == obj["stats"]["generated_tokens"]


@sync
async def test_chat_shows_the_analysis_collapsed_and_sends_back_the_final(harmony, tmp_path):
    """The chat app on the harmony model: the analysis is a collapsed reasoning block, the final answer the reply,
    both stored apart; the next turn's prompt has the past reply as its final message only (the template drops old
    analysis), the cache the app prepared between turns is reused, and the reply is the same again."""
    db = tmp_path / "chats.sqlite3"
    app = ChatApp(engine=harmony, db_path=db, settings=GenerationSettings(max_new_tokens=40))
    async with app.run_test(size=(100, 30)) as pilot:
        for n, text in enumerate(("hi", "more"), start=1):
            await type_and_send(pilot, text)
            await wait_for(pilot, lambda n=n: app.reply is None and len(app.turns) == 2 * n, 30)
            view = replies(app)[-1]
            block = view.query_one(ReasoningView)
            assert (view.content, view.reasoning) == ("OK", "Why?") and view.markdown.source == "OK"
            assert block.collapsed and not block.streaming
            assert str(block.query_one(ReasoningHeader).render()) == "▶ Reasoning · 1 word"
        context = app.context()
        assert harmony.stats.reused_prompt_tokens > 0
    assert context[1] == {"role": "assistant", "content": "OK", "reasoning_content": "Why?"}
    rendered = harmony.tokenizer.decode(harmony.encode_chat(context[:3]), skip_special_tokens=False)
    assert (
        rendered.endswith(
            "<|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>final<|message|>OK<|end|>"
            "<|start|>user<|message|>more<|end|><|start|>assistant"
        )
        and "Why?" not in rendered
    )
    store = HistoryStore(db)
    msgs = store.messages(store.last_session().id)
    store.close()
    assert [(m.role, m.content, m.reasoning) for m in msgs] == [
        ("user", "hi", None),
        ("assistant", "OK", "Why?"),
        ("user", "more", None),
        ("assistant", "OK", "Why?"),
    ]


@pytest.fixture(scope="module")
def gpt_oss(src_dir, hub_cache, tmp_path_factory) -> Engine:
    """The tiny random GPT-OSS of conftest with the harmony tokenizer and template in place of its own."""
    folder = tmp_path_factory.mktemp("gpt-oss-harmony") / "tiny-gpt_oss-harmony"
    shutil.copytree(src_dir / "gpt_oss", folder)
    for f in folder.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            f.unlink()
    tiny_harmony.harmony_tokenizer().save_pretrained(folder)
    tiny_models.place_in_hf_cache(folder, hub_cache, f"{tiny_models.ORG}/tiny-gpt_oss-harmony")
    return Engine.load(f"{tiny_models.ORG}/tiny-gpt_oss-harmony", device="cpu", sparsity=0.0)


def test_random_gpt_oss_streams_what_its_whole_reply_splits_into(gpt_oss):
    """GPT-OSS itself (random weights) on a prompt that opens the analysis: whatever markers its tokens make, the
    channels streamed are the whole raw reply split at once, and no split text carries a marker."""
    tail = "<|start|>assistant" + A
    prompt = gpt_oss.encode_chat(HI)[:-1] + gpt_oss.encode_raw(tail)
    settings = GenerationSettings(max_new_tokens=24)
    events = list(gpt_oss.generate(prompt, settings))
    raw = "".join(e.text for e in gpt_oss.generate(prompt, settings, split_reasoning=False))
    assert gpt_oss.stats.generated_tokens == len({e.index for e in events}) > 0
    assert _split(events) == split_harmony(raw, tail) and not any("<|" in e.text for e in events)


def test_reasoning_effort_reaches_the_template(harmony, capsys):
    """--reasoning-effort sets the harmony template's reasoning_effort (default medium); a template without it says
    the flag does nothing; a value outside low/medium/high is a usage error."""
    assert "Reasoning: medium" in harmony.tokenizer.decode(harmony.encode_chat(HI))
    try:
        assert harmony.set_reasoning_effort("high")
        assert "Reasoning: high" in harmony.tokenizer.decode(harmony.encode_chat(HI))
        with pytest.raises(UsageError):
            harmony.set_reasoning_effort("max")
    finally:
        harmony.set_reasoning_effort(None)
    code, out, err = _run(capsys, "run", REPO, "hi", "--reasoning-effort", "low")
    assert code == 0 and out == "OK\n"
    code, _, err = _run(capsys, "run", repo_id("qwen3_moe"), "hi", "--reasoning-effort", "low", "--max-new-tokens", "2")
    assert code == 0 and "--reasoning-effort does nothing" in err
    code, _, err = _run(capsys, "run", REPO, "hi", "--reasoning-effort", "max")
    assert code == 2 and "invalid choice" in err
