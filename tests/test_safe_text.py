"""Output safety: what `localmoe.safe_text` removes before text reaches a terminal, case by case."""

import pytest

from localmoe.safe_text import for_line, for_terminal, is_clean

CASES = [
    ("osc-title-bel", "ok\x1b]0;pwned\x07after", "okafter"),
    ("osc-title-st", "ok\x1b]2;pwned\x1b\\after", "okafter"),
    ("osc-unterminated", "text \x1b]0;abc", "text "),
    ("osc-8-hyperlink", "\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\", "link"),
    ("csi-colour", "a\x1b[31mred\x1b[0m", "ared"),
    ("csi-clear-screen", "x\x1b[2J\x1b[Hy", "xy"),
    ("csi-private-mode", "\x1b[?1049h\x1b[?1000hz", "z"),
    ("dcs", "x\x1bPq#0\x1b\\y", "xy"),
    ("apc", "x\x1b_payload\x1b\\y", "xy"),
    ("two-byte-esc", "a\x1bcb", "ab"),
    ("charset-esc", "a\x1b(0b", "ab"),
    ("lone-esc", "lone\x1b", "lone"),
    ("c1-csi", "c1\x9b31mz", "c1z"),
    ("c1-osc", "a\x9d0;t\x07b", "ab"),
    ("bell", "ding\x07", "ding"),
    ("backspace", "abc\x08\x08x", "abcx"),
    ("carriage-return", "safe\rEVIL", "safeEVIL"),
    ("crlf", "a\r\nb", "a\nb"),
    ("nul-del", "a\x00b\x7fc", "abc"),
    ("bidi-override", "\u202eevil\u202c", "evil"),
    ("newline-tab-kept", "tab\tnl\nok", "tab\tnl\nok"),
    ("unicode-kept", "ünïcödé 中文 😀", "ünïcödé 中文 😀"),
    ("empty", "", ""),
]


@pytest.mark.parametrize("text,want", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_for_terminal(text, want):
    assert for_terminal(text) == want
    assert is_clean(for_terminal(text))


def test_for_line_is_one_line():
    assert for_line("a\nb\tc\x1b[2J") == "a b c"
    assert for_line(123) == "123"


def test_split_sequence_is_inert():
    """A sequence split across streamed chunks loses its ESC: the tail shows as plain text, nothing is executed."""
    parts = [for_terminal(p) for p in ("ok\x1b]0;ti", "tle\x07done")]
    assert all("\x1b" not in p and "\x07" not in p for p in parts)
