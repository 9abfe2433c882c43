"""Model resolution: turn what the user typed (alias, `org/name`, or a directory) into a local checkpoint folder.

Hub models go through huggingface_hub into the standard HF cache, fetching only what localmoe reads
(config, tokenizer, safetensors). Offline (`HF_HUB_OFFLINE=1` or no network) cached models still work and
uncached ones fail with a message naming `localmoe pull`. A model localmoe cannot run is refused before anything
is downloaded: a registry model by its family, a hub repo by its config.json (fetched alone first). A cached
snapshot counts only when it holds config.json and every weight file. Imports no torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from localmoe.errors import RuntimeFailure, UsageError
from localmoe.events import ProgressFn
from localmoe.models.checkpoint import plain_shard_name
from localmoe.models.families import family_for_model_type, supported_families
from localmoe.models.registry import ModelSpec, Registry, load_registry, unknown_model_error, unsupported_model_error
from localmoe.models.shapes import SHAPES

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
    """A local folder's revision: name, size and modification time (ns) of each JSON and weight file, plus the small
    JSON files' contents. A checkpoint rewritten in place, even at the same size, gets a new revision, so thresholds
    calibrated on the old weights (cached by revision) are not reused."""
    h = hashlib.sha256()
    for f in sorted(path.glob("*.json")) + sorted(path.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
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


def _unreachable(e: BaseException) -> bool:
    """A connection failure (DNS, refused, timeout, proxy) rather than an answer from the hub."""
    names = {k.__name__ for k in type(e).__mro__}
    return isinstance(e, ConnectionError) or bool(
        names & {"ConnectionError", "ConnectError", "Timeout", "TimeoutException", "ProxyError", "SSLError"}
    )


def _cause(e: BaseException) -> str:
    """The innermost reason in an exception chain, one line (e.g. 'Name or service not known')."""
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text[-120:]


def _check_family_first(repo_id: str, label: str) -> None:
    """Fetch config.json alone and refuse a model localmoe cannot run before its weights are downloaded."""
    from huggingface_hub import snapshot_download

    # snapshot_download asks the hub for the file list once (no retries: an unreachable hub fails at once) and
    # fetches config.json alone
    folder = Path(snapshot_download(repo_id, allow_patterns=["config.json"]))
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"{label} has no config.json on the hub: it is not a transformers checkpoint") from None
    except (OSError, ValueError):
        return  # unreadable or not JSON: the loader says so with the file's path
    if not isinstance(config, dict):
        return
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    types = [t for t in (config.get("model_type"), text.get("model_type")) if isinstance(t, str)]
    if not types:
        return
    fam = next((f for f in map(family_for_model_type, types) if f is not None), None)
    if fam is None:
        raise UsageError(
            f"{label} is a {types[0]!r} model, not a MoE family localmoe runs (supported: "
            f"{supported_families()}); nothing else was downloaded"
        )
    if fam.unsupported:
        raise UsageError(f"{label}: {fam.unsupported}; nothing else was downloaded")


def download(
    repo_id: str,
    *,
    local_only: bool,
    progress: ProgressFn | None = None,
    label: str | None = None,
    pulling: bool = False,
) -> Path:
    """The snapshot folder of `repo_id` in the HF cache, downloaded first unless `local_only`. `label`: the name the
    user typed (alias or repo id), for messages."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    label = label or repo_id
    kwargs = {"allow_patterns": ALLOW_PATTERNS}
    if progress is not None:
        kwargs["tqdm_class"] = _progress_tqdm(progress)
    try:
        if local_only:
            folder = Path(snapshot_download(repo_id, local_files_only=True, **kwargs))
            if not complete_snapshot(folder):
                raise LocalEntryNotFoundError(f"{folder} lacks config.json or weight files")
            return folder
        _check_family_first(repo_id, label)
        return Path(snapshot_download(repo_id, local_files_only=False, **kwargs))
    except GatedRepoError:
        raise RuntimeFailure(f"{repo_id} is gated: accept its licence on the hub, then `hf auth login`") from None
    except RepositoryNotFoundError:
        raise UsageError(
            f"no model {repo_id!r} on the Hugging Face hub (or it is private: run `hf auth login`)"
        ) from None
    except RevisionNotFoundError:
        raise UsageError(f"{repo_id} has no such revision on the hub") from None
    except LocalEntryNotFoundError as e:  # not cached, and (when downloading) the hub could not be reached
        if not local_only:
            raise _unreachable_error(label, pulling, _cause(e)) from None
        if _offline():
            raise _unreachable_error(label, pulling, "HF_HUB_OFFLINE is set") from None
        raise RuntimeFailure(f"{label} is not downloaded: run `localmoe pull {label}`") from None
    except HfHubHTTPError as e:
        raise RuntimeFailure(
            f"the hub refused {repo_id} ({_cause(e)}): try again later, then `localmoe pull {label}`"
        ) from None
    except OSError as e:  # connection errors, a full disk and the like
        if _unreachable(e):
            raise _unreachable_error(label, pulling, _cause(e)) from None
        raise RuntimeFailure(
            f"could not download {label}: {_cause(e)}; fix that, then `localmoe pull {label}`"
        ) from None


