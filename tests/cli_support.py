"""What the CLI tests share (test_cli.py, test_cli_terminal.py, test_cli_hub.py): the tiny model they run and `run`,
the CLI in-process with its status and captured output."""

from __future__ import annotations

from conftest import repo_id

from localmoe.cli.main import main

MODEL = repo_id("qwen3_moe")


def run(capsys, *args):
    code = main(list(args))
    cap = capsys.readouterr()
    return code, cap.out, cap.err
