"""The conversation flow of `localmoe chat` (mixed into ChatApp): sending a message, queueing what is sent while the
model loads or replies, streaming the reply from a worker thread into its view (a thinking model's reasoning
apart from the answer), cancelling it, and stopping it at quit or on a signal.

Queued messages are shown last in the conversation, marked queued, and sent in order once the model is free;
Esc on an empty input takes the last one back into the input, /cancel drops them all. A reply's reasoning arrives
as TokenEvents with `channel == "reasoning"` (engines without channels send answers only) and is stored and sent
back to the chat template (`reasoning_content`) apart from the answer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from textual.containers import VerticalScroll
from textual.message import Message

from localmoe.events import ChatEngine, GenerationSettings
from localmoe.tui import prompts
from localmoe.tui.commands import WITHOUT_ENGINE, CommandError, parse_command
from localmoe.tui.prompts import context_limit, fit_to_context
from localmoe.tui.store_sync import SAVE_INTERVAL, Turn
from localmoe.tui.widgets import ChatInput, LoadingView, MessageView, describe_error


class Progress(Message):
    """A stage of long work (the load, a recalibration) advanced: posted from worker threads."""

    def __init__(self, stage: str, done: int, total: int | None) -> None:
        super().__init__()
        self.stage, self.done, self.total = stage, done, total


class ReplyChunk(Message):
    def __init__(self, reply_id: int, text: str, channel: str = "answer") -> None:
        super().__init__()
        self.reply_id, self.text, self.channel = reply_id, text, channel


class ReplyDone(Message):
    def __init__(self, reply_id: int, text: str, reason: str, error: str, reasoning: str = "") -> None:
        super().__init__()
        self.reply_id, self.text, self.reason, self.error, self.reasoning = reply_id, text, reason, error, reasoning


class ContextTrimmed(Message):
    def __init__(self, reply_id: int, dropped: int) -> None:
        super().__init__()
        self.reply_id, self.dropped = reply_id, dropped


@dataclass
class Reply:
    """The reply in flight (its turn is the last of ChatApp.turns, status 'streaming')."""

    id: int
    view: MessageView
    turn: Turn
    cancel_requested: bool = False
    thinking: bool = False  # its reasoning is streaming


@dataclass
class Queued:
    """A message sent while the model loads or replies: shown as queued, sent in order once the model is free."""

    text: str
    view: MessageView | None = None


class RepliesMixin:
    """ChatApp's sending, queueing and streaming (relies on its engine, turns, queue, settings and _sync)."""

    async def on_chat_input_submitted(self, event: ChatInput.Submitted) -> None:
        text = event.text.strip()
        try:
            parsed = parse_command(text)
        except CommandError as exc:
            self.notify(str(exc), severity="error")
            return
        prompt = self.query_one(ChatInput)
        if parsed is not None:
            if self.engine is None and parsed.name not in WITHOUT_ENGINE:
                why = "is still loading" if self.loading else "did not load"
                self.notify(
                    f"The model {why}: /{parsed.name} works once it is ready. ctrl+q quits.", severity="warning"
                )
                return  # the command stays in the input
            prompt.clear()
            await self.run_command(parsed)
            return
        prompt.clear()
        message = text[1:] if text.startswith("//") else text
        if self.queue or not self.can_start(quiet=True):
            await self.enqueue(message)
        else:
            await self.send(message)

    def can_start(self, quiet: bool = False) -> bool:
        if self.engine is None or self.loading:
            return False
        if self.reply is not None or self.busy:
            if not quiet:
                self.notify("Wait for the reply to finish (Esc cancels it).", severity="warning")
            return False
        return True

    async def enqueue(self, text: str) -> None:
        view = MessageView("user", text, "queued")
        await self.query_one("#conversation").mount(view)  # queued messages stay last
        self.query_one("#conversation", VerticalScroll).scroll_end(animate=False)
        self.queue.append(Queued(text, view))
        self._queue_changed()

    async def dispatch_queue(self) -> None:
        """Send the first queued message if the model is free."""
        if self.queue and self.can_start(quiet=True):
            item = self.queue.pop(0)
            self._queue_changed()
            if item.view is not None:
                item.view.mark_sent()
            await self.send(item.text, view=item.view)

    async def unqueue_last(self) -> None:
        """Esc on an empty input: the last queued message goes back into the input, unsent."""
        item = self.queue.pop()
        if item.view is not None:
            await item.view.remove()
        prompt = self.query_one(ChatInput)
        prompt.text = item.text
        prompt.move_cursor(prompt.document.end)
        self._queue_changed()

    async def drop_queue(self) -> int:
        dropped, self.queue = self.queue, []
        for item in dropped:
            if item.view is not None:
                await item.view.remove()
        self._queue_changed()
        return len(dropped)

    def _queue_changed(self) -> None:
        self._queue_drop_confirmed = False
        for view in self.query(LoadingView):
            view.show_queued([q.text for q in self.queue])
        self.refresh_status()

    async def send(self, text: str, view: MessageView | None = None) -> None:
        if not self.can_start():
            return
        if view is None:
            view = MessageView("user", text)
            await self._mount_message(view)
        self.turns.append(Turn(0, "user", text, "ok", view))
        self._drop_confirmed = False
        self._sync()
        await self.start_reply()

    async def start_reply(self) -> None:
        self._reply_counter += 1
        messages = self.context()
        view = MessageView("assistant")
        turn = Turn(0, "assistant", "", "streaming", view)
        self.turns.append(turn)
        self.reply = Reply(self._reply_counter, view, turn)  # before the view shows: no moment without either
        await self._mount_message(view)
        view.start_stream()
        self._sync()  # the reply's row exists from its start: what streams is saved as it comes
        self.query_one("#conversation", VerticalScroll).anchor()
        self.refresh_status()
        self._decode_worker = self._spawn(
            self._decode_thread, self._reply_counter, messages, self.settings, self.think, self.engine
        )

    def context(self) -> list[dict]:
        """The messages for the engine: system prompt, then user/assistant turns with content (a reply's reasoning
        as `reasoning_content`: the chat template decides whether it goes into the prompt)."""
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        for t in self.turns:
            if t.role == "user" or (t.role == "assistant" and t.content.strip()):
                msgs.append({"role": t.role, "content": t.content})
                if t.role == "assistant" and t.reasoning:
                    msgs[-1]["reasoning_content"] = t.reasoning
        return msgs

    def _decode_thread(
        self,
        reply_id: int,
        messages: Sequence[dict],
        settings: GenerationSettings,
        think: bool | None,
        engine: ChatEngine,
    ) -> None:
        answer: list[str] = []
        reasoning: list[str] = []
        reason, error = "", ""
        try:
            messages, dropped = fit_to_context(engine, messages, settings.max_new_tokens, think)
            if dropped:
                self._post(ContextTrimmed(reply_id, dropped))
            for event in prompts.chat(engine, messages, settings, think):
                if event.text:
                    channel = getattr(event, "channel", "answer") or "answer"
                    (reasoning if channel == "reasoning" else answer).append(event.text)
                    self._post(ReplyChunk(reply_id, event.text, channel))
            reason = engine.stats.finish_reason
        except Exception as exc:
            reason, error = "error", describe_error(exc)[0].removeprefix("localmoe: error: ")
        text, thought = "".join(answer), "".join(reasoning)
        self._post(ReplyDone(reply_id, text, reason, error, thought))
        # while the user reads and types: the engine adds this reply to its cache, so the next turn prefills only
        # the new message (an engine without it, or a failure here, just prefills more next turn)
        if reason in ("stop", "length") and text.strip():
            reply = {"role": "assistant", "content": text}
            if thought:
                reply["reasoning_content"] = thought
            try:
                prompts.prepare_next_turn(engine, [*messages, reply], think)
            except Exception:  # noqa: BLE001
                pass

    async def on_reply_chunk(self, msg: ReplyChunk) -> None:
        reply = self.reply
        if reply is None or reply.id != msg.reply_id:
            return
        if msg.channel == "reasoning":
            await reply.view.write_reasoning(msg.text)
            reply.turn.reasoning = reply.view.reasoning
        else:
            await reply.view.write(msg.text)
            reply.turn.content = reply.view.content
        thinking = msg.channel == "reasoning"
        reply.turn.saved = False
        if time.monotonic() - self._last_save >= SAVE_INTERVAL:
            self._sync()
        if thinking != reply.thinking or not thinking:
            reply.thinking = thinking
            self.refresh_status()

    def on_context_trimmed(self, msg: ContextTrimmed) -> None:
        self.dropped_for_context = msg.dropped
        if not self._trim_noticed:
            self._trim_noticed = True
            self.notify(
                f"Oldest {msg.dropped} messages left out to fit the context ({context_limit(self.engine)} tokens).",
                timeout=8,
            )

    async def on_reply_done(self, msg: ReplyDone) -> None:
        reply = self.reply
        if reply is None or reply.id != msg.reply_id:
            return
        self.reply = None
        cancelled = reply.cancel_requested or msg.reason == "cancelled"
        status = "error" if msg.error else "cancelled" if cancelled else "ok"
        text = msg.text if len(msg.text) >= len(reply.view.content) else reply.view.content
        thought = msg.reasoning if len(msg.reasoning) >= len(reply.view.reasoning) else reply.view.reasoning
        reply.turn.content, reply.turn.reasoning, reply.turn.status, reply.turn.saved = text, thought, status, False
        self._sync()  # saved before the view is touched: the app may be closing and the view going away
        await reply.view.finish(status, msg.error)
        self.refresh_status()
        await self.dispatch_queue()

    def action_cancel_reply(self) -> None:
        if self.reply is not None and self.engine is not None:
            self.reply.cancel_requested = True
            self.engine.cancel()
            self.refresh_status()

    def _stop_reply(self, status: str) -> None:
        """End the reply in flight now (the engine is told to stop) and save what it has shown, as `status`."""
        reply = self.reply
        if reply is None:
            return
        self.reply = None
        if self.engine is not None:
            self.engine.cancel()
        reply.turn.content, reply.turn.status, reply.turn.saved = reply.view.content, status, False
        reply.turn.reasoning = reply.view.reasoning
        self._sync()
