"""Tool calls in a model's reply, found as it streams: which format a chat template defines (`tool_format`), and
`ToolCallParser`, which splits reply text into plain text and complete calls ({"name", "arguments": a JSON string}).

Formats, by the marker the template writes a past call with:
    <tool_call> … </tool_call>   Qwen3 (and Hermes-style templates): a JSON object {"name", "arguments"} inside;
                                 Qwen3.5 (Qwen3-Coder style): <function=NAME><parameter=P>value</parameter>…</function>
    <|tool_call|>[…]             Granite 3.x: a JSON list of {"name", "arguments"} to the end of the reply
A template that mentions `tools` but neither marker renders the tools; its calls come back as text. A call whose
body does not parse comes back as text too, exactly as the model wrote it.

Pure Python; imports nothing from localmoe.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolFormat:
    name: str
    start: str
    end: str | None  # None: the call runs to the end of the reply


FORMATS = (ToolFormat("granite", "<|tool_call|>", None), ToolFormat("qwen", "<tool_call>", "</tool_call>"))
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?(?:</parameter>|(?=<parameter=)|\Z)", re.S)


def template_text(tokenizer) -> str:
    t = getattr(tokenizer, "chat_template", None)
    return t if isinstance(t, str) else " ".join(t.values()) if isinstance(t, dict) else ""


def has_tools(template: str) -> bool:
    """The template renders a `tools` variable."""
    return re.search(r"\btools\b", template) is not None


def tool_format(template: str) -> ToolFormat | None:
    if not has_tools(template):
        return None
    return next((f for f in FORMATS if f.start in template), None)


def _tail_prefix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _schema_types(tools) -> dict[str, dict[str, str]]:
    """{function name: {parameter: its JSON-schema type}} from the request's tools."""
    out: dict[str, dict[str, str]] = {}
    for t in tools or ():
        fn = t.get("function", {})
        props = fn.get("parameters", {}).get("properties", {}) if isinstance(fn.get("parameters"), dict) else {}
        out[fn.get("name", "")] = {k: v.get("type", "") for k, v in props.items() if isinstance(v, dict)}
    return out


def _json_call(obj) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        return {"name": obj["name"], "arguments": args}
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


def _value(text: str, kind: str):
    if kind == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_body(body: str, fmt: ToolFormat, types: dict[str, dict[str, str]]) -> list[dict] | None:
    """The calls in one call's body (between the markers), or None when it does not parse."""
    body = body.strip()
    if fmt.name == "granite" or body.startswith(("{", "[")):
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        calls = [_json_call(o) for o in (obj if isinstance(obj, list) else [obj])]
        return calls if calls and all(calls) else None
    found = _FUNCTION.findall(body)
    if not found:
        return None
    calls = []
    for name, inner in found:
        name = name.strip()
        kinds = types.get(name, {})
        args = {p.strip(): _value(v, kinds.get(p.strip(), "")) for p, v in _PARAMETER.findall(inner)}
        calls.append({"name": name, "arguments": json.dumps(args, ensure_ascii=False)})
    return calls


class ToolCallParser:
    """push(text) -> [("text", str) | ("call", {"name", "arguments"})] as the reply streams; flush() at its end.
    Text that may begin a call marker is held back until it is known not to."""

    def __init__(self, fmt: ToolFormat, tools=()):
        self.fmt, self.types = fmt, _schema_types(tools)
        self.buf, self.in_call = "", False

    def push(self, text: str) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        self.buf += text
        while True:
            if not self.in_call:
                i = self.buf.find(self.fmt.start)
                if i < 0:
                    keep = _tail_prefix(self.buf, self.fmt.start)
                    if len(self.buf) > keep:
                        out.append(("text", self.buf[: len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep :]
                    return out
                if i:
                    out.append(("text", self.buf[:i]))
                self.buf, self.in_call = self.buf[i + len(self.fmt.start) :], True
                continue
            if self.fmt.end is None:
                return out
            j = self.buf.find(self.fmt.end)
            if j < 0:
                return out
            self._close(out, self.buf[:j], self.fmt.start + self.buf[: j + len(self.fmt.end)])
            self.buf, self.in_call = self.buf[j + len(self.fmt.end) :], False

    def flush(self) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        if self.in_call:
            self._close(out, self.buf, self.fmt.start + self.buf)
        elif self.buf:
            out.append(("text", self.buf))
        self.buf, self.in_call = "", False
        return out

    def _close(self, out: list, body: str, raw: str) -> None:
        calls = parse_body(body, self.fmt, self.types)
        if calls is None:
            out.append(("text", raw))
        else:
            out.extend(("call", c) for c in calls)
