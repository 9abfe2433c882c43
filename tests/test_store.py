"""Expert master copies as memory-mapped files (localmoe/experts/store.py), the fallback when host RAM cannot hold them:
a tiny offloaded model decodes the all-resident tokens from them, a second load maps the files without rewriting
them, and a stale, damaged or unfinished layer is rewritten (a table of cases). CPU; the real HF cache layout and XDG
dirs of conftest."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from conftest import repo_id
from offload_support import budget_for, tokens

from localmoe.engine.engine import Engine
from localmoe.errors import RuntimeFailure
from localmoe.experts import placement, store


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
        Engine.load(
            repo_id("qwen3_moe"), device="cpu", vram_gib=budget_for(repo_id("qwen3_moe"), 3), host_storage="disk"
        )


def _rewrite_experts_in_place(folder, layer_files):
    """The checkpoint's experts rewritten in place: same names, shapes and size, other values, a later mtime."""
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    before = f.stat()
    tensors = load_file(f)
    for k in tensors:
        if ".experts." in k:
            tensors[k] = (tensors[k] * 3.0).contiguous()
    save_file(tensors, f, metadata={"format": "pt"})
    os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns + 5_000_000_000))
    assert f.stat().st_size == before.st_size


def _truncate_bin(folder, layer_files):
    f = layer_files[0][0]  # layer 0's gate
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _remove_bin(folder, layer_files):
    layer_files[1][1].unlink()  # layer 1's up


def _marker(text):
    def edit(folder, layer_files):
        layer_files[0][3].write_text(text)

    return edit


# (id, edit of the checkpoint folder or of the store's files after a first load)
STORE_CASES = [
    ("checkpoint-rewritten-in-place-same-size", _rewrite_experts_in_place),
    ("bin-truncated", _truncate_bin),
    ("bin-missing", _remove_bin),
    ("marker-truncated", _marker('{"model": "x", "rev')),
    ("marker-not-object", _marker("[1, 2, 3]")),
    ("marker-nested-too-deep", _marker("[" * 100_000 + "]" * 100_000)),
]


@pytest.mark.parametrize("edit", [c[1] for c in STORE_CASES], ids=[c[0] for c in STORE_CASES])
def test_stale_or_damaged_expert_files_are_rewritten(src_dir, tmp_path, edit):
    """A layer's files are used only when its marker matches the checkpoint (sizes and mtimes of its shards) and every
    file has the layer's size; otherwise the layer is rewritten from the checkpoint, never mapped as it is."""
    folder = tmp_path / "ckpt"
    shutil.copytree(src_dir / "qwen3_moe", folder)
    vram = budget_for(str(folder), 3)
    first = Engine.load(str(folder), device="cpu", sparsity=0.0, vram_gib=vram, host_storage="mmap")
    before = tokens(first, n=8)
    layer_files = []
    for marker in sorted(store.store_root().rglob("*.json")):
        stem = marker.name[: -len(".json")]
        layer_files.append([marker.with_name(f"{stem}.{p}.bin") for p in store.PARTS] + [marker])
    assert len(layer_files) == 2 and all(f.is_file() for row in layer_files for f in row)
    del first
    edit(folder, layer_files)
    want = tokens(Engine.load(str(folder), device="cpu", sparsity=0.0), n=8)  # resident: read from the checkpoint
    if edit is _rewrite_experts_in_place:
        assert want != before  # the new weights decode differently, so stale files would show
    again = Engine.load(str(folder), device="cpu", sparsity=0.0, vram_gib=vram, host_storage="mmap")
    assert again.loaded.host_storage == "mmap"
    assert tokens(again, n=8) == want
    markers = sorted(store.store_root().rglob("*.json"))
    assert markers and all(json.loads(m.read_text())["shape"] for m in markers)
    assert not list(store.store_root().rglob("*.tmp"))


def test_unwritable_store_fails_with_the_folder_named():
    store.store_root().parent.mkdir(parents=True, exist_ok=True)
    store.store_root().write_text("not a folder")  # mkdir and every file under it fail
    model = repo_id("qwen3_moe")
    vram = budget_for(model, 3)
    with pytest.raises(
        RuntimeFailure,
        match=r"cannot write the memory-mapped expert files under .*experts.* \(Not a "
        r"directory\): free disk space or fix the folder's permissions",
    ):
        Engine.load(model, device="cpu", sparsity=0.0, vram_gib=vram, host_storage="mmap")


def test_marker_records_source_mtimes(src_dir, tmp_path):
    """Same model name and revision, a source shard rewritten at the same size: the layer is not ready (the marker
    records each shard's mtime as well as its size), whatever revision hub.py derives for the folder."""
    import torch

    shard = tmp_path / "model.safetensors"
    shutil.copyfile(src_dir / "qwen3_moe" / "model.safetensors", shard)
    shape = (2, 3, 4)
    first = store.ExpertStore("m", "rev", [shard], torch.float32)
    first.open("layers.0", shape)
    first.done("layers.0", shape)
    assert store.ExpertStore("m", "rev", [shard], torch.float32).open("layers.0", shape)[1]
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert not store.ExpertStore("m", "rev", [shard], torch.float32).open("layers.0", shape)[1]
