"""Signals and closed pipes in `localmoe run`/`models`, each a row of one table, run as real subprocesses.

The checkpoint's greedy reply is one 4096-character token over and over (tiny_models.save_repeating_checkpoint), so
a reader that stops reading fills the pipe within a few tokens: the child is then certainly mid-reply (blocked
writing, or computing the next token) when the reader closes its end or the signal is sent, whatever the
machine's speed. Choices: a reader that goes away ends the command quietly with 141 (128 + SIGPIPE, what `cat`
or `yes` give); ctrl+c exits 130 with `localmoe: interrupted`, SIGTERM 143 with `localmoe: terminated`.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest
import tiny_models

TOKEN = "x" * 4096
# `localmoe ARGV` with ctrl+c turned into KeyboardInterrupt even when this run of the suite ignores SIGINT (a
# background job's children inherit that), as it is for a user at a terminal
CHILD = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from localmoe.cli.main import main; sys.exit(main(sys.argv[1:]))"
)


@pytest.fixture(scope="module")
def long_reply(tmp_path_factory) -> str:
    return str(tiny_models.save_repeating_checkpoint(tmp_path_factory.mktemp("signals") / "long", TOKEN))


def _start(argv, stderr_file):
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=stderr_file,
        env=dict(os.environ),
    )


def _read_some(proc, n: int, timeout: float = 120.0) -> bytes:
    """Block until the child has written `n` bytes (it is then past loading and streaming its reply)."""
    got = b""
    deadline = time.monotonic() + timeout
    while len(got) < n:
        left = deadline - time.monotonic()
        assert left > 0, "the child wrote nothing in time"
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if ready:
            chunk = os.read(proc.stdout.fileno(), n - len(got))
            assert chunk, "the child closed stdout early"
            got += chunk
    return got


def _close_reader_at_once(proc):
    proc.stdout.close()  # before the child has written anything (it is still importing)


def _close_reader_after_5_bytes(proc):  # `| head -c 5`
    assert _read_some(proc, 5) == b"xxxxx"
    proc.stdout.close()


def _signal_mid_reply(signum):
    def act(proc):
        _read_some(proc, len(TOKEN))  # streaming; not read further, so the pipe fills and the child blocks
        proc.send_signal(signum)

    return act


RUN = ["run", "{ckpt}", "hi", "--sparsity", "0"]

# (id, argv, what the parent does, exit status, the one stderr line, or "" for none)
CASES = [
    ("run-head-c5", RUN, _close_reader_after_5_bytes, 141, ""),
    ("run-reader-gone", RUN, _close_reader_at_once, 141, ""),
    ("run-json-reader-gone", RUN + ["--json", "--max-new-tokens", "48"], _close_reader_at_once, 141, ""),  # short:
    # the JSON line is written once the reply is done
    ("models-reader-gone", ["models"], _close_reader_at_once, 141, ""),
    ("models-json-reader-gone", ["models", "--json"], _close_reader_at_once, 141, ""),
    ("run-sigterm-mid-reply", RUN, _signal_mid_reply(signal.SIGTERM), 143, "localmoe: terminated"),
    ("run-sigint-mid-reply", RUN, _signal_mid_reply(signal.SIGINT), 130, "localmoe: interrupted"),
    ("run-quiet-sigterm-mid-reply", RUN + ["--quiet"], _signal_mid_reply(signal.SIGTERM), 143, "localmoe: terminated"),
]


@pytest.mark.parametrize("argv, act, status, line", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_signal_or_closed_pipe(long_reply, tmp_path, argv, act, status, line):
    err_path = tmp_path / "stderr"
    with open(err_path, "wb") as err_file:
        proc = _start([a.replace("{ckpt}", long_reply) for a in argv], err_file)
        try:
            act(proc)
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout and not proc.stdout.closed:
                proc.stdout.close()
    err = err_path.read_text(errors="replace")
    assert code == status, err
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err
    assert err == (line + "\n" if line else ""), err
