"""`localmoe run` greedy output equals transformers `generate(do_sample=False)` token for token (float32, sparsity 0),
for every family, from the offline HF cache, plus sharded checkpoints and local directories."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import FAMILIES, repo_id

from localmoe.cli.main import main

PROMPT = "Tell me about sparse experts."
N_NEW = 16


def run_json(capsys, *args) -> dict:
    code = main(["run", *args, "--json", "--max-new-tokens", str(N_NEW), "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0, out
    return json.loads(out.strip().splitlines()[-1])


def reference_tokens(path, prompt_ids: list[int]) -> list[int]:
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = {}
    qc = getattr(AutoConfig.from_pretrained(path), "quantization_config", None) or {}
    if qc.get("quant_method") == "mxfp4":  # gpt-oss: transformers' MXFP4 kernels are a hub download (with the
        from transformers import Mxfp4Config  # `kernels` package, 5.25 on), not here: its dequantized experts

        kw["quantization_config"] = Mxfp4Config(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=N_NEW)
    gen = out[0, len(prompt_ids) :].tolist()
    eos = 3
    return gen[: gen.index(eos)] if eos in gen else gen


def prompt_ids(path, raw: bool) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if raw:
        return tok(PROMPT)["input_ids"]
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def snapshot(repo: str):
    from huggingface_hub import snapshot_download

    return snapshot_download(repo, local_files_only=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(family, hub_cache, capsys):
    result = run_json(capsys, repo_id(family), PROMPT, "--sparsity", "0")
    path = snapshot(repo_id(family))
    assert result["token_ids"] == reference_tokens(path, prompt_ids(path, raw=False))
    assert result["stats"]["generated_tokens"] == len(result["token_ids"])


def test_sharded_checkpoint_and_raw_prompt(hub_cache, capsys):
    path = snapshot(repo_id("sharded"))
    assert (hub_cache / f"models--{repo_id('sharded').replace('/', '--')}").is_dir()
    import pathlib

    assert (pathlib.Path(path) / "model.safetensors.index.json").is_file()
    result = run_json(capsys, repo_id("sharded"), PROMPT, "--sparsity", "off", "--raw")
    assert result["token_ids"] == reference_tokens(path, prompt_ids(path, raw=True))


def test_local_directory(src_dir, capsys):
    result = run_json(capsys, str(src_dir / "mixtral"), PROMPT, "--sparsity", "0")
    assert result["token_ids"] == reference_tokens(src_dir / "mixtral", prompt_ids(src_dir / "mixtral", raw=False))


def test_sharded_multimodal_fused_checkpoint(hub_cache, capsys):
    """Qwen3.5 as on the hub: multimodal checkpoint, fused experts, several shards."""
    import pathlib

    path = snapshot(repo_id("sharded35"))
    index = json.loads((pathlib.Path(path) / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and any(k.endswith("mlp.experts.gate_up_proj") for k in index["weight_map"])
    result = run_json(capsys, repo_id("sharded35"), PROMPT, "--sparsity", "0")
    assert result["token_ids"] == reference_tokens(path, prompt_ids(path, raw=False))
