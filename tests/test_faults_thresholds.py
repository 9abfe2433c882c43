"""Faults of the threshold cache at load time, one table per area, each row a case the suite names (the checkpoint's
faults: test_faults_load.py):

- CACHE_CASES: threshold cache files that are corrupt, invalid or stale are validated in full, recalibrated and
  overwritten with a notice (never applied: a NaN or huge τ used to give 100% realised sparsity silently), and a
  checkpoint rewritten in place or a changed fingerprint recalibrates;
- SAVE_CASES: a cache that cannot be written keeps the finished calibration in memory for the run, with a notice.

Real tiny checkpoints (tests/tiny_models.py) copied and edited on disk; nothing mocked. CPU, offline."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
from conftest import repo_id
from safetensors.torch import load_file, save_file

from localmoe import paths
from localmoe.engine.engine import Engine
from localmoe.experts import threshold_files, thresholds

TOKENS = 256  # calibration tokens: enough for a tiny model's quantiles, quick on the CPU


# -- threshold cache ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(hub_cache):
    return Engine.load(repo_id("qwen3_moe"), device="cpu", sparsity=0.0)


def _edit(fn):
    """A case that edits the saved JSON object in place with `fn(saved)` and writes it back."""

    def write(path: Path):
        saved = json.loads(path.read_text())
        fn(saved)
        path.write_text(json.dumps(saved))  # json.dumps writes NaN / Infinity as given

    return write


def _raw(data: bytes):
    return lambda path: path.write_bytes(data)


def _set(key, value):
    return _edit(lambda s: s.__setitem__(key, value))


def _tau(i, value):
    return _edit(lambda s: s["thresholds"].__setitem__(i, value))


def _raw_tau(literal: bytes):
    """Layer 0's threshold replaced by a JSON number literal as written (beyond what json.dumps makes of a float)."""

    def write(path: Path):
        saved = json.loads(path.read_text())
        saved["thresholds"][0] = "@TAU@"
        path.write_bytes(json.dumps(saved).encode().replace(b'"@TAU@"', literal))

    return write


def _expert_tau(i, e, value):
    return _edit(lambda s: s["thresholds"][i].__setitem__(e, value))


# (id, mode, edit of the valid file, what the notice's reason says)
CACHE_CASES = [
    ("json-list-not-object", "layer", _raw(b"[0.1, 0.2]"), "not an object"),
    ("json-number-not-object", "layer", _raw(b"0.5"), "not an object"),
    ("json-null", "layer", _raw(b"null"), "not an object"),
    ("empty-file", "layer", _raw(b""), "not JSON"),
    ("truncated", "layer", lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), "not JSON"),
    ("binary-garbage", "layer", _raw(bytes(range(256)) * 4), "not"),
    ("deeply-nested", "layer", _raw(b"[" * 100_000 + b"]" * 100_000), "JSON nested too deeply"),
    ("nan-threshold", "layer", _tau(0, math.nan), "layer 0 threshold is nan"),
    ("inf-threshold", "layer", _tau(1, math.inf), "layer 1 threshold is inf"),
    ("huge-threshold", "layer", _tau(0, 1e30), "layer 0 threshold 1e+30 is above"),
    ("negative-threshold", "layer", _tau(1, -0.25), "layer 1 threshold -0.25 is negative"),
    ("huge-integer-threshold", "layer", _raw_tau(b"1" + b"0" * 400), "layer 0 threshold a 401-digit number is above"),
    ("negative-huge-integer", "layer", _raw_tau(b"-" + b"9" * 400), "layer 0 threshold a 400-digit number is negative"),
    ("oversized-file", "layer", _raw(b" " * (threshold_files.MAX_CACHE_BYTES + 1)), "bytes, not a threshold file"),
    ("string-threshold", "layer", _tau(0, "0.3"), "layer 0 threshold is str"),
    ("bool-threshold", "layer", _tau(0, True), "layer 0 threshold is bool"),
    ("list-in-layer-mode", "layer", _tau(0, [0.1] * 8), "layer 0 threshold is list"),
    ("too-few-layers", "layer", _edit(lambda s: s["thresholds"].pop()), "1 layers of thresholds for a model with 2"),
    ("too-many-layers", "layer", _edit(lambda s: s["thresholds"].append(0.1)), "3 layers of thresholds"),
    ("wrong-layer-count-meta", "layer", _set("layers", 3), "layers is 3, expected 2"),
    ("thresholds-not-list", "layer", _set("thresholds", {"0": 0.1}), "thresholds are dict"),
    ("no-thresholds", "layer", _edit(lambda s: s.pop("thresholds")), "no 'thresholds'"),
    ("no-model", "layer", _edit(lambda s: s.pop("model")), "no 'model'"),
    ("other-model", "layer", _set("model", "someone/else"), "model is 'someone/else'"),
    ("other-sparsity", "layer", _set("sparsity", 0.9), "sparsity is 0.9, expected 0.6"),
    ("other-mode", "layer", _set("mode", "expert"), "mode is 'expert'"),
    ("other-experts-format", "layer", _set("experts", "int4"), "experts is 'int4', expected 'full'"),
    (
        "routing-counts-wrong-shape",
        "layer",
        _edit(lambda s: s["routing_counts"][0].pop()),
        "routing_counts of layer 0 is not a list of 8",
    ),
    (
        "routing-counts-negative",
        "layer",
        _edit(lambda s: s["routing_counts"][1].__setitem__(0, -5)),
        "routing_counts of layer 1",
    ),
    ("tokens-not-count", "layer", _set("tokens", "many"), "tokens is not a token count"),
    (
        "expert-list-too-short",
        "expert",
        _edit(lambda s: s["thresholds"][0].pop()),
        "layer 0 has 7 per-expert thresholds for 8 experts",
    ),
    (
        "expert-list-too-long",
        "expert",
        _edit(lambda s: s["thresholds"][1].append(0.1)),
        "layer 1 has 9 per-expert thresholds",
    ),
    ("expert-number-not-list", "expert", _tau(0, 0.2), "layer 0 has float, not a list of 8"),
    ("expert-nan", "expert", _expert_tau(1, 3, math.nan), "layer 1 expert 3 threshold is nan"),
    ("expert-huge", "expert", _expert_tau(0, 0, 5e4), "layer 0 expert 0 threshold 50000 is above"),
    ("expert-negative", "expert", _expert_tau(0, 7, -1), "layer 0 expert 7 threshold -1 is negative"),
]


