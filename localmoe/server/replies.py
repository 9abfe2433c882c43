"""A reply's TokenEvents as OpenAI's objects: `ReplyBuilder` turns them into streamed chunks
(`chat.completion.chunk` / `text_completion` deltas) as they come, or one `chat.completion` / `text_completion` at
the end, with `usage` and localmoe's own figures in the `localmoe` extension field.

Chat: the answer channel is `content`, a thinking model's reasoning `reasoning_content` (as vLLM and llama.cpp
name it); with tools, calls the template's format defines (tools.py) become `tool_calls` (streamed as two deltas
per call: id and name, then the arguments) and finish_reason "tool_calls". Completions: the text as the model wrote
it (the worker asks the engine not to split a thinking model's reasoning off).

Imports tools.py and localmoe.events.
"""

from __future__ import annotations

import secrets
import time

from localmoe.events import EngineStats, TokenEvent
from localmoe.server.tools import ToolCallParser, ToolFormat

STAT_KEYS = (
    "ttft_s",
    "prefill_tok_s",
    "decode_tok_s",
    "prompt_tokens",
    "reused_prompt_tokens",
    "generated_tokens",
    "sparsity_target",
    "sparsity_realized",
    "cache_hit_rate",
    "h2d_bytes_per_token",
    "department_hit_rate",
    "private_hit_rate",
    "peak_gpu_mem_gb",
    "wall_s",
)


def localmoe_figures(stats: EngineStats, queue_s: float) -> dict:
    """The `localmoe` extension field: the engine's figures for this reply, and the time it waited in the queue."""
    d = stats.as_json()
    out = {k: d.get(k) for k in STAT_KEYS}
    out["queue_s"] = queue_s
    return out


class ReplyBuilder:
    def __init__(self, request, model: str, tool_format: ToolFormat | None):
        self.kind, self.model = request.kind, model
        self.include_usage = request.include_usage
        chat = request.kind == "chat"
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.object = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())
        self.parser = ToolCallParser(tool_format, request.tools) if chat and request.tools and tool_format else None
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[dict] = []
        self.reasoning_tokens: set[int] = set()

    # -- the reply's parts as they stream -------------------------------------------------------------------
    def feed(self, ev: TokenEvent) -> list[dict]:
        """One event -> the deltas it adds (chat: delta objects; completions: {"text": ...})."""
        if ev.channel == "reasoning":
            self.reasoning_tokens.add(ev.index)
            if self.kind == "chat":
                self.reasoning.append(ev.text)
                return [{"reasoning_content": ev.text}] if ev.text else []
        return self._answer(ev.text)

    def _answer(self, text: str, final: bool = False) -> list[dict]:
        if self.kind != "chat":
            self.content.append(text)
            return [{"text": text}] if text else []
        if self.parser is None:
            parts = [("text", text)]
        else:
            parts = self.parser.push(text) + (self.parser.flush() if final else [])
        deltas: list[dict] = []
        for kind, value in parts:
            if kind == "text":
                if value:
                    self.content.append(value)
                    deltas.append({"content": value})
                continue
            i = len(self.calls)
            call = {"id": "call_" + secrets.token_hex(12), "type": "function", "function": dict(value)}
            self.calls.append(call)
            head = {
                "index": i,
                "id": call["id"],
                "type": "function",
                "function": {"name": value["name"], "arguments": ""},
            }
            deltas.append({"tool_calls": [head]})
            deltas.append({"tool_calls": [{"index": i, "function": {"arguments": value["arguments"]}}]})
        return deltas

    def end(self) -> list[dict]:
        """The reply ended: text a possible call marker held back, or a call left open, as deltas."""
        return self._answer("", final=True) if self.parser is not None else []

    def finish_reason(self, stats: EngineStats) -> str:
        if self.calls:
            return "tool_calls"
        return "length" if stats.finish_reason == "length" else "stop"

    def usage(self, stats: EngineStats) -> dict:
        n = stats.generated_tokens
        return {
            "prompt_tokens": stats.prompt_tokens,
            "completion_tokens": n,
            "total_tokens": stats.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": stats.reused_prompt_tokens},
            "completion_tokens_details": {"reasoning_tokens": len(self.reasoning_tokens)},
        }

    # -- streamed chunks --------------------------------------------------------------------------------------
    def chunk(self, delta: dict | None, finish: str | None = None, **extra) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": (delta or {}).get("text", ""), "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        out.update(extra)
        return out

    def first_chunk(self) -> dict | None:
        """Chat streams open with the assistant's role."""
        return self.chunk({"role": "assistant", "content": ""}) if self.kind == "chat" else None

    def last_chunks(self, stats: EngineStats, queue_s: float) -> list[dict]:
        """The finish_reason chunk (with the `localmoe` figures), then the usage chunk when asked for."""
        out = [self.chunk({}, self.finish_reason(stats), localmoe=localmoe_figures(stats, queue_s))]
        if self.include_usage:
            out.append(
                {
                    "id": self.id,
                    "object": out[0]["object"],
                    "created": self.created,
                    "model": self.model,
                    "choices": [],
                    "usage": self.usage(stats),
                }
            )
        return out

    # -- one response ---------------------------------------------------------------------------------------
    def response(self, stats: EngineStats, queue_s: float) -> dict:
        text = "".join(self.content)
        if self.kind == "chat":
            message: dict = {"role": "assistant", "content": text if text or not self.calls else None}
            if self.reasoning:
                message["reasoning_content"] = "".join(self.reasoning)
            if self.calls:
                message["tool_calls"] = self.calls
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": self.finish_reason(stats)}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish_reason(stats)}
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(stats),
            "localmoe": localmoe_figures(stats, queue_s),
        }

    def answer_text(self) -> str:
        return "".join(self.content)
