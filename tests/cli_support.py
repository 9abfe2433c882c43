"""What the CLI tests share (test_cli.py, test_cli_terminal.py, test_cli_hub.py): the tiny model they run and `run`,
the CLI in-process with its status and captured output, and `on_terminal`, the CLI on a pseudo-terminal (also
test_reasoning.py)."""

from __future__ import annotations

import os
import pty
import subprocess
import sys

from conftest import repo_id

from localmoe.cli.main import main

MODEL = repo_id("qwen3_moe")


def run(capsys, *args):
    code = main(list(args))
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def on_terminal(argv: list[str]) -> tuple[int, bytes]:
    """Run the CLI with stdout and stderr on a pseudo-terminal, as a user at a terminal would: (status, what the
    terminal received)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "localmoe", *argv],
        stdin=subprocess.DEVNULL,
        stdout=follower,
        stderr=follower,
        env=dict(os.environ),
    )
    os.close(follower)
    received = b""
    try:
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            received += chunk
    finally:
        os.close(leader)
    return proc.wait(timeout=120), received
