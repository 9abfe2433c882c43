"""Where localmoe keeps files on the user's machine (XDG base directories), and file-name-safe names for them.

`cache_root()`: thresholds (`localmoe.experts.thresholds`) and memory-mapped expert copies (`localmoe.experts.store`),
all of it
recomputable. Chat history, which is not, lives under the data dir (`localmoe.tui.history`). Pure stdlib; imports
nothing from localmoe, so any layer may use it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path


def cache_root() -> Path:
    """`$XDG_CACHE_HOME/localmoe` (default `~/.cache/localmoe`): thresholds here, expert files (`store`) too."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "localmoe"


def data_root() -> Path:
    """`$XDG_DATA_HOME/localmoe` (default `~/.local/share/localmoe`): what the user made (chat history)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "localmoe"


def slug(s: str) -> str:
    """A file-name-safe form of a model name or revision."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s).strip("_")[:80] or "model"
