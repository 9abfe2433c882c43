"""Slash commands of `localmoe chat`: their table, parsing of `/name ARG` input, and the
command-palette provider that offers the same commands in Textual's palette (ctrl+p).

The handlers that ChatApp mixes in are in handlers.py. A setting's command alone (`/temp`,
`/topp`, `/topk`, `/penalty`, `/sparsity`, `/think`, `/system`, `/model`) shows its value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

from localmoe.tui.prompts import supports_thinking


@dataclass(frozen=True)
class CommandSpec:
    name: str
    usage: str  # argument synopsis, "" when it takes none
    help: str
    arg: str = "none"  # "none", "optional" or "required"
    prefill: bool = False  # chosen in the palette: put `/name ` in the input for its argument


@dataclass(frozen=True)
class Sampling:
    """A sampling setting's command: the GenerationSettings field, its name for people, its bounds."""

    field: str
    label: str
    kind: type
    lo: float
    hi: float | None
    lo_open: bool = False
    off: float | None = None  # the value that turns it off
    example: str = ""


SAMPLING = {
    "temp": Sampling("temperature", "Temperature", float, 0.0, 5.0, off=0.0, example="0.7"),
    "topp": Sampling("top_p", "Top-p", float, 0.0, 1.0, lo_open=True, off=1.0, example="0.9"),
    "topk": Sampling("top_k", "Top-k", int, 0, None, off=0, example="40"),
    "penalty": Sampling(
        "repetition_penalty", "Repetition penalty", float, 0.0, 5.0, lo_open=True, off=1.0, example="1.1"
    ),
}

COMMANDS: list[CommandSpec] = [
    CommandSpec("help", "", "Show the commands and keys"),
    CommandSpec("new", "", "Start a new conversation"),
    CommandSpec("system", "[TEXT|off]", "Show or set the system prompt (off clears it)", "optional", True),
    CommandSpec("model", "[NAME]", "Show the model, or switch to another (the conversation stays)", "optional", True),
    CommandSpec(
        "think", "[on|off]", "Show or set the model's thinking mode (reasoning before the answer)", "optional", True
    ),
    CommandSpec("temp", "[T]", "Show or set the sampling temperature, 0 = greedy", "optional", True),
    CommandSpec("topp", "[P]", "Show or set top-p (nucleus) sampling, 1 = off", "optional", True),
    CommandSpec("topk", "[K]", "Show or set top-k sampling, 0 = off", "optional", True),
    CommandSpec("penalty", "[R]", "Show or set the repetition penalty, 1 = off", "optional", True),
    CommandSpec(
        "sparsity", "[S]", "Show or set the decode sparsity target, 0 = dense (may calibrate)", "optional", True
    ),
    CommandSpec("regenerate", "", "Drop the last reply and generate it again"),
    CommandSpec("cancel", "", "Cancel the reply in flight and drop the queued messages"),
    CommandSpec(
        "export",
        "[FILE] [--force]",
        "Write this conversation to a Markdown file (an existing FILE is kept unless --force)",
        "optional",
    ),
    CommandSpec("sessions", "[ID]", "Saved conversations: resume (Enter), rename (r), delete (d)", "optional"),
    CommandSpec("stats", "", "Show the figures of the model and the last reply"),
    CommandSpec("quit", "", "Quit (ctrl+q)"),
]
BY_NAME = {spec.name: spec for spec in COMMANDS}
WITHOUT_ENGINE = {"quit", "cancel", "model"}  # what runs while no model is ready (loading, or its load failed)

KEYS_HELP = [
    ("Enter", "send (while the model loads or replies: queue the message)"),
    ("ctrl+j / shift+enter", "new line"),
    ("Esc", "take the last queued message back (input empty), else cancel the reply"),
    ("ctrl+c", "cancel the reply (copies a selection in the input)"),
    ("click “▶ Reasoning” (or Tab to it, Enter)", "show or hide a reply's reasoning"),
    ("ctrl+p", "command palette"),
    ("ctrl+q", "quit (the only key that quits)"),
]


