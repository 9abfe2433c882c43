"""The department-shared gate predictor (--departments, issue #23) on the bundled trained localmoe-tiny: fit shapes and
balanced departments, the cache's round trip and invalidation, τ′ = 0 decoding exactly today's sparse tokens, the
mass recall evaluation reports, and the CLI's one-line refusals. Few calibration tokens: the predictor's quality is
measured by `localmoe eval` (bench/RESULTS.md), not here."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from localmoe.cli.main import main
from localmoe.decode import replacements
from localmoe.engine.engine import Engine
from localmoe.errors import UsageError
from localmoe.events import GenerationSettings
from localmoe.experts import local_experts, placement, predicted, predictor, predictor_cache, thresholds
from localmoe.experts.expert_weights import ExpertWeights
from localmoe.experts.predicted import LayerPredictor, predicted_reference
from localmoe.measure.evaluate import evaluate

GiB = 1 << 30
TOKENS = 512  # calibration tokens: enough for a fit of rank 16 on 8 experts, quick on two cores
SPARSITY = 0.85


@pytest.fixture(scope="module")
def tiny():
    """(engine at 85% sparsity without a predictor, its thresholds, predictors N=4 r=16 fitted on 512 tokens)."""
    engine = Engine.load("localmoe-tiny", device="cpu", sparsity=0.0)
    table = thresholds.thresholds_for(engine, SPARSITY, tokens=TOKENS)
    thresholds.apply(engine.loaded, table, device=engine._device)
    engine.sparsity = SPARSITY
    seen = []
    preds, path = predictor.predictors_for(engine, table, 4, 16, tokens=TOKENS, progress=lambda *a: seen.append(a))
    assert seen[-1] == ("fit predictor", 8, 8)  # through the calibration's progress callback
    return engine, table, preds, path


def test_fit_shapes_and_balanced_departments(tiny):
    engine, _, preds, path = tiny
    assert len(preds) == len(engine.loaded.experts) == 8
    for p in preds:
        assert p.B.shape == (4, 16, 256) and p.C.shape == (8, 160, 16) and p.dept_of.shape == (8,)
        assert p.B.dtype == p.C.dtype == torch.int8 and p.B_scale.shape == (4, 16) and p.C_scale.shape == (8, 160)
        assert torch.bincount(p.dept_of, minlength=4).tolist() == [2, 2, 2, 2]
        assert p.tau_rows.shape == (8, 160) and p.tau_rows.dtype == torch.float16 and float(p.tau_rows.max()) > 0
        assert torch.isfinite(p.B_scale).all() and torch.isfinite(p.C_scale).all() and float(p.tau_rows.min()) >= 0
        assert int(p.C.abs().amax(-1).min()) == 127  # each row's scale spans it
    assert predictor.group(torch.rand(8, 8), 3) and [len(g) for g in predictor.group(torch.ones(7, 7), 3)] == [3, 2, 2]
    assert path is not None and path.exists() and path.name == "s0.8500-d4-r16-coact.safetensors"


def test_tau_for_recall_holds_the_target_mass():
    exact = torch.tensor([[1.0, 0.1, 2.0, 0.5]])
    pred = torch.tensor([[0.9, 0.8, 0.2, 0.1]])
    # kept at τ=0.4: 1.0, 2.0, 0.5 (mass 3.5). Candidates by pred: neuron 0 (1.0), 1 (0), 2 (2.0), 3 (0.5)
    assert predictor.tau_for_recall(exact, pred, 0.4, 0.25) == pytest.approx(0.9)
    assert predictor.tau_for_recall(exact, pred, 0.4, 0.8) == pytest.approx(0.2)
    assert predictor.tau_for_recall(exact, pred, 0.4, 1.0) == pytest.approx(0.1)
    assert predictor.mass_recall(exact, pred, 0.4, 0.2) == pytest.approx(3.0 / 3.5)


def test_thresholds_lower_where_predictions_stray():
    """Two experts' neurons: expert 0 predicted exactly, expert 1 with noise. Each neuron's error σ is shrunk toward
    the layer's; the fitted rows hold the recall target, and a slack k > 0 (the noisy expert's thresholds below the
    exact one's by k (σ_1 - σ_0): more margin where predictions stray) lets fewer neurons through than one τ′."""
    gen = torch.Generator().manual_seed(0)
    n, I = 400, 6
    exact = torch.rand(2 * n, I, generator=gen, dtype=torch.float64)
    experts = torch.cat([torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.long)])
    noise = 0.3 * torch.randn(n, I, generator=gen, dtype=torch.float64)
    pred = torch.cat([exact[:n], (exact[n:] + noise).abs()])
    err = predictor.row_errors(exact, pred, experts, 3)
    assert err.shape == (3, I) and float(err[0].max()) < float(err[1].min())
    prior = float((exact - pred).pow(2).mean().sqrt())
    torch.testing.assert_close(err[2], torch.full((I,), prior, dtype=torch.float64))  # never routed: the layer's
    rows, k, share = predictor.fit_thresholds(exact, pred, experts, 3, 0.5, 0.99)
    assert rows.dtype == torch.float16 and rows.shape == (3, I) and k > 0
    assert float(rows[1].max()) < float(rows[0].min())
    got = predictor.mass_recall(exact, pred, 0.5, rows.double()[experts])
    assert got >= 0.99 - 1e-3
    one = predictor.tau_for_recall(exact, pred, 0.5, 0.99)
    assert float((pred >= rows.double()[experts]).double().mean()) < float((pred >= one).double().mean())