def _unreachable_error(label: str, pulling: bool, cause: str) -> RuntimeFailure:
    if pulling and cause == "HF_HUB_OFFLINE is set":
        return RuntimeFailure(f"cannot download {label}: HF_HUB_OFFLINE is set; unset it, then `localmoe pull {label}`")
    if pulling:
        return RuntimeFailure(
            f"cannot download {label}: the hub cannot be reached ({cause}); check the network, "
            f"then run `localmoe pull {label}` again"
        )
    return RuntimeFailure(
        f"{label} is not downloaded and the hub cannot be reached ({cause}): run `localmoe pull {label}` when online"
    )


def complete_snapshot(folder: Path) -> bool:
    """A cached snapshot localmoe can load: config.json and weights, every file a sharded index names present."""
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        return False
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError, OSError, RecursionError):
            return True  # a broken index: the loader reports it by name
        if not all(plain_shard_name(n) for n in names):
            return True  # a name that is no plain shard file name: complete as far as we look, the loader refuses it
        return all((folder / n).is_file() for n in names)
    return True


def resolve(
    name: str,
    *,
    download_missing: bool = True,
    progress: ProgressFn | None = None,
    registry: Registry | None = None,
    pulling: bool = False,
) -> ResolvedModel:
    """Resolve MODEL. Downloads hub models that are not cached unless offline or `download_missing` is False.
    `pulling`: for `localmoe pull`, whose messages say to run it again rather than to run it when online."""
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
    if spec is not None and spec.unsupported:  # before any download
        raise unsupported_model_error(spec, registry)
    cached = None
    try:
        cached = download(repo_id, local_only=True, label=name, pulling=pulling)
    except RuntimeFailure:
        if _offline() or not download_missing:
            raise
    path = (
        cached
        if cached is not None
        else download(repo_id, local_only=False, progress=progress, label=name, pulling=pulling)
    )
    return ResolvedModel(name=spec.alias if spec else repo_id, path=path, spec=spec, revision=path.name)


def is_downloaded(spec: ModelSpec) -> bool:
    if spec.packaged_dir is not None:
        return (spec.packaged_dir / "config.json").is_file()
    from huggingface_hub import try_to_load_from_cache

    cfg = try_to_load_from_cache(spec.repo, "config.json")
    if not isinstance(cfg, str):
        return False
    return complete_snapshot(Path(cfg).parent)


@dataclass(frozen=True)
class ConfigSource:
    """Where `localmoe show` found a model's config: a folder holding config.json (a local checkpoint, a cached
    snapshot, or the config files alone fetched from the hub), or None when it comes from localmoe's table of
    shapes (localmoe/data/shapes.json: a registry model, offline)."""

    name: str  # what to show the user
    folder: Path | None
    spec: ModelSpec | None
    repo_id: str | None  # the hub repo (None for local folders and bundled models)
    downloaded: bool  # the folder is a loadable checkpoint (weights included)
    how: str  # "local", "bundled", "cache", "hub" (config files fetched), "shapes"


CONFIG_FILES = ("config.json", "generation_config.json")


