"""Pre-quantized bitsandbytes 4-bit checkpoints (localmoe/models/bnb.py): tiny random-weight models of two families
saved as bitsandbytes' Linear4bit saves them (every Linear's `weight` packed NF4 beside its quant-state tensors; one
with double-quantized statistics), in the HF cache layout, loaded offline: the experts go into the NF4 store with the
checkpoint's own bytes, the tokens equal those of the same model with the dequantized experts, and the formats
localmoe does not load are refused in one line. CPU; never a time.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import tiny_models
import torch
from conftest import repo_id
from test_nf4 import assert_same_as_dequantized

from localmoe.engine.engine import Engine
from localmoe.errors import UsageError
from localmoe.events import GenerationSettings
from localmoe.kernels.nf4 import Nf4Tensor
from localmoe.models import bnb

bnb_f = pytest.importorskip("bitsandbytes.functional")

FAMILIES = {"qwen3_moe": True, "mixtral": False}  # family -> double-quantized statistics


def save_bnb_checkpoint(family: str, folder: Path, double_quant: bool) -> Path:
    """A tiny model of `family` (hidden 64: blocks of 64 along a row) saved as transformers saves a bnb-4bit model."""
    import transformers as tf

    torch.manual_seed(7)
    tiny = tiny_models.spec(family).tiny
    cfg = tf.AutoConfig.for_model(family, **tiny_models._common(**{**tiny.config, "hidden_size": 64}))
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    tiny_models.char_tokenizer().save_pretrained(folder)
    return bnb_quantize_folder(folder, double_quant)


def bnb_quantize_folder(folder: Path, double_quant: bool, device: str = "cpu") -> Path:
    """A saved bf16/fp32 checkpoint folder rewritten in place as bitsandbytes' Linear4bit saves a 4-bit model: every
    2-D Linear weight but the embeddings and lm_head as NF4 bytes (blocks of 64, quantized on `device`) beside its
    `weight.<quant state>` tensors, and config.json's quantization_config (bench/nf4_check.py uses it too)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    for shard in sorted(folder.glob("*.safetensors")):
        out = {}
        with safe_open(str(shard), "pt") as f:
            for key in f.keys():
                t = f.get_tensor(key)
                if t.dim() == 2 and key.endswith(".weight") and "embed_tokens" not in key and "lm_head" not in key:
                    q, st = bnb_f.quantize_4bit(
                        t.to(device, torch.bfloat16).contiguous(),
                        blocksize=64,
                        quant_type="nf4",
                        compress_statistics=double_quant,
                    )
                    out[key] = q.cpu()
                    out.update({f"{key}.{k}": v.cpu() for k, v in st.as_dict(packed=True).items()})
                else:
                    out[key] = t
        save_file(out, str(shard), metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.is_file():  # the quant-state tensors live in their weight's shard
        data = json.loads(index.read_text())
        wm = data["weight_map"]
        for shard in sorted(folder.glob("*.safetensors")):
            with safe_open(str(shard), "pt") as f:
                wm.update({k: shard.name for k in f.keys()})
        index.write_text(json.dumps(data))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "bitsandbytes",
        "load_in_4bit": True,
        "load_in_8bit": False,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": double_quant,
        "bnb_4bit_compute_dtype": "bfloat16",
        "llm_int8_skip_modules": ["lm_head"],
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def bnb_repos(hub_cache, tmp_path_factory) -> dict[str, str]:
    repos = {}
    for family, dq in FAMILIES.items():
        folder = save_bnb_checkpoint(family, tmp_path_factory.mktemp(f"bnb-{family}"), dq)
        repos[family] = f"{repo_id(family)}-bnb-4bit"
        tiny_models.place_in_hf_cache(folder, hub_cache, repos[family])
    return repos


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bnb_checkpoint_loads_as_nf4(bnb_repos, family):
    """A bnb-4bit checkpoint loads with NF4 experts (no flag needed): gate and up hold the checkpoint's own bytes
    and absmax, non-expert Linears are dequantized; greedy tokens at sparsity 0 and 0.5 equal those of the same
    model with the dequantized experts."""
    from safetensors import safe_open

    e = Engine.load(bnb_repos[family], device="cpu", sparsity=0.0)
    assert e.experts_format == "nf4" and e.dtype == torch.float32
    m = e.loaded.experts[0]
    assert all(isinstance(t, Nf4Tensor) for t in (m.weights.w_gate, m.weights.w_up, m.weights.w_down_t))
    gate = tiny_models.spec(family).expert_names[0]
    block = "mlp" if family == "qwen3_moe" else "block_sparse_moe"
    path = Path(e.resolved.path) / "model.safetensors"
    with safe_open(str(path), "pt") as f:
        key = f"model.layers.0.{block}.experts.3.{gate}.weight"
        assert torch.equal(m.weights.w_gate.packed[3].flatten(), f.get_tensor(key).flatten())
        if not FAMILIES[family]:  # plain fp32 statistics: the absmax as stored
            assert torch.equal(m.weights.w_gate.scale[3].flatten(), f.get_tensor(key + ".absmax"))
    assert_same_as_dequantized(e, Engine.load(bnb_repos[family], device="cpu", sparsity=0.0, experts="nf4"))


def test_bnb_checkpoint_offloaded(bnb_repos):
    """A bnb-4bit checkpoint offloaded behind the expert cache (NF4 slots, NF4 master copies filled from the
    checkpoint in host memory): the resident model's tokens."""
    from localmoe.experts.placement import WORKSPACE_RESERVE, state_bytes

    repo = bnb_repos["qwen3_moe"]
    resident = Engine.load(repo, device="cpu", sparsity=0.5)
    ids = resident.encode_raw("offloaded")
    s = GenerationSettings(max_new_tokens=6)
    want = [ev.token_id for ev in resident.generate(ids, s)]
    plan = resident.loaded
    fixed = sum(p.numel() * 4 for p in resident.model.parameters()) + state_bytes(plan.config, 8192, torch.float32)
    vram = (fixed + WORKSPACE_RESERVE + plan.expert_bytes() // 4) / 2**30  # a quarter of the experts
    e = Engine.load(repo, device="cpu", sparsity=0.5, vram_gib=vram, offload_miss="copy")
    assert e.loaded.cache is not None and isinstance(e.loaded.cache.pool.w_up, Nf4Tensor)
    assert [ev.token_id for ev in e.generate(ids, s)] == want


def test_bnb_refusals(bnb_repos, tmp_path):
    """int4 over NF4 experts, 8-bit and FP4 checkpoints: one-line usage errors naming the fix."""
    with pytest.raises(UsageError, match="use --experts nf4"):
        Engine.load(bnb_repos["mixtral"], device="cpu", sparsity=0.0, experts="int4")
    snap = Path(os.environ["HF_HUB_CACHE"]) / f"models--{bnb_repos['mixtral'].replace('/', '--')}" / "snapshots"
    src = next(snap.iterdir())
    for change, match in (
        ({"load_in_8bit": True, "load_in_4bit": False}, "8-bit"),
        ({"bnb_4bit_quant_type": "fp4"}, "fp4"),
    ):
        folder = tmp_path / match
        folder.mkdir()
        for f in src.iterdir():
            (folder / f.name).symlink_to(f.resolve())
        config = json.loads((src / "config.json").read_text())
        config["quantization_config"].update(change)
        (folder / "config.json").unlink()
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(UsageError, match=match) as err:
            Engine.load(str(folder), device="cpu", sparsity=0.0)
        assert "\n" not in str(err.value)


def test_a_codebook_other_than_nf4_is_refused():
    """A quant state whose quant_map is not NF4's 16 values is refused in one line, checked on the host before the
    state moves to the device."""

    class Shard:
        def get_tensor(self, key):
            return torch.linspace(-1, 1, 16)

    with pytest.raises(UsageError, match="not the NF4 codebook"):
        bnb._state({"quant_map": (Path("model.safetensors"), "w.weight.quant_map")}, lambda f: Shard(), "cpu")
