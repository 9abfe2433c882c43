"""Text made safe to show in a terminal: control sequences from model output, prompts, history or paths removed.

Whatever localmoe shows (run's stdout on a terminal, stats and error lines, every chat widget, exports) passes
through `for_terminal` or `for_line` first. Complete escape sequences (CSI `ESC [ ...`, OSC `ESC ] ... BEL/ST`,
DCS/SOS/PM/APC strings, two-byte `ESC x`) are dropped whole, payload included, so an OSC title never shows as
text; any control character left over (C0 but newline and tab, DEL, C1, a lone ESC) is dropped too. A sequence
split across two streamed chunks therefore loses its ESC in the first chunk and shows its tail as plain, inert
text. Machine-readable output (`--json`) keeps the exact text; JSON escapes the control characters itself.
Pure stdlib; imports nothing from localmoe.
"""

from __future__ import annotations

import re

# String-type sequences: OSC (ESC ]), DCS (ESC P), SOS (ESC X), PM (ESC ^), APC (ESC _), and their C1 forms,
# ended by BEL or ST (ESC \ or 0x9c); an unterminated one runs to the end of the text.
_STRING_SEQ = r"(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c|$)"
# CSI: ESC [ or 0x9b, parameters, intermediates, one final byte.
_CSI_SEQ = r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]?"
# Other escapes: ESC, optional intermediates, one final byte.
_ESC_SEQ = r"\x1b[ -/]*[0-~]?"
_SEQUENCES = re.compile(f"{_STRING_SEQ}|{_CSI_SEQ}|{_ESC_SEQ}")
# Left-over controls: C0 but \t and \n, DEL, C1; \r is dropped too (it would let text overwrite a line).
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# Bidirectional overrides and isolates reorder what follows them on screen (Trojan Source).
_BIDI = re.compile("[\u202a-\u202e\u2066-\u2069]")


def for_terminal(text: str) -> str:
    """`text` with every terminal control sequence and control character removed; newlines and tabs kept."""
    if not text:
        return text
    text = text.replace("\r\n", "\n")
    return _BIDI.sub("", _CONTROLS.sub("", _SEQUENCES.sub("", text)))


def for_line(text: str) -> str:
    """`for_terminal`, then newlines and tabs as spaces: for one-line places (stats, errors, titles, labels)."""
    return " ".join(for_terminal(str(text)).replace("\t", " ").split("\n"))


def is_clean(text: str) -> bool:
    """True when `for_terminal` would leave `text` as it is."""
    return for_terminal(text) == text.replace("\r\n", "\n")
