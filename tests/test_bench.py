"""`localmoe bench` pieces that run on CPU: real shapes parse into configs, random-weight engines build and decode,
skewed routing rescales only the routers and concentrates picks, the byte floor counts what a step reads, and the
bench command prints its table (never asserting a time)."""

from __future__ import annotations

import json

import pytest
import tiny_models
import torch
from conftest import repo_id

from localmoe.cli.main import main
from localmoe.engine.engine import Engine
from localmoe.errors import UsageError
from localmoe.events import GenerationSettings
from localmoe.measure.benchmark import step_bytes, table
from localmoe.models import shapes as localmoe_shapes
from localmoe.models.random_weights import build_random, router_weight
from localmoe.models.shapes import shape_config


def test_real_shapes():
    c = shape_config("qwen3.5-35b")
    assert (
        c.hidden_size,
        c.num_hidden_layers,
        c.num_experts,
        c.num_experts_per_tok,
        c.moe_intermediate_size,
        c.shared_expert_intermediate_size,
        c.vocab_size,
    ) == (2048, 40, 256, 8, 512, 512, 248320)
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
    code = main(
        [
            "bench",
            repo_id("olmoe"),
            "--prompt-tokens",
            "96,32",
            "--decode-tokens",
            "8",
            "--sparsity",
            "0,0.5",
            "--json",
            "--device",
            "cpu",
        ]
    )
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and [r["sparsity"] for r in res["rows"]] == [0.0, 0.5] and res["routing"] == "uniform"
    assert all(r["decode_tok_s"] > 0 for r in res["rows"]) and res["prompt_tokens"] == 32  # decode after the shortest
    pre = res["prefill_rows"]  # each length's first token at each sparsity (no PCIe figure: not offloaded)
    assert [(r["prompt_tokens"], r["sparsity"]) for r in pre] == [(32, 0.0), (32, 0.5), (96, 0.0), (96, 0.5)]
    assert all(r["ttft_s"] > 0 and r["prefill_tok_s"] > 0 and r["pcie_s"] is None for r in pre)
    assert "time to first token (median of 3)" in table(res)
    assert main(["bench", repo_id("olmoe"), "--prompt-tokens", "32,x"]) == 2


def test_bench_accelerate_baseline(capsys):
    code = main(
        [
            "bench",
            repo_id("olmoe"),
            "--baseline",
            "accelerate",
            "--prompt-tokens",
            "16",
            "--decode-tokens",
            "4",
            "--sparsity",
            "0",
            "--json",
            "--device",
            "cpu",
        ]
    )
    assert code == 2 and "needs --vram" in capsys.readouterr().err
    code = main(
        [
            "bench",
            repo_id("olmoe"),
            "--baseline",
            "accelerate",
            "--vram",
            "8",
            "--prompt-tokens",
            "16",
            "--decode-tokens",
            "4",
            "--sparsity",
            "0",
            "--json",
            "--device",
            "cpu",
        ]
    )
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert code == 0 and rows[-1]["name"].startswith("accelerate offload") and rows[-1]["decode_tok_s"] > 0


def _wide_config():
    """Qwen3.5-35B's routing shape (256 experts, top-8) on a tiny model; the shared expert's gate/up are [256, H]
    too, so finding the router must skip them."""
    import transformers as tf

    return tf.Qwen3_5MoeTextConfig(
        **tiny_models._common(
            hidden_size=64,
            head_dim=8,
            num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"],
            num_experts=256,
            num_experts_per_tok=8,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=256,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=4,
        )
    )


def _routers(loaded) -> list[torch.Tensor]:  # [E, H] per MoE layer
    return [router_weight(loaded.model.get_submodule(f"model.layers.{m.layer_idx}.mlp"), m) for m in loaded.experts]


