"""The user's text as the subcommands take it, checked before anything loads: PROMPT or stdin, --system, --stop,
and text files given as flags (--calibration-text, --text). Text that is not UTF-8, empty, or unreadable is a
one-line usage error (exit 2).
"""

from __future__ import annotations

import sys
from pathlib import Path

from localmoe.cli.terminal import isatty
from localmoe.errors import UsageError


def stops(args) -> tuple[str, ...]:
    out = []
    for s in args.stop or []:
        text = utf8(s, "--stop")
        if not text:
            raise UsageError("--stop is empty: give the text that ends the reply")
        out.append(text)
    return tuple(out)


def utf8(data: bytes | str, what: str) -> str:
    """`data` as text, or a UsageError naming the first byte that is not UTF-8. A str may carry the bytes the
    locale could not decode (argv, a surrogateescape'd stream) as lone surrogates: they are checked the same way."""
    if isinstance(data, str):
        try:
            data.encode("utf-8")
            return data
        except UnicodeEncodeError:
            try:
                data = data.encode("utf-8", "surrogateescape")
            except UnicodeEncodeError:
                data = data.encode("utf-8", "surrogatepass")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(
            f"{what} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}): "
            "convert it to UTF-8 first (e.g. `iconv -f LATIN1 -t UTF-8`)"
        ) from None


def read_prompt(prompt: str) -> str:
    """PROMPT, or stdin when it is '-' (read as bytes and decoded as UTF-8; a leading BOM dropped)."""
    if prompt != "-":
        return utf8(prompt, "PROMPT")
    if sys.stdin is None or isatty(sys.stdin):
        raise UsageError("no prompt: pass PROMPT or pipe it on stdin")
    raw = getattr(sys.stdin, "buffer", None)
    text = utf8(raw.read() if raw is not None else sys.stdin.read(), "stdin")
    return text.removeprefix("\ufeff").replace("\r\n", "\n")


def text_file(path: str | None, flag: str) -> None:
    """A text file flag (--calibration-text, --text): readable UTF-8 with some text, checked before the load."""
    if path is None:
        return
    p = Path(path).expanduser()
    try:
        data = p.read_bytes()
    except IsADirectoryError:
        raise UsageError(f"{flag} {path} is a directory: give a text file") from None
    except OSError as e:
        raise UsageError(f"cannot read {flag} {path}: {e.strerror or e}") from None
    if not utf8(data, f"{flag} {path}").strip():
        raise UsageError(f"{flag} {path} is empty: give a file with some text")


def system_prompt(args) -> str | None:
    if args.system is None:
        return None
    if getattr(args, "raw", False):
        raise UsageError(
            "--raw sends the prompt without the chat template, which is what places --system: "
            "put the system text in PROMPT, or drop --raw"
        )
    system = utf8(args.system, "--system")
    if not system.strip():
        raise UsageError("--system is empty: give the system prompt's text, or leave --system out")
    return system
