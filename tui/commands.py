"""Slash commands of `localmoe chat`: their table, parsing of `/name ARG` input, and the
command-palette provider that offers the same commands in Textual's palette (ctrl+p).

`CommandsMixin` carries the command handlers that `ChatApp` mixes in; the chat flow
itself (sending, streaming, saving) stays in app.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from textual.command import DiscoveryHit, Hit, Hits, Provider

from localmoe.tui.history import HistoryError, render_markdown, title_of
from localmoe.tui.widgets import ChatInput, MessageView, SessionPicker, describe_error

FORCE_FLAG = "--force"


@dataclass(frozen=True)
class CommandSpec:
    name: str
    usage: str  # argument synopsis, "" when it takes none
    help: str
    arg: str = "none"  # "none", "optional" or "required"


COMMANDS: list[CommandSpec] = [
    CommandSpec("help", "", "Show the commands and keys"),
    CommandSpec("new", "", "Start a new conversation"),
    CommandSpec("system", "[TEXT|off]", "Show or set the system prompt (off clears it)", "optional"),
    CommandSpec("sparsity", "S", "Set the decode sparsity target, 0 = dense (may calibrate)", "required"),
    CommandSpec("temp", "T", "Set the sampling temperature, 0 = greedy", "required"),
    CommandSpec("regenerate", "", "Drop the last reply and generate it again"),
    CommandSpec("export", "[FILE] [--force]",
                "Write this conversation to a Markdown file (an existing FILE is kept unless --force)", "optional"),
    CommandSpec("sessions", "[ID]", "List saved conversations and resume one", "optional"),
    CommandSpec("stats", "", "Show the engine figures for the last reply"),
    CommandSpec("quit", "", "Quit (ctrl+q)"),
]
BY_NAME = {spec.name: spec for spec in COMMANDS}

KEYS_HELP = [
    ("Enter", "send"),
    ("ctrl+j / shift+enter", "new line"),
    ("Esc", "cancel the reply in flight"),
    ("ctrl+p", "command palette"),
    ("ctrl+q", "quit"),
]


class CommandError(ValueError):
    """User input that looks like a command but is not a valid one; the message says why."""


@dataclass(frozen=True)
class ParsedCommand:
    name: str
    arg: str = ""
    number: float | None = None  # the parsed argument of /sparsity, /temp and /sessions ID


def parse_command(text: str) -> ParsedCommand | None:
    """`/name arg` -> ParsedCommand; None for ordinary chat text (including `//...`, sent as `/...`)."""
    text = text.strip()
    if not text.startswith("/") or text.startswith("//"):
        return None
    name, _, arg = text[1:].partition(" ")
    name, arg = name.strip().lower(), arg.strip()
    spec = BY_NAME.get(name)
    if spec is None:
        matches = [s.name for s in COMMANDS if s.name.startswith(name)] if name else []
        if len(matches) != 1:
            raise CommandError(f"unknown command /{name}; type /help for the list")
        spec = BY_NAME[matches[0]]
    if spec.arg == "none" and arg:
        raise CommandError(f"/{spec.name} takes no argument")
    if spec.arg == "required" and not arg:
        raise CommandError(f"usage: /{spec.name} {spec.usage}")
    number = None
    if spec.name in ("sparsity", "temp") or (spec.name == "sessions" and arg):
        try:
            number = float(arg)
        except ValueError:
            raise CommandError(f"/{spec.name} needs a number, not {arg!r}") from None
        if spec.name == "sparsity" and not 0.0 <= number < 1.0:
            raise CommandError("sparsity must be in [0, 1), e.g. /sparsity 0.5")
        if spec.name == "temp" and not 0.0 <= number <= 5.0:
            raise CommandError("temperature must be between 0 and 5")
    return ParsedCommand(spec.name, arg, number)


def help_markdown() -> str:
    lines = ["**Commands** (also in the palette, ctrl+p)", ""]
    lines += [f"- `/{s.name}{' ' + s.usage if s.usage else ''}`: {s.help}" for s in COMMANDS]
    lines += ["", "**Keys**", ""] + [f"- {key}: {action}" for key, action in KEYS_HELP]
    return "\n".join(lines)


class ChatCommands(Provider):
    """The slash commands in the command palette. Commands with arguments prefill the input."""

    def _choose(self, spec: CommandSpec) -> None:
        chooser = getattr(self.app, "palette_command", None)
        if chooser is not None:
            chooser(spec)

    async def discover(self) -> Hits:
        for spec in COMMANDS:
            yield DiscoveryHit(f"/{spec.name}", partial(self._choose, spec), help=spec.help)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query.lstrip("/"))
        for spec in COMMANDS:
            score = matcher.match(spec.name)
            if score > 0:
                yield Hit(score, matcher.highlight(f"/{spec.name}"), partial(self._choose, spec),
                          text=f"/{spec.name}", help=spec.help)


class CommandsMixin:
    """The `/command` handlers of ChatApp (relies on its engine, store, turns and views)."""

    async def run_command(self, cmd: ParsedCommand) -> None:
        handler = getattr(self, f"cmd_{cmd.name}")
        try:
            await handler(cmd)
        except Exception as exc:  # a failing command is reported, never a crash
            self.notify(f"/{cmd.name} failed: {type(exc).__name__}: {exc}", severity="error", timeout=8)

    def palette_command(self, spec: CommandSpec) -> None:
        """A command chosen in the palette: run it, or prefill the input when it needs an argument."""
        if spec.arg == "required" or spec.name == "system":
            prompt = self.query_one(ChatInput)
            prompt.text = f"/{spec.name} "
            prompt.move_cursor(prompt.document.end)
            prompt.focus()
        else:
            self.run_worker(self.run_command(ParsedCommand(spec.name)))

    async def cmd_help(self, cmd: ParsedCommand) -> None:
        await self.add_note(help_markdown())

    async def cmd_new(self, cmd: ParsedCommand) -> None:
        if self.reply is None and self.may_drop_conversation("/new"):
            await self.clear_conversation()
            self.notify("New conversation")

    async def cmd_system(self, cmd: ParsedCommand) -> None:
        if not cmd.arg:
            await self.add_note(f"System prompt: {self.system}" if self.system else "No system prompt set.")
            return
        self.system = None if cmd.arg.lower() == "off" else cmd.arg
        if self.session_id is not None:
            self._system_dirty = True
            self._sync()
        await self.add_note(f"System prompt: {self.system}" if self.system else "System prompt cleared.", "system")

    async def cmd_temp(self, cmd: ParsedCommand) -> None:
        self.settings = replace(self.settings, temperature=cmd.number)
        self.notify(f"Temperature {cmd.number:g}" + (" (greedy)" if cmd.number == 0 else ""))

    async def cmd_sparsity(self, cmd: ParsedCommand) -> None:
        if not self.can_start():
            return
        self.busy = "setting sparsity…"
        self.refresh_status()
        self._spawn(self._sparsity_thread, cmd.number)

    def _sparsity_thread(self, sparsity: float) -> None:
        from localmoe.tui.app import Progress  # app.py imports this module

        def progress(stage: str, done: int, total: int | None) -> None:
            self._post(Progress(stage, done, total))

        try:
            self.engine.set_sparsity(sparsity, progress)
            note = f"Sparsity target {sparsity:g}"
        except Exception as exc:
            note = describe_error(exc)[0]
        try:
            self.call_from_thread(self._sparsity_done, note)
        except RuntimeError:
            pass

    def _sparsity_done(self, note: str) -> None:
        self.busy = ""
        self.refresh_status()
        self.notify(note, severity="error" if note.startswith("localmoe: error") else "information")

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

    def export_text(self) -> str:
        """The conversation as shown (from memory: what the history could not save is in it too), as Markdown safe
        to print in a terminal."""
        turns = [t for t in self.turns if t.role in ("user", "assistant")]
        first_user = next((t.content for t in turns if t.role == "user"), "")
        return render_markdown(title_of(first_user), self.model_label, time.time(), self.system,
                               ((t.role, t.content, t.status) for t in turns))

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
            path = next(p for n in range(1, 10_000)
                        if not (p := Path(f"{stem}.md" if n == 1 else f"{stem}-{n}.md")).exists())
        try:
            with open(path, "w" if force else "x", encoding="utf-8") as out:
                out.write(self.export_text())
        except FileExistsError:
            self.notify(f"{path} exists: give another name, or /export {name} {FORCE_FLAG} to overwrite it.",
                        severity="warning", timeout=10)
            return
        self.notify(f"Exported to {path}")

    async def cmd_sessions(self, cmd: ParsedCommand) -> None:
        if self.reply is not None:
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

        self.push_screen(SessionPicker(sessions), chosen)

    async def cmd_stats(self, cmd: ParsedCommand) -> None:
        if self.engine is None:
            return
        rows = [f"| {k} | {v:.3g} |" if isinstance(v, float) else f"| {k} | {v} |"
                for k, v in self.engine.stats.as_json().items()]
        await self.add_note("\n".join(["| figure | value |", "|---|---|", *rows]))

    async def cmd_quit(self, cmd: ParsedCommand) -> None:
        await self.action_quit()

    async def clear_conversation(self) -> None:
        await self.query_one("#conversation").remove_children()
        self.session_id, self.turns = None, []
        self._system_dirty = self._drop_confirmed = self._trim_noticed = False
        self.dropped_for_context = 0

    async def show_session(self, session_id: int) -> None:
        """Resume a saved conversation: its system prompt and messages become the current ones. A reply stored
        as 'streaming' was cut off (its process killed): it is shown, and saved, as interrupted."""
        from localmoe.tui.app import Turn

        try:
            info = self.store.session(session_id) if self.store is not None else None
            stored = self.store.messages(info.id) if info is not None else []
        except HistoryError as exc:
            self._history_failed(exc)
            return
        if info is None:
            self.notify(f"No saved conversation #{session_id}.", severity="error")
            return
        await self.clear_conversation()
        self.session_id, self.system = info.id, info.system
        self.turns = []
        for m in stored:
            status = "interrupted" if m.status == "streaming" else m.status
            self.turns.append(Turn(m.id, m.role, m.content, status, MessageView(m.role, m.content, status),
                                   saved=status == m.status))
        self._sync()
        notes = [MessageView("system", f"System prompt: {info.system}")] if info.system else []
        await self.query_one("#conversation").mount_all(notes + [t.view for t in self.turns])
        self.query_one("#conversation").scroll_end(animate=False)
        self.query_one(ChatInput).focus()
        self.notify(f"Resumed #{info.id}: {info.title or '(empty)'}")

