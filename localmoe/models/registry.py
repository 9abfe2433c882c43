"""The model registry: `models.toml` parsed into frozen `ModelSpec`s, validated, and looked up by alias.

Imports no torch (used by `localmoe models` and `--help`).
"""

from __future__ import annotations

import difflib
import math
import sys
from dataclasses import dataclass, fields
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from localmoe.errors import UsageError
from localmoe.models.families import family_for_model_type, supported_families

REGISTRY_PATH = Path(__file__).parent.parent / "models.toml"
PACKAGE_PREFIX = "package:"
ASSETS_DIR = Path(__file__).parent.parent / "assets"

UNKNOWN_MODEL_SPARSITY = 0.5  # default sparsity of a model the registry does not list
DEFAULT_CONTEXT = 8192  # prompt + reply tokens, when the model allows that many


@dataclass(frozen=True)
class ModelSpec:
    alias: str
    repo: str  # hub repo id, or "package:<dir>" for a model shipped in localmoe/assets
    family: str  # transformers model_type
    sparsity: float  # default decode sparsity target
    params_b: float
    bf16_gb: float
    vram: str = ""
    description: str = ""

    @property
    def unsupported(self) -> str:
        """Why localmoe cannot run this model yet ('' when it can): its family (models/families/) is marked unsupported,
        or is no MoE family localmoe knows. Known before anything is downloaded."""
        fam = family_for_model_type(self.family)
        if fam is None:
            return f"its family {self.family!r} is not one localmoe runs (supported: {supported_families()})"
        return fam.unsupported

    @property
    def packaged_dir(self) -> Path | None:
        if self.repo.startswith(PACKAGE_PREFIX):
            return ASSETS_DIR / self.repo[len(PACKAGE_PREFIX) :]
        return None


@dataclass(frozen=True)
class Registry:
    models: dict[str, ModelSpec]
    default: str

    def get(self, alias: str) -> ModelSpec | None:
        return self.models.get(alias)

    def by_repo(self, repo: str) -> ModelSpec | None:
        for spec in self.models.values():
            if spec.repo.lower() == repo.lower():
                return spec
        return None

    def alternative(self, spec: ModelSpec) -> ModelSpec | None:
        """The supported hub model closest in size to `spec` (what to use instead of an unsupported one)."""
        options = [
            m
            for m in self.models.values()
            if not m.unsupported and m.packaged_dir is None and m.bf16_gb > 0 and m.alias != spec.alias
        ]
        if not options or spec.bf16_gb <= 0:
            return None
        return min(options, key=lambda m: abs(math.log(m.bf16_gb / spec.bf16_gb)))

    def suggestions(self, name: str) -> list[str]:
        names = list(self.models) + [m.repo for m in self.models.values() if "/" in m.repo]
        return difflib.get_close_matches(name, names, n=3, cutoff=0.5)


_REQUIRED = {"repo", "family", "sparsity", "params_b", "bf16_gb"}
_ALLOWED = {f.name for f in fields(ModelSpec)} - {"alias"}


def parse_registry(text: str, source: str = "models.toml") -> Registry:
    """Parse and validate registry TOML; raises ValueError naming the offending entry and key."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{source}: invalid TOML: {e}") from None
    unknown_top = set(data) - {"default", "models"}
    if unknown_top:
        raise ValueError(f"{source}: unknown top-level keys {sorted(unknown_top)}")
    models: dict[str, ModelSpec] = {}
    for alias, entry in data.get("models", {}).items():
        if not isinstance(entry, dict):
            raise ValueError(f"{source}: models.{alias} must be a table")
        unknown = set(entry) - _ALLOWED
        if unknown:
            raise ValueError(f"{source}: models.{alias}: unknown keys {sorted(unknown)} (allowed: {sorted(_ALLOWED)})")
        missing = _REQUIRED - set(entry)
        if missing:
            raise ValueError(f"{source}: models.{alias}: missing keys {sorted(missing)}")
        for key in ("repo", "family", "vram", "description"):
            if key in entry and not isinstance(entry[key], str):
                raise ValueError(f"{source}: models.{alias}.{key} must be a string")
        for key in ("sparsity", "params_b", "bf16_gb"):
            if not isinstance(entry[key], (int, float)) or isinstance(entry[key], bool):
                raise ValueError(f"{source}: models.{alias}.{key} must be a number")
        if not 0.0 <= float(entry["sparsity"]) < 1.0:
            raise ValueError(f"{source}: models.{alias}.sparsity must be in [0, 1)")
        repo = entry["repo"]
        if not (repo.startswith(PACKAGE_PREFIX) or repo.count("/") == 1):
            raise ValueError(f"{source}: models.{alias}.repo must be 'org/name' or 'package:<dir>'")
        models[alias] = ModelSpec(
            alias=alias,
            repo=repo,
            family=entry["family"],
            sparsity=float(entry["sparsity"]),
            params_b=float(entry["params_b"]),
            bf16_gb=float(entry["bf16_gb"]),
            vram=entry.get("vram", ""),
            description=entry.get("description", ""),
        )
    default = data.get("default", "")
    if default and default not in models:
        raise ValueError(f"{source}: default {default!r} is not a listed model")
    return Registry(models=models, default=default)


_cached: Registry | None = None


def load_registry() -> Registry:
    global _cached
    if _cached is None:
        _cached = parse_registry(REGISTRY_PATH.read_text(encoding="utf-8"), str(REGISTRY_PATH))
    return _cached


def unknown_model_error(name: str, registry: Registry) -> UsageError:
    close = registry.suggestions(name)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    return UsageError(
        f"unknown model {name!r}: {hint}give an alias from `localmoe models`, a hub repo id (org/name), "
        "or a local directory"
    )


def unsupported_model_error(spec: ModelSpec, registry: Registry) -> UsageError:
    """The one-line refusal of a registry model localmoe cannot run, raised before anything is downloaded."""
    alt = registry.alternative(spec)
    instead = f"e.g. {alt.alias} ({alt.bf16_gb:g} GB), " if alt else ""
    return UsageError(
        f"{spec.alias} ({spec.repo}) cannot run: {spec.unsupported}. Use a supported model instead: "
        f"{instead}see `localmoe models`"
    )
