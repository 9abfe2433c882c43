"""Loading the engine behind the chat's loading view, and switching models (`/model`), mixed into ChatApp.

Owns `LoadingMixin`: the load runs in a worker thread as `load(progress)` (or `load(progress, model=NAME)` for
`/model NAME`), its progress shown in the loading view (or the status line when a recalibration runs in the chat); a
failure shows the error view, and ctrl+r retries. A switch frees the old engine first (its GPU memory back to the
driver) and keeps the conversation. Once loaded, the engine's sampling defaults are adopted under what the user set.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import threading
import time
from collections.abc import Callable

from textual.message import Message
from textual.widgets import ContentSwitcher

from localmoe.events import ChatEngine
from localmoe.tui.replies import Progress
from localmoe.tui.widgets import ChatInput, ErrorView, LoadingView, describe_error

LoadFn = Callable[..., ChatEngine]  # load(progress) -> engine; load(progress, model=NAME) for /model NAME


class Loaded(Message):
    def __init__(self, engine: ChatEngine | None, error: str = "", hint: str = "", model: str | None = None) -> None:
        super().__init__()
        self.engine, self.error, self.hint, self.model = engine, error, hint, model


def free_engine(holder: list) -> None:
    """Drop the last reference the app holds to an engine and give its memory back (GPU memory to the driver)."""
    holder.clear()
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


class LoadingMixin:
    """ChatApp's engine loading and model switching (needs the app's `_load`, `_spawn`, `_post`, `enter_chat`,
    `add_event`, `dispatch_queue`)."""

    def start_loading(self, model: str | None = None, old: list | None = None) -> None:
        self.loading = True
        self.query_one("#main", ContentSwitcher).current = "loading"
        load = self._load or (lambda progress: self.engine)
        sparsity = self._initial_sparsity if model is None else None
        self._spawn(self._load_thread, load, sparsity, model, old or [])
        self.refresh_status()

    def action_retry_load(self) -> None:
        if self.load_error and not self.loading:
            self.load_error = ""
            self.start_loading(self._switch_to)

    def _load_thread(self, load: LoadFn, sparsity: float | None, model: str | None, old: list) -> None:
        last = {"stage": "", "at": 0.0}

        def progress(stage: str, done: int, total: int | None) -> None:
            now = time.monotonic()  # downloads report per chunk: pass ~20 updates/s, and every stage change and end
            if stage != last["stage"] or done == total or now - last["at"] >= 0.05:
                last.update(stage=stage, at=now)
                self._post(Progress(stage, done, total))

        try:
            if old:  # /model: the old engine goes first (its reply and next-turn prefill are over), then the new
                worker = self._decode_worker
                if worker is not None and worker is not threading.current_thread():
                    worker.join(timeout=60)
                free_engine(old)
            engine = load(progress) if model is None else load(progress, model=model)
            if sparsity is not None:
                engine.set_sparsity(sparsity, progress)
        except (Exception, SystemExit) as exc:
            self._post(Loaded(None, *describe_error(exc), model=model))
        else:
            self._post(Loaded(engine, model=model))

    def on_progress(self, msg: Progress) -> None:
        if self.query_one("#main", ContentSwitcher).current == "loading":
            self.query_one(LoadingView).update_progress(msg.stage, msg.done, msg.total)
        else:
            self.busy = f"{msg.stage} {msg.done}/{msg.total}" if msg.total else f"{msg.stage}…"
            self.refresh_status()

    async def on_loaded(self, msg: Loaded) -> None:
        self.loading = False
        if msg.engine is None:
            self.load_error = msg.error
            self.query_one(ErrorView).show(msg.error, msg.hint)
            self.query_one("#main", ContentSwitcher).current = "error"
            self.refresh_status()
            return
        self.engine, self.load_error = msg.engine, ""
        self.model_label = self.engine.model_name or self.model_label
        self.adopt_defaults()
        if not self._entered:
            await self.enter_chat()
        else:
            await self.after_switch()
        await self.show_load_notes()
        await self.dispatch_queue()

    def adopt_defaults(self) -> None:
        """The engine's sampling defaults (the checkpoint's generation config; the CLI's loader has put the flags
        given over them), under what this app was given and what the slash commands set. An engine without
        `default_settings` keeps the settings as they are."""
        defaults = getattr(self.engine, "default_settings", None)
        if not callable(defaults):
            return
        try:
            base = defaults()
            known = {f.name for f in dataclasses.fields(base)}
            self.settings = dataclasses.replace(
                base, **{k: v for k, v in {**self._given, **self.chat_overrides}.items() if k in known}
            )
        except Exception:  # noqa: BLE001  (an engine's defaults that do not fit: keep ours)
            return

    async def show_load_notes(self) -> None:
        """What the engine noted while loading (the VRAM plan line first), as lines of the conversation."""
        for note in getattr(self.engine, "notes", None) or []:
            await self.add_event(str(note))

    async def switch_model(self, name: str) -> None:
        """`/model NAME`: free this engine, load NAME behind the loading view; the conversation stays and the new
        model prefills it with the next message."""
        old = [self.engine] if self.engine is not None else []
        self.engine = None
        self._switch_to = name
        self.model_label = name
        self.dropped_for_context, self._trim_noticed = 0, False
        await self.add_event(f"Switching to {name}…")
        self.query_one(LoadingView).reset(f"Switching to {name}")
        self.start_loading(name, old)

    async def after_switch(self) -> None:
        self.query_one("#main", ContentSwitcher).current = "chat"
        if self.session_id is not None:
            self._model_dirty = True
            self._sync()
        n = len([t for t in self.turns if t.role in ("user", "assistant")])
        kept = f" The conversation ({n} messages) stays: the new model reads it with your next message." if n else ""
        await self.add_event(f"Now chatting with {self.model_label}{self._where()}.{kept}{self._thinking_note()}")
        self.refresh_status()
        self.query_one(ChatInput).focus()
