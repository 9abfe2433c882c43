"""DeaMoE: config and model round trip through a real HF cache (offline), dense vs decode paths, bad checkpoints.

Tiny random-weight checkpoints are built here from DeaMoeConfig (tests/tiny_models.py is not touched), saved with
save_pretrained and placed in the session's HF cache layout with tiny_models.place_in_hf_cache.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import place_in_hf_cache

from localmoe.engine.generate import cache_of
from localmoe.errors import UsageError
from localmoe.experts import thresholds
from localmoe.experts.departments import DepartmentExperts, group_limited_topk
from localmoe.experts.gate_recorder import GateRecorder
from localmoe.models.deamoe import DeaMoeConfig, DeaMoeForCausalLM
from localmoe.models.deamoe.checkpoint import check_checkpoint

REPO = "localmoe-test/tiny-deamoe"
# The Triton path runs on CUDA tensors when the kernels are compiled (a GPU run sets TRITON_INTERPRET=0: a compiled
# kernel cannot read CPU tensors), on CPU tensors under the interpreter otherwise.
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0" else "cpu"


def tiny_config(**kw) -> DeaMoeConfig:
    base = dict(
        vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_departments=3, experts_per_department=3, department_size=32, num_experts_per_tok=3, topk_group=2,
        private_init_noise=0.05, pad_token_id=0, eos_token_id=2,
    )  # fmt: skip
    return DeaMoeConfig(**{**base, **kw})


def save_tiny(folder: Path, **kw) -> Path:
    torch.manual_seed(0)
    model = DeaMoeForCausalLM(tiny_config(**kw)).eval()
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def cached(tmp_path_factory) -> Path:
    src = save_tiny(tmp_path_factory.mktemp("deamoe") / "src")
    return place_in_hf_cache(src, Path(os.environ["HF_HUB_CACHE"]), REPO)


def test_round_trip_through_hf_cache(cached):
    from transformers import AutoConfig, AutoModelForCausalLM

    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert AutoConfig.from_pretrained(REPO).model_type == "deamoe"
    model = AutoModelForCausalLM.from_pretrained(REPO).eval()
    assert isinstance(model, DeaMoeForCausalLM)
    torch.manual_seed(0)
    fresh = DeaMoeForCausalLM(tiny_config()).eval()
    ids = torch.randint(3, 96, (2, 11))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fresh(ids).logits)
        out = model.generate(ids[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 17)


def test_cached_decode_matches_full_forward(cached):
    """Token-by-token decode (the department-slot path, one token) gives the full forward's logits. The cache's
    name follows transformers: `cache` from 5.2x, `past_key_values` before (5.17 is supported too)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(REPO).eval()
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.randint(3, 96, (1, 9))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :5], use_cache=True)
        cache, steps = cache_of(out), []
        for t in range(5, 9):
            out = model(ids[:, t : t + 1], use_cache=True, **{kw: cache})
            cache = cache_of(out)
            steps.append(out.logits[:, -1])
    torch.testing.assert_close(torch.stack(steps, 1), full[:, 5:], rtol=1e-4, atol=1e-4)


def _experts(seed=0, D=4, n=3, H=64, h=32):
    torch.manual_seed(seed)
    ex = DepartmentExperts(D, n, H, h).eval()
    with torch.no_grad():
        for p in (ex.gate_proj, ex.up_proj, ex.down_t):
            p.normal_(0, H**-0.5)
        ex.private.copy_(torch.eye(h) + 0.2 * torch.randn(D, n, h, h) / h**0.5)
    ex.slots = 2
    return ex


def _route(T, D=4, n=3, k=3, g=2, seed=1):
    torch.manual_seed(seed)
    probs = torch.softmax(torch.randn(T, D * n), -1)
    idx, top = group_limited_topk(probs, n, k, g)
    return idx, top / top.sum(-1, keepdim=True)


