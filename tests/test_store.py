"""Expert master copies as memory-mapped files (localmoe/store.py), the fallback when host RAM cannot hold them:
a tiny offloaded model decodes the all-resident tokens from them, a second load maps the files without rewriting
them, and a stale or unfinished layer is rewritten. CPU; the real HF cache layout and XDG dirs of conftest."""

from __future__ import annotations

import json

import pytest

from conftest import repo_id
from localmoe import placement, store
from localmoe.engine import Engine
from test_offload import budget_for, tokens


def _bins(engine) -> dict:
    root = store.store_root()
    files = sorted(root.rglob("*.bin"))
    assert files and all(f.stat().st_size > 0 for f in files)
    return {f: f.stat().st_mtime_ns for f in files}


def test_mmap_masters_decode_the_same_tokens_and_are_reused():
    model = repo_id("qwen3_moe")
    want = tokens(Engine.load(model, device="cpu", sparsity=0.5), n=8)
    vram = budget_for(model, 3)
    notes: list[str] = []
    e = Engine.load(model, device="cpu", sparsity=0.5, vram_gib=vram, host_storage="mmap", on_notice=notes.append)
    assert e.loaded.host_storage == "mmap" and any("memory-mapped files" in n for n in notes)
    assert tokens(e, n=8) == want
    written = _bins(e)
    markers = sorted(store.store_root().rglob("*.json"))
    assert len(markers) == len(e.loaded.experts)

    again = Engine.load(model, device="cpu", sparsity=0.5, vram_gib=vram, host_storage="mmap")
    assert _bins(again) == written  # mapped as they were: not rewritten
    assert tokens(again, n=8) == want

    meta = json.loads(markers[0].read_text())
    markers[0].write_text(json.dumps({**meta, "sources": []}))  # stale: another checkpoint wrote it
    markers[1].unlink()  # unfinished: the marker comes last
    third = Engine.load(model, device="cpu", sparsity=0.5, vram_gib=vram, host_storage="mmap")
    assert tokens(third, n=8) == want
    assert json.loads(markers[0].read_text()) == meta and markers[1].is_file()  # both layers rewritten


def test_auto_uses_files_only_when_ram_is_short():
    assert store.needs_files(60 << 30, 64 << 30)  # 60 GiB of experts on a 64 GiB desktop
    assert not store.needs_files(60 << 30, 128 << 30)
    assert not store.needs_files(60 << 30, None)  # unknown RAM: host memory, as before
    assert placement.total_ram() is None or placement.total_ram() > 0
    e = Engine.load(repo_id("qwen3_moe"), device="cpu", sparsity=0.0, vram_gib=budget_for(repo_id("qwen3_moe"), 3))
    assert e.loaded.host_storage == "pageable"  # a tiny model fits in RAM: no files


def test_unknown_host_storage_is_refused():
    with pytest.raises(Exception, match="host storage"):
        Engine.load(repo_id("qwen3_moe"), device="cpu", vram_gib=budget_for(repo_id("qwen3_moe"), 3),
                    host_storage="disk")
