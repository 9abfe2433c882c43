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
import subprocess
import sys
from pathlib import Path

from chat_pairs import IDENTITY, chat_record, make_pairs
from doc_pages import SKIP_PATH, is_prose, parse_page, render

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