@pytest.mark.parametrize("T", [1, 4], ids=["one_token", "prompt_piece_4"])
@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("tau", [0.0, 0.15], ids=["tau0", "tau0.15"])
def test_dense_and_decode_paths_agree(T, kernel, tau):
    """fp32 on CPU (the torch reference) or, for the kernel, on DEV: CUDA when the kernels are compiled, where the
    down kernel adds the departments' rows atomically in no fixed order (the tolerance of the other atomic sums).
    With a threshold, a second one on z (`tau_z`) too."""
    dev = DEV if kernel else "cpu"
    ex = _experts().to(dev)
    x = torch.randn(T, 64).to(dev)
    idx, w = (t.to(dev) for t in _route(T))
    with torch.no_grad():
        ex.tau = torch.full((4,), tau, device=dev)
        ex.tau_z = torch.full((4,), 0.02, device=dev) if tau > 0 else None
        ex.sparse_enabled = tau > 0
        ex.mask_all_tokens = tau > 0
        dense = ex(x, idx, w)  # mask_all_tokens: the dense path with the same mask
        ex.mask_all_tokens, ex.max_sparse_tokens, ex.kernel_on_cpu = False, 4, kernel and dev == "cpu"
        ex.reset_counters()
        decode = ex(x, idx, w)
    tol = 1e-4 if dev == "cuda" else 1e-5
    torch.testing.assert_close(decode, dense, rtol=tol, atol=tol)
    if tau > 0:
        assert 0 < int(ex.kept) < int(ex.seen)


