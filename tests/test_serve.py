"""`localmoe serve` end to end: the real server (`python -m localmoe serve`, a subprocess on a free localhost port)
driven by the official `openai` client, on a tiny scripted checkpoint whose chat template defines tools.

The checkpoint (`tools_checkpoint`): a tiny Qwen3-MoE whose attention and experts output zero, so each next token
depends on the current token only, and whose lm_head makes a fixed successor win by a logit of 20 (as
tiny_models.save_think_checkpoint). Its chat template is ChatML with tools (Qwen3's `<tool_call>` JSON format); the
generation header ends in "\\n" without tools and in the token "\\n\\n" with them, so:
    a chat without tools replies "Hello world" (then EOS)
    a chat with tools replies <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call> (then EOS)
    a completion of a prompt ending in "x" (or "y") replies "xxxx…" ("yyyy…") until max_tokens: never EOS
One server for the module (max queue 3, an API key, a 16 KiB body limit); every test leaves it idle.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import tiny_models

KEY = "test-key"
REPO = f"{tiny_models.ORG}/tiny-tools"
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ADDED = ["Hello", " world", "\n\n", "<tool_call>", "</tool_call>", CALL]
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "<|im_end|>{{ '\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m['tool_calls'] is defined %}<|im_start|>assistant\n{{ m['content'] }}"
    "{% for c in m['tool_calls'] %}<tool_call>{{ {'name': c['function']['name'], "
    "'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}<|im_end|>{{ '\\n' }}"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>{{ m['content'] }}</tool_response>"
    "<|im_end|>{{ '\\n' }}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n\\n' if tools else '\\n' }}{% endif %}"
)
SCRIPT = [
    ("\n", "Hello"),
    ("Hello", " world"),
    (" world", "<|im_end|>"),
    ("\n\n", "<tool_call>"),
    ("<tool_call>", CALL),
    (CALL, "</tool_call>"),
    ("</tool_call>", "<|im_end|>"),
    ("x", "x"),
    ("y", "y"),
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
HI = [{"role": "user", "content": "hi"}]


def tools_tokenizer():
    """The character-level tokenizer with ADDED as (non-special) tokens and TOOLS_TEMPLATE."""
    return tiny_models.added_tokens_tokenizer(ADDED, TOOLS_TEMPLATE)


def save_tools_checkpoint(folder):
    """The scripted tiny Qwen3-MoE described in the module docstring (context 4096, greedy by default)."""
    tok = tools_tokenizer()
    model, kwargs = tiny_models.scripted_qwen3_moe(tok, SCRIPT)
    model.config.max_position_embeddings = 4096
    model.save_pretrained(folder, **kwargs)
    tok.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 3, "bos_token_id": 1}))
    return folder


@pytest.fixture(scope="module")
def tools_checkpoint(hub_cache, tmp_path_factory):
    folder = save_tools_checkpoint(tmp_path_factory.mktemp("tools") / "tiny-tools")
    tiny_models.place_in_hf_cache(folder, hub_cache, REPO)
    return REPO


class Server:
    """`python -m localmoe serve` in a subprocess; its stderr collected on a thread."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "localmoe", "serve", *args, "--port", "0"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},  # a tiny model's ops: one thread (two contend on CI)
            # started with SIGINT ignored, as a script's background job (or pytest-xdist's worker's child) is: ctrl+c
            # (SIGINT) must still stop it with status 130
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.url = ""
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(180) or not self.url:
            self.proc.kill()
            raise RuntimeError("the server did not start: " + "".join(self.lines)[-2000:])

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            if " at http://" in line and not self.url:
                self.url = line.split(" at ")[1].split()[0]
                self.ready.set()
        self.ready.set()

    @property
    def base(self) -> str:
        return self.url.removesuffix("/v1")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


