"""`localmoe serve`'s parts without a server: the tool-call parser on each template format, request checking, the
Engine's per-reply cancel check, and the CLI's refusals before any model loads (missing extra, a non-loopback
address without a key, a port in use)."""

from __future__ import annotations

import json
import socket

import pytest
from conftest import repo_id

from localmoe.cli.main import main
from localmoe.events import GenerationSettings
from localmoe.server.errors import ApiError
from localmoe.server.requests import chat_request, completion_request
from localmoe.server.tools import FORMATS, ToolCallParser, tool_format

QWEN, GRANITE = (next(f for f in FORMATS if f.name == n) for n in ("qwen", "granite"))


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models' ops on one thread: two contend on a shared two-core machine (each step 10x slower)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def run(parser: ToolCallParser, pieces) -> list:
    out = []
    for p in pieces:
        out += parser.push(p)
    out += parser.flush()
    text = "".join(v for k, v in out if k == "text")
    return [text] + [v for k, v in out if k == "call"]


def test_qwen_json_calls_split_across_pieces():
    reply = 'Let me look.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><tool_call>{"name": "g"}'
    pieces = [reply[i : i + 3] for i in range(0, len(reply), 3)]
    text, f, g = run(ToolCallParser(QWEN), pieces)
    assert text == "Let me look."
    assert f == {"name": "f", "arguments": json.dumps({"a": 1})} and g == {"name": "g", "arguments": "{}"}


def test_qwen35_function_calls_typed_by_the_schema():
    tools = [
        {"type": "function", "function": {"name": "w", "parameters": {"properties": {"city": {"type": "string"}}}}}
    ]
    reply = "<tool_call>\n<function=w>\n<parameter=city>\n123\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
    reply += "</function>\n</tool_call>"
    text, call = run(ToolCallParser(QWEN, tools), [reply])
    assert text == "" and json.loads(call["arguments"]) == {"city": "123", "days": 3}


def test_granite_list_and_text_that_is_not_a_call():
    text, a, b = run(ToolCallParser(GRANITE), ['<|tool_call|>[{"name": "a", "arguments": {}}, ', '{"name": "b"}]'])
    assert (text, a["name"], b["name"]) == ("", "a", "b")
    assert run(ToolCallParser(QWEN), ["a <tool", "s> b <tool_call>not json</tool_call>"]) == [
        "a <tools> b <tool_call>not json</tool_call>"
    ]


def test_tool_format_from_the_template():
    assert tool_format("{% for t in tools %}{% endfor %}<tool_call>") is QWEN
    assert tool_format("{{ tools }} <|tool_call|>") is GRANITE
    assert tool_format("<tool_call> but no variable") is None and tool_format("{{ tools }}") is None


def test_requests_checked():
    d = GenerationSettings(temperature=0.7, top_k=40)
    r = chat_request({"messages": [{"role": "developer", "content": [{"type": "text", "text": "hi"}]}]}, d, 99, False)
    assert r.messages == ({"role": "system", "content": "hi"},)
    assert r.settings.max_new_tokens == 99 and r.settings.temperature == 0.7  # the context's rest, the model's
    body = {"prompt": [[5, 6]], "max_tokens": 3, "top_k": -1, "seed": 2**64 - 1, "stop": "\n", "temperature": 0}
    r = completion_request(body, d, 99)
    assert r.prompt == (5, 6) and r.settings.top_k == 0 and r.settings.stop == ("\n",)
    assert (r.settings.max_new_tokens, r.settings.temperature) == (3, 0.0)
    for bad, status in [
        ({"prompt": "a", "stream_options": {"include_usage": True}}, 400),  # only with stream
        ({"prompt": "a", "max_tokens": True}, 400),
        ({"prompt": ["a", "b"]}, 422),
        ({"prompt": "a", "echo": True}, 422),
        ({"prompt": ""}, 400),
    ]:
        with pytest.raises(ApiError) as e:
            completion_request(bad, d, 99)
        assert e.value.status == status
    with pytest.raises(ApiError) as e:
        chat_request({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, d, 9, True)
    assert e.value.status == 400 and e.value.param == "tools"


def test_engine_reply_cancel_check(hub_cache):
    from localmoe.engine.engine import Engine

    e = Engine.load(repo_id("qwen3_moe"), device="cpu", sparsity=0.0)
    e.eos_ids = set()
    n = []
    events = e.generate([5, 6, 7], GenerationSettings(max_new_tokens=50), cancelled=lambda: len(n) >= 3)
    for ev in events:
        n.append(ev.index)
    assert (len(n), e.stats.finish_reason) == (3, "cancelled")
    assert len(list(e.generate([5, 6, 7], GenerationSettings(max_new_tokens=4)))) == 4  # the next reply is its own


def test_penalize_frequency_and_presence():
    import torch

    from localmoe.engine.sampling import Seen, penalize

    seen = Seen(8, torch.device("cpu"))
    seen.start([1, 2], 1.0, frequency=0.5, presence=0.25)
    for t in (5, 5, 7):
        seen.mark(torch.tensor(t))
    logits = torch.arange(8, dtype=torch.float32)
    want = logits.clone()
    want[5] -= 2 * 0.5 + 0.25
    want[7] -= 0.5 + 0.25  # prompt tokens 1 and 2 are not the reply's: untouched
    assert torch.equal(penalize(logits, seen), want)
    seen.start([], 1.0)  # off again: nothing subtracted
    assert torch.equal(penalize(logits, seen), logits)


def test_engine_presence_penalty(hub_cache):
    from localmoe.engine.engine import Engine

    e = Engine.load(repo_id("qwen3_moe"), device="cpu", sparsity=0.0)
    e.eos_ids = set()

    def tokens(**kw):
        return [ev.token_id for ev in e.generate([5, 6, 7], GenerationSettings(max_new_tokens=40, **kw))]

    plain = tokens()
    assert len(set(plain)) < len(plain)  # the tiny random model repeats itself greedily
    assert len(set(tokens(presence_penalty=100.0))) == 40  # a huge presence penalty: never the same token twice
    assert len(set(tokens(frequency_penalty=100.0))) == 40
    assert tokens(frequency_penalty=0.0, presence_penalty=0.0) == plain


def test_engine_reply_unsplit_for_raw_completions(hub_cache):
    import tiny_models

    from localmoe.engine.engine import Engine

    e = Engine.load(tiny_models.THINK_REPO, device="cpu", sparsity=0.0)
    ids = e.encode_chat([{"role": "user", "content": "hi"}])
    split = [(ev.channel, ev.text) for ev in e.generate(ids, GenerationSettings(max_new_tokens=20))]
    assert "".join(t for c, t in split if c == "reasoning") == tiny_models.THINK_REASONING
    raw = [
        (ev.channel, ev.text) for ev in e.generate(ids, GenerationSettings(max_new_tokens=20), split_reasoning=False)
    ]
    assert {c for c, _ in raw} == {"answer"} and "".join(t for _, t in raw) == "<think>Why?</think>\n\nOK"


def test_cli_refusals_before_the_load(monkeypatch, capsys):
    monkeypatch.setattr("localmoe.server.find_spec", lambda name: None)
    assert main(["serve", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.strip().endswith("pip install 'localmoe[serve]'")
    monkeypatch.undo()
    monkeypatch.delenv("LOCALMOE_API_KEY", raising=False)
    assert main(["serve", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("localmoe: error:") and "--api-key" in err[0]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        assert main(["serve", "--port", str(taken.getsockname()[1])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "in use" in err[0] and "--port" in err[0]