def test_group_limited_routing_stays_in_allowed_departments():
    idx, _ = _route(64, D=4, n=3, k=3, g=2)
    assert all(len(set((row // 3).tolist())) <= 2 for row in idx)


def test_recorder_keys_samples_by_department():
    ex = _experts()
    ex.recorder = GateRecorder()
    idx, w = _route(8)
    with torch.no_grad():
        ex(torch.randn(8, 64), idx, w)
    assert set(ex.recorder.routed) == set((idx // 3).unique().tolist())
    assert ex.recorder.count == sum(ex.recorder.routed.values()) * 32


def test_training_step_has_gradients_everywhere():
    ex = _experts().train()
    idx, w = _route(16)
    ex(torch.randn(16, 64), idx, w).square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in ex.parameters())


def _drop(folder: Path, name: str) -> None:
    f = folder / "model.safetensors"
    t = load_file(f)
    del t[name]
    save_file(t, f, metadata={"format": "pt"})


def _reshape(folder: Path, name: str) -> None:
    f = folder / "model.safetensors"
    t = load_file(f)
    t[name] = t[name][:, :-1].contiguous()
    save_file(t, f, metadata={"format": "pt"})


def _config(folder: Path, **kw) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **kw}))


BAD = [
    ("missing_private", lambda f: _drop(f, "model.layers.1.mlp.experts.private"), "model.layers.1.mlp.experts.private"),
    ("missing_down", lambda f: _drop(f, "model.layers.0.mlp.experts.down_t"), "model.layers.0.mlp.experts.down_t"),
    ("private_experts_short", lambda f: _reshape(f, "model.layers.0.mlp.experts.private"), "mlp.experts.private"),
    ("config_more_experts", lambda f: _config(f, experts_per_department=4), "model.layers.0.mlp.gate.weight"),
    ("config_more_departments", lambda f: _config(f, num_departments=4), "model.layers.0.mlp.gate.weight"),
    ("config_wider", lambda f: _config(f, department_size=48), "model.layers.0.mlp.experts.gate_proj"),
    ("config_topk_too_large", lambda f: _config(f, num_experts_per_tok=7), "num_experts_per_tok"),
]


@pytest.mark.parametrize("breaks, needle", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_checkpoint_is_refused_in_one_line(tmp_path, breaks, needle):
    folder = save_tiny(tmp_path / "ckpt")
    breaks(folder)
    for load in (check_checkpoint, DeaMoeForCausalLM.from_pretrained):
        with pytest.raises(UsageError) as e:
            load(folder)
        assert needle in str(e.value) and "\n" not in str(e.value)


# -- through the product: the bundled localmoe-tiny-deamoe, the CLI's refusals ---------------------------------------
BUNDLED = "localmoe-tiny-deamoe"
ASSET = Path(__file__).resolve().parent.parent / "localmoe" / "assets" / BUNDLED


@pytest.fixture(scope="module")
def engine():
    from localmoe.engine.engine import Engine

    return Engine.load(BUNDLED, device="cpu", sparsity=0.0)


def _reply(engine, n: int) -> list[int]:
    from localmoe.events import GenerationSettings

    ids = engine.encode_chat([{"role": "user", "content": "What is a generator?"}])
    events = engine.generate(ids, GenerationSettings(max_new_tokens=n, temperature=0.0))
    return ids, [e.token_id for e in events]


def test_engine_tokens_equal_transformers_generate(engine):
    """The loader's model (DepartmentExperts kept, tensors streamed) decodes the tokens transformers' own load and
    generate give, greedy at sparsity 0 (float32, CPU)."""
    from transformers import AutoModelForCausalLM

    assert engine.loaded.family.key == "deamoe" and engine.experts_format == "full"
    assert all(type(m) is DepartmentExperts for m in engine.loaded.experts) and len(engine.loaded.experts) == 8
    ids, got = _reply(engine, 6)
    ref = AutoModelForCausalLM.from_pretrained(ASSET, dtype=torch.float32).eval()
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, repetition_penalty=1.0)
    assert got == out[0, len(ids) :].tolist()[: len(got)] and len(got) > 1


@pytest.mark.parametrize("mode", ["layer", "expert"])
def test_thresholds_calibrate_and_apply_per_department(engine, mode):
    """Calibration records |silu(x W_gate_d)| by department: tau is [D] per layer (a layer's tau broadcast, or in
    expert mode one quantile per department), routing counts one per department; decoding at 30% realises about
    30%, and the stats are plain floats."""
    table = thresholds.thresholds_for(engine, 0.3, tokens=256, mode=mode)
    assert table.path is not None and table.path.is_file()
    assert [len(c) for c in table.meta["routing_counts"]] == [6] * 8
    try:
        thresholds.apply(engine.loaded, table, device=engine._device)
        for m in engine.loaded.experts:
            assert m.sparse_enabled and m.tau.shape == (6,) and m.tau.dtype == torch.float32
            assert (len(set(m.tau.tolist())) > 1) == (mode == "expert")
        _, got = _reply(engine, 4)
        st = engine.stats
        assert len(got) == st.generated_tokens and type(st.sparsity_realized) is float
        assert 0.1 < st.sparsity_realized < 0.5
        json.dumps(dataclasses.asdict(st))
    finally:
        engine.set_sparsity(0.0)
    assert engine.realized_sparsity() == 0.0


def test_z_sparsity_calibrates_tau_z_caches_it_and_decodes(engine, monkeypatch):
    """--z-sparsity Q: a second pass records |z| with tau's mask on; tau_z per layer is its Q-quantile, cached in a
    file of its own (read back without calibrating), applied to every department, the sparse decode runs with it,
    and `set_z_sparsity(0)` clears it at the next `set_sparsity`."""
    table = thresholds.thresholds_for(engine, 0.3, tokens=256, z_sparsity=0.5)
    assert table.path is not None and table.path.name.endswith("-z0.5000.json")
    assert table.taus_z is not None and len(table.taus_z) == 8 and all(t > 0 for t in table.taus_z)
    saved = json.loads(table.path.read_text())
    assert saved["z_sparsity"] == 0.5 and saved["z_thresholds"] == list(table.taus_z)
    plain = thresholds.thresholds_for(engine, 0.3, tokens=256)
    assert plain.taus_z is None and plain.path != table.path and plain.taus == table.taus

    def no_calibration(*a, **k):
        raise AssertionError("calibrated again")

    monkeypatch.setattr(thresholds, "calibrate_ids", no_calibration)
    again = thresholds.thresholds_for(engine, 0.3, tokens=256, z_sparsity=0.5)
    assert again.taus_z == table.taus_z
    monkeypatch.undo()
    try:
        engine.set_z_sparsity(0.5)
        engine.set_sparsity(0.3)
        for m in engine.loaded.experts:  # (the engine calibrates on its own token count: its own table)
            assert m.tau_z is not None and m.tau_z.shape == (6,) and float(m.tau_z.min()) > 0
        _, got = _reply(engine, 4)
        assert len(got) == 4
    finally:
        engine.set_z_sparsity(0.0)
        engine.set_sparsity(0.0)
    engine.set_sparsity(0.3)
    try:
        assert all(m.tau_z is None for m in engine.loaded.experts)
    finally:
        engine.set_sparsity(0.0)


def test_z_thresholds_drop_about_q_of_z_on_the_calibration_text(engine):
    """tau_z at the 0.5-quantile of |z| (with tau's mask on) drops about half of z's entries on the text it was
    calibrated on."""
    table = thresholds.thresholds_for(engine, 0.3, tokens=512, z_sparsity=0.5)
    m = engine.loaded.experts[3]
    rec = GateRecorder()
    thresholds.apply(engine.loaded, table, device=engine._device)
    try:
        for x in engine.loaded.experts:
            x.mask_all_tokens = True
        m.z_recorder = rec
        ids = engine.tokenizer(thresholds.DEFAULT_TEXT.read_text(), add_special_tokens=False)["input_ids"][:512]
        with torch.no_grad():
            engine.model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        m.z_recorder = None
        for x in engine.loaded.experts:
            x.mask_all_tokens = False
        engine.set_sparsity(0.0)
    z = torch.cat(rec.values)
    assert 0.4 < float((z < table.taus_z[3]).float().mean()) < 0.6


def test_z_sparsity_on_calibrate_and_eval(capsys):
    """`calibrate --z-sparsity` says what it calibrated and saves the z thresholds; `eval --z-sparsity --json` reports
    it and scores the sparse rows with it."""
    from localmoe.cli.main import main

    capsys.readouterr()
    assert main(["calibrate", BUNDLED, "--sparsity", "0.3", "--z-sparsity", "0.5", "--tokens", "256"]) == 0
    out = capsys.readouterr().out
    assert "at sparsity 30.0% and z sparsity 50.0%" in out and "-z0.5000.json" in out
    args = ["eval", BUNDLED, "--sparsity", "0,0.3", "--z-sparsity", "0.5", "--tokens", "64", "--window", "32"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["z_sparsity"] == 0.5 and [r["sparsity"] for r in report["rows"]] == [0.0, 0.3]


def test_z_sparsity_is_refused_for_a_model_without_departments(capsys):
    code, err = _cli(capsys, "run", "localmoe-tiny", "hi", "--z-sparsity", "0.5")
    assert code == 2 and err.startswith("localmoe: error: ") and err.count("\n") == 1
    assert "--z-sparsity is for DeaMoE models" in err


def _cli(capsys, *args):
    from localmoe.cli.main import main

    capsys.readouterr()  # what came before (save_pretrained's progress bar) is not the command's
    code = main(list(args))
    return code, capsys.readouterr().err


def test_bad_checkpoint_refused_by_the_cli(tmp_path, capsys):
    import tiny_models

    folder = save_tiny(tmp_path / "ckpt")
    tiny_models.char_tokenizer().save_pretrained(folder)
    _drop(folder, "model.layers.1.mlp.experts.private")
    code, err = _cli(capsys, "run", str(folder), "hi")
    assert code == 2 and err.startswith("localmoe: error: ") and err.count("\n") == 1
    assert "model.layers.1.mlp.experts.private is missing" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--experts", "int4"], "--experts int4 is not supported for DeaMoE"),
        (["--vram", "0.25"], "one token needs 2 departments and 4 private parts of a layer"),
    ],
    ids=["int4", "vram-below-one-token"],
)
def test_unsupported_options_refused_in_one_line(capsys, flags, needle):
    code, err = _cli(capsys, "run", BUNDLED, "hi", *flags)
    assert code == 2 and err.startswith("localmoe: error: ") and err.count("\n") == 1 and needle in err


def test_resident_budget_loads(engine):
    """A --vram budget that holds every department loads resident (the plan says so; nothing is offloaded)."""
    from localmoe.models.loader import LoadOptions, load_model

    loaded = load_model(ASSET, device=torch.device("cpu"), dtype=torch.float32, options=LoadOptions(vram_bytes=1 << 30))
    assert loaded.offload is not None and not loaded.offload.offloading and loaded.cache is None
    assert loaded.expert_bytes() == engine.loaded.expert_bytes() > 0


def test_decode_replacements_take_the_department_block():
    """DeaMoE's block is fused by its own row of the table (group-limited router in router_topk's department mode),
    never by a plain top-k row; the norms and Linears around it are fused as in every family; uninstall restores."""
    from localmoe.decode import replacements

    model = DeaMoeForCausalLM(tiny_config()).eval()
    counts = replacements.install(model, "cpu", force=True)
    try:
        assert counts.get("Qwen3MoeRMSNorm") and counts.get("Linear") and counts["DeaMoeSparseMoeBlock"] == 2
        assert not {"Qwen3MoeSparseMoeBlock", "Qwen3_5MoeSparseMoeBlock", "Qwen3_5MoeDecoderLayer"} & set(counts)
        blocks = [layer.mlp for layer in model.model.layers]
        assert all(type(b).__name__ == "FusedSparseMoeBlock" and b._router_ok for b in blocks)
        assert all(b._group == {"group_size": 3, "topk_group": 2} for b in blocks)
    finally:
        replacements.uninstall(model)
    assert all(type(layer.mlp).__name__ == "DeaMoeSparseMoeBlock" for layer in model.model.layers)