def locate_config(name: str, *, registry: Registry | None = None) -> ConfigSource:
    """A model's config without downloading its weights: a local folder or bundled model; a cached snapshot; else
    config.json (and generation_config.json) alone from the hub; else, offline or when the hub cannot be reached,
    the registry's entry in localmoe's table of shapes. Errors: unknown names and unsupported registry models as
    `resolve` gives them; a model none of these has, one line naming HF_HUB_OFFLINE or the network."""
    registry = registry or load_registry()
    name = name.strip()
    if not name:
        raise UsageError("no model given: pass an alias from `localmoe models`, a hub repo id, or a directory")
    spec = registry.get(name)
    path = Path(name).expanduser()
    if spec is None and (path.is_dir() or name.startswith((".", "/", "~"))):
        folder = resolve(name, download_missing=False, registry=registry).path
        return ConfigSource(path.name, folder, None, None, complete_snapshot(folder), "local")
    if spec is not None and spec.packaged_dir is not None:
        folder = resolve(name, download_missing=False, registry=registry).path
        return ConfigSource(name, folder, spec, None, True, "bundled")
    repo_id = spec.repo if spec else name
    if spec is None:
        if not _REPO_RE.match(name):
            raise unknown_model_error(name, registry)
        spec = registry.by_repo(name)
    if spec is not None and spec.unsupported:
        raise unsupported_model_error(spec, registry)
    label = spec.alias if spec else repo_id
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(repo_id, "config.json")
    if isinstance(cached, str):
        folder = Path(cached).parent
        return ConfigSource(label, folder, spec, repo_id, complete_snapshot(folder), "cache")
    why = "HF_HUB_OFFLINE is set"
    if not _offline():
        try:
            return ConfigSource(label, _fetch_config(repo_id), spec, repo_id, False, "hub")
        except RuntimeFailure as e:
            why = str(e)
    if spec is not None and _has_shape(spec.alias):
        return ConfigSource(label, None, spec, repo_id, False, "shapes")
    raise RuntimeFailure(
        f"{name} is not downloaded and its config.json cannot be fetched ({why}): connect to the "
        f"network (or unset HF_HUB_OFFLINE), or `localmoe pull {name}` first"
    )


def _has_shape(alias: str) -> bool:
    try:
        shapes = json.loads(SHAPES.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return alias in shapes and not alias.startswith("_")


def _fetch_config(repo_id: str) -> Path:
    """config.json (and generation_config.json when the repo has one) alone, into the HF cache -> their folder.
    RuntimeFailure with the reason when the hub cannot be reached; UsageError when there is no such repo."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        folder = Path(hf_hub_download(repo_id, "config.json")).parent
    except GatedRepoError:
        raise RuntimeFailure(f"{repo_id} is gated: accept its licence on the hub, then `hf auth login`") from None
    except RepositoryNotFoundError:
        raise UsageError(
            f"no model {repo_id!r} on the Hugging Face hub (or it is private: run `hf auth login`)"
        ) from None
    except EntryNotFoundError:
        raise UsageError(f"{repo_id} has no config.json on the hub: it is not a transformers checkpoint") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise RuntimeFailure(f"the hub cannot be reached: {_cause(e)}") from None
    try:
        hf_hub_download(repo_id, "generation_config.json")
    except Exception:  # noqa: BLE001 - optional: the model's sampling defaults, when it has them
        pass
    return folder


def hub_weight_bytes(repo_id: str) -> int | None:
    """The size of a hub repo's safetensors files from its file list, or None (offline, unreachable, no sizes)."""
    if _offline():
        return None
    try:
        from huggingface_hub import HfApi

        info = HfApi().model_info(repo_id, files_metadata=True)
        sizes = [f.size for f in info.siblings or [] if f.rfilename.endswith(".safetensors")]
    except Exception:  # noqa: BLE001 - any failure: the size is estimated instead
        return None
    return sum(sizes) if sizes and all(isinstance(x, int) for x in sizes) else None


def local_weight_bytes(folder: Path) -> int:
    """Bytes of a folder's safetensors files (links followed, as a cache snapshot's are)."""
    total = 0
    for f in folder.glob("*.safetensors"):
        try:
            total += f.stat().st_size
        except OSError:
            pass
    return total
