"""The two kinds of error a user can meet, and how the CLI reports them.

`UsageError` (exit 2): bad input the user can fix by changing the command.
`RuntimeFailure` (exit 1): the command was fine but something failed (corrupt file, no GPU, out of memory).
Both carry a one-line message that says what is wrong and what to do; the CLI prints
`localmoe: error: <message>` on stderr and shows a traceback only with `--debug`.
"""

from __future__ import annotations


class LocalmoeError(Exception):
    exit_code = 1

    def __str__(self) -> str:  # one line, always
        return " ".join(str(self.args[0]).split()) if self.args else self.__class__.__name__


class UsageError(LocalmoeError):
    exit_code = 2


class RuntimeFailure(LocalmoeError):
    exit_code = 1


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread by the CLI's handler so that a command unwinds (and its `finally` blocks
    run) as on ctrl+c; the CLI exits 143 (128 + SIGTERM) with one line."""
