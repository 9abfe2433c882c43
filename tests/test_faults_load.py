"""Faults at load time, one table per area, each row a case the suite names (the threshold cache's:
test_faults_thresholds.py):

- SHARD_CASES: a safetensors index resolves shards inside the checkpoint folder only (by name: the HF cache's
  symlinked snapshots still load);
- LOAD_CASES: broken checkpoints (wrong shapes, bad config sizes, no tokenizer, quantized tensors, NaN weights) and
  calibration texts fail with one line naming the file, tensor or field.

Real tiny checkpoints (tests/tiny_models.py) copied and edited on disk; nothing mocked. CPU, offline."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import repo_id
from safetensors.torch import load_file, save_file

from localmoe.engine.engine import Engine
from localmoe.errors import RuntimeFailure, UsageError
from localmoe.experts import thresholds
from localmoe.models.loader import load_model

TOKENS = 256  # calibration tokens: enough for a tiny model's quantiles, quick on the CPU


@pytest.fixture(scope="module")
def engine(hub_cache):
    return Engine.load(repo_id("qwen3_moe"), device="cpu", sparsity=0.0)


def _local_copy(src_dir, tmp_path, family="qwen3_moe") -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(src_dir / family, d)
    return d


# -- checkpoint files resolve inside the checkpoint folder ---------------------------------------------------------


def _index_entry(name, *, outside: bool = False, link: bool = False):
    """Point the sharded checkpoint's first weight_map entry at `name` (with a real shard placed outside the folder
    when `outside`, and a `link` folder symlinked to it when `link`)."""

    def edit(folder: Path) -> str:
        index = folder / "model.safetensors.index.json"
        data = json.loads(index.read_text())
        tensor = next(iter(data["weight_map"]))
        first = folder / data["weight_map"][tensor]
        if outside:
            other = folder.parent / "other"
            other.mkdir()
            shutil.copyfile(first, other / "model.safetensors")
        if link:
            (folder / "link").symlink_to(folder.parent / "other", target_is_directory=True)
        data["weight_map"][tensor] = name
        index.write_text(json.dumps(data))
        return tensor

    return edit


# (id, edit -> tensor whose entry is bad (or None), error type, what the message says)
SHARD_CASES = [
    (
        "dotdot-relative",
        _index_entry("../other/model.safetensors", outside=True),
        UsageError,
        '"../other/model.safetensors"',
    ),
    ("absolute-etc-passwd", _index_entry("/etc/passwd"), UsageError, '"/etc/passwd"'),
    ("absolute-real-shard", None, UsageError, "not a .safetensors file of the checkpoint folder"),
    (
        "through-symlinked-folder",
        _index_entry("link/model.safetensors", outside=True, link=True),
        UsageError,
        '"link/model.safetensors"',
    ),
    ("backslash-dotdot", _index_entry("..\\other\\model.safetensors"), UsageError, "other"),
    ("dot-slash", _index_entry("./model-00001-of-00010.safetensors"), UsageError, '"./model-00001-of-00010'),
    ("pickle-file", _index_entry("pytorch_model.bin"), UsageError, '"pytorch_model.bin"'),
    ("not-a-string", _index_entry(7), UsageError, "points to 7"),
    ("null", _index_entry(None), UsageError, "points to null"),
    ("empty-name", _index_entry(""), UsageError, 'points to ""'),
    (
        "index-not-json",
        lambda f: (f / "model.safetensors.index.json").write_text('{"weight_map": {'),
        RuntimeFailure,
        "is not a valid safetensors index",
    ),
    (
        "index-no-weight-map",
        lambda f: (f / "model.safetensors.index.json").write_text('{"metadata": {}}'),
        RuntimeFailure,
        "(no weight_map)",
    ),
    (
        "index-weight-map-list",
        lambda f: (f / "model.safetensors.index.json").write_text('{"weight_map": []}'),
        RuntimeFailure,
        "weight_map is not a non-empty object",
    ),
]


def _absolute_real_shard(folder: Path) -> str:
    return _index_entry(str(folder / "model-00001-of-00010.safetensors"))(folder)


@pytest.mark.parametrize(("edit", "error", "says"), [c[1:] for c in SHARD_CASES], ids=[c[0] for c in SHARD_CASES])
def test_index_entries_stay_inside_the_checkpoint(src_dir, tmp_path, edit, error, says):
    folder = _local_copy(src_dir, tmp_path, "sharded")
    tensor = (edit or _absolute_real_shard)(folder)
    with pytest.raises(error) as info:
        Engine.load(str(folder), device="cpu", sparsity=0.0)
    msg = str(info.value)
    assert says in msg and "model.safetensors.index.json" in msg and "\n" not in msg, msg
    if isinstance(tensor, str) and error is UsageError:
        assert f"weight_map entry {json.dumps(tensor)}" in msg, msg


def test_symlinked_shards_still_load(src_dir, tmp_path):
    """Names are checked, not link targets: the HF cache's snapshot files are symlinks into ../../blobs, and a local
    folder whose shards are symlinks to files elsewhere loads too."""
    cached = Engine.load(repo_id("sharded"), device="cpu", sparsity=0.0)
    assert any(p.is_symlink() for p in cached.resolved.path.glob("*.safetensors"))
    folder = tmp_path / "linked"
    folder.mkdir()
    for f in (src_dir / "sharded").iterdir():
        (folder / f.name).symlink_to(f)
    Engine.load(str(folder), device="cpu", sparsity=0.0)


# -- load errors name what is wrong ---------------------------------------------------------------------------------


def _config(**changes):
    def edit(folder: Path):
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(changes)
        (folder / "config.json").write_text(json.dumps(cfg))

    return edit


def _text_config(**changes):
    def edit(folder: Path):
        cfg = json.loads((folder / "config.json").read_text())
        cfg["text_config"].update(changes)
        (folder / "config.json").write_text(json.dumps(cfg))

    return edit


def _tensor(key, fn, file="model.safetensors"):
    def edit(folder: Path):
        tensors = load_file(folder / file)
        tensors[key] = fn(tensors[key])
        save_file(tensors, folder / file, metadata={"format": "pt"})

    return edit


def _remove(*names):
    def edit(folder: Path):
        for n in names:
            (folder / n).unlink()

    return edit


QWEN35_GATE_UP = "model.language_model.layers.0.mlp.experts.gate_up_proj"
# (id, family, edit, error type, what the one-line message says)
LOAD_CASES = [
    (
        "attention-wrong-shape",
        "qwen3_moe",
        _tensor("model.layers.0.self_attn.q_proj.weight", lambda t: t[:16]),
        RuntimeFailure,
        "tensor model.layers.0.self_attn.q_proj.weight has shape [16, 32], config.json says [32, 32]",
    ),
    (
        "router-wrong-shape",
        "qwen3_moe",
        _tensor("model.layers.1.mlp.gate.weight", lambda t: t[:6]),
        RuntimeFailure,
        "tensor model.layers.1.mlp.gate.weight has shape [6, 32], config.json says [8, 32]",
    ),
    (
        "router-wrong-shape-mixtral",
        "mixtral",
        _tensor("model.layers.0.block_sparse_moe.gate.weight", lambda t: t.repeat(2, 1)),
        RuntimeFailure,
        "tensor model.layers.0.block_sparse_moe.gate.weight has shape [8, 32], config.json says [4, 32]",
    ),
    (
        "expert-wrong-shape",
        "qwen3_moe",
        _tensor("model.layers.0.mlp.experts.3.up_proj.weight", lambda t: t[:, :8].contiguous()),
        RuntimeFailure,
        "model.layers.0.mlp.experts.3.up_proj has shape [16, 8], config.json says [16, 32]",
    ),
    (
        "fused-experts-too-few",
        "qwen3_5_moe",
        _tensor(QWEN35_GATE_UP, lambda t: t[:6]),
        RuntimeFailure,
        f"expert tensor {QWEN35_GATE_UP} has shape [6, 32, 32], config.json says [8, 32, 32]",
    ),
    (
        "top-k-above-experts",
        "qwen3_moe",
        _config(num_experts_per_tok=9),
        UsageError,
        "num_experts_per_tok is 9 but the model has 8 routed experts",
    ),
    (
        "top-k-above-experts-mixtral",
        "mixtral",
        _config(num_experts_per_tok=5),
        UsageError,
        "num_experts_per_tok is 5 but the model has 4 routed experts",
    ),
    ("top-k-zero", "qwen3_moe", _config(num_experts_per_tok=0), UsageError, "num_experts_per_tok is 0, it must be"),
    ("hidden-size-negative", "qwen3_moe", _config(hidden_size=-32), UsageError, "hidden_size is -32, it must be a"),
    ("hidden-size-zero", "olmoe", _config(hidden_size=0), UsageError, "hidden_size is 0, it must be a positive"),
    ("layers-zero", "qwen3_moe", _config(num_hidden_layers=0), UsageError, "num_hidden_layers is 0"),
    ("layers-negative", "granitemoe", _config(num_hidden_layers=-2), UsageError, "num_hidden_layers is -2"),
    ("experts-zero", "qwen3_moe", _config(num_local_experts=0), UsageError, "num_experts / num_local_experts is 0"),
    ("experts-negative-deepseek", "deepseek_v2", _config(n_routed_experts=-8), UsageError, "is -8, it must be"),
    (
        "expert-width-negative",
        "qwen3_moe",
        _config(moe_intermediate_size=-16),
        UsageError,
        "moe_intermediate_size is -16",
    ),
    ("expert-width-zero-mixtral", "mixtral", _config(intermediate_size=0), UsageError, "intermediate_size is 0"),
    ("heads-negative", "qwen3_moe", _config(num_attention_heads=-4), UsageError, "num_attention_heads is -4"),
    ("vocab-zero", "qwen3_moe", _config(vocab_size=0), UsageError, "vocab_size is 0"),
    (
        "text-config-negative",
        "qwen3_5_moe",
        _text_config(moe_intermediate_size=-1),
        UsageError,
        "config.json (text_config): moe_intermediate_size is -1",
    ),
    (
        "no-tokenizer-files",
        "qwen3_moe",
        _remove("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"),
        UsageError,
        "no tokenizer in ",
    ),
    (
        "int8-expert",
        "qwen3_moe",
        _tensor("model.layers.1.mlp.experts.5.gate_proj.weight", lambda t: (t * 100).to(torch.int8)),
        RuntimeFailure,
        "tensor model.layers.1.mlp.experts.5.gate_proj.weight is int8; localmoe loads float16",
    ),
    (
        "int8-fused-experts",
        "qwen3_5_moe",
        _tensor(QWEN35_GATE_UP, lambda t: (t * 100).to(torch.int8)),
        RuntimeFailure,
        f"tensor {QWEN35_GATE_UP} is int8",
    ),
    (
        "fp8-expert",
        "mixtral",
        _tensor("model.layers.0.block_sparse_moe.experts.0.w2.weight", lambda t: t.to(torch.float8_e4m3fn)),
        RuntimeFailure,
        "experts.0.w2.weight is float8_e4m3fn",
    ),
    (
        "int8-attention",
        "qwen3_moe",
        _tensor("model.layers.0.self_attn.o_proj.weight", lambda t: (t * 100).to(torch.int8)),
        RuntimeFailure,
        "tensor model.layers.0.self_attn.o_proj.weight is int8",
    ),
    (
        "int32-embedding",
        "olmoe",
        _tensor("model.embed_tokens.weight", lambda t: t.to(torch.int32)),
        RuntimeFailure,
        "tensor model.embed_tokens.weight is int32",
    ),
    (
        "nan-expert-weights",
        "qwen3_moe",
        _tensor("model.layers.0.mlp.experts.0.gate_proj.weight", lambda t: torch.full_like(t, math.nan)),
        RuntimeFailure,
        "gave unusable thresholds (layer",
    ),
]


@pytest.mark.parametrize(
    ("family", "edit", "error", "says"), [c[1:] for c in LOAD_CASES], ids=[c[0] for c in LOAD_CASES]
)
def test_broken_checkpoint_fails_with_the_cause(src_dir, tmp_path, family, edit, error, says):
    folder = _local_copy(src_dir, tmp_path, family)
    edit(folder)
    with pytest.raises(error) as info:
        # sparsity 0.99: the NaN gate's quantile is NaN whatever the share of NaN activations
        Engine.load(str(folder), device="cpu", sparsity=0.99 if "unusable" in says else 0.0)
    msg = str(info.value)
    assert says in msg and "\n" not in msg, msg


def test_config_field_of_the_wrong_type(src_dir, tmp_path):
    """transformers' own validation error, as one line naming the field (the loader's check, beneath the engine)."""
    folder = _local_copy(src_dir, tmp_path)
    _config(hidden_size="32")(folder)
    with pytest.raises(
        UsageError, match=r"config\.json: Field 'hidden_size' expected int, got str \(value: '32'\): fix"
    ):
        load_model(folder, device=torch.device("cpu"), dtype=torch.float32)


# (id, file content, what the message says)
CALIBRATION_TEXT_CASES = [
    ("nul-bytes", b"Sparse experts skip neurons.\x00\x01\x02" * 50, "is a binary file (it holds NUL bytes)"),
    (
        "latin-1",
        "Caf\u00e9 cr\u00e8me, na\u00efve r\u00e9sum\u00e9. ".encode("latin-1") * 40,
        "is not UTF-8 text (byte 0xe9 at offset 3)",
    ),
    ("png-header", b"\x89PNG\r\n\x1a\n" + bytes(range(1, 200)) * 8, "is not UTF-8 text (byte 0x89 at offset 0)"),
    ("utf16", "Sparse experts skip most neurons. ".encode("utf-16") * 20, "is UTF-16 (or UTF-32) text, not UTF-8"),
    ("utf16-no-bom", "Sparse experts skip most neurons. ".encode("utf-16-le") * 20, "is a binary file"),
    ("empty", b"  \n\n", "is empty"),
    ("folder", None, "cannot read calibration text"),
]


@pytest.mark.parametrize(
    ("content", "says"), [c[1:] for c in CALIBRATION_TEXT_CASES], ids=[c[0] for c in CALIBRATION_TEXT_CASES]
)
def test_bad_calibration_text_is_refused(engine, tmp_path, content, says):
    path = tmp_path / "calibration.txt"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    with pytest.raises(UsageError) as info:
        thresholds.thresholds_for(engine, 0.6, text=path, tokens=TOKENS)
    assert says in str(info.value) and str(path) in str(info.value), str(info.value)


def test_utf8_calibration_text_is_used(engine, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("Les experts clairsem\u00e9s sautent la plupart des neurones. " * 20, encoding="utf-8")
    assert thresholds.thresholds_for(engine, 0.6, text=path, tokens=TOKENS).meta["calibration_set"] == "notes.txt"
