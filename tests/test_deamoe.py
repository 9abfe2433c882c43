"""DeaMoE: config and model round trip through a real HF cache (offline), dense vs decode paths, bad checkpoints.

Tiny random-weight checkpoints are built here from DeaMoeConfig (tests/tiny_models.py is not touched), saved with
save_pretrained and placed in the session's HF cache layout with tiny_models.place_in_hf_cache.
"""

from __future__ import annotations

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
from localmoe.experts.departments import DepartmentExperts, group_limited_topk
from localmoe.experts.local_experts import GateRecorder
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
    down kernel adds the departments' rows atomically in no fixed order (the tolerance of the other atomic sums)."""
    dev = DEV if kernel else "cpu"
    ex = _experts().to(dev)
    x = torch.randn(T, 64).to(dev)
    idx, w = (t.to(dev) for t in _route(T))
    with torch.no_grad():
        ex.tau = torch.full((4,), tau, device=dev)
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