@pytest.mark.parametrize(("mode", "corrupt", "reason"), [c[1:] for c in CACHE_CASES], ids=[c[0] for c in CACHE_CASES])
def test_invalid_threshold_cache_is_recalibrated(engine, mode, corrupt, reason):
    notes: list[str] = []
    engine.on_notice = notes.append
    try:
        fresh = thresholds.thresholds_for(engine, 0.6, tokens=TOKENS, mode=mode)
        path = thresholds.cache_path(engine.model_name, engine.resolved.revision, 0.6, mode)
        assert fresh.path == path and path.is_file() and notes == []
        corrupt(path)
        again = thresholds.thresholds_for(engine, 0.6, tokens=TOKENS, mode=mode)
        assert again.taus == fresh.taus and again.path == path  # recalibrated: never the file's values
        assert len(notes) == 1, notes
        assert notes[0].startswith(f"cached thresholds at {path} were invalid (") and notes[0].endswith(
            "); recalibrated"
        ), notes[0]
        assert reason in notes[0], notes[0]
        # overwritten with a valid file: the next run reads it as is
        assert thresholds.thresholds_for(engine, 0.6, tokens=TOKENS, mode=mode).taus == fresh.taus and len(notes) == 1
        assert not list(path.parent.glob("*.tmp"))
    finally:
        engine.on_notice = None


def test_stale_cache_is_recalibrated_with_a_notice(engine):
    notes: list[str] = []
    engine.on_notice = notes.append
    try:
        fresh = thresholds.thresholds_for(engine, 0.6, tokens=TOKENS)
        _set("localmoe_version", "0.0.1")(fresh.path)
        assert thresholds.thresholds_for(engine, 0.6, tokens=TOKENS).taus == fresh.taus
        assert notes == [
            f"cached thresholds at {fresh.path} were stale (made with localmoe_version '0.0.1', this run "
            f"has {threshold_files.__version__!r}); recalibrated"
        ]
    finally:
        engine.on_notice = None


def _local_copy(src_dir, tmp_path, family="qwen3_moe") -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(src_dir / family, d)
    return d


def _rewrite_in_place(folder: Path, scale: float) -> None:
    """The checkpoint's weights rewritten in place: same names, shapes and file size, other values, a new mtime."""
    f = folder / "model.safetensors"
    before = f.stat()
    tensors = load_file(f)
    for k in tensors:
        if ".experts." in k:
            tensors[k] = tensors[k] * scale
    save_file(tensors, f, metadata={"format": "pt"})
    os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns + 5_000_000_000))
    assert f.stat().st_size == before.st_size


