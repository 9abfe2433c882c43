"""Model resolution: turn what the user typed (alias, `org/name`, or a directory) into a local checkpoint folder.

Hub models go through huggingface_hub into the standard HF cache, fetching only what localmoe reads
(config, tokenizer, safetensors). Offline (`HF_HUB_OFFLINE=1` or no network) cached models still work and
uncached ones fail with a message naming `localmoe pull`. Imports no torch.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from localmoe.errors import RuntimeFailure, UsageError
from localmoe.events import ProgressFn
from localmoe.registry import ModelSpec, Registry, load_registry, unknown_model_error

# What a checkpoint folder needs; never pickle weights (*.bin, *.pt) and never remote code (*.py).
ALLOW_PATTERNS = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
]
_REPO_RE = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


@dataclass(frozen=True)
class ResolvedModel:
    name: str  # what to show the user
    path: Path  # local folder holding config.json + safetensors
    spec: ModelSpec | None  # registry entry, when there is one
    revision: str  # hub commit hash, or a content hash of a local folder

    @property
    def default_sparsity(self) -> float | None:
        return self.spec.sparsity if self.spec else None


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def _local_revision(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(path.glob("*.json")) + sorted(path.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}".encode())
        if f.suffix == ".json" and st.st_size < 1 << 22:
            h.update(f.read_bytes())
    return "local-" + h.hexdigest()[:16]


def _progress_tqdm(progress: ProgressFn):
    """A tqdm class that reports bytes to `progress` (for the TUI's loading view)."""
    from tqdm.auto import tqdm

    class _Report(tqdm):
        def update(self, n=1):
            out = super().update(n)
            progress("download", int(self.n), int(self.total) if self.total else None)
            return out

    return _Report


def download(repo_id: str, *, local_only: bool, progress: ProgressFn | None = None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    kwargs = {"allow_patterns": ALLOW_PATTERNS}
    if progress is not None:
        kwargs["tqdm_class"] = _progress_tqdm(progress)
    try:
        return Path(snapshot_download(repo_id, local_files_only=local_only, **kwargs))
    except RepositoryNotFoundError:
        raise UsageError(f"no model {repo_id!r} on the Hugging Face hub (or it is private: run `hf auth login`)") from None
    except GatedRepoError:
        raise RuntimeFailure(f"{repo_id} is gated: accept its licence on the hub, then `hf auth login`") from None
    except LocalEntryNotFoundError:
        if local_only:
            raise RuntimeFailure(
                f"{repo_id} is not downloaded and the hub cannot be reached (offline): "
                f"run `localmoe pull {repo_id}` on a machine with network access"
            ) from None
        raise
    except OSError as e:  # connection errors and the like
        raise RuntimeFailure(f"could not download {repo_id}: {e}; check the network, then `localmoe pull {repo_id}`") from None


def resolve(
    name: str,
    *,
    download_missing: bool = True,
    progress: ProgressFn | None = None,
    registry: Registry | None = None,
) -> ResolvedModel:
    """Resolve MODEL. Downloads hub models that are not cached unless offline or `download_missing` is False."""
    registry = registry or load_registry()
    name = name.strip()
    if not name:
        raise UsageError("no model given: pass an alias from `localmoe models`, a hub repo id, or a directory")
    spec = registry.get(name)
    path = Path(name).expanduser()
    looks_like_path = name.startswith((".", "/", "~")) or os.sep in name.rstrip(os.sep) and path.exists()
    if spec is None and (path.is_dir() or looks_like_path):
        if not path.is_dir():
            raise UsageError(f"model directory {name!r} does not exist: check the path")
        if not (path / "config.json").is_file():
            raise UsageError(f"{name!r} has no config.json: point at a Hugging Face checkpoint folder")
        return ResolvedModel(name=path.name, path=path.resolve(), spec=None, revision=_local_revision(path))
    if spec is not None and spec.packaged_dir is not None:
        d = spec.packaged_dir
        if not (d / "config.json").is_file():
            raise RuntimeFailure(f"the bundled model {name!r} is missing from this install ({d}); reinstall localmoe")
        return ResolvedModel(name=name, path=d, spec=spec, revision=_local_revision(d))
    repo_id = spec.repo if spec else name
    if spec is None:
        if not _REPO_RE.match(name):
            raise unknown_model_error(name, registry)
        spec = registry.by_repo(name)
    cached = None
    try:
        cached = download(repo_id, local_only=True)
    except RuntimeFailure:
        if _offline() or not download_missing:
            raise
    path = cached if cached is not None else download(repo_id, local_only=False, progress=progress)
    return ResolvedModel(name=spec.alias if spec else repo_id, path=path, spec=spec, revision=path.name)


def is_downloaded(spec: ModelSpec) -> bool:
    if spec.packaged_dir is not None:
        return (spec.packaged_dir / "config.json").is_file()
    from huggingface_hub import try_to_load_from_cache

    cfg = try_to_load_from_cache(spec.repo, "config.json")
    if not isinstance(cfg, str):
        return False
    folder = Path(cfg).parent
    return any(folder.glob("*.safetensors"))
