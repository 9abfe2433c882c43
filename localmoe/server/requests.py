"""A request body checked and turned into what the engine takes: `chat_request` (POST /v1/chat/completions) and
`completion_request` (POST /v1/completions) -> `Request` (the messages or prompt, GenerationSettings over the
model's defaults, stream and usage options, the tools for the chat template). Anything wrong is an `ApiError`
(errors.py) naming the field; nothing here raises anything else for any JSON value.

Fields taken (OpenAI's names): model, messages / prompt, stream, stream_options.include_usage, max_tokens,
max_completion_tokens, temperature, top_p, stop, seed, frequency_penalty, presence_penalty, tools, tool_choice
("auto" or "none"), n (1 only), response_format ("text" only); localmoe's (as vLLM and llama.cpp name them): top_k,
repetition_penalty, chat_template_kwargs.enable_thinking.
Fields it does not know are ignored, as other OpenAI-compatible servers do.

Imports errors.py and localmoe.events (no torch).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

from localmoe.events import GenerationSettings
from localmoe.server.errors import ApiError, bad, unsupported

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch.Generator.manual_seed takes
MAX_STOPS = 16
ROLES = {"system", "developer", "user", "assistant", "tool"}


@dataclass(frozen=True)
class Request:
    """A checked request: `messages` (chat, as the chat template takes them) or `prompt` (completions: text, or
    token ids), the reply's settings, and how to answer."""

    kind: str  # "chat" or "completion"
    settings: GenerationSettings
    stream: bool = False
    include_usage: bool = False
    messages: tuple = ()
    tools: tuple = ()  # function definitions given to the chat template (empty: none)
    think: bool | None = None  # chat_template_kwargs.enable_thinking (None: the template's default)
    prompt: str | tuple[int, ...] = ""


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _number(body: dict, key: str, lo: float, hi: float, *, lo_open: bool = False, integer: bool = False):
    """body[key] checked to be a number in range (None when absent or null)."""
    v = body.get(key)
    if v is None:
        return None
    ok = isinstance(v, int) and not isinstance(v, bool) if integer else _is_number(v)
    if not ok:
        raise bad(f"'{key}' must be {'an integer' if integer else 'a number'}, got {json.dumps(v)[:40]}", key)
    if (v <= lo if lo_open else v < lo) or v > hi:
        raise bad(f"'{key}' must be {'>' if lo_open else '>='} {lo} and <= {hi}, got {v}", key)
    return v


