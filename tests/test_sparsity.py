"""The sparse path on tiny models: sparsity 0 equals dense, realised sparsity tracks the target, calibration is
cached with its metadata and recomputed when stale, and the torch sparse reference equals a masked dense product."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import repo_id

from localmoe.cli.main import main
from localmoe.engine.engine import Engine
from localmoe.events import GenerationSettings
from localmoe.experts import thresholds
from localmoe.experts.expert_weights import ExpertWeights
from localmoe.experts.sparse_reference import sparse_reference


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("target", [0.5, 0.85])
def test_realised_sparsity_within_3_points(family, target):
    engine = Engine.load(repo_id(family), device="cpu", sparsity=target)
    list(
        engine.generate(
            engine.encode_raw("The quick brown fox jumps over the lazy dog. " * 2),
            GenerationSettings(max_new_tokens=64, temperature=1.0, seed=0),
        )
    )  # sampled: varied tokens
    assert engine.stats.sparsity_target == target
    assert abs(engine.stats.sparsity_realized - target) <= 0.03, engine.stats.sparsity_realized


def test_sparse_reference_equals_masked_dense():
    torch.manual_seed(0)
    E, I, H, k = 5, 24, 40, 3
    w = ExpertWeights(torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, I, H))
    x = torch.randn(2, H)
    idx = torch.tensor([[0, 3, 4], [1, 2, 3]])
    wts = torch.rand(2, k)
    tau = torch.full((E,), 0.4)
    act = torch.nn.functional.silu
    y, kept = sparse_reference(x, w, idx, wts, tau, act)
    ref = torch.zeros(2, H)
    n_kept = 0
    for t in range(2):
        for j in range(k):
            e = idx[t, j]
            g = act(w.w_gate[e] @ x[t])
            mask = (g.abs() >= tau[e]).float()
            n_kept += int(mask.sum())
            ref[t] += wts[t, j] * ((g * mask * (w.w_up[e] @ x[t])) @ w.w_down_t[e])
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    assert int(kept) == n_kept
    y0, kept0 = sparse_reference(x, w, idx, wts, torch.zeros(E), act)  # tau 0 keeps everything: dense
    assert int(kept0) == 2 * k * I


def test_sparsity_zero_equals_dense_logits():
    engine = Engine.load(repo_id("qwen3_5_moe"), device="cpu", sparsity=0.0)
    ids = engine.encode_raw("hello")
    dense = [e.token_id for e in engine.generate(ids, GenerationSettings(max_new_tokens=10))]
    engine.set_sparsity(0.5)
    engine.set_sparsity(0.0)
    assert [e.token_id for e in engine.generate(ids, GenerationSettings(max_new_tokens=10))] == dense
    assert engine.stats.sparsity_realized == 0.0


def test_calibration_cache_and_staleness(tmp_path):
    engine = Engine.load(repo_id("olmoe"), device="cpu", sparsity=0.0)
    table = thresholds.thresholds_for(engine, 0.7, tokens=600)
    path = thresholds.cache_path(engine.model_name, engine.resolved.revision, 0.7)
    saved = json.loads(path.read_text())
    for key in ("model", "revision", "sparsity", "calibration_set", "calibration_sha256", "tokens", "localmoe_version"):
        assert key in saved
    assert saved["thresholds"] == list(table.taus) and len(table.taus) == len(engine.loaded.experts)
    # reused as is
    saved["thresholds"] = [123.0] * len(table.taus)
    path.write_text(json.dumps(saved))
    assert thresholds.thresholds_for(engine, 0.7, tokens=600).taus[0] == 123.0
    # stale metadata (another localmoe version) is recomputed, never used
    saved["localmoe_version"] = "0.0.0"
    path.write_text(json.dumps(saved))
    assert thresholds.thresholds_for(engine, 0.7, tokens=600).taus == table.taus
    # another calibration text is another key
    text = tmp_path / "cal.txt"
    text.write_text("Sparse experts skip most neurons. " * 40)
    assert thresholds.thresholds_for(engine, 0.7, text=text, tokens=600).meta["calibration_set"] == "cal.txt"


def test_calibrate_command(capsys, tmp_path):
    code = main(["calibrate", repo_id("granitemoe"), "--sparsity", "0.6", "--tokens", "500", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0 and "thresholds saved to" in out
    saved = json.loads(out.strip().split("saved to ")[-1].strip() and open(out.strip().split("saved to ")[-1]).read())
    assert saved["sparsity"] == 0.6 and saved["tokens"] <= 500