@pytest.fixture(scope="module")
def server(tools_checkpoint):
    srv = Server(
        tools_checkpoint, "--device", "cpu", "--sparsity", "0", "--max-queue", "3", "--max-body", "0.015625",
        "--api-key", KEY, "--cors-origin", "http://ui.localhost:3000",
    )  # fmt: skip
    yield srv
    code = srv.stop()
    text = "".join(srv.lines)
    assert "Traceback" not in text, text
    assert code == 130, text  # ctrl+c: the CLI's interrupted status, one line


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def http(server, method: str, path: str, body: bytes | None = None, key: str | None = KEY):
    """A raw request -> (status, headers, parsed JSON body)."""
    req = urllib.request.Request(server.base + path, data=body, method=method)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())


def wait_idle(server) -> dict:
    """The server's health once nothing runs or waits (cancelled work ends within a token)."""
    for _ in range(600):
        _, _, h = http(server, "GET", "/health", key=None)
        if h["running"] == 0 and h["queued"] == 0:
            return h
        time.sleep(0.05)
    raise AssertionError(f"the server stayed busy: {h}")


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [REPO]
    assert client.models.retrieve(REPO).id == REPO
    status, _, health = http(server, "GET", "/health", key=None)  # no key needed
    assert status == 200 and health["status"] == "ok" and health["model"] == REPO


def test_chat_whole_reply_usage_and_figures(client):
    r = client.chat.completions.create(model=REPO, messages=HI, max_tokens=8)
    assert r.choices[0].message.content == "Hello world"
    assert r.choices[0].finish_reason == "stop" and r.object == "chat.completion"
    assert r.usage.completion_tokens == 2 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 2
    figures = r.model_extra["localmoe"]
    assert figures["generated_tokens"] == 2 and figures["decode_tok_s"] > 0 and figures["ttft_s"] > 0
    assert {"sparsity_realized", "cache_hit_rate", "queue_s", "reused_prompt_tokens"} <= figures.keys()