def _flag(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(f"'{key}' must be true or false", key)
    return v


def _stops(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad("'stop' must be a string or a list of strings", "stop")
    if len(items) > MAX_STOPS:
        raise bad(f"'stop' takes at most {MAX_STOPS} strings, got {len(items)}", "stop")
    if any(not s for s in items):
        raise bad("'stop' strings must not be empty", "stop")
    return tuple(items)


def settings_from(body: dict, defaults: GenerationSettings, context: int) -> GenerationSettings:
    """The reply's settings: the request's fields over the model's defaults (generation_config.json); no
    max_tokens means whatever the context leaves after the prompt."""
    given: dict = {"max_new_tokens": context, "stop": _stops(body)}
    limit = _number(body, "max_completion_tokens", 1, 1 << 30, integer=True)
    limit = limit if limit is not None else _number(body, "max_tokens", 1, 1 << 30, integer=True)
    if limit is not None:
        given["max_new_tokens"] = limit
    for key, field, lo, hi, lo_open in (
        ("temperature", "temperature", 0.0, 2.0, False),
        ("top_p", "top_p", 0.0, 1.0, True),
        ("repetition_penalty", "repetition_penalty", 0.0, 10.0, True),
    ):
        v = _number(body, key, lo, hi, lo_open=lo_open)
        if v is not None:
            given[field] = float(v)
    top_k = _number(body, "top_k", -1, 1 << 30, integer=True)
    if top_k is not None:
        given["top_k"] = max(0, top_k)  # -1 (vLLM's "off") is 0 here
    seed = _number(body, "seed", SEED_MIN, SEED_MAX, integer=True)
    if seed is not None:
        given["seed"] = seed
    for key in ("frequency_penalty", "presence_penalty"):
        v = _number(body, key, -2.0, 2.0)
        if v is not None:
            given[key] = float(v)
    n = _number(body, "n", 1, 1 << 30, integer=True)
    if n is not None and n != 1:
        raise unsupported("'n' must be 1: localmoe generates one reply per request", "n")
    if body.get("logprobs") not in (None, False, 0):
        raise unsupported("'logprobs' is not supported", "logprobs")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise unsupported(
            '\'response_format\' must be {"type": "text"}: JSON modes are not supported', "response_format"
        )
    return replace(defaults, **given)


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = _flag(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    if not stream:
        raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
    return stream, _flag(opts, "include_usage")


def _content(m: dict, i: int, role: str) -> str | None:
    """A message's content as text: a string, null (an assistant's tool calls), or text parts joined by newlines."""
    c = m.get("content")
    if c is None or isinstance(c, str):
        if c is None and role not in ("assistant",):
            raise bad(f"messages[{i}].content is missing", f"messages[{i}].content")
        return c
    if not isinstance(c, list):
        raise bad(f"messages[{i}].content must be a string or a list of content parts", f"messages[{i}].content")
    texts = []
    for part in c:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            if isinstance(kind, str):
                raise unsupported(
                    f"messages[{i}] has a '{kind}' part: only text is supported", f"messages[{i}].content"
                )
            raise bad(f"messages[{i}].content parts must be objects with a 'type'", f"messages[{i}].content")
        if not isinstance(part.get("text"), str):
            raise bad(f"messages[{i}].content: a text part needs a string 'text'", f"messages[{i}].content")
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_calls(m: dict, i: int) -> list[dict]:
    """An assistant message's tool_calls for the template: arguments as an object (templates iterate them)."""
    calls = m.get("tool_calls")
    if not isinstance(calls, list):
        raise bad(f"messages[{i}].tool_calls must be a list", f"messages[{i}].tool_calls")
    out = []
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"messages[{i}].tool_calls: each needs a function with a name", f"messages[{i}].tool_calls")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise bad(f"messages[{i}].tool_calls: arguments are not JSON", f"messages[{i}].tool_calls") from None
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def messages_from(body: dict) -> tuple:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list of messages", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(sorted(ROLES))}", f"messages[{i}].role")
        role = "system" if m["role"] == "developer" else m["role"]
        msg: dict = {"role": role, "content": _content(m, i, role)}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m, i)
        if msg["content"] is None:
            if "tool_calls" not in msg:
                raise bad(f"messages[{i}].content is missing", f"messages[{i}].content")
            msg["content"] = ""
        for key in ("name", "tool_call_id", "reasoning_content"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        out.append(msg)
    return tuple(out)


def tools_from(body: dict, template_has_tools: bool) -> tuple:
    tools, choice = body.get("tools"), body.get("tool_choice", "auto")
    if choice is None:
        choice = "auto"
    if choice not in ("auto", "none"):
        raise unsupported('\'tool_choice\' must be "auto" or "none" (localmoe cannot force a call)', "tool_choice")
    if tools is None or choice == "none":
        return ()
    if not isinstance(tools, list) or not all(
        isinstance(t, dict)
        and t.get("type") == "function"
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
        for t in tools
    ):
        raise bad('\'tools\' must be a list of {"type": "function", "function": {"name": ...}}', "tools")
    if tools and not template_has_tools:
        raise unsupported("this model's chat template does not define tools: send the request without 'tools'", "tools")
    return tuple(tools)


def _think(body: dict) -> bool | None:
    kw = body.get("chat_template_kwargs")
    if kw is None:
        return None
    if not isinstance(kw, dict):
        raise bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    v = kw.get("enable_thinking")
    if v is not None and not isinstance(v, bool):
        raise bad("'chat_template_kwargs.enable_thinking' must be true or false", "chat_template_kwargs")
    return v


def chat_request(body: dict, defaults: GenerationSettings, context: int, template_has_tools: bool) -> Request:
    stream, usage = _stream_options(body)
    return Request(
        kind="chat",
        settings=settings_from(body, defaults, context),
        stream=stream,
        include_usage=usage,
        messages=messages_from(body),
        tools=tools_from(body, template_has_tools),
        think=_think(body),
    )


def completion_request(body: dict, defaults: GenerationSettings, context: int) -> Request:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = tuple(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise unsupported("'prompt' must be one prompt: localmoe does not batch", "prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise bad("'prompt' must be a non-empty string (or a list of token ids)", "prompt")
    for key in ("echo", "suffix"):
        if body.get(key):
            raise unsupported(f"'{key}' is not supported", key)
    if _number(body, "best_of", 1, 1 << 30, integer=True) not in (None, 1):
        raise unsupported("'best_of' must be 1", "best_of")
    stream, usage = _stream_options(body)
    return Request(
        kind="completion",
        settings=settings_from(body, defaults, context),
        stream=stream,
        include_usage=usage,
        prompt=prompt,
    )


def check_model(body: dict, names: set[str], served: str) -> None:
    """'model' must name the model this server holds (`served`, or any of its other `names`)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' must be a string naming the model (GET /v1/models lists it)", "model")
    if model not in names:
        raise ApiError(
            404,
            f"model {model!r} is not served here: this server holds {served!r} (GET /v1/models)",
            param="model",
            code="model_not_found",
        )