def test_checkpoint_rewritten_in_place_recalibrates(src_dir, tmp_path, monkeypatch):
    """A local checkpoint rewritten in place at the same size: its old thresholds are not reused (7% realised sparsity
    against a 50% target, before), whatever the revision localmoe derives for the folder."""
    folder = _local_copy(src_dir, tmp_path)
    first = Engine.load(str(folder), device="cpu", sparsity=0.5)
    old = thresholds.thresholds_for(first, 0.5)
    _rewrite_in_place(folder, 3.0)
    notes: list[str] = []
    second = Engine.load(str(folder), device="cpu", sparsity=0.5, on_notice=notes.append)
    new = thresholds.thresholds_for(second, 0.5)
    assert new.meta["checkpoint"] != old.meta["checkpoint"] and new.taus != old.taus
    if second.resolved.revision == first.resolved.revision:  # same cache file: replaced, and said so
        assert any("the checkpoint's files changed since calibration); recalibrated" in n for n in notes), notes
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "elsewhere"))  # the new weights calibrated from scratch
    assert thresholds.thresholds_for(second, 0.5).taus == new.taus


def test_fingerprint_change_alone_recalibrates(src_dir, tmp_path):
    """The fingerprint is checked even when the revision the file is keyed on is unchanged (an engine whose files
    were rewritten under it: same values here, new mtimes)."""
    folder = _local_copy(src_dir, tmp_path)
    notes: list[str] = []
    engine = Engine.load(str(folder), device="cpu", sparsity=0.0, on_notice=notes.append)
    before = thresholds.thresholds_for(engine, 0.5, tokens=TOKENS)
    _rewrite_in_place(folder, 1.0)
    after = thresholds.thresholds_for(engine, 0.5, tokens=TOKENS)
    assert after.taus == before.taus and after.meta["checkpoint"] != before.meta["checkpoint"]
    assert notes == [
        f"cached thresholds at {before.path} were stale (the checkpoint's files changed since "
        "calibration); recalibrated"
    ]


# -- a cache that cannot be written --------------------------------------------------------------------------------


def _block_dir(root: Path) -> None:  # the thresholds folder is a file: mkdir fails
    root.mkdir(parents=True, exist_ok=True)
    (root / "thresholds").write_text("not a folder")


def _block_file(root: Path) -> None:  # the cache file's path is a folder: reading and replacing it fail
    thresholds.cache_path(repo_id("qwen3_moe"), _revision(), 0.6).mkdir(parents=True)


def _read_only(root: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    d = thresholds.cache_path(repo_id("qwen3_moe"), _revision(), 0.6).parent
    d.mkdir(parents=True)
    d.chmod(0o555)


def _cache_home_is_file(root: Path) -> None:  # XDG_CACHE_HOME itself is a file
    shutil.rmtree(root.parent, ignore_errors=True)
    root.parent.write_text("")


def _revision() -> str:
    from localmoe.models import hub

    return hub.resolve(repo_id("qwen3_moe"), download_missing=False).revision


SAVE_CASES = [
    ("thresholds-dir-is-a-file", _block_dir, "Not a directory"),
    ("cache-file-is-a-folder", _block_file, "Is a directory"),
    ("read-only-cache-dir", _read_only, "Permission denied"),
    ("cache-home-is-a-file", _cache_home_is_file, "Not a directory"),
]


@pytest.mark.parametrize(("block", "reason"), [c[1:] for c in SAVE_CASES], ids=[c[0] for c in SAVE_CASES])
def test_unwritable_cache_keeps_thresholds_for_the_run(block, reason):
    block(paths.cache_root())
    notes: list[str] = []
    engine = Engine.load(repo_id("qwen3_moe"), device="cpu", sparsity=0.6, on_notice=notes.append)
    path = thresholds.cache_path(engine.model_name, engine.resolved.revision, 0.6)
    saved = [n for n in notes if n.startswith("could not save thresholds")]
    assert saved == [f"could not save thresholds to {path} ({reason}); using them for this run only"], notes
    assert engine.sparsity == 0.6 and all(m.sparse_enabled and m.tau is not None for m in engine.loaded.experts)
    table = thresholds.thresholds_for(engine, 0.6)
    assert table.path is None and all(0 < t < threshold_files.MAX_TAU for t in table.taus)
    assert not path.is_file()
    if path.parent.is_dir():
        assert not list(path.parent.glob("*.tmp"))  # no temporary file left behind
