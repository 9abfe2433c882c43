"""The package's import rules, checked on the source: `kernels/` and `tui/` are imported as `localmoe.kernels` and
`localmoe.tui` only (Hugging Face's `kernels` package exists and transformers imports it), and `localmoe --help`
imports no torch (it must stay instant)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOP_LEVEL = re.compile(r"^\s*(from|import)\s+(kernels|tui)(\.|\s|$)", re.M)


def test_kernels_and_tui_are_imported_through_localmoe_only():
    found = []
    for folder in ("localmoe", "kernels", "tui", "tests", "bench", "train"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path.is_symlink() or any(p.is_symlink() for p in path.parents if REPO in p.parents):
                continue
            for m in TOP_LEVEL.finditer(path.read_text()):
                found.append(f"{path.relative_to(REPO)}: {m.group(0).strip()}")
    assert not found, found


def test_help_imports_no_torch():
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "localmoe", "--help"], capture_output=True, text=True, check=True
    )
    assert not re.search(r"\|\s+torch(\.|$)", out.stderr, re.M)
