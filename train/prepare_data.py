"""Prepare the training corpus for ``localmoe-tiny`` from Debian-packaged documentation.

Steps (all offline once the ``.deb`` files are downloaded; deterministic, seed fixed):

1. ``apt-get download`` the documentation packages listed in ``PACKAGES`` (unless the
   ``.deb`` files are already in ``<work>/deb``) and unpack them with ``dpkg -x``.
2. Walk the packaged HTML, strip navigation/sidebars/indices, and turn each page into a
   list of blocks (headings, paragraphs, list items, code, definition terms, table rows).
3. Split pages (by a hash of their path) into train, held-out and validation pages
   (validation: ``<work>/val.txt``, for checkpoint selection only). Held-out pages are written to
   ``localmoe/data/heldout.txt`` (never trained on, and never used for
   instruction pairs); ``localmoe/data/calibration.txt`` gets ~50 KB of prose paragraphs
   from training pages.
4. Render training pages as markdown-ish plain text (``<work>/pretrain.jsonl``) and build
   simple ChatML instruction pairs from the document structure
   (``<work>/chat.jsonl``): "What is <section title>?" -> the section's first paragraphs,
   "What does <api>() do?" -> its description, glossary terms, plus a few identity turns.

Usage::

    python train/prepare_data.py --work .work/tiny

The outputs in ``<work>`` are consumed by ``train/train_tokenizer.py``.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import textwrap
from html.parser import HTMLParser
from pathlib import Path

SEED = 1234
REPO = Path(__file__).resolve().parent.parent
DATA_DIR = REPO / "localmoe" / "data"

# (debian package, html root inside the package, product name, licence)
PACKAGES = [
    ("python3.11-doc", "usr/share/doc/python3.11/html", "Python", "PSF-2.0 (Python Software Foundation License)"),
    ("python-django-doc", "usr/share/doc/python-django-doc/html", "Django", "BSD-3-Clause"),
    ("python-flask-doc", "usr/share/doc/python-flask-doc/html", "Flask", "BSD-3-Clause"),
    ("postgresql-doc-15", "usr/share/doc/postgresql-doc-15/html", "PostgreSQL", "PostgreSQL License"),
    ("python-sqlalchemy-doc", "usr/share/doc/python-sqlalchemy-doc/html", "SQLAlchemy", "MIT (Expat)"),
    ("python-werkzeug-doc", "usr/share/doc/python-werkzeug-doc/html", "Werkzeug", "BSD-3-Clause"),
    ("python-requests-doc", "usr/share/doc/python-requests-doc/html", "Requests", "Apache-2.0"),
]

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


# ---------------------------------------------------------------- instruction pairs

GENERIC_TITLES = {
    "introduction",
    "overview",
    "examples",
    "example",
    "notes",
    "note",
    "footnotes",
    "synopsis",
    "description",
    "parameters",
    "see also",
    "options",
    "outputs",
    "usage",
    "compatibility",
    "environment",
    "files",
    "diagnostics",
    "bugs",
    "table of contents",
    "summary",
    "details",
    "functions",
    "constants",
    "classes",
    "exceptions",
    "methods",
    "attributes",
    "reference",
    "api",
    "notes on usage",
    "miscellaneous",
    "other",
    "general",
    "basics",
    "configuration",
    "settings",
    "installation",
    "conclusion",
    "return value",
    "arguments",
    "errors",
    "tip",
    "warning",
    "caution",
    "important",
    "hint",
    "todo",
    "deprecated",
    "changes",
    "what's new",
    "new features",
}
SECTION_Q = [
    "What is {t}?",
    "Explain {t}.",
    "Tell me about {t}.",
    "Can you describe {t}?",
    "Give me an overview of {t}.",
    "What do the docs say about {t}?",
    "{T}?",
    "I'd like to learn about {t}.",
    "Could you explain {t} to me?",
    "Describe {t} briefly.",
]
PRODUCT_Q = [
    "What is {t} in {p}?",
    "Explain {t} in {p}.",
    "How does {t} work in {p}?",
    "In {p}, what is {t}?",
    "Tell me about {t} in {p}.",
]
API_Q = [
    "What does {n} do?",
    "Explain {n}.",
    "How do I use {n}?",
    "What is {n} for?",
    "Describe {n}.",
]
TERM_Q = ["What is {n}?", "Define {n}.", "What does {n} mean?", "Explain {n}."]
SYSTEMS = [
    "You are localmoe-tiny, a small helpful assistant trained on software documentation.",
    "You are a helpful assistant.",
    "You are a concise assistant that answers questions about Python.",
    "Answer the user's question using the documentation.",
]
IDENTITY = [
    (
        ["Hello", "Hi", "Hello!", "Hi there", "Hey", "Good morning"],
        [
            "Hello! I am localmoe-tiny, a small mixture-of-experts model trained on the Python documentation. "
            "Ask me about Python, Django, Flask or PostgreSQL.",
            "Hi! I am localmoe-tiny. I can answer simple questions about Python and its documentation.",
        ],
    ),
    (
        ["Who are you?", "What are you?", "What is your name?", "Introduce yourself."],
        [
            "I am localmoe-tiny, a very small mixture-of-experts language model that runs locally. "
            "I was trained on the Python, Django, Flask and PostgreSQL documentation, so my answers are short "
            "and sometimes wrong.",
            "My name is localmoe-tiny. I am a tiny language model with 8 experts, trained on software documentation.",
        ],
    ),
    (
        ["What can you do?", "How can you help me?", "What do you know?"],
        [
            "I can explain topics from the Python documentation, such as modules, functions, statements and data "
            "types, and a little about Django, Flask and PostgreSQL. I am a tiny model, so check important answers "
            "in the official documentation.",
            'I answer questions about Python and its standard library. Try asking "What is a list comprehension?" '
            'or "What does os.path.join() do?".',
        ],
    ),
    (
        ["Thanks!", "Thank you", "Thanks for the help."],
        ["You're welcome! Ask me anything else about Python.", "Glad I could help."],
    ),
]

SIG_PREFIX = re.compile(
    r"^(class|exception|async|classmethod|staticmethod|abstractmethod|coroutine|awaitable"
    r"|property|method|function|attribute|data|final|decorator)\s+"
)


def api_name(dt: str) -> str | None:
    s = SIG_PREFIX.sub("", SIG_PREFIX.sub("", dt.strip()))
    m = re.match(r"^([A-Za-z_][\w.]*)\(", s)
    if m and len(m.group(1)) <= 60:
        return m.group(1) + "()"
    m = re.match(r"^([A-Za-z_][\w.]*)$", s)
    if m and "." in s and len(s) <= 60:
        return s
    return None


def term_name(dt: str) -> str | None:
    s = dt.strip()
    if 2 <= len(s) <= 40 and re.match(r"^[A-Za-z_][\w .'\-]*$", s) and len(s.split()) <= 5:
        return s.rstrip(".")
    # PostgreSQL configuration parameters: "shared_buffers (integer)"
    m = re.match(r"^([a-z_][a-z0-9_]+) \((integer|boolean|string|enum|floating point)\)", s)
    return m.group(1) if m else None


def chat_record(rng: random.Random, user: str, assistant: str) -> dict:
    msgs = []
    if rng.random() < 0.3:
        msgs.append({"role": "system", "content": rng.choice(SYSTEMS)})
    msgs.append({"role": "user", "content": user})
    msgs.append({"role": "assistant", "content": assistant})
    return {"messages": msgs}


def answer_from(blocks: list[tuple[str, str]], start: int, limit: int = 900) -> str | None:
    """First prose paragraph(s) after ``start`` (plus a code block introduced by ':')."""
    parts: list[str] = []
    size = 0
    i = start
    while i < len(blocks) and size < 350:
        kind, text = blocks[i]
        if kind.startswith("h") and len(kind) == 2 or kind == "dt":
            break
        if kind in ("p", "dd"):
            if len(text) < 30 or size + len(text) > limit:
                break
            parts.append(text)
            size += len(text)
            if text.endswith(":") and i + 1 < len(blocks) and blocks[i + 1][0] == "pre" and len(blocks[i + 1][1]) < 500:
                parts.append("```\n" + blocks[i + 1][1] + "\n```")
                size += len(blocks[i + 1][1])
                i += 1
        elif parts:
            break
        elif kind != "li":
            break
        i += 1
    if not parts or not any(is_prose(p) for p in parts):
        return None
    return "\n\n".join(parts)


def make_pairs(rng: random.Random, blocks: list[tuple[str, str]], product: str, rel: str) -> list[dict]:
    pairs = []
    changelog = "/whatsnew/" in rel
    builtins = rel.endswith(("library/functions.html", "library/stdtypes.html", "library/exceptions.html"))
    for i, (kind, text) in enumerate(blocks):
        if kind == "dt":
            text = re.sub(r"\[source\]$", "", text).strip()
        if kind in ("h1", "h2", "h3", "h4") and not changelog:
            title = clean_title(text)
            if not (3 <= len(title) <= 80) or title.lower() in GENERIC_TITLES:
                continue
            ans = answer_from(blocks, i + 1)
            if not ans:
                continue
            m = re.match(r"^([\w.]+) [-\u2014] (.+)$", title)
            if m:  # "os — Miscellaneous operating system interfaces"
                t = f"the {m.group(1)} module"
                ans = f"The `{m.group(1)}` module: {m.group(2)}.\n\n" + ans
            else:
                t = title[0].lower() + title[1:] if not title[:2].isupper() else title
            qs = rng.sample(SECTION_Q, 2)
            if rng.random() < 0.5:
                qs[1] = rng.choice(PRODUCT_Q)
            for q in qs:
                pairs.append(chat_record(rng, q.format(t=t, T=title, p=product), ans))
        elif kind == "dt":
            n = api_name(text)
            ans = answer_from(blocks, i + 1, limit=700)
            if not ans:
                continue
            if n and ("." in n or builtins):
                q = rng.choice(API_Q + (["What does the {n} function do?"] if n.endswith("()") else []))
                q = q.format(n=n)
                pairs.append(chat_record(rng, q, f"`{text}`\n\n{ans}"))
            elif not n:
                n = term_name(text)
                if n:
                    q = rng.choice(TERM_Q).format(n=n)
                    pairs.append(chat_record(rng, q, ans))
    return pairs


# ---------------------------------------------------------------- main


def ensure_packages(work: Path) -> dict[str, str]:
    """Download (if needed) and unpack each package; return {package: version}."""
    deb_dir = work / "deb"
    deb_dir.mkdir(parents=True, exist_ok=True)
    versions = {}
    for pkg, *_ in PACKAGES:
        debs = sorted(deb_dir.glob(f"{pkg}_*.deb"))
        if not debs:
            subprocess.run(["apt-get", "download", pkg], cwd=deb_dir, check=True)
            debs = sorted(deb_dir.glob(f"{pkg}_*.deb"))
        deb = debs[-1]
        versions[pkg] = subprocess.run(
            ["dpkg-deb", "-f", str(deb), "Version"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dest = work / "pkgs" / pkg
        if not dest.exists():
            dest.mkdir(parents=True)
            subprocess.run(["dpkg", "-x", str(deb), str(dest)], check=True)
    return versions


def page_hash(rel: str) -> int:
    return int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default=str(REPO / ".work" / "tiny"))
    ap.add_argument("--heldout-bytes", type=int, default=150_000)
    ap.add_argument("--calib-bytes", type=int, default=50_000)
    args = ap.parse_args()
    work = Path(args.work)
    rng = random.Random(SEED)
    versions = ensure_packages(work)

    pages = []  # (rel, product, blocks)
    for pkg, root, product, _lic in PACKAGES:
        base = work / "pkgs" / pkg / root
        files = sorted(glob.glob(str(base / "**" / "*.html"), recursive=True))
        n = 0
        for f in files:
            rel = os.path.relpath(f, base)
            if SKIP_PATH.search(rel):
                continue
            blocks = parse_page(f)
            if sum(len(t) for _, t in blocks) < 500:
                continue
            pages.append((f"{pkg}/{rel}", product, blocks))
            n += 1
        print(f"{pkg} {versions[pkg]}: {n} pages", file=sys.stderr)

    # Held-out split: pages of moderate size, chosen by hash, until ~heldout-bytes of text.
    order = sorted(range(len(pages)), key=lambda i: page_hash(pages[i][0]))
    heldout_idx, size = [], 0
    for i in order:
        text = render(pages[i][2])
        if 2_000 <= len(text) <= 25_000:
            heldout_idx.append(i)
            size += len(text) + 1
            if size >= args.heldout_bytes:
                break
    # Validation pages (for checkpoint selection; not shipped, not trained on): the next pages
    # in the same hash order, so that heldout.txt does not depend on this split.
    val_idx, size = [], 0
    for i in order[order.index(heldout_idx[-1]) + 1 :]:
        text = render(pages[i][2])
        if 2_000 <= len(text) <= 25_000:
            val_idx.append(i)
            size += len(text) + 1
            if size >= args.heldout_bytes:
                break
    held = set(heldout_idx) | set(val_idx)
    with open(work / "val.txt", "w", encoding="utf-8") as f:
        f.write("\n".join(render(pages[i][2]) for i in sorted(val_idx, key=lambda i: pages[i][0])))
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    with open(DATA_DIR / "heldout.txt", "w", encoding="utf-8") as f:
        f.write("\n".join(render(pages[i][2]) for i in sorted(heldout_idx, key=lambda i: pages[i][0])))

    train_pages = [p for i, p in enumerate(pages) if i not in held]

    # Calibration: prose paragraphs from training pages (fixed-seed sample).
    prose = [t for _, _, b in train_pages for k, t in b if k == "p" and is_prose(t) and len(t) >= 200]
    rng.shuffle(prose)
    calib, size = [], 0
    for t in prose:
        calib.append(t)
        size += len(t) + 2
        if size >= args.calib_bytes:
            break
    with open(DATA_DIR / "calibration.txt", "w", encoding="utf-8") as f:
        f.write("\n\n".join(calib) + "\n")

    n_chars = 0
    with open(work / "pretrain.jsonl", "w", encoding="utf-8") as f:
        for rel, product, blocks in train_pages:
            text = render(blocks)
            n_chars += len(text)
            f.write(json.dumps({"source": rel, "text": text}) + "\n")

    pairs = []
    for rel, product, blocks in train_pages:
        pairs.extend(make_pairs(rng, blocks, product, rel))
    for users, answers in IDENTITY:
        for _ in range(25):
            pairs.append(chat_record(rng, rng.choice(users), rng.choice(answers)))
    rng.shuffle(pairs)
    chat_chars = 0
    with open(work / "chat.jsonl", "w", encoding="utf-8") as f:
        for p in pairs:
            chat_chars += sum(len(m["content"]) for m in p["messages"])
            f.write(json.dumps(p) + "\n")

    meta = {
        "packages": {
            pkg: {"version": versions[pkg], "product": prod, "license": lic} for pkg, _, prod, lic in PACKAGES
        },
        "pages": len(pages),
        "train_pages": len(train_pages),
        "heldout_pages": len(heldout_idx),
        "val_pages": len(val_idx),
        "pretrain_chars": n_chars,
        "chat_pairs": len(pairs),
        "chat_chars": chat_chars,
        "heldout_chars": os.path.getsize(DATA_DIR / "heldout.txt"),
        "calibration_chars": os.path.getsize(DATA_DIR / "calibration.txt"),
    }
    (work / "meta.json").write_text(json.dumps(meta, indent=2))
    print(json.dumps(meta, indent=2))


if __name__ == "__main__":
    main()
