"""Reading a checkpoint folder: config.json (the family table decides whether the architecture is supported, sizes
checked), the tokenizer's presence, the safetensors index and its shards, and which module each tensor goes to.

Nothing here imports torch (`localmoe models` and the hub's snapshot check read shard names through it); transformers
and safetensors are imported where a config or shard is actually read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from localmoe.errors import RuntimeFailure, UsageError
from localmoe.models.families import (
    EXPERT_COUNT_KEYS,
    EXPERT_WIDTH_KEYS,
    expert_count,
    family_for_model_type,
    register_model_type,
    supported_families,
)
from localmoe.safe_text import for_line


def read_config(path: Path):
    from transformers import AutoConfig

    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # older huggingface_hub: transformers' configs were not validated dataclasses
        StrictDataclassError = ValueError
    where = f"{for_line(path)}/config.json"
    _register(path)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except StrictDataclassError as e:  # a field of the wrong type (transformers >= 5 validates them)
        why = str(e).strip().splitlines()[-1].strip().removeprefix("TypeError: ").removeprefix("ValueError: ")
        raise UsageError(f"{where}: {for_line(why)}: fix config.json (or re-download the checkpoint)") from None
    except ValueError as e:  # unknown model_type, remote code needed
        raise UsageError(
            f"cannot read {where}: {for_line(str(e).splitlines()[0])}; supported: {supported_families()}"
        ) from None
    except (OSError, json.JSONDecodeError) as e:
        raise RuntimeFailure(f"cannot read {where}: {for_line(e)}") from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    fam = family_for_model_type(config.model_type) or family_for_model_type(text.model_type)
    if fam is None:
        raise UsageError(
            f"architecture {for_line(repr(config.model_type))} is not a supported MoE family; "
            f"supported: {supported_families()}"
        )
    if fam.unsupported:
        raise UsageError(fam.unsupported)
    check_sizes(text, where + ("" if text is config else " (text_config)"))
    return config, text, fam


def _register(path: Path) -> None:
    """localmoe's own architectures (DeaMoE) registered with the Auto classes before AutoConfig reads their config
    (config.json's model_type peeked at; an unreadable file is left to AutoConfig's own message)."""
    try:
        model_type = json.loads((Path(path) / "config.json").read_bytes()).get("model_type")
    except (OSError, ValueError, AttributeError, RecursionError):
        return
    if isinstance(model_type, str):
        register_model_type(model_type)


def check_native(path: Path, fam) -> None:
    """A family of localmoe's own (DeaMoE): its checkpoint's tensors checked against its config from the safetensors
    headers (`FamilySpec.checkpoint_check`: a UsageError naming the tensor) before the skeleton is built."""
    if fam.checkpoint_check:
        import importlib

        module, func = fam.checkpoint_check.split(":")
        getattr(importlib.import_module(module), func)(path)


# Sizes a config may carry that must be positive integers when present (transformers builds tensors of negative
# size, or a model with no experts, without complaint). Zero is refused too: no supported family has a zero here.
POSITIVE_SIZES = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "head_dim",
    "intermediate_size",
    "max_position_embeddings",
    *EXPERT_COUNT_KEYS,
    *EXPERT_WIDTH_KEYS,
    "num_experts_per_tok",
)


def check_sizes(text_config, where: str) -> None:
    """UsageError naming the field when a size in the text config is not a positive integer, or when a token is
    routed to more experts (`num_experts_per_tok`) than the model has."""
    aliases = dict(getattr(text_config, "attribute_map", None) or {})  # e.g. num_experts -> num_local_experts
    for key in POSITIVE_SIZES:
        value = getattr(text_config, key, None)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            stored = aliases.get(key, key)  # config.json may spell it either way
            names = sorted({key, stored} | {a for a, k in aliases.items() if k == stored})
            raise UsageError(
                f"{where}: {' / '.join(names)} is {for_line(repr(value))}, it must be a positive "
                "integer: fix config.json (or re-download the checkpoint)"
            )
    experts = expert_count(text_config)
    k = getattr(text_config, "num_experts_per_tok", None)
    if experts is not None and k is not None and k > experts:
        raise UsageError(
            f"{where}: num_experts_per_tok is {k} but the model has {experts} routed experts: a token "
            "cannot be routed to more experts than exist; fix config.json"
        )


# A checkpoint needs its tokenizer: without these transformers builds an empty one (every text is 0 tokens).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def check_tokenizer(path: Path) -> None:
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise UsageError(
            f"no tokenizer in {for_line(path)}: it has none of {', '.join(TOKENIZER_FILES[:3])}; copy "
            "the tokenizer files of the model's hub repo into it"
        )


INDEX = "model.safetensors.index.json"


def index_map(index: Path) -> dict:
    """The index's `weight_map` {tensor: shard file name}, each name a plain .safetensors file name: shards resolve
    inside the checkpoint folder only (by name: an HF cache snapshot's files are symlinks into ../../blobs, which
    is fine; a name with a path separator, `..` or an absolute path is refused)."""
    try:
        weight_map = json.loads(index.read_bytes())["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError("weight_map is not a non-empty object")
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
        why = "no weight_map" if isinstance(e, (KeyError, TypeError)) else getattr(e, "strerror", None) or e
        raise RuntimeFailure(
            f"{for_line(index)} is not a valid safetensors index ({for_line(why)}): re-download the "
            "checkpoint (`localmoe pull`) or save it again"
        ) from None
    for tensor, name in weight_map.items():
        if not plain_shard_name(name):
            raise UsageError(
                f"{for_line(index)}: weight_map entry {for_line(json.dumps(tensor))} points to "
                f"{for_line(json.dumps(name))}, not a .safetensors file of the checkpoint folder (shards are "
                "plain file names: no folders, '..' or absolute paths); fix the index"
            )
    return weight_map


def plain_shard_name(name) -> bool:
    return (
        isinstance(name, str)
        and name.endswith(".safetensors")
        and name != ".safetensors"
        and not any(c in name for c in "/\\\0")
        and not os.path.isabs(name)
    )


def shard_files(path: Path) -> list[Path]:
    index = path / INDEX
    if index.is_file():
        files = sorted({path / f for f in index_map(index).values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise RuntimeFailure(f"{for_line(path)} has no .safetensors weights (localmoe never loads pickle weights)")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise RuntimeFailure(f"checkpoint is incomplete, missing {for_line(missing)}: run `localmoe pull` again")
    return files


def open_shard(file: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt", device="cpu")
    except Exception as e:  # SafetensorError: header corrupt, file truncated
        raise RuntimeFailure(f"{file} is corrupt or truncated ({e}); delete it and run `localmoe pull` again") from None


def map_keys(files: list[Path], rename, expert_prefixes, params: set[str], others: dict | None = None):
    """Where each checkpoint key lives, in the module namespace: (dense [(file, key, parameter name)], expert keys
    {experts module name: {name under it: (file, key)}}). `rename`: the family's checkpoint key -> module name (None:
    not loaded); keys of no parameter are skipped, or collected in `others` {name: (file, key)} when given (a
    bitsandbytes checkpoint's quant states: models/bnb.py)."""
    plan: list[tuple[Path, str, str]] = []  # (file, checkpoint key, module name)
    for file in files:
        with open_shard(file) as f:
            for key in f.keys():
                name = rename(key)
                if name is not None:
                    plan.append((file, key, name))
    expert_keys: dict[str, dict[str, tuple[Path, str]]] = {p: {} for p in expert_prefixes}
    dense: list[tuple[Path, str, str]] = []
    for file, key, name in plan:
        prefix = next((p for p in expert_prefixes if name.startswith(p + ".")), None)
        if prefix is not None:
            expert_keys[prefix][name[len(prefix) + 1 :]] = (file, key)
        elif name in params:
            dense.append((file, key, name))
        elif others is not None:
            others[name] = (file, key)
    return dense, expert_keys
