"""Documentation HTML to text blocks, for ``train/prepare_data.py``: which pages and parts of a page are skipped
(indices, navigation, sidebars), `parse_page` (a page -> its blocks: headings, paragraphs, list items, code, definition
terms, table rows, each as (kind, text)), `render` (blocks -> markdown-ish plain text) and `is_prose`.
"""

from __future__ import annotations

import re
import textwrap
from html.parser import HTMLParser

# Pages that are indices, tables of contents, changelogs or source listings.
SKIP_PATH = re.compile(
    r"(^|/)(_sources|_static|_images|_modules|_downloads|releases|changelog)/"
    r"|(^|/)(genindex[^/]*|search|py-modindex|contents|index|copyright|license|bugs|about|changelog"
    r"|release-[^/]*|bookindex|appendix-obsolete[^/]*|docguide[^/]*)\.html$"
)
SKIP_CLASSES = {
    "headerlink",
    "sphinxsidebar",
    "sphinxsidebarwrapper",
    "related",
    "footer",
    "navheader",
    "navfooter",
    "clearer",
    "mobile-nav",
    "menu-wrapper",
    "inline-search",
    "nav",
    "version_switcher_placeholder",
    "language_switcher_placeholder",
    "toctree-wrapper",
    "toc",
    "contents",
    "searchbox",
    "footnotes",
    "footnote",
    "audit-hook",
}
SKIP_IDS = {
    "hd",
    "ft",
    "sidebar",
    "searchbox",
    "global-nav",
    "sidebarbutton",
    "docs-top-navigation-container",
    "fixed-sidebar",
    "narrow-index-nav",
    "docs-narrow-top-navigation",
    "docs-bottom-navigation",
    "docs-copyright",
}
SKIP_TAGS = {"script", "style", "head", "title", "nav", "form", "button", "select", "noscript"}
VOID_TAGS = {"br", "img", "meta", "link", "input", "hr", "area", "base", "col", "embed", "source", "wbr"}
KIND_TAGS = {"p", "pre", "li", "dt", "dd", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "caption"}
FLUSH_TAGS = KIND_TAGS | {"div", "section", "table", "ul", "ol", "dl", "blockquote", "tbody", "thead"}

CHAR_MAP = str.maketrans(
    {
        "\u2018": "'",
        "\u2019": "'",
        "\u201c": '"',
        "\u201d": '"',
        "\u00a0": " ",
        "\u2026": "...",
        "\u2013": "-",
        "\u00b6": "",
        "\u200b": "",
        "\ufeff": "",
        "\u2192": "->",
    }
)


class DocParser(HTMLParser):
    """Collect (kind, text) blocks from one documentation page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, bool]] = []  # (tag, skipped)
        self.skip_depth = 0
        self.buf: list[str] = []
        self.blocks: list[tuple[str, str]] = []

    def _kind(self) -> str:
        for tag, _ in reversed(self.stack):
            if tag in KIND_TAGS:
                return tag
        return "p"

    def _in(self, tag: str) -> bool:
        return any(t == tag for t, _ in self.stack)

    def flush(self) -> None:
        if not self.buf:
            return
        raw = "".join(self.buf)
        self.buf = []
        kind = self._kind()
        if kind == "pre" or self._in("pre"):
            text = textwrap.dedent(raw.strip("\n")).rstrip()
            kind = "pre"
        else:
            text = re.sub(r"\s+", " ", raw).strip().strip("|").strip()
        text = text.translate(CHAR_MAP)
        if text:
            self.blocks.append((kind, text))

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag in VOID_TAGS:
            if tag == "br" and not self.skip_depth:
                self.buf.append("\n" if self._in("pre") else " ")
            return
        classes = set((a.get("class") or "").split())
        skip = tag in SKIP_TAGS or bool(classes & SKIP_CLASSES) or a.get("id") in SKIP_IDS
        if tag in FLUSH_TAGS and not self.skip_depth:
            self.flush()
        if tag in ("td", "th") and not self.skip_depth:
            self.buf.append(" | ")
        self.stack.append((tag, skip))
        if skip:
            self.skip_depth += 1

    def handle_endtag(self, tag):
        if tag in VOID_TAGS or not any(t == tag for t, _ in self.stack):
            return
        if tag in FLUSH_TAGS and not self.skip_depth:
            self.flush()
        while self.stack:
            t, skip = self.stack.pop()
            if skip:
                self.skip_depth -= 1
            if t == tag:
                break

    def handle_data(self, data):
        if not self.skip_depth and any(t == "body" for t, _ in self.stack):
            self.buf.append(data)


def parse_page(path: str) -> list[tuple[str, str]]:
    with open(path, encoding="utf-8", errors="replace") as f:
        src = f.read()
    p = DocParser()
    p.feed(src)
    p.close()
    p.flush()
    return p.blocks


NUM_PREFIX = re.compile(r"^(Chapter|Appendix)?\s*([0-9A-Z]+\.)*[0-9]+\.?\s+|^[A-Z]\.\s+|^[IVX]+\.\s+")


def clean_title(t: str) -> str:
    t = NUM_PREFIX.sub("", t).strip()
    return t.rstrip(":").strip()


def render(blocks: list[tuple[str, str]]) -> str:
    out: list[str] = []
    prev = None
    for kind, text in blocks:
        if kind.startswith("h") and len(kind) == 2:
            piece = "#" * int(kind[1]) + " " + clean_title(text)
        elif kind == "pre":
            piece = "```\n" + text + "\n```"
        elif kind == "li":
            piece = "- " + text
        elif kind == "tr":
            piece = text
        else:
            piece = text
        if out and ((kind == "li" and prev == "li") or (kind == "tr" and prev == "tr")):
            out[-1] += "\n" + piece
        else:
            out.append(piece)
        prev = kind
    return "\n\n".join(out).strip() + "\n"


def is_prose(text: str) -> bool:
    if len(text) < 60:
        return False
    letters = sum(c.isalpha() or c == " " for c in text)
    return letters / len(text) > 0.85 and text[-1] in '.!?)"'
