"""Shared fixtures: an isolated offline HF cache and XDG dirs, and tiny random-weight MoE checkpoints of each family.

The environment is set at import time, before anything imports huggingface_hub or triton, so the library reads
it exactly as it would for a user running offline.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_ROOT = Path(tempfile.mkdtemp(prefix="localmoe-tests-"))
os.environ["HF_HOME"] = str(_ROOT / "hf")
os.environ["HF_HUB_CACHE"] = str(_ROOT / "hf" / "hub")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["XDG_CACHE_HOME"] = str(_ROOT / "xdg-cache")
os.environ["XDG_DATA_HOME"] = str(_ROOT / "xdg-data")
os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on the CPU in CI
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # `pytest -n N`: the workers share the cores, torch's threads too
    # (N workers of one thread each on N cores; torch's default, a thread per core in every worker, oversubscribes
    # them and its threads spin waiting for each other: tiny models' steps run several times slower). Subprocesses
    # the tests start (the CLI, the chat in a terminal) inherit it.
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

import pytest  # noqa: E402
import tiny_models  # noqa: E402  (tests/ is on sys.path under pytest's default import mode)

if os.environ.get("LOCALMOE_RECORD_LAUNCHES"):  # .ci/run: compile each launch for real GPUs afterwards
    import launch_recorder

    launch_recorder.install()

    def pytest_sessionfinish(session):
        launch_recorder.save(os.environ["LOCALMOE_RECORD_LAUNCHES"])


FAMILIES = tiny_models.SUPPORTED  # every family localmoe runs (localmoe.models.families.FAMILIES), by key


def repo_id(family: str) -> str:
    return f"{tiny_models.ORG}/tiny-{family}"


@pytest.fixture(scope="session")
def hub_cache() -> Path:
    """The session's HF cache holding one tiny checkpoint per family (org localmoe-test), sharded ones, and
    `localmoe-test/tiny-think` (tiny_models.THINK_REPO: a thinking chat template, a scripted reply)."""
    cache = Path(os.environ["HF_HUB_CACHE"])
    src = _ROOT / "src"
    for fam in tiny_models.BUILT + ["qwen3_dense"]:  # GPT-OSS and a dense model too: their refusals are tested
        folder = tiny_models.save_checkpoint(fam, src / fam)
        tiny_models.place_in_hf_cache(folder, cache, repo_id(fam))
    sharded = tiny_models.save_checkpoint("qwen3_moe", src / "sharded", max_shard_size="20KB")
    tiny_models.place_in_hf_cache(sharded, cache, repo_id("sharded"))
    sharded35 = tiny_models.save_checkpoint("qwen3_5_moe", src / "sharded35", max_shard_size="40KB")
    tiny_models.place_in_hf_cache(sharded35, cache, repo_id("sharded35"))
    think = tiny_models.save_think_checkpoint(src / "think")  # a thinking model (Qwen3's template), scripted reply
    tiny_models.place_in_hf_cache(think, cache, tiny_models.THINK_REPO)
    return cache


@pytest.fixture(scope="session")
def src_dir(hub_cache) -> Path:
    """Plain checkpoint folders (not in the cache layout), one per family."""
    return _ROOT / "src"


@pytest.fixture(autouse=True)
def _fresh_xdg(hub_cache, tmp_path, monkeypatch):
    """Private XDG cache/data dirs per test, so calibration files and chat history never leak between tests."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
