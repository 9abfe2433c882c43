"""What the CLI shows: on a terminal no control sequence a model or a folder name carries (pipes and --json keep the
exact text), streamed pieces shown as the whole would be, and progress one line per stage."""

from __future__ import annotations

import io
import json
import sys

import pytest
import tiny_models
from cli_support import on_terminal, run

# -- output safety: what reaches a terminal carries no control sequences; pipes and --json keep the exact text ------
ESC_TOKEN = "title:\x1b]0;pwn\x07done"  # the checkpoint's greedy reply, token after token: an OSC that retitles
ESC_DIR = "esc\x1b]0;dir\x07"  # the checkpoint folder's name, shown in the stats line as the model's name


@pytest.fixture(scope="module")
def escape_model(tmp_path_factory) -> str:

    return str(tiny_models.save_repeating_checkpoint(tmp_path_factory.mktemp("safety") / ESC_DIR, ESC_TOKEN))


def _safety_piped(model, capsys):
    code, out, err = run(capsys, "run", model, "hi", "--max-new-tokens", "2", "--sparsity", "0")
    assert code == 0 and out == ESC_TOKEN * 2 + "\n"  # a pipe or a file gets the exact text
    assert err.startswith("[esc on cpu] load ") and err.count("\n") == 1
    return err


def _safety_json(model, capsys):
    code, out, err = run(capsys, "run", model, "hi", "--max-new-tokens", "2", "--sparsity", "0", "--json")
    obj = json.loads(out)
    assert code == 0 and err == "" and obj["text"] == ESC_TOKEN * 2 and obj["model"] == ESC_DIR
    assert "\\u001b]0;pwn\\u0007" in out  # escaped by JSON
    return out


def _safety_error_line(model, capsys):
    code, out, err = run(capsys, "run", model, "hi", "--calibration-text", f"/nonexistent/{ESC_DIR}.txt")
    assert code == 2 and "cannot read --calibration-text /nonexistent/esc.txt" in err and err.count("\n") == 1
    return err


def _safety_terminal(model, capsys):
    code, seen = on_terminal(["run", model, "hi", "--max-new-tokens", "3", "--sparsity", "0"])
    text = seen.decode()
    assert code == 0 and "title:done" * 3 + "\r\n" in text and "[esc on cpu] load " in text
    assert "localmoe: note: esc: " in text  # the plan line, on a terminal
    import re

    assert len(re.findall(r"load: (\d+)/\1\b", text)) == 1  # the load stage ends as one line
    return text


def _safety_terminal_json(model, capsys):
    code, seen = on_terminal(["run", model, "hi", "--max-new-tokens", "2", "--sparsity", "0", "--json", "--quiet"])
    text = seen.decode()
    assert code == 0 and json.loads(text.splitlines()[-1])["text"] == ESC_TOKEN * 2
    return text


def _safety_terminal_error(model, capsys):
    code, seen = on_terminal(["run", model, "hi", "--system", " ", "--calibration-text", ESC_DIR])
    assert code == 2 and seen.decode().startswith("localmoe: error: --system is empty")
    first = seen.decode()
    code, seen = on_terminal(["pull", f"./{ESC_DIR}-missing"])
    assert code == 2 and b"does not exist" in seen and b"\\x1b]0;dir\\x07" in seen  # shown as inert text (repr)
    return first + seen.decode()


SAFETY = [
    ("run-piped-exact-stats-line-clean", _safety_piped),
    ("run-json-exact", _safety_json),
    ("error-line-path", _safety_error_line),
    ("run-on-terminal", _safety_terminal),
    ("run-json-on-terminal", _safety_terminal_json),
    ("errors-on-terminal", _safety_terminal_error),
]


@pytest.mark.parametrize("check", [c[1] for c in SAFETY], ids=[c[0] for c in SAFETY])
def test_output_safety(escape_model, capsys, check):
    shown = check(escape_model, capsys)
    assert "\x1b" not in shown and "\x07" not in shown  # JSON escapes them; everything else drops them


STREAMS = [  # (id, text): streamed in pieces, it shows exactly what safe_text.for_terminal shows for the whole
    ("osc-title-bel", "title:\x1b]0;pwn\x07done"),
    ("osc-hyperlink-st", "x\x1b]8;;http://e\x1b\\link\x1b]8;;\x1b\\y"),
    ("csi-colour", "a\x1b[31mred\x1b[0m b"),
    ("csi-clear-screen", "\x1b[2J\x1b[Hhome"),
    ("dcs", "p\x1bPq#0\x1b\\z"),
    ("c1-forms", "\x9b31mC1\x9d0;t\x9c!"),
    ("esc-save-restore", "\x1b7save\x1b8"),
    ("osc-unterminated", "end\x1b]0;open"),
    ("lone-esc", "\x1b"),
    ("csi-unfinished", "q\x1b["),
    ("carriage-returns", "a\r\nb\rc"),
    ("bidi-override", "\u202eevil\u202c"),
]


@pytest.mark.parametrize("text", [c[1] for c in STREAMS], ids=[c[0] for c in STREAMS])
def test_terminal_stream_pieces(text):
    from localmoe.engine.detokenize import TerminalStream
    from localmoe.safe_text import for_terminal

    want = for_terminal(text)
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        stream = TerminalStream()
        assert "".join(stream.push(p) for p in pieces) + stream.flush() == want, pieces


def test_terminal_stream_gives_up_on_a_sequence_that_never_ends():
    from localmoe.engine.detokenize import TerminalStream

    stream = TerminalStream(max_hold=16)
    assert stream.push("a\x1b]0;") == "a"
    assert stream.push("x" * 32) == ""  # held too long: dropped whole, as for_terminal drops an unterminated one
    assert stream.push("after") == "after"


# -- progress on a terminal: one line per stage ------------------------------------------------------------------
class _TTY(io.StringIO):
    def isatty(self):
        return True


PROGRESS = [  # (id, calls, what stderr shows)
    (
        "load-final-reported-twice",
        [("load", 16, 37), ("load", 37, 37), ("load", 37, 37)],
        "\r      load: 16/37\r      load: 37/37\n",
    ),
    (
        "load-then-calibrate",
        [("load", 37, 37), ("load", 37, 37), ("calibrate", 1, 2), ("calibrate", 2, 2)],
        "\r      load: 37/37\n\r calibrate: 1/2\r calibrate: 2/2\n",
    ),
    ("stage-cut-short", [("load", 1, 9), ("calibrate", 2, 2)], "\r      load: 1/9\n\r calibrate: 2/2\n"),
    (
        "same-stage-again",
        [("ppl 0%", 2, 2), ("ppl 0%", 1, 2), ("ppl 0%", 2, 2)],
        "\r    ppl 0%: 2/2\n\r    ppl 0%: 1/2\r    ppl 0%: 2/2\n",
    ),
    ("stage-name-escapes", [("\x1b]0;x\x07load", 1, 1)], "\r      load: 1/1\n"),
    ("download-left-to-the-hub", [("download", 10, 100)], ""),
]


@pytest.mark.parametrize("calls, shown", [c[1:] for c in PROGRESS], ids=[c[0] for c in PROGRESS])
def test_progress_one_line_per_stage(monkeypatch, calls, shown):
    from localmoe.cli.terminal import stderr_progress

    err = _TTY()
    monkeypatch.setattr(sys, "stderr", err)
    progress = stderr_progress()
    for call in calls:
        progress(*call)
    assert err.getvalue() == shown
