"""GPT-OSS end to end on CPU: the tiny checkpoint stored as the hub stores gpt-oss (MXFP4 expert blocks and scales,
bf16 biases, `quantization_config`) loads with its experts in place (Mxfp4Tensor stacks, no bf16 copy), the experts'
clamped SwiGLU with biases matches its formula on the dense and sparse paths, offloading (MXFP4 slots and host
copies, staged prefill, CPU misses) changes no token, eval and random weights at a tiny shape run, and a checkpoint
missing or misshaping an MXFP4 tensor is refused in one line naming it. Greedy tokens against transformers' are
test_parity.py's (GPT-OSS is among its families). Never a time."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import tiny_models
import torch
from conftest import repo_id
from safetensors import safe_open
from safetensors.torch import save_file
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from localmoe.cli.main import main
from localmoe.decode import moe_layer, replacements
from localmoe.decode.ops import FusedRMSNorm
from localmoe.engine.engine import Engine
from localmoe.errors import RuntimeFailure, UsageError
from localmoe.events import GenerationSettings
from localmoe.experts.placement import WORKSPACE_RESERVE
from localmoe.experts.sparse_reference import sparse_reference
from localmoe.kernels.mxfp4 import Mxfp4Tensor, dequant_mxfp4_ref, down_t_from_hub
from localmoe.models.loaded import attach_cache
from localmoe.models.loader import LoadOptions, load_model
from localmoe.models.random_weights import build_random

MODEL = repo_id("gpt_oss")
PROMPT = "Sparse experts skip most neurons."
CALIBRATION_TEXT = "Mixtures of experts route each token to a few experts; most of their neurons stay quiet. " * 8
GiB = 1 << 30


def tokens(e, n=8, prompt=PROMPT) -> list[int]:
    return [ev.token_id for ev in e.generate(e.encode_raw(prompt), GenerationSettings(max_new_tokens=n))]


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> str:
    """A short calibration text file (thresholds calibrated in a fraction of the default text's time)."""
    path = tmp_path_factory.mktemp("calibration") / "text.txt"
    path.write_text(CALIBRATION_TEXT)
    return str(path)


@pytest.fixture(scope="module")
def resident():
    return Engine.load(MODEL, device="cpu", sparsity=0.0)


def test_experts_load_as_stored(resident, src_dir):
    """Gate and up hold the checkpoint's own MXFP4 bytes (rows de-interleaved), down its codes transposed; the biases
    its bf16 values; the experts take MXFP4's bytes and no more; the activation's limit is the config's."""
    assert resident.experts_format == "mxfp4"
    m = resident.loaded.experts[0]
    w = m.weights
    assert all(isinstance(t, Mxfp4Tensor) for t in (w.w_gate, w.w_up, w.w_down_t))
    E, I, H = w.shape
    assert w.nbytes() == 3 * E * I * (H // 2 + H // 32)
    with torch.device("meta"):  # the constants transformers' own module uses (5.2x: the config's; 5.17: 7.0, 1.702)
        hf = GptOssExperts(resident.loaded.config)
    assert m.act_fn.limit == hf.limit and m.act_fn.alpha == pytest.approx(hf.alpha)
    with safe_open(str(src_dir / "gpt_oss" / "model.safetensors"), "pt") as f:
        t = {n: f.get_tensor(f"model.layers.0.mlp.experts.{n}") for n in ("gate_up_proj_blocks", "down_proj_blocks")}
        s = {n: f.get_tensor(f"model.layers.0.mlp.experts.{n}") for n in ("gate_up_proj_scales", "down_proj_scales")}
        bias = f.get_tensor("model.layers.0.mlp.experts.gate_up_proj_bias")
    assert torch.equal(w.w_gate.blocks, t["gate_up_proj_blocks"][:, 0::2].flatten(2))
    assert torch.equal(w.w_up.scales, s["gate_up_proj_scales"][:, 1::2])
    blocks, scales = down_t_from_hub(t["down_proj_blocks"][3], s["down_proj_scales"][3])
    assert torch.equal(w.w_down_t.blocks[3], blocks) and torch.equal(w.w_down_t.scales[3], scales)
    assert torch.equal(m.biases.up, bias[:, 1::2].float())


def _formula(m, x, idx, wts, tau):
    """The task's formula on dequantized weights, one (token, expert) at a time: y = sum_k w_k (sum_n h_n Wd[:, n] +
    bd), h_n = (clamp(up) + 1) * a_n where |a_n| >= tau[e], a_n = min(gate, L) * sigmoid(alpha * min(gate, L))."""
    w, b, alpha, limit = m.weights, m.biases, m.act_fn.alpha, m.act_fn.limit
    y = torch.zeros(x.shape)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            gate = (w.w_gate[e] @ x[t] + b.gate[e]).clamp(max=limit)
            a = gate * torch.sigmoid(alpha * gate)
            up = (w.w_up[e] @ x[t] + b.up[e]).clamp(-limit, limit) + 1
            h = torch.where(a.abs() >= tau[e], a * up, torch.zeros_like(a))
            y[t] += wts[t, j] * (h @ w.w_down_t[e] + b.down[e])
    return y


def test_dense_and_sparse_paths_are_the_formula(resident):
    m = resident.loaded.experts[1]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, m.hidden_size, generator=gen)
    idx = torch.tensor([[0, 2], [3, 1], [2, 3]])
    wts = torch.softmax(torch.randn(3, 2, generator=gen), -1)
    zero = torch.zeros(m.num_experts)
    want = _formula(m, x, idx, wts, zero)
    torch.testing.assert_close(m._dense(x, idx, wts), want, rtol=1e-5, atol=1e-5)
    m.grouped = False  # the per-expert loop
    try:
        torch.testing.assert_close(m._dense(x, idx, wts), want, rtol=1e-5, atol=1e-5)
    finally:
        m.grouped = True
    tau = torch.full((m.num_experts,), 0.05)
    y, kept = sparse_reference(x, m.weights, idx, wts, tau, m.act_fn, biases=m.biases, up_fn=m.up_fn)
    torch.testing.assert_close(y, _formula(m, x, idx, wts, tau), rtol=1e-5, atol=1e-5)
    assert 0 < int(kept) < idx.numel() * m.intermediate_size
    up = m.weights.w_up
    assert torch.equal(up[2], dequant_mxfp4_ref(up.blocks[2], up.scales[2], True, torch.float32))


def _budget(slots: int) -> float:
    """--vram (GiB) that leaves `slots` MXFP4 expert slots."""
    probe = Engine.load(MODEL, device="cpu", sparsity=0.0, vram_gib=64.0).loaded.offload
    fixed = probe.non_expert_bytes + probe.state_bytes + WORKSPACE_RESERVE
    return (fixed + slots * probe.expert_bytes + probe.expert_bytes // 2) / GiB


def test_offloaded_equals_resident(resident, calibration):
    """MXFP4 slots and master copies behind the expert cache: greedy tokens at sparsity 0 and 0.5 (calibrated), by
    copy misses and CPU misses, equal the resident model's; an offloaded prompt's staged prefill gives its logits."""
    want = {s: None for s in (0.0, 0.5)}
    for s in want:
        resident.set_sparsity(s, calibration_text=calibration)
        want[s] = tokens(resident)
    resident.set_sparsity(0.0)
    k = resident.loaded.config.num_experts_per_tok
    e = Engine.load(MODEL, device="cpu", sparsity=0.0, vram_gib=_budget(k + 1))
    cache = e.loaded.cache
    assert cache is not None and cache.slots == k + 1 and isinstance(cache.pool.w_down_t, Mxfp4Tensor)
    assert e.loaded.host_storage in ("pinned", "pageable")
    for mode, s in (("copy", 0.0), ("copy", 0.5), ("cpu", 0.5)):
        attach_cache(e.loaded, e.dtype, torch.device("cpu"), False, mode)
        e.set_sparsity(s, calibration_text=calibration)
        assert tokens(e) == want[s], (mode, s)
    e.set_sparsity(0.0)
    attach_cache(e.loaded, e.dtype, torch.device("cpu"), False, "copy")
    e.loaded.cache.staging.span = 2
    ids = torch.tensor([resident.encode_raw("Departments share weights, experts keep their own. " * 2)])
    with torch.inference_mode():
        torch.testing.assert_close(e.model(input_ids=ids).logits, resident.model(input_ids=ids).logits)


def test_eval_and_calibrate_run(capsys, calibration):
    code = main(["eval", MODEL, "--sparsity", "0", "--tokens", "64", "--json", "--device", "cpu"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert json.loads(out.strip().splitlines()[-1])
    code = main(["calibrate", MODEL, "--sparsity", "0.5", "--text", calibration, "--tokens", "64", "--device", "cpu"])
    assert code == 0, capsys.readouterr()


@pytest.mark.parametrize(
    ("model", "experts", "says"),
    [
        (MODEL, "int4", "this checkpoint's experts are MXFP4 already"),
        (repo_id("qwen3_moe"), "mxfp4", "--experts mxfp4 reads a checkpoint's own MXFP4 experts"),
    ],
    ids=["int4-of-mxfp4", "mxfp4-of-bf16"],
)
def test_experts_format_refusals(model, experts, says):
    with pytest.raises(UsageError, match=says):
        Engine.load(model, device="cpu", sparsity=0.0, experts=experts)


FAULTS = [  # (id, tensor of layer 1's experts, what happens to it, the message)
    ("missing-scales", "down_proj_scales", None, "checkpoint lacks model.layers.1.mlp.experts.down_proj_scales"),
    ("missing-blocks", "gate_up_proj_blocks", None, "checkpoint lacks model.layers.1.mlp.experts.gate_up_proj_blocks"),
    (
        "short-scales",
        "gate_up_proj_scales",
        lambda t: t[:, :-1].contiguous(),
        "gate_up_proj_scales has shape [4, 63, 2], config",
    ),
    ("bias-as-codes", "down_proj_bias", lambda t: t.to(torch.uint8), "down_proj_bias is U8, MXFP4 biases are floats"),
]


@pytest.mark.parametrize(("name", "change", "says"), [f[1:] for f in FAULTS], ids=[f[0] for f in FAULTS])
def test_bad_mxfp4_tensor_is_one_line(src_dir, tmp_path, name, change, says):
    folder = tmp_path / "ckpt"
    shutil.copytree(src_dir / "gpt_oss", folder)
    shard = folder / "model.safetensors"
    with safe_open(str(shard), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    key = f"model.layers.1.mlp.experts.{name}"
    if change is None:
        del tensors[key]
    else:
        tensors[key] = change(tensors[key])
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(RuntimeFailure, match=re.escape(says)) as e:
        load_model(folder, device=torch.device("cpu"), dtype=torch.float32)
    assert "\n" not in str(e.value)


def test_random_weights_at_a_tiny_shape():
    """`bench --shape`'s build: a GPT-OSS config with the hub's quantization_config gets random MXFP4 experts and
    biases, resident and offloaded."""
    from transformers import AutoConfig

    cfg = tiny_models.spec("gpt_oss").tiny.config
    text = AutoConfig.for_model(
        "gpt_oss", **tiny_models._common(**cfg), quantization_config=tiny_models.GPT_OSS_QUANTIZATION
    )
    loaded = build_random(text, device=torch.device("cpu"), dtype=torch.float32)
    m = loaded.experts[0]
    assert isinstance(m.weights.w_down_t, Mxfp4Tensor) and not m.weights.w_down_t.along_rows
    assert m.biases is not None and m.biases.down.shape == (m.num_experts, m.hidden_size)
    with torch.no_grad():
        logits = loaded.model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits
    assert torch.isfinite(logits).all()
    plan = build_random(text, device=torch.device("cpu"), dtype=torch.float32, options=LoadOptions(vram_bytes=GiB))
    fixed = plan.offload.non_expert_bytes + plan.offload.state_bytes + WORKSPACE_RESERVE
    budget = LoadOptions(vram_bytes=fixed + 3 * plan.offload.expert_bytes)
    offloaded = build_random(text, device=torch.device("cpu"), dtype=torch.float32, options=budget)
    assert offloaded.cache.slots == 3 and isinstance(offloaded.cache.pool.w_gate, Mxfp4Tensor)
    assert isinstance(offloaded.experts[0].weights.w_up, Mxfp4Tensor)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the kernel on CPU tensors needs the interpreter")
def test_decode_kernel_equals_the_reference(resident, calibration):
    """`sparse_mxfp4` wired in (one launch per layer and decode step; here under the interpreter, one step, the
    slowest of these tests): offloaded with direct misses (the kernel reads resident parts from the cache's slots and
    absent ones from the host copies, gates from their tier first), the greedy tokens at sparsity 0.5 equal the
    resident torch reference's."""
    resident.set_sparsity(0.5, calibration_text=calibration)
    want = tokens(resident, n=2)
    resident.set_sparsity(0.0)
    k = resident.loaded.config.num_experts_per_tok
    off = Engine.load(MODEL, device="cpu", sparsity=0.0, vram_gib=_budget(k + 1))
    off.set_sparsity(0.5, calibration_text=calibration)
    attach_cache(off.loaded, off.dtype, torch.device("cpu"), False, "direct")
    assert off.loaded.cache.gate_slots > 0
    for m in off.loaded.experts:
        m.kernel_on_cpu = True
    assert tokens(off, n=2) == want
    assert off.stats.sparsity_realized > 0 and off.loaded.cache.host_rows.item() > 0


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the kernels on CPU tensors need the interpreter")
@pytest.mark.parametrize("where", ["resident", "offloaded"])
@torch.no_grad()
def test_moe_front_takes_the_router_bias(resident, monkeypatch, where):
    """`bias_in_front`: a fused decoder layer's MoE half in 2 launches (moe_front with the router's bias, then
    sparse_mxfp4 adding the residual) gives what the 4 launches give (add + norm, router_topk with its bias, the
    experts, the add), resident and offloaded with direct misses (the slot tables beside the tail); switched off, the
    layer does not take the front."""
    engine = resident
    if where == "offloaded":
        engine = Engine.load(MODEL, device="cpu", sparsity=0.0, vram_gib=_budget(2))
        attach_cache(engine.loaded, engine.dtype, torch.device("cpu"), False, "direct")
        assert engine.loaded.cache.mode == "direct"
    layer = engine.loaded.model.model.layers[0]
    block = replacements.REPLACEMENTS[type(layer.mlp).__name__].make(layer.mlp)
    hf_norm = layer.post_attention_layernorm
    norm = replacements.REPLACEMENTS[type(hf_norm).__name__].make(hf_norm)
    assert isinstance(norm, FusedRMSNorm) and block._router_bias is not None
    experts = layer.mlp.experts
    gen = torch.Generator().manual_seed(3)
    H, dt = layer.mlp.router.weight.shape[1], layer.mlp.router.weight.dtype
    mixed, residual = torch.randn(1, 1, H, generator=gen).to(dt), (2 * torch.randn(1, 1, H, generator=gen)).to(dt)
    try:
        experts.kernel_on_cpu = True
        monkeypatch.setattr(moe_layer.FusedSparseMoeBlock, "bias_in_front", False)
        assert not block.takes_front(mixed)  # off: the four launches
        monkeypatch.setattr(moe_layer.FusedSparseMoeBlock, "bias_in_front", True)
        assert block.takes_front(mixed)  # on: the default
        calls = block.front_calls
        got = block.step_front(mixed, residual, norm)
        assert block.front_calls == calls + 1
        s = (mixed.float() + residual.float()).to(dt)
        y = block(norm(s))
        want = s + (y[0] if isinstance(y, tuple) else y)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    finally:
        experts.kernel_on_cpu = False
