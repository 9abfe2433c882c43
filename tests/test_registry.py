"""models.toml parses into frozen ModelSpecs, rejects unknown keys and bad values, and lists the required models."""

from __future__ import annotations

import dataclasses

import pytest
import tiny_models

from localmoe.models.registry import ModelSpec, load_registry, parse_registry

REQUIRED = {
    "qwen3.5-35b": "Qwen/Qwen3.5-35B-A3B",
    "qwen3.5-122b": None,
    "qwen3-30b": None,
    "olmoe": None,
    "granite-moe-1b": None,
    "granite-moe-3b": None,
    "deepseek-v2-lite": None,
    "mixtral-8x7b": None,
    "gpt-oss-20b": "openai/gpt-oss-20b",
    "gpt-oss-120b": "openai/gpt-oss-120b",
    "localmoe-tiny": None,
}


def test_shipped_registry():
    reg = load_registry()
    for alias, repo in REQUIRED.items():
        spec = reg.get(alias)
        assert isinstance(spec, ModelSpec), alias
        assert repo is None or spec.repo == repo
        assert 0 <= spec.sparsity < 1 and spec.bf16_gb > 0 and spec.vram
    assert reg.get("qwen3.5-35b").sparsity == pytest.approx(0.85)
    assert reg.default == "localmoe-tiny"
    with pytest.raises(dataclasses.FrozenInstanceError):
        reg.get("olmoe").sparsity = 0.1


GOOD = '[models.a]\nrepo = "o/a"\nfamily = "olmoe"\nsparsity = 0.5\nparams_b = 1\nbf16_gb = 2\n'


@pytest.mark.parametrize(
    "text, needle",
    [
        (GOOD + "colour = 'red'\n", "unknown keys"),
        (GOOD.replace("sparsity = 0.5", "sparsity = 1.0"), "sparsity"),
        (GOOD.replace('repo = "o/a"', 'repo = "nope"'), "repo"),
        (GOOD.replace("bf16_gb = 2\n", ""), "missing keys"),
        (GOOD + 'x = "y"\n', "unknown keys"),
        ('default = "b"\n' + GOOD, "default"),
        ("wat = 1\n", "unknown top-level"),
        ("[models.a\n", "invalid TOML"),
    ],
)
def test_rejects_bad_entries(text, needle):
    with pytest.raises(ValueError, match=None) as e:
        parse_registry(text)
    assert needle in str(e.value)


def test_parses_good_entry_and_suggests():
    reg = parse_registry(GOOD)
    assert reg.get("a").repo == "o/a" and reg.by_repo("O/A").alias == "a"
    assert load_registry().suggestions("qwen35-35b")[0] == "qwen3.5-35b"


SUPPORT = [  # (id, family in models.toml, supported, a piece of the reason)
    ("qwen3-moe", "qwen3_moe", True, ""),
    ("qwen3.5-moe", "qwen3_5_moe", True, ""),
    ("gpt-oss", "gpt_oss", True, ""),
    ("unknown-family", "llama", False, "its family 'llama' is not one localmoe runs (supported: "),
]


@pytest.mark.parametrize("family, supported, reason", [c[1:] for c in SUPPORT], ids=[c[0] for c in SUPPORT])
def test_support_follows_the_family_table(family, supported, reason):
    spec = parse_registry(GOOD.replace('"olmoe"', f'"{family}"')).get("a")
    assert (spec.unsupported == "") == supported and reason in spec.unsupported


def test_shipped_registry_support_and_alternative(monkeypatch):
    """Every shipped model runs; a model of a family marked unsupported (GPT-OSS, for this test) is refused naming the
    closest supported one."""
    from localmoe.models.registry import unsupported_model_error

    assert [a for a, s in load_registry().models.items() if s.unsupported] == []
    reason = tiny_models.mark_unsupported(monkeypatch)
    reg = load_registry()
    assert [a for a, s in reg.models.items() if s.unsupported] == ["gpt-oss-20b", "gpt-oss-120b"]
    alt = reg.alternative(reg.get("gpt-oss-20b"))
    assert alt is not None and not alt.unsupported and alt.packaged_dir is None
    message = str(unsupported_model_error(reg.get("gpt-oss-20b"), reg))
    assert message.startswith(f"gpt-oss-20b (openai/gpt-oss-20b) cannot run: {reason}")
    assert f"e.g. {alt.alias} (" in message and "\n" not in message