def test_chat_streamed_with_usage(client):
    chunks = list(
        client.chat.completions.create(
            model=REPO, messages=HI, stream=True, stream_options={"include_usage": True}, max_completion_tokens=8
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello world"
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finish] == ["stop"]
    assert finish[0].model_extra["localmoe"]["generated_tokens"] == 2
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2


def test_length_and_stop_strings(client):
    r = client.chat.completions.create(model=REPO, messages=HI, max_tokens=1)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("Hello", "length")
    r = client.chat.completions.create(model=REPO, messages=HI, stop=[" wor"], temperature=0.5, seed=3)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("Hello", "stop")
    chunks = client.chat.completions.create(model=REPO, messages=HI, stop=["ld", "o w"], stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hell"


def test_completions(client):
    r = client.completions.create(model=REPO, prompt="say y", max_tokens=5)
    assert (r.choices[0].text, r.choices[0].finish_reason, r.object) == ("yyyyy", "length", "text_completion")
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens == 5
    r = client.completions.create(model=REPO, prompt="y", max_tokens=3, frequency_penalty=0.5, presence_penalty=1)
    assert r.choices[0].text == "yyy"  # penalties far smaller than the script's margin change nothing


def test_tool_call_whole_and_streamed(client):
    r = client.chat.completions.create(model=REPO, messages=HI, tools=[WEATHER])
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and not msg.content
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    calls: dict[int, dict] = {}
    for c in client.chat.completions.create(model=REPO, messages=HI, tools=[WEATHER], stream=True):
        assert not (c.choices and c.choices[0].delta.content)  # no marker text leaks as content
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            slot = calls.setdefault(d.index, {"name": "", "arguments": ""})
            slot["name"] += d.function.name or ""
            slot["arguments"] += d.function.arguments or ""
    assert calls == {0: {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
    # the call and its result sent back render through the template; "none" leaves the tools out
    history = HI + [msg.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r = client.chat.completions.create(model=REPO, messages=history, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.content == "Hello world"


def test_conversation_reuses_the_prompt_prefix(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first"}]
    first = client.chat.completions.create(model=REPO, messages=msgs)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "more"}]
    second = client.chat.completions.create(model=REPO, messages=msgs)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # at least the first turn's prompt (and its reply too when the engine was idle long enough to prefill it ahead)
    assert 0 < first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
    assert second.model_extra["localmoe"]["reused_prompt_tokens"] == cached


def test_concurrent_clients_each_get_their_own_reply(client, server):
    def one(i: int) -> tuple[str, str]:
        ch = "xy"[i % 2]
        stream = client.completions.create(model=REPO, prompt=f"say {ch}", max_tokens=30, stream=True)
        return ch, "".join(c.choices[0].text for c in stream)

    with ThreadPoolExecutor(4) as pool:  # one runs, three wait: the queue's limit
        results = list(pool.map(one, range(4)))
    assert all(text == ch * 30 for ch, text in results), results
    assert wait_idle(server)["rejected"] == 0


def test_disconnect_cancels_and_queue_limit(client, server):
    before = wait_idle(server)
    streams = [client.completions.create(model=REPO, prompt="x", max_tokens=3000, stream=True) for _ in range(4)]
    next(iter(streams[0]))  # the first is generating; three wait
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=REPO, prompt="x", max_tokens=3)
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"]
    assert e.value.body["code"] == "queue_full"
    for s in streams:
        s.close()
    after = wait_idle(server)
    assert after["cancelled"] - before["cancelled"] == 4
    assert after["completed"] == before["completed"] and after["rejected"] - before["rejected"] == 1
    r = client.completions.create(model=REPO, prompt="y", max_tokens=2)  # the engine is free again
    assert r.choices[0].text == "yy"


def test_a_client_that_gives_up_cancels_its_whole_reply(client, server):
    before = wait_idle(server)
    with pytest.raises(openai.APITimeoutError):  # not streaming: the client stops waiting, its reply is cancelled
        client.with_options(timeout=0.5).completions.create(model=REPO, prompt="x", max_tokens=4000)
    after = wait_idle(server)
    assert after["cancelled"] - before["cancelled"] == 1 and after["completed"] == before["completed"]


@pytest.mark.parametrize(
    "fields, status, param",
    [
        ({"temperature": 5}, 400, "temperature"),
        ({"model": "gpt-4o"}, 404, "model"),
        ({"n": 2}, 422, "n"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 422, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x" * 20000}]}, 413, None),
        ({"messages": [{"role": "user", "content": "x" * 5000}]}, 400, None),  # longer than the context
        ({"frequency_penalty": 2.5}, 400, "frequency_penalty"),
        ({"stop": ""}, 400, "stop"),
    ],
)
def test_bad_requests_get_openai_errors(client, fields, status, param):
    kwargs = {"model": REPO, "messages": HI, **fields}
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(**kwargs)
    assert e.value.status_code == status
    assert isinstance(e.value.body, dict) and e.value.body["message"] and e.value.body["param"] == param


def test_cors_only_for_the_allowed_origin(server):
    def preflight(origin: str):
        req = urllib.request.Request(server.base + "/v1/chat/completions", method="OPTIONS")
        req.add_header("Origin", origin)
        req.add_header("Access-Control-Request-Method", "POST")
        req.add_header("Access-Control-Request-Headers", "authorization, content-type")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.headers.get("access-control-allow-origin")
        except urllib.error.HTTPError as e:
            return e.code, e.headers.get("access-control-allow-origin")

    assert preflight("http://ui.localhost:3000") == (200, "http://ui.localhost:3000")
    assert preflight("http://elsewhere.example")[1] is None


def test_raw_http_errors(server):
    status, _, body = http(server, "POST", "/v1/chat/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, _, body = http(server, "POST", "/v1/chat/completions", b"[]")
    assert status == 400
    status, _, body = http(server, "POST", "/v1/completions", b"[" * 5000 + b"]" * 5000)
    assert status == 400 and body["error"]["message"]
    status, _, body = http(server, "GET", "/v1/nowhere")
    assert status == 404 and "no such endpoint" in body["error"]["message"]
    status, _, body = http(server, "GET", "/v1/chat/completions")
    assert status == 405 and body["error"]
    status, _, body = http(server, "GET", "/v1/models", key="wrong")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, _, body = http(server, "GET", "/v1/models", key=None)
    assert status == 401
