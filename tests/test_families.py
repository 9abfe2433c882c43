"""The families table: one module per family, the tables derived from them, each family's facts checked against its
transformers config, the decode table and the real shapes. Builds configs only, no models."""

from __future__ import annotations

import json
import pkgutil

import pytest

from localmoe.decode.replacements import REPLACEMENTS
from localmoe.experts.clamped_swiglu import CLAMPED_SWIGLU
from localmoe.models import families
from localmoe.models.families import (
    EXPERT_COUNT_KEYS,
    EXPERT_WIDTH_KEYS,
    FAMILIES,
    PER_EXPERT_NAMES,
    family_for_model_type,
)

SPECS = list(FAMILIES.values())


def test_one_module_per_family():
    """Every module of the package but spec.py is one family, named by its key, listed in FAMILIES."""
    names = sorted(m.name for m in pkgutil.iter_modules(families.__path__) if m.name != "spec")
    assert names == sorted(s.key for s in SPECS)
    assert [m.SPEC for m in families._MODULES] == SPECS
    model_types = [t for s in SPECS for t in s.model_types]
    assert len(model_types) == len(set(model_types))
    assert all(family_for_model_type(t) is s for s in SPECS for t in s.model_types)


def test_derived_tables_are_the_loaders():
    """What the loader reads, assembled from the family modules."""
    assert list(PER_EXPERT_NAMES.values()) == [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")]
    assert EXPERT_COUNT_KEYS == ("num_experts", "num_local_experts", "n_routed_experts")
    assert EXPERT_WIDTH_KEYS == ("moe_intermediate_size", "department_size")


def test_native_family_registers_its_model_type():
    """DeaMoE, localmoe's own architecture: its config is read through AutoConfig once the family registers it, and
    its count and width keys are the config's (D * n experts of department width h). No tiny model in the family
    row: tests/test_deamoe.py builds its own."""
    from transformers import AutoConfig

    spec = family_for_model_type("deamoe")
    assert spec.native_experts and spec.tiny is None and spec.no_int4
    families.register_model_type("deamoe")
    config = AutoConfig.for_model("deamoe", num_departments=3, experts_per_department=2, num_experts_per_tok=2)
    assert getattr(config, spec.expert_count_key) == 6
    assert getattr(config, spec.expert_width_key) == config.department_size
    assert config.hidden_act == spec.activation


@pytest.mark.parametrize("spec", [s for s in SPECS if s.tiny], ids=[s.key for s in SPECS if s.tiny])
def test_facts_match_the_transformers_config(spec):
    """The tiny config of every family builds; its text config has the family's expert count and width keys, and a
    supported family's activation is the config's."""
    from transformers import AutoConfig

    assert spec.tiny is not None
    text = AutoConfig.for_model(spec.key, **spec.tiny.config).get_text_config()
    tiny_text = spec.tiny.config.get("text_config", spec.tiny.config)
    assert text.model_type in spec.model_types
    assert getattr(text, spec.expert_count_key) == tiny_text[spec.expert_count_key]
    assert isinstance(getattr(text, spec.expert_width_key), int)
    if not spec.unsupported:  # GPT-OSS's clamped SwiGLU is localmoe's own (its config's hidden_act goes unused)
        assert text.hidden_act == spec.activation or spec.activation == CLAMPED_SWIGLU


def test_every_family_has_fused_decode_in_the_replacements_table():
    assert [s.key for s in SPECS if s.block_class in REPLACEMENTS] == [
        "qwen3_5_moe",
        "qwen3_moe",
        "olmoe",
        "mixtral",
        "deepseek_v2",
        "granitemoe",
        "deamoe",
        "deamoe_qwen3_5_text",
        "gpt_oss",
    ]


def test_real_shapes_are_registry_models_of_their_family():
    """localmoe/data/shapes.json stays per model: each alias is in models.toml, of the family its model_type names,
    unless the entry says why it is bench-only (DeaMoE's twins: no checkpoint of those shapes exists)."""
    from localmoe.models.registry import load_registry
    from localmoe.models.shapes import SHAPES

    registry = load_registry()
    shapes = {k: v for k, v in json.loads(SHAPES.read_text()).items() if not k.startswith("_")}
    assert shapes
    for alias, entry in shapes.items():
        spec = registry.get(alias)
        if entry.get("bench_only"):
            assert spec is None and family_for_model_type(entry["model_type"]) is not None, alias
            continue
        assert spec is not None, alias
        assert family_for_model_type(entry["model_type"]) is family_for_model_type(spec.family), alias
