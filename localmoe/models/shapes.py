"""Real configs of the registry's models without their weights (`data/shapes.json`): `bench --shape`, `show` offline.

`shape_config(alias)` builds the transformers config of a registry model from the stored entry, so benchmarks and
plans run at real shapes with nothing downloaded. The entries are per model (keyed by registry alias, like
models.toml), not per family: a family module (models/families/) says how a family's checkpoints are read, this
file what one published checkpoint's config is. Imports only the families table and errors.
"""

from __future__ import annotations

import json
from pathlib import Path

from localmoe.errors import UsageError
from localmoe.models.families import family_for_model_type, register_model_type, supported_families

SHAPES = Path(__file__).parent.parent / "data" / "shapes.json"


def shape_config(alias: str):
    from transformers import AutoConfig

    shapes = json.loads(SHAPES.read_text())
    if alias not in shapes or alias.startswith("_"):
        known = ", ".join(k for k in shapes if not k.startswith("_"))
        raise UsageError(f"no shape for {alias!r}; known shapes: {known}")
    entry = shapes[alias]
    fam = family_for_model_type(entry["model_type"])
    if fam is None or fam.unsupported:
        raise UsageError(
            f"the shape {alias!r} is a {entry['model_type']!r} model: "
            + (
                fam.unsupported
                if fam is not None
                else f"not a family localmoe runs (supported: {supported_families()})"
            )
        )
    kwargs = {k: v for k, v in entry["config"].items() if not k.startswith("_")}
    register_model_type(entry["model_type"])  # localmoe's own architectures (DeaMoE) with the Auto classes
    return AutoConfig.for_model(entry["model_type"], **kwargs)
