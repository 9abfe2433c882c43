"""`localmoe bench` pieces that run on CPU: real shapes parse into configs, random-weight engines build and decode,
the byte floor counts what a step reads, and the bench command prints its table (never asserting a time)."""

from __future__ import annotations

import json

import torch

from conftest import repo_id
from localmoe.benchmark import shape_config, step_bytes
from localmoe.cli import main
from localmoe.engine import Engine
from localmoe.events import GenerationSettings
from localmoe.loader import build_random


def test_real_shapes():
    c = shape_config("qwen3.5-35b")
    assert (c.hidden_size, c.num_hidden_layers, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
            c.shared_expert_intermediate_size, c.vocab_size) == (2048, 40, 256, 8, 512, 512, 248320)
    assert c.layer_types.count("full_attention") == 10
    q = shape_config("qwen3-30b")
    assert (q.num_hidden_layers, q.num_experts, q.moe_intermediate_size) == (48, 128, 768)


def test_random_engine_and_byte_floor():
    engine = Engine.load(repo_id("qwen3_moe"), device="cpu", sparsity=0.0)
    loaded = build_random(engine.loaded.config, device=torch.device("cpu"), dtype=torch.float32)
    assert all(m.weights.w_gate.abs().sum() > 0 for m in loaded.experts)
    engine.loaded, engine.model = loaded, loaded.model
    b0, b85 = step_bytes(engine, 0.0), step_bytes(engine, 0.85)
    m = loaded.experts[0]
    E, I, H = m.weights.shape
    k = engine.loaded.config.num_experts_per_tok
    assert abs((b0 - b85) - len(loaded.experts) * k * 2 * I * H * 4 * 0.85) < 1.0
    out = [ev.token_id for ev in engine.generate([5, 6, 7], GenerationSettings(max_new_tokens=4))]
    assert 1 <= len(out) <= 4


def test_bench_command_json(capsys):
    code = main(["bench", repo_id("olmoe"), "--prompt-tokens", "32", "--decode-tokens", "8", "--sparsity", "0,0.5",
                 "--json", "--device", "cpu"])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and [r["sparsity"] for r in res["rows"]] == [0.0, 0.5]
    assert all(r["decode_tok_s"] > 0 for r in res["rows"])


def test_bench_accelerate_baseline(capsys):
    code = main(["bench", repo_id("olmoe"), "--baseline", "accelerate", "--prompt-tokens", "16", "--decode-tokens",
                 "4", "--sparsity", "0", "--json", "--device", "cpu"])
    assert code == 2 and "needs --vram" in capsys.readouterr().err
    code = main(["bench", repo_id("olmoe"), "--baseline", "accelerate", "--vram", "8", "--prompt-tokens", "16",
                 "--decode-tokens", "4", "--sparsity", "0", "--json", "--device", "cpu"])
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert code == 0 and rows[-1]["name"].startswith("accelerate offload") and rows[-1]["decode_tok_s"] > 0
