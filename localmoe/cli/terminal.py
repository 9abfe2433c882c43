"""The `localmoe` command's streams: one-line notices on stderr made safe for a terminal, the load progress line,
exit statuses for signals and a closed pipe, SIGTERM turned into `Terminated`, a piped stdout abandoned when
interrupted, and library chatter kept for --debug.
"""

from __future__ import annotations

import os
import sys

from localmoe.errors import Terminated
from localmoe.safe_text import for_line

EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE
EXIT_TERMINATED = 143  # 128 + SIGTERM


def say(line: str) -> None:
    """One line on stderr, made safe for a terminal (it may carry paths, model names or the user's input)."""
    try:
        print(for_line(line), file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr closed or gone: nowhere left to say it
        pass


def stdout_to_devnull() -> None:
    """After EPIPE: point stdout's descriptor at /dev/null so the interpreter's final flush does not fail again."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(fd, sys.stdout.fileno())
        finally:
            os.close(fd)
    except (OSError, ValueError, AttributeError):  # not a real file (tests capture stdout)
        pass


def abandon_piped_stdout() -> None:
    """Interrupted: text still buffered for a pipe whose reader has stopped reading would block the interpreter's
    final flush forever, so a pipe's leftovers are dropped (every token was flushed as it came: at most the one
    being written is lost). A terminal or a file is left alone."""
    import stat

    try:
        mode = os.fstat(sys.stdout.fileno()).st_mode
    except (OSError, ValueError, AttributeError):
        return
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
        stdout_to_devnull()


def raise_on_sigterm():
    """SIGTERM raises `Terminated` in the main thread, so the command unwinds like ctrl+c and exits 143 with one
    line; a second SIGTERM while unwinding ends the process at once. -> a function restoring the old handler."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except (ValueError, OSError):
        return None
    return lambda: signal.signal(signal.SIGTERM, previous)


def isatty(stream) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


def quiet_libraries() -> None:
    """Library chatter (fallback notices, deprecations) is for --debug; users see localmoe's own lines."""
    import logging
    import warnings

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # retry chatter: the failure is one line of ours


class Progress:
    """A ProgressFn drawing one updating line per stage on stderr (only on a terminal). Each stage ends as one line:
    a final update repeated without updates between (the loader reports its last layer and then the end of the
    load, both done == total) draws nothing."""

    def __init__(self):
        self.tty = isatty(sys.stderr)
        self.open: str | None = None  # the stage whose line is drawn and not yet ended
        self.ended: tuple | None = None  # (stage, total) of the line ended last

    def __call__(self, stage: str, done: int, total: int | None) -> None:
        if stage.startswith("note: "):  # bench's notices come this way
            self.end_line()
            say(f"localmoe: {stage}")
            return
        if stage == "download" or not self.tty:
            return  # huggingface_hub draws its own bars
        final = bool(total) and done >= total
        if final and self.open is None and self.ended == (stage, total):
            return
        if self.open not in (None, stage):
            self.end_line()
        self.open, self.ended = stage, None
        frac = f"{done}/{total}" if total else str(done)
        try:
            sys.stderr.write(f"\r{for_line(stage):>10}: {frac}")
            if final:
                self.end_line()
                self.ended = (stage, total)
            sys.stderr.flush()
        except (OSError, ValueError):
            self.tty = False

    def end_line(self) -> None:
        """End the line being drawn (before a notice or the next stage)."""
        if self.open is not None:
            self.open = None
            try:
                sys.stderr.write("\n")
            except (OSError, ValueError):
                pass


def stderr_progress() -> Progress:
    return Progress()