class CommandError(ValueError):
    """User input that looks like a command but is not a valid one; the message says why."""


@dataclass(frozen=True)
class ParsedCommand:
    name: str
    arg: str = ""
    number: float | None = None  # the parsed argument of /sparsity, the sampling commands and /sessions ID


def _number(spec_name: str, arg: str) -> float:
    sampling = SAMPLING.get(spec_name)
    kind = sampling.kind if sampling else (int if spec_name == "sessions" else float)
    try:
        value = float(arg)
        if kind is int and value != int(value):
            raise ValueError
    except (ValueError, OverflowError):
        what = "a whole number" if kind is int else "a number"
        raise CommandError(f"/{spec_name} needs {what}, not {arg!r}") from None
    if not math.isfinite(value):
        raise CommandError(f"/{spec_name} needs a finite number")
    if sampling is not None:
        low_ok = value > sampling.lo if sampling.lo_open else value >= sampling.lo
        if not low_ok or (sampling.hi is not None and value > sampling.hi):
            low = f"above {sampling.lo:g}" if sampling.lo_open else f"at least {sampling.lo:g}"
            high = f" and at most {sampling.hi:g}" if sampling.hi is not None else ""
            raise CommandError(f"{sampling.label.lower()} must be {low}{high}, e.g. /{spec_name} {sampling.example}")
        return int(value) if kind is int else value
    if spec_name == "sparsity" and not 0.0 <= value < 1.0:
        raise CommandError("sparsity must be in [0, 1), e.g. /sparsity 0.5")
    return value


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
            hint = f" (/{', /'.join(matches)}?)" if len(matches) > 1 else "; type /help for the list"
            raise CommandError(f"unknown command /{name}{hint}")
        spec = BY_NAME[matches[0]]
    if spec.arg == "none" and arg:
        raise CommandError(f"/{spec.name} takes no argument")
    if spec.arg == "required" and not arg:
        raise CommandError(f"usage: /{spec.name} {spec.usage}")
    if spec.name == "think" and arg and arg.lower() not in ("on", "off"):
        raise CommandError("usage: /think on|off")
    number = None
    if arg and (spec.name in SAMPLING or spec.name in ("sparsity", "sessions")):
        number = _number(spec.name, arg)
    return ParsedCommand(spec.name, arg, number)


def help_markdown(thinking: bool = True) -> str:
    """The commands and keys; /think only for a model with a thinking mode."""
    specs = [s for s in COMMANDS if thinking or s.name != "think"]
    lines = ["**Commands** (also in the palette, ctrl+p)", ""]
    lines += [f"- `/{s.name}{' ' + s.usage if s.usage else ''}`: {s.help}" for s in specs]
    lines += ["", "**Keys**", ""] + [f"- {key}: {action}" for key, action in KEYS_HELP]
    return "\n".join(lines)


class ChatCommands(Provider):
    """The slash commands in the command palette. Commands with arguments prefill the input."""

    def _choose(self, spec: CommandSpec) -> None:
        chooser = getattr(self.app, "palette_command", None)
        if chooser is not None:
            chooser(spec)

    def _specs(self) -> list[CommandSpec]:
        thinking = supports_thinking(getattr(self.app, "engine", None))
        return [s for s in COMMANDS if thinking or s.name != "think"]

    async def discover(self) -> Hits:
        for spec in self._specs():
            yield DiscoveryHit(f"/{spec.name}", partial(self._choose, spec), help=spec.help)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query.lstrip("/"))
        for spec in self._specs():
            score = matcher.match(spec.name)
            if score > 0:
                yield Hit(
                    score,
                    matcher.highlight(f"/{spec.name}"),
                    partial(self._choose, spec),
                    text=f"/{spec.name}",
                    help=spec.help,
                )