def _top20_share(w: torch.Tensor, k: int) -> float:
    """Share of top-k picks taken by the hottest 20% of experts, on N(0, 1) inputs."""
    x = torch.randn(4096, w.shape[1], generator=torch.Generator().manual_seed(1))  # [T, H]
    picks = (x @ w.T).topk(k, dim=-1).indices  # [T, k]
    counts = torch.bincount(picks.flatten(), minlength=w.shape[0]).sort(descending=True).values  # [E]
    return (counts[: w.shape[0] // 5].sum() / counts.sum()).item()


def test_skewed_routing_rescales_only_routers():
    cfg, cpu = _wide_config(), torch.device("cpu")
    uni, skew, again = (
        build_random(cfg, device=cpu, dtype=torch.float32, routing=r) for r in ("uniform", "skewed", "skewed")
    )
    routers = {id(w) for w in _routers(skew)}
    p_uni, p_again = dict(uni.model.named_parameters()), dict(again.model.named_parameters())
    for name, p in skew.model.named_parameters():
        assert torch.equal(p, p_again[name])  # deterministic
        if id(p) not in routers:
            assert torch.equal(p, p_uni[name]), name
    for a, b in zip(uni.experts, skew.experts):
        assert all(torch.equal(getattr(a.weights, n), getattr(b.weights, n)) for n in ("w_gate", "w_up", "w_down_t"))
    scales = [(ws / wu)[:, 0] for wu, ws in zip(_routers(uni), _routers(skew))]  # [E]: one factor per row
    for wu, ws, s in zip(_routers(uni), _routers(skew), scales):
        assert torch.allclose(ws, wu * s[:, None], rtol=1e-5) and abs(s.mean().item() - 1) < 1e-4
    assert scales[0].argmax() != scales[1].argmax()  # each layer has its own hot experts
    k = cfg.num_experts_per_tok
    for wu, ws in zip(_routers(uni), _routers(skew)):
        assert _top20_share(ws, k) > _top20_share(wu, k) + 0.2  # measured: 0.67 vs 0.30 at H = 64


def test_routing_flag_errors(capsys):
    with pytest.raises(UsageError, match="unknown routing"):
        build_random(_wide_config(), device=torch.device("cpu"), dtype=torch.float32, routing="zipf")
    assert main(["bench", "--shape", "qwen3.5-35b", "--routing", "zipf"]) == 2
    assert "invalid choice: 'zipf'" in capsys.readouterr().err
    assert main(["bench", repo_id("olmoe"), "--routing", "skewed", "--device", "cpu"]) == 2
    assert "--routing needs --shape" in capsys.readouterr().err


def test_table_names_skewed_routing():
    res = {
        "model": "m",
        "device": "cpu",
        "dtype": "float32",
        "load_s": 0.0,
        "copy_gb_s": 0.0,
        "prompt_tokens": 1,
        "decode_tokens": 2,
        "rows": [],
    }
    assert "routing" not in table({**res, "routing": "uniform"}).splitlines()[0]
    assert table({**res, "routing": "skewed"}).splitlines()[0].endswith(", skewed routing")


def test_table_marks_what_a_baseline_does_not_measure():
    """A baseline row (and a CPU row) has no byte floor, and only localmoe's rows have a realised sparsity: "–"."""
    res = {
        "model": "m",
        "device": "cuda",
        "dtype": "bfloat16",
        "load_s": 0.0,
        "copy_gb_s": 4200.0,
        "prompt_tokens": 1,
        "decode_tokens": 2,
    }
    row = {"sparsity": 0.0, "prefill_tok_s": 10.0, "decode_tok_s": 5.0, "peak_gpu_mem_gb": 1.0}
    rows = [
        {
            **row,
            "name": "localmoe",
            "graph": True,
            "floor_tok_s": 10.0,
            "fraction_of_floor": 0.5,
            "sparsity_realized": 0.85,
        },
        {
            **row,
            "name": "transformers generate (grouped_mm)",
            "floor_tok_s": 0.0,
            "fraction_of_floor": 0.0,
            "sparsity_realized": 0.0,
        },
    ]
    local, base = table({**res, "rows": rows}).splitlines()[2:]
    assert "50.0%" in local and "85.0%" in local and "–" not in local
    assert base.split()[-4:] == ["–", "–", "–", "1.0"]


@pytest.mark.parametrize(
    ("model_type", "says"),
    [("gpt_oss", "GPT-OSS is not yet supported"), ("qwen3", "not a family localmoe runs")],
    ids=["unsupported-family", "not-moe"],
)
def test_shape_of_an_unsupported_family_is_refused(tmp_path, monkeypatch, model_type, says):
    if model_type == "gpt_oss":  # every family runs: GPT-OSS marked unsupported for this test
        tiny_models.mark_unsupported(monkeypatch)

    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"odd": {"model_type": model_type, "config": {}}}))
    monkeypatch.setattr(localmoe_shapes, "SHAPES", shapes)
    with pytest.raises(UsageError, match=f"the shape 'odd' is a '{model_type}' model: .*{says}"):
        shape_config("odd")


def test_bench_repeat_penalty_rows(capsys):
    """--repeat-penalty: a row with the penalty after each row without, from the same engine."""
    code = main(
        [
            "bench",
            repo_id("qwen3_moe"),
            "--prompt-tokens",
            "16",
            "--decode-tokens",
            "6",
            "--sparsity",
            "0",
            "--repeat-penalty",
            "1.2",
            "--json",
            "--device",
            "cpu",
        ]
    )
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert code == 0 and [(r["sparsity"], r["repetition_penalty"]) for r in rows] == [(0.0, 1.0), (0.0, 1.2)]
    assert all(r["decode_tok_s"] > 0 for r in rows)
    assert "localmoe rep.pen. 1.2" in table(
        {
            "model": "m",
            "device": "cpu",
            "dtype": "float32",
            "load_s": 0.0,
            "copy_gb_s": 0.0,
            "prompt_tokens": 1,
            "decode_tokens": 2,
            "rows": rows,
        }
    )
