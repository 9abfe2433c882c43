"""Instruction pairs from a page's structure, for ``train/prepare_data.py``: "What is <section title>?" -> the
section's first paragraphs, "What does <api>() do?" -> its description, glossary terms, and the identity turns, each
as a ChatML-style record (`chat_record`). `make_pairs` takes a seeded `random.Random`: the pairs are deterministic.
"""

from __future__ import annotations

import random
import re

from doc_pages import clean_title, is_prose

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