def test_cache_round_trip_and_invalidation(tiny, monkeypatch):
    engine, table, preds, path = tiny
    monkeypatch.setenv("XDG_CACHE_HOME", str(path.parents[3]))  # the fixture's cache (each test has its own)
    notes = []
    engine.on_notice = notes.append
    try:
        again, same = predictor.predictors_for(engine, table, 4, 16, tokens=TOKENS)
        assert same == path and not notes
        assert all(torch.equal(a.C, b.C) and torch.equal(a.tau_rows, b.tau_rows) for a, b in zip(preds, again))
        assert all(
            torch.equal(a.B_scale, b.B_scale) and torch.equal(a.C_scale, b.C_scale) for a, b in zip(preds, again)
        )
        body = path.read_bytes()
        path.write_bytes(body[: len(body) // 2])  # truncated: fitted again, with a notice
        refit, _ = predictor.predictors_for(engine, table, 4, 16, tokens=TOKENS)
        assert len(notes) == 1 and "was invalid" in notes[0] and "fitted again" in notes[0]
        assert all(torch.equal(a.B, b.B) for a, b in zip(preds, refit))
        meta = predictor_cache.metadata(
            engine, SPARSITY, 4, 16, "coact", predictor.DEFAULT_RECALL, *thresholds.read_calibration_text(None), TOKENS
        )
        shapes = [(8, 160, 256)] * 8
        assert predictor_cache.read(path, meta, shapes)[0] is not None
        stale = predictor_cache.read(path, {**meta, "rank": 8}, shapes)[1]
        assert "was stale (made with rank" in stale
        assert "tensor" in predictor_cache.read(path, meta, [(8, 160, 256)] * 9)[1]
        # a file of another map format (one from before int8 maps has no "maps" key): stale, fitted again
        assert "was stale (made with maps" in predictor_cache.read(path, {**meta, "maps": "bf16"}, shapes)[1]
        floats = [dataclasses.replace(p, B=p.B.float()) for p in preds]  # the right metadata, float B: refused
        assert predictor_cache.write(path, floats, meta) is None
        assert "0.B is torch.float32, expected torch.int8" in predictor_cache.read(path, meta, shapes)[1]
        path.write_bytes(body)  # the valid file back, for the tests after this one
    finally:
        engine.on_notice = None


def _tokens(engine, n=12):
    ids = engine.encode_raw("The requests library sends HTTP requests")
    return [e.token_id for e in engine.generate(ids, GenerationSettings(max_new_tokens=n, temperature=0.0))]


def test_tau_zero_decodes_todays_sparse_tokens(tiny):
    engine, _, preds, _ = tiny
    today = _tokens(engine)
    everyone = [dataclasses.replace(p, tau_rows=torch.zeros_like(p.tau_rows)) for p in preds]
    predicted.apply(engine.loaded, everyone, device=engine._device)
    try:
        assert _tokens(engine) == today
        c = engine.loaded.experts[0].predictor.counts
        assert c["candidates"] == c["slots"] * 160 > 0 and 0 < c["touches"] <= c["slots"]
        predicted.apply(engine.loaded, preds, device=engine._device)
        c = engine.loaded.experts[0].predictor.counts
        _tokens(engine, 4)
        assert 0 < c["candidates"] < c["slots"] * 160  # a fitted τ′ reads fewer gate rows
    finally:
        predicted.apply(engine.loaded, None, device=engine._device)


def test_eval_reports_recall_and_bytes(tiny, monkeypatch):
    engine, _, _, path = tiny
    monkeypatch.setenv("XDG_CACHE_HOME", str(path.parents[3]))  # thresholds and predictor from the fixture's fit
    engine.calibration_tokens = TOKENS
    engine.set_sparsity(0.0)
    report = evaluate(engine, [SPARSITY], tokens=300, window=150, departments=[0, 4], rank=16)
    by_n = {r.departments: r for r in report.rows if r.sparsity == SPARSITY}
    assert set(by_n) == {0, 4}
    assert by_n[0].mask_recall == 1.0 and by_n[0].bytes_vs_sparse == 1.0
    assert 0.0 <= by_n[4].mask_recall <= 1.0 and by_n[4].mask_recall > 0.5
    assert 0 < by_n[4].routed_bytes_per_token and 0 < by_n[4].bytes_vs_sparse
    assert engine.departments == 0 and engine.sparsity == 0.0  # restored
    assert "recall" in report.table() and "departments" in report.as_json()["rows"][-1]


def test_set_departments_refusals(tiny):
    engine, *_ = tiny
    with pytest.raises(UsageError, match=r"--departments 9 is more than the 8 routed experts per layer"):
        engine.set_departments(9)
    with pytest.raises(UsageError, match=r"--rank must be in \[1, 256\]"):
        engine.set_departments(4, 257)
    assert engine.departments == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "localmoe-tiny", "hi", "--departments", "9"], "--departments 9 is more than the 8 routed experts"),
        (["run", "localmoe-tiny", "hi", "--departments", "-1"], "--departments must be >= 0, got -1"),
        (["run", "localmoe-tiny", "hi", "--departments", "4", "--rank", "0"], "--rank must be >= 1, got 0"),
        (["run", "localmoe-tiny", "hi", "--rank", "8"], "--rank needs --departments"),
        (["eval", "localmoe-tiny", "--departments", "0,x"], "expected department counts"),
        (["calibrate", "localmoe-tiny", "--sparsity", "0.85", "--rank", "8"], "--rank needs --departments"),
    ],
)
def test_cli_refusals(capsys, argv, message):
    assert main([*argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("localmoe: error: ") and message in err[0]


def test_calibrate_fits_and_caches_the_predictor(capsys):
    argv = ["calibrate", "localmoe-tiny", "--sparsity", "0.85", "--tokens", "256", "--device", "cpu"]
    assert main([*argv, "--departments", "2", "--rank", "8"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("calibrated localmoe-tiny") and "thresholds saved to" in out[0]
    assert out[1].startswith("gate predictor with 2 departments saved to ") and out[1].endswith(
        "-d2-r8-coact.safetensors"
    )


def test_bench_takes_departments(capsys):
    """`bench --departments`: the sparse rows decode through the predictor (resident, CPU), named in the header."""
    argv = ["bench", "localmoe-tiny", "--sparsity", "0.5", "--prompt-tokens", "16", "--decode-tokens", "4"]
    assert main([*argv, "--departments", "2", "--rank", "8", "--device", "cpu", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["departments"] == 2 and [r["sparsity"] for r in result["rows"]] == [0.5]


def test_predicted_reference_keeps_candidates_over_tau():
    """Stages 1-3 equal the whole gate masked by (candidate and |g| >= τ), and the counts add up."""
    gen = torch.Generator().manual_seed(0)
    E, I, H, N, r = 4, 16, 8, 2, 3
    w = ExpertWeights(*(torch.randn(E, I, H, generator=gen) for _ in range(3)))
    pred = LayerPredictor.of(
        torch.randn(N, r, H, generator=gen), torch.randn(E, I, r, generator=gen), torch.tensor([0, 1, 0, 1]), 0.3
    )
    x, idx = torch.randn(3, H, generator=gen), torch.tensor([[0, 2], [1, 3], [0, 1]])
    weights, tau = torch.rand(3, 2, generator=gen), torch.full((E,), 0.2)
    y, kept = predicted_reference(x, w, idx, weights, tau, torch.nn.functional.silu, pred)
    want, n = torch.zeros(3, H), 0
    for t in range(3):
        cand = pred.candidates(x[t].expand(2, H), idx[t], torch.nn.functional.silu)  # [2, I]
        for j in range(2):
            e = int(idx[t, j])
            g = torch.nn.functional.silu(w.w_gate[e] @ x[t])
            keep = cand[j] & (g.abs() >= 0.2)
            n += int(keep.sum())
            want[t] += weights[t, j] * ((g * keep * (w.w_up[e] @ x[t])) @ w.w_down_t[e])
    assert int(kept) == n and 0 < n < 3 * 2 * I
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert pred.counts["slots"] == 6 and pred.counts["touches"] == 1 + 1 + 2  # B_d x once per touched department


def _sparse_again(tiny) -> None:
    """The fixture's engine at 85% with its thresholds (an earlier test may have left it dense)."""
    engine, table, *_ = tiny
    thresholds.apply(engine.loaded, table, device=engine._device)
    engine.sparsity = SPARSITY


def _kernels_on_cpu(engine, on: bool) -> None:
    for m in engine.loaded.experts:
        m.kernel_on_cpu = on


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "0", reason="a CPU engine's kernels need the interpreter")
def test_fused_predictor_decodes_the_reference_tokens(tiny):
    """The kernels' path (department_basis + sparse_fused with its predictor, as on CUDA) decodes the tokens of the
    torch reference path, resident."""
    pytest.importorskip("triton")
    _sparse_again(tiny)
    engine, _, preds, _ = tiny
    predicted.apply(engine.loaded, preds, device=engine._device)
    try:
        want = _tokens(engine, 2)
        m = engine.loaded.experts[0]
        kept = int(m.kept)  # this reply's kept neurons (counters restart with each reply)
        assert m.predictor.counts["slots"] > 0  # the reference path ran (it counts slots; the kernels do not)
        _kernels_on_cpu(engine, True)
        assert m.predictor_fused(engine._device)
        m.predictor.reset()
        assert _tokens(engine, 2) == want
        assert int(m.kept) == kept > 0 and m.predictor.counts["slots"] == 0  # the same neurons, kept by the kernels
    finally:
        _kernels_on_cpu(engine, False)
        predicted.apply(engine.loaded, None, device=engine._device)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "0", reason="a CPU engine's kernels need the interpreter")
@torch.no_grad()
def test_moe_front_computes_stage_one(tiny, monkeypatch):
    """A fused decoder layer's MoE front (moe_front + sparse_fused) with the predictor's stage 1 inside moe_front's
    launch (`basis_in_front`, for every department) gives the output and the kept neurons of the launch with
    department_basis between the two."""
    pytest.importorskip("triton")
    _sparse_again(tiny)
    engine, _, preds, _ = tiny
    predicted.apply(engine.loaded, preds, device=engine._device)
    try:
        _kernels_on_cpu(engine, True)
        layer = engine.loaded.model.model.layers[3]
        block = replacements.REPLACEMENTS[type(layer.mlp).__name__].make(layer.mlp)
        hf_norm = layer.post_attention_layernorm
        norm = replacements.REPLACEMENTS[type(hf_norm).__name__].make(hf_norm)
        gen = torch.Generator().manual_seed(5)
        H, dt = hf_norm.weight.shape[0], hf_norm.weight.dtype
        mixed, residual = torch.randn(1, 1, H, generator=gen).to(dt), (4 * torch.randn(1, 1, H, generator=gen)).to(dt)
        experts = layer.mlp.experts
        assert block.takes_front(mixed) and experts.front_basis(mixed) is not None
        launched = []
        basis = local_experts.department_basis
        monkeypatch.setattr(local_experts, "department_basis", lambda *a, **k: launched.append(1) or basis(*a, **k))
        got = {}
        for front in (False, True):
            block.basis_in_front = front
            kept = int(experts.kept)
            y = block.step_front(mixed, residual, norm)
            got[front] = (y, int(experts.kept) - kept, len(launched))
        assert got[False][2] == got[True][2] == 1  # department_basis launched without the front's stage 1 only
        torch.testing.assert_close(got[True][0], got[False][0], rtol=1e-5, atol=1e-5)
        assert got[True][1] == got[False][1] > 0
        _kernels_on_cpu(engine, False)
        assert experts.front_basis(mixed) is None  # the torch reference path computes its own stage 1
    finally:
        _kernels_on_cpu(engine, False)
        predicted.apply(engine.loaded, None, device=engine._device)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "0", reason="a CPU engine's kernels need the interpreter")
def test_offloaded_predictor_gives_gate_slots_to_b_and_c(tiny, monkeypatch):
    """Offloaded with direct misses and a gate tier: set_departments takes VRAM from the gates for B and C (and gives
    it back at 0), and the tokens equal the resident engine's with the same predictor (its torch reference path)."""
    pytest.importorskip("triton")
    _sparse_again(tiny)
    engine, _, preds, path = tiny
    monkeypatch.setenv("XDG_CACHE_HOME", str(path.parents[3]))  # thresholds and predictor from the fixture's fit
    predicted.apply(engine.loaded, preds, device=engine._device)
    try:  # the torch reference path (the test above shows the kernels' path decodes the same tokens)
        want = _tokens(engine, 2)
    finally:
        predicted.apply(engine.loaded, None, device=engine._device)
    probe = engine.loaded.offload or Engine.load("localmoe-tiny", device="cpu", vram_gib=64.0).loaded.offload
    fixed = probe.non_expert_bytes + probe.state_bytes + placement.WORKSPACE_RESERVE
    vram = (fixed + 12.5 * probe.expert_bytes) / GiB
    off = Engine.load("localmoe-tiny", device="cpu", vram_gib=vram, offload_miss="direct")
    cache = off.loaded.cache
    assert cache.mode == "direct" and cache.gate_slots == 36 and cache.slots == 0  # 36 of 64 gates, no up/down
    _kernels_on_cpu(off, True)
    off.calibration_tokens = TOKENS
    with pytest.raises(UsageError, match="needs direct misses on CUDA"):
        _kernels_on_cpu(off, False) or off.set_departments(4, 16)
    _kernels_on_cpu(off, True)
    off.set_departments(4, 16)
    off.set_sparsity(SPARSITY)
    need = -(-predicted.device_bytes(preds) // (cache.row_bytes * cache.width))
    assert cache.gate_slots == 36 - need and cache.pool.w_gate.shape[0] == 36 - need
    assert _tokens(off, 2) == want
    off.set_departments(0)
    off.set_sparsity(SPARSITY)
    assert cache.gate_slots == 36 and all(m.predictor is None for m in off.loaded.experts)


def test_synthetic_predictor_for_random_weights():
    """Random weights (bench --shape) get a synthetic predictor: balanced contiguous departments, C = W_gate B^T,
    and τ′ letting the requested share of routed neurons through."""
    engine = Engine.load("localmoe-tiny", device="cpu", sparsity=0.0)
    ids = list(range(5, 133))
    preds = predictor.synthetic(engine, ids, 4, 16, candidates=0.25)
    m = engine.loaded.experts[0]
    p = preds[0]
    assert p.B.shape == (4, 16, m.hidden_size) and p.C.shape == (m.num_experts, m.intermediate_size, 16)
    assert torch.bincount(p.dept_of).tolist() == [2, 2, 2, 2]
    B, C = p.maps()  # as stored: int8 rows, within a few steps of each row's scale (C was made with B unrounded)
    torch.testing.assert_close(B[0] @ B[0].T, torch.eye(16), rtol=0, atol=0.02)
    want = m.weights.w_gate[3].float() @ B[int(p.dept_of[3])].T
    assert float((C[3] - want).abs().max()) <= 4 * float(p.C_scale[3].max())
    assert all(abs(q.candidate_share - 0.25) < 0.02 and float(q.tau_rows.min()) > 0 for q in preds)
    assert all(torch.equal(q.tau_rows, q.tau_rows[0, 0].expand_as(q.tau_rows)) for q in preds)  # one τ′ a layer
