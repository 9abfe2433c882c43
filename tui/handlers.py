"""The `/command` handlers of `localmoe chat` (CommandsMixin, mixed into ChatApp); the command table and parsing are
in commands.py.

Every command confirms in the conversation: a system line (ChatApp.add_event, plain text) or a note; a setting's
command alone shows its value. Refusals (the model is busy, a file exists) are toasts, and the typed text stays.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import replace
from pathlib import Path

from localmoe.safe_text import for_line
from localmoe.tui.commands import BY_NAME, SAMPLING, CommandSpec, ParsedCommand, help_markdown
from localmoe.tui.history import HistoryError, render_markdown, title_of
from localmoe.tui.prompts import accepts, context_limit, supports_thinking
from localmoe.tui.replies import Progress
from localmoe.tui.sessions import SessionPicker
from localmoe.tui.stats_view import stats_markdown, stats_rows
from localmoe.tui.widgets import ChatInput, describe_error

FORCE_FLAG = "--force"


class CommandsMixin:
    """The `/command` handlers of ChatApp (relies on its engine, store, turns, views and add_event)."""

    async def run_command(self, cmd: ParsedCommand) -> None:
        handler = getattr(self, f"cmd_{cmd.name}")
        try:
            await handler(cmd)
        except Exception as exc:  # a failing command is reported, never a crash
            self.notify(f"/{cmd.name} failed: {type(exc).__name__}: {exc}", severity="error", timeout=8)

    def palette_command(self, spec: CommandSpec) -> None:
        """A command chosen in the palette: run it, or prefill the input when it takes a setting."""
        if spec.arg == "required" or spec.prefill:
            prompt = self.query_one(ChatInput)
            prompt.text = f"/{spec.name} "
            prompt.move_cursor(prompt.document.end)
            prompt.focus()
        else:
            self.run_worker(self.run_command(ParsedCommand(spec.name)))

    async def cmd_help(self, cmd: ParsedCommand) -> None:
        await self.add_note(help_markdown(thinking=self.engine is None or supports_thinking(self.engine)))

    async def cmd_new(self, cmd: ParsedCommand) -> None:
        if self.reply is None and self.may_drop_conversation("/new"):
            await self.clear_conversation()
            await self.add_event("New conversation.")

    async def cmd_system(self, cmd: ParsedCommand) -> None:
        if not cmd.arg:
            await self.add_note(f"System prompt: {self.system}" if self.system else "No system prompt set.")
            return
        self.system = None if cmd.arg.lower() == "off" else cmd.arg
        if self.session_id is not None:
            self._system_dirty = True
            self._sync()
        await self.add_note(f"System prompt: {self.system}" if self.system else "System prompt cleared.", "system")

    # sampling --------------------------------------------------------------------------------

    def _sampling_value(self, name: str) -> tuple[str, str]:
        """(the setting's value, what it means when it turns the setting off: " (greedy)", " (off)" or "")."""
        spec = SAMPLING[name]
        value = getattr(self.settings, spec.field)
        meaning = (" (greedy)" if name == "temp" else " (off)") if value == spec.off else ""
        return (f"{value:g}" if isinstance(value, float) else str(value)), meaning

    async def _cmd_sampling(self, cmd: ParsedCommand) -> None:
        spec = SAMPLING[cmd.name]
        if spec.field not in {f.name for f in dataclasses.fields(self.settings)}:
            await self.add_event(f"{spec.label}: not available with this localmoe version.")
            return
        if cmd.number is None:
            value, meaning = self._sampling_value(cmd.name)
            usage = BY_NAME[cmd.name].usage.strip("[]")
            await self.add_event(f"{spec.label} {value}{meaning}. /{cmd.name} {usage} changes it.")
            return
        before, _ = self._sampling_value(cmd.name)
        self.settings = replace(self.settings, **{spec.field: spec.kind(cmd.number)})
        self.chat_overrides[spec.field] = spec.kind(cmd.number)  # kept when /model loads another model
        value, meaning = self._sampling_value(cmd.name)
        note = f"{spec.label} {value}{meaning}, was {before}."
        if cmd.name in ("topp", "topk") and self.settings.temperature == 0 and cmd.number != spec.off:
            note += " It applies when the temperature is above 0 (/temp)."
        await self.add_event(note)

    cmd_temp = cmd_topp = cmd_topk = cmd_penalty = _cmd_sampling

    # thinking --------------------------------------------------------------------------------

    def think_state(self) -> str:
        if self.think is None:
            return "the model's default"
        return "on" if self.think else "off"

    async def cmd_think(self, cmd: ParsedCommand) -> None:
        if self.engine is not None and not supports_thinking(self.engine):
            await self.add_event(f"{for_line(self.model_label)} has no thinking mode: /think does nothing here.")
            return
        if not cmd.arg:
            await self.add_event(f"Thinking: {self.think_state()}. /think on|off changes it.")
            return
        self.think = cmd.arg.lower() == "on"
        await self.add_event(
            "Thinking on: replies start with the model's reasoning, shown collapsed."
            if self.think
            else "Thinking off: the model answers without reasoning first."
        )

    # sparsity --------------------------------------------------------------------------------

    async def cmd_sparsity(self, cmd: ParsedCommand) -> None:
        if cmd.number is None:
            stats = self.engine.stats
            realised = (
                f", {stats.sparsity_realized:.0%} realised in the last reply"
                if stats.generated_tokens and stats.sparsity_target
                else ""
            )
            await self.add_event(
                f"Sparsity target {stats.sparsity_target:.0%}{realised}. /sparsity S changes it (0 = dense)."
            )
            return
        if not self.can_start():
            return
        self.busy = "setting sparsity…"
        self.refresh_status()
        self._spawn(self._sparsity_thread, cmd.number)

    def _sparsity_thread(self, sparsity: float) -> None:
        def progress(stage: str, done: int, total: int | None) -> None:
            self._post(Progress(stage, done, total))

        try:
            self.engine.set_sparsity(sparsity, progress)
            note = f"Sparsity target {sparsity:.0%}" + (" (dense experts)." if sparsity == 0 else ".")
        except Exception as exc:
            note = describe_error(exc)[0]
        try:
            self.call_from_thread(self._sparsity_done, note)
        except RuntimeError:
            pass

    async def _sparsity_done(self, note: str) -> None:
        self.busy = ""
        self.refresh_status()
        if note.startswith("localmoe: error"):
            self.notify(note, severity="error")
        await self.add_event(note)
        await self.dispatch_queue()

    # conversation ----------------------------------------------------------------------------

    async def cmd_regenerate(self, cmd: ParsedCommand) -> None:
        if not self.can_start():
            return
        if self.turns and self.turns[-1].role == "assistant":
            last = self.turns.pop()
            if last.id:
                self._pending_deletes.append(last.id)  # deleted at the next write (start_reply's)
            if last.view is not None:
                await last.view.remove()
        if not self.turns or self.turns[-1].role != "user":
            self.notify("Nothing to regenerate.", severity="warning")
            return
        await self.start_reply()

    async def cmd_cancel(self, cmd: ParsedCommand) -> None:
        dropped = await self.drop_queue()
        cancelled = self.reply is not None
        self.action_cancel_reply()
        if dropped or cancelled:
            parts = (["reply cancelled"] if cancelled else []) + (
                [f"{dropped} queued message{'s' if dropped != 1 else ''} dropped"] if dropped else []
            )
            await self.add_event(", ".join(parts).capitalize() + ".")
        else:
            await self.add_event("Nothing to cancel.")

    def export_text(self) -> str:
        """The conversation as shown (from memory: what the history could not save is in it too), as Markdown safe
        to print in a terminal; reasoning marked apart from the answers."""
        turns = [t for t in self.turns if t.role in ("user", "assistant")]
        first_user = next((t.content for t in turns if t.role == "user"), "")
        return render_markdown(
            title_of(first_user),
            self.model_label,
            time.time(),
            self.system,
            ((t.role, t.content, t.status, t.reasoning) for t in turns),
        )

    async def cmd_export(self, cmd: ParsedCommand) -> None:
        """`/export [FILE] [--force]`: never overwrites an existing file unless --force; without FILE, the first
        free name of localmoe-chat-ID.md, localmoe-chat-ID-2.md, ..."""
        if not self.turns:
            self.notify("Nothing to export yet.", severity="warning")
            return
        words = cmd.arg.split()
        force = FORCE_FLAG in words
        name = " ".join(w for w in words if w != FORCE_FLAG) if force else cmd.arg
        if name:
            path = Path(name).expanduser()
        else:
            stem = f"localmoe-chat-{self.session_id or 'unsaved'}"
            path = next(
                p for n in range(1, 10_000) if not (p := Path(f"{stem}.md" if n == 1 else f"{stem}-{n}.md")).exists()
            )
        try:
            with open(path, "w" if force else "x", encoding="utf-8") as out:
                out.write(self.export_text())
        except FileExistsError:
            self.notify(
                f"{path} exists: give another name, or /export {name} {FORCE_FLAG} to overwrite it.",
                severity="warning",
                timeout=10,
            )
            return
        await self.add_event(f"Exported to {path}.")

    # sessions --------------------------------------------------------------------------------

    async def cmd_sessions(self, cmd: ParsedCommand) -> None:
        if self.reply is not None:
            self.notify("Wait for the reply to finish (Esc cancels it).", severity="warning")
            return
        if self.store is None and not self._open_store():
            return  # _open_store has said why
        if cmd.number is not None:
            if self.may_drop_conversation(f"/sessions {int(cmd.number)}"):
                await self.show_session(int(cmd.number))
            return
        try:
            sessions = self.store.sessions()
        except HistoryError as exc:
            self._history_failed(exc)
            return

        async def chosen(session_id: int | None) -> None:
            if session_id and self.may_drop_conversation("/sessions"):
                await self.show_session(session_id)

        self.push_screen(SessionPicker(sessions, rename=self.rename_session, delete=self.delete_session), chosen)

    def rename_session(self, session_id: int, title: str) -> str | None:
        try:
            return self.store.rename_session(session_id, title) if self.store is not None else None
        except HistoryError as exc:
            self._history_failed(exc)
            return None

    def delete_session(self, session_id: int) -> bool:
        """Delete a saved conversation; the open one is then cleared from the screen too (its rows are gone)."""
        try:
            deleted = self.store.delete_session(session_id) if self.store is not None else False
        except HistoryError as exc:
            self._history_failed(exc)
            return False
        if deleted and session_id == self.session_id:
            self.run_worker(self._deleted_open_session(session_id))
        return deleted

    async def _deleted_open_session(self, session_id: int) -> None:
        self._pending_deletes.clear()
        await self.clear_conversation()
        await self.add_event(f"Conversation #{session_id} deleted; this is a new one.")

    # figures and models ----------------------------------------------------------------------

    async def cmd_stats(self, cmd: ParsedCommand) -> None:
        if self.engine is None:
            return
        think = self.think_state() if supports_thinking(self.engine) else None
        rows = stats_rows(
            self.engine,
            self.settings,
            model=self.model_label,
            think=think,
            context=context_limit(self.engine),
            dropped=self.dropped_for_context,
        )
        await self.add_note(stats_markdown(rows))

    async def cmd_model(self, cmd: ParsedCommand) -> None:
        if not cmd.arg:
            device = f" on {for_line(self.engine.device)}" if self.engine is not None and self.engine.device else ""
            await self.add_event(
                f"Model: {for_line(self.model_label)}{device}. /model NAME switches to another "
                "(`localmoe models` lists them); the conversation stays."
            )
            return
        if self._load is None or not accepts(self._load, "model"):
            await self.add_event("This chat cannot load another model: quit and run `localmoe chat NAME`.")
            return
        if self.reply is not None or self.busy or self.loading:
            self.notify("Wait for the reply or the load to finish (Esc cancels a reply).", severity="warning")
            return
        await self.switch_model(cmd.arg)

    async def cmd_quit(self, cmd: ParsedCommand) -> None:
        await self.action_quit()
