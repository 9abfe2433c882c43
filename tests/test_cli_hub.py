"""The CLI with the hub and the registry: `models` (JSON types, unsupported models marked and refused before any
download), no network (one line, the right exit code), partial snapshots and local revisions."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import tiny_models
from cli_support import MODEL, run


# -- the hub and the registry -------------------------------------------------------------------------------------
def test_models_json_types(capsys):
    code, out, _ = run(capsys, "models", "--json")
    rows = {r["alias"]: r for r in json.loads(out)}
    assert code == 0 and "localmoe-tiny" in rows and not any("(" in a for a in rows)
    for r in rows.values():
        assert isinstance(r["bf16_gb"], float) and isinstance(r["params_b"], float)
        assert isinstance(r["default_sparsity"], float) and 0 <= r["default_sparsity"] < 1
        assert all(isinstance(r[k], bool) for k in ("default", "downloaded", "supported"))
        assert (r["unsupported_reason"] is None) == r["supported"]
    assert [a for a, r in rows.items() if r["default"]] == ["localmoe-tiny"]
    assert rows["qwen3.5-35b"]["bf16_gb"] == 69.4 and rows["qwen3.5-35b"]["default_sparsity"] == 0.85
    assert [a for a, r in rows.items() if not r["supported"]] == []  # GPT-OSS runs (issue #25)
    assert rows["gpt-oss-20b"]["supported"] and rows["gpt-oss-120b"]["supported"]


def test_models_table_marks_unsupported(capsys, monkeypatch):
    reason = tiny_models.mark_unsupported(monkeypatch)
    code, out, _ = run(capsys, "models")
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[-1] == "SUPPORTED"
    unsupported = ["gpt-oss-20b", "gpt-oss-120b"]
    assert [ln.split()[0] for ln in lines[1:] if ln.split()[-1] == "no" and "/" in ln] == unsupported
    assert lines[-2:] == [f"{a}: not supported: {reason}" for a in unsupported]


# Unsupported registry models are refused before any download, by every command that would fetch them (GPT-OSS, which
# runs, marked unsupported for these tests). The tests run offline with nothing of gpt-oss cached: a refusal after a
# download attempt would say "not downloaded" (1).
REFUSED = [
    ("run", ["run", "gpt-oss-20b", "hi"]),
    ("run-repo-id", ["run", "openai/gpt-oss-20b", "hi"]),
    ("chat", ["chat", "gpt-oss-20b"]),
    ("pull", ["pull", "gpt-oss-20b"]),
    ("pull-repo-id", ["pull", "openai/gpt-oss-20b"]),
    ("eval", ["eval", "gpt-oss-20b"]),
    ("bench", ["bench", "gpt-oss-20b"]),
    ("bench-shape", ["bench", "--shape", "gpt-oss-20b"]),
    ("calibrate", ["calibrate", "gpt-oss-20b", "--sparsity", "0.5"]),
]


@pytest.mark.parametrize("argv", [c[1] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_unsupported_refused_before_download(capsys, monkeypatch, argv):
    reason = tiny_models.mark_unsupported(monkeypatch)
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"localmoe: error: gpt-oss-20b (openai/gpt-oss-20b) cannot run: {reason}")
    assert "Use a supported model instead: e.g. " in err


def _cli_unreachable_hub(*argv) -> subprocess.CompletedProcess:
    """The CLI as a user without network runs it: HF_HUB_OFFLINE unset, and the hub's address refuses connections."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"
    return subprocess.run(
        [sys.executable, "-m", "localmoe", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )


NO_NETWORK = [  # (id, argv, exit code, the error line, or None for success)
    (
        "run-uncached-repo",
        ["run", "someorg/uncached", "hi"],
        1,
        "localmoe: error: someorg/uncached is not downloaded and the hub cannot be reached (",
        "run `localmoe pull someorg/uncached` when online",
    ),
    (
        "pull-uncached-repo",
        ["pull", "someorg/uncached"],
        1,
        "localmoe: error: cannot download someorg/uncached: the hub cannot be reached (",
        "then run `localmoe pull someorg/uncached` again",
    ),
    (
        "pull-uncached-alias",
        ["pull", "olmoe"],
        1,
        "localmoe: error: cannot download olmoe: the hub cannot be reached",
        "`localmoe pull olmoe` again",
    ),
    (
        "pull-uncached-gpt-oss",
        ["pull", "gpt-oss-20b"],
        1,
        "localmoe: error: cannot download gpt-oss-20b: the hub cannot be reached",
        "`localmoe pull gpt-oss-20b` again",
    ),
    ("pull-cached-repo", ["pull", MODEL], 0, None, None),
]


@pytest.mark.parametrize("argv, code, starts, ends", [c[1:] for c in NO_NETWORK], ids=[c[0] for c in NO_NETWORK])
def test_without_network(hub_cache, argv, code, starts, ends):
    r = _cli_unreachable_hub(*argv)
    assert r.returncode == code, r.stderr
    if starts is None:
        assert r.stderr == "" and r.stdout.startswith(f"{MODEL}: ")
    else:
        assert r.stderr.startswith(starts) and r.stderr.rstrip("\n").endswith(ends) and r.stderr.count("\n") == 1


def test_partial_snapshot_is_not_downloaded(hub_cache, src_dir, tmp_path, capsys):
    """A download cut short (config.json cached, no weights) counts as not downloaded, not as a broken model."""
    import tiny_models

    folder = tmp_path / "partial"
    folder.mkdir()
    shutil.copyfile(src_dir / "qwen3_moe" / "config.json", folder / "config.json")
    tiny_models.place_in_hf_cache(folder, hub_cache, "localmoe-test/partial")
    code, _, err = run(capsys, "run", "localmoe-test/partial", "hi")
    assert code == 1 and "localmoe-test/partial is not downloaded" in err and "localmoe pull" in err


def test_local_revision_follows_rewrites(src_dir, tmp_path):
    """A local checkpoint rewritten in place (same size) gets a new revision, so its cached thresholds are not
    reused; left alone, its revision is stable."""
    from localmoe.models import hub

    folder = tmp_path / "ckpt"
    shutil.copytree(src_dir / "qwen3_moe", folder)
    first = hub.resolve(str(folder)).revision
    assert hub.resolve(str(folder)).revision == first
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # same size, other content
    st = weights.stat()
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    second = hub.resolve(str(folder)).revision
    assert second != first
    config = folder / "config.json"
    os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 1_000_000_000))
    assert hub.resolve(str(folder)).revision not in {first, second}
