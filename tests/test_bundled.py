"""The bundled, trained `localmoe-tiny` works offline on first run and writes language, not noise."""

from __future__ import annotations

import json
import re

import pytest

from localmoe.cli.main import main
from localmoe.engine.engine import Engine
from localmoe.events import GenerationSettings
from localmoe.models.registry import load_registry


def test_is_the_default_and_small():
    reg = load_registry()
    spec = reg.get("localmoe-tiny")
    assert reg.default == "localmoe-tiny"
    files = list(spec.packaged_dir.iterdir())
    assert sum(f.stat().st_size for f in files) < 25 * 1024 * 1024
    assert any(f.suffix == ".safetensors" for f in files)
    assert not any(f.suffix in {".bin", ".pt", ".py"} for f in files)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """(engine, XDG cache dir): the first run on a fresh cache (it calibrates the registry's sparsity: most of the
    load), loaded once; the CLI test runs on the cache it wrote, as a user's second run does."""
    cache = tmp_path_factory.mktemp("bundled-xdg-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(cache))
        engine = Engine.load("localmoe-tiny", device="cpu")  # registry default sparsity: the sparse path
    return engine, cache


def test_generates_language_offline(first_run):
    engine, _ = first_run
    assert engine.sparsity == load_registry().get("localmoe-tiny").sparsity > 0
    text = "".join(
        ev.text
        for ev in engine.chat(
            [{"role": "user", "content": "What does the json module do?"}], GenerationSettings(max_new_tokens=60)
        )
    )
    words = re.findall(r"[A-Za-z]+", text)
    assert len(words) >= 8 and len(set(words)) >= 6, text
    assert sum(c.isascii() for c in text) / max(len(text), 1) > 0.95
    assert engine.stats.generated_tokens > 10
    assert abs(engine.stats.sparsity_realized - engine.sparsity) < 0.1


def test_run_json_on_bundled_model(first_run, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(first_run[1]))  # the thresholds the first run calibrated
    code = main(["run", "localmoe-tiny", "Hello", "--json", "--max-new-tokens", "30"])
    obj = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and obj["model"] == "localmoe-tiny" and obj["text"].strip()
    assert obj["stats"]["finish_reason"] in {"stop", "length"}
