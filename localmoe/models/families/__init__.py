"""The MoE families localmoe supports, each described in one module here, and `FAMILIES`, their table keyed by the
transformers MoE block class.

A family module (`qwen3_5_moe.py`, `qwen3_moe.py`, `olmoe.py`, `mixtral.py`, `deepseek_v2.py`, `granitemoe.py`,
`deamoe.py`, `deamoe_qwen3_5_text.py`, `gpt_oss.py`) holds one `SPEC = FamilySpec(...)` (spec.py): which `model_type`s
use the block class, how
checkpoint keys are renamed into the transformers module namespace (the same renames transformers applies when it
loads), which checkpoint prefixes are not part of the text model, how the experts are stored (per-expert names or
fused), the config keys of their count and width, their activation, why the family is unsupported (if it is), and the
tiny random-weight model the tests build of it. The loader swaps the `experts` submodule of every block whose class is
in `FAMILIES` for localmoe's `LocalExperts` (DeaMoE, localmoe's own architecture, holds localmoe's `DepartmentExperts`
already: `FamilySpec.native_experts`); nothing else of transformers is replaced at load. Everything a test or
benchmark iterates over "every family" derives from `FAMILIES`.

Adding a family: write its module here (copy the closest one) and add it to `_MODULES` below. That is all when its
experts are a gated MLP in one of the two layouts the loader reads (per-expert gate/up/down, or fused gate_up_proj
and down_proj, after renames); the tests then build and run its tiny model too. Fused decode kernels for it, if
any, are rows keyed by transformers class name in localmoe/decode/replacements.py (that table stays the one place
decode replacements live). Real configs of registry models for
`bench --shape` and `show` offline are per model, in localmoe/data/shapes.json beside models.toml.

Imports no torch.
"""

from __future__ import annotations

from localmoe.models.families import (
    deamoe,
    deamoe_qwen3_5_text,
    deepseek_v2,
    gpt_oss,
    granitemoe,
    mixtral,
    olmoe,
    qwen3_5_moe,
    qwen3_moe,
)
from localmoe.models.families.spec import FUSED_EXPERTS, FamilySpec, TinyModel

__all__ = [
    "EXPERT_COUNT_KEYS",
    "EXPERT_WIDTH_KEYS",
    "FAMILIES",
    "FUSED_EXPERTS",
    "PER_EXPERT_NAMES",
    "FamilySpec",
    "TinyModel",
    "expert_count",
    "family_for_model_type",
    "register_model_type",
    "supported_families",
]

_MODULES = (
    qwen3_5_moe,
    qwen3_moe,
    olmoe,
    mixtral,
    deepseek_v2,
    granitemoe,
    deamoe,
    deamoe_qwen3_5_text,
    gpt_oss,
)  # the order families are listed

FAMILIES: dict[str, FamilySpec] = {m.SPEC.block_class: m.SPEC for m in _MODULES}


def family_for_model_type(model_type: str) -> FamilySpec | None:
    for spec in FAMILIES.values():
        if model_type in spec.model_types:
            return spec
    return None


def register_model_type(model_type: str) -> None:
    """Register localmoe's own architectures with transformers' Auto classes (`FamilySpec.registers`, e.g. DeaMoE)
    before a config of `model_type` is read; nothing for transformers' families. Imports torch for those only."""
    spec = family_for_model_type(model_type)
    if spec is not None and spec.registers:
        import importlib

        importlib.import_module(spec.registers)


def supported_families() -> str:
    return ", ".join(f"{s.name} ({'/'.join(s.model_types)})" for s in FAMILIES.values() if not s.unsupported)


def _unique(values) -> tuple:
    return tuple(dict.fromkeys(values))


# Per-expert tensor names on disk, (gate, up, down) by the families that use them (a checkpoint's experts are these
# or FUSED_EXPERTS): {"Qwen3-MoE, OLMoE, DeepSeek-V2": ("gate_proj", "up_proj", "down_proj"), "Mixtral": (...)}.
PER_EXPERT_NAMES: dict[str, tuple[str, str, str]] = {
    ", ".join(s.name for s in FAMILIES.values() if s.expert_names == names): names
    for names in _unique(s.expert_names for s in FAMILIES.values() if s.expert_names)
}

# Config keys for the number of routed experts and their width over all families (the first present is the one):
# ("num_experts", "num_local_experts", "n_routed_experts") and ("moe_intermediate_size",). The width keys leave out
# the dense `intermediate_size`, which every config has and every size check reads already.
EXPERT_COUNT_KEYS = _unique(s.expert_count_key for s in FAMILIES.values())
EXPERT_WIDTH_KEYS = tuple(k for k in _unique(s.expert_width_key for s in FAMILIES.values()) if k != "intermediate_size")


def expert_count(config) -> int | None:
    """The number of routed experts of a text config (whichever key its family uses), or None when none is set."""
    for key in EXPERT_COUNT_KEYS:
        value = getattr(config, key, None)  # transformers maps the other families' keys onto these (attribute_map)
        if value is not None:
            return value
    return None
