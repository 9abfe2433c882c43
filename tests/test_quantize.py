"""4-bit routed experts (localmoe/experts/int4.py, `--experts int4`): the format's arithmetic, the experts module's
paths
on it (grouped GEMMs a span at a time, the loop, the sparse reference), and whole engines: int4 gives the same tokens
as the model whose experts are the dequantized weights, with its own thresholds file. CPU; never a time.

Shape legend: E experts, I expert width, H hidden, T tokens, k experts per token.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import repo_id

from localmoe.engine.engine import Engine
from localmoe.errors import UsageError
from localmoe.events import GenerationSettings
from localmoe.experts import dense_path, thresholds
from localmoe.experts.expert_weights import ExpertWeights
from localmoe.experts.int4 import Int4Tensor, dequantize, group_for, quantize
from localmoe.experts.local_experts import LocalExperts


def test_group_size():
    assert [group_for(h) for h in (2048, 3072, 96, 80, 32)] == [128, 128, 32, 16, 32]
    with pytest.raises(ValueError, match="divisible by 16"):
        group_for(100)


def test_layout_and_dequantize():
    """Byte j of a row: q[2j] in the low nibble, q[2j+1] in the high; w = q * scale + minimum per group."""
    packed = torch.tensor([[[0x21, 0xF0]]], dtype=torch.uint8)  # q = 1, 2, 0, 15
    scale = torch.tensor([[[0.5, 2.0]]], dtype=torch.bfloat16)  # group 2
    minimum = torch.tensor([[[-1.0, 3.0]]], dtype=torch.bfloat16)
    w = Int4Tensor(packed, scale, minimum, torch.float32)
    assert w.shape == (1, 1, 4) and w.group == 2
    assert w[0].tolist() == [[-0.5, 0.0, 3.0, 33.0]]


@pytest.mark.parametrize("H", [96, 256])
def test_quantize_error_bound(H):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(5, 7, H, generator=gen) * 0.02
    w[1, 2, :32] = 0.25  # a constant group
    q = quantize(w, chunk=2)
    G = q.group
    assert q.packed.shape == (5, 7, H // 2) and q.scale.shape == (5, 7, H // G) and q.packed.dtype == torch.uint8
    d = q.dequantize(torch.float32)
    half_step = (q.scale.float() / 2).repeat_interleave(G, dim=-1)
    assert ((d - w).abs() <= half_step + 2e-3 * w.abs() + 1e-6).all()  # + the bf16 rounding of scale and minimum
    torch.testing.assert_close(d[1, 2, :32], w[1, 2, :32], rtol=4e-3, atol=0)
    torch.testing.assert_close(q[torch.tensor([3, 1])].float(), d[[3, 1]])
    assert q.nbytes() == 5 * 7 * (H // 2 + 4 * H // G)


def _int4_experts(E, I, H, seed=0):
    gen = torch.Generator().manual_seed(seed)
    m = LocalExperts(E, H, I, "silu", 0)
    m.weights = ExpertWeights(*(torch.randn(E, I, H, generator=gen) / H**0.5 for _ in range(3))).to_int4()
    plain = LocalExperts(E, H, I, "silu", 0)
    plain.weights = ExpertWeights(
        *(t.dequantize(torch.float32) for t in (m.weights.w_gate, m.weights.w_up, m.weights.w_down_t))
    )
    return m, plain


def test_int4_dense_paths_span_by_span(monkeypatch):
    """Grouped GEMMs over spans of dequantized experts (forced small here: several spans, an unrouted one skipped)
    equal the loop and the model with the dequantized weights, with the evaluation mask and its kept count."""
    T, k, E, I, H = 23, 2, 9, 16, 64
    m, plain = _int4_experts(E, I, H)
    assert m.weights.int4 and m.weights.nbytes() < plain.weights.nbytes() / 5
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=gen)
    idx = torch.stack([torch.randperm(E - 2, generator=gen)[:k] for _ in range(T)])  # experts 7, 8 never routed
    wts = torch.rand(T, k, generator=gen)
    monkeypatch.setattr(dense_path, "DEQUANT_BYTES", 3 * I * H * 4 * 2)  # two experts a span
    spans = m._spans(torch.cumsum(torch.bincount(idx.reshape(-1), minlength=E), 0), T * k)
    assert len(spans) == 4 and spans[-1][1] == 8  # experts 8's span has no slot
    m.dequant_bytes = 3 * I * H * 4 * 3  # the budget's span (prefill_budget.fit) wins over the default: three a span
    assert [s[:2] for s in m._spans(torch.cumsum(torch.bincount(idx.reshape(-1), minlength=E), 0), T * k)] == [
        (0, 3),
        (3, 6),
        (6, 9),
    ]
    m.dequant_bytes = None
    tau = torch.full((E,), 0.1)
    for mod in (m, plain):
        mod.tau, mod.sparse_enabled, mod.mask_all_tokens = tau, True, True
    outs, kept = [], []
    for mod, grouped in ((m, True), (m, False), (plain, True)):
        mod.grouped = grouped
        mod.reset_counters()
        outs.append(mod(x, idx, wts))
        kept.append(int(mod.kept))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0], outs[2], rtol=1e-5, atol=1e-5)
    assert kept[0] == kept[1] == kept[2] > 0


def test_int4_sparse_reference():
    """One token on the sparse path (CPU: the torch reference) reads the int4 experts as the dequantized model."""
    m, plain = _int4_experts(6, 24, 32, seed=2)
    x = torch.randn(1, 32, generator=torch.Generator().manual_seed(3))  # not the global RNG: test order moved it
    idx, wts = torch.tensor([[4, 1]]), torch.tensor([[0.7, 0.3]])
    tau = torch.full((6,), 0.05)
    ys = []
    for mod in (m, plain):
        mod.tau, mod.sparse_enabled = tau, True
        ys.append(mod(x, idx, wts))
    torch.testing.assert_close(ys[0], ys[1], rtol=1e-5, atol=1e-6)
    assert int(m.kept) == int(plain.kept) and 0 < int(m.kept) < 48


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe", "mixtral", "deepseek_v2"])
def test_engine_int4_equals_dequantized_model(family):
    """`--experts int4`: ~4x smaller experts; greedy tokens at sparsity 0 and 0.5 equal those of the same model with
    the dequantized experts, whose thresholds (calibrated on the same values) are cached apart."""
    e4 = Engine.load(repo_id(family), device="cpu", sparsity=0.0, experts="int4")
    ref = Engine.load(repo_id(family), device="cpu", sparsity=0.0)
    assert e4.experts_format == "int4" and ref.experts_format == "full"
    assert e4.loaded.expert_bytes() < ref.loaded.expert_bytes() / 3
    for a, b in zip(e4.loaded.experts, ref.loaded.experts):
        w = a.weights
        b.weights = ExpertWeights(*(t.dequantize(torch.float32) for t in (w.w_gate, w.w_up, w.w_down_t)))
    ids = e4.encode_raw("four bits per weight")
    s = GenerationSettings(max_new_tokens=10)
    for sparsity in (0.0, 0.5):
        e4.set_sparsity(sparsity)
        ref.set_sparsity(sparsity)
        got = [ev.token_id for ev in e4.generate(ids, s)]
        assert got == [ev.token_id for ev in ref.generate(ids, s)]
    rev = e4.resolved.revision
    assert thresholds.cache_path(e4.model_name, rev, 0.5, experts="int4").is_file()
    assert thresholds.cache_path(e4.model_name, rev, 0.5).is_file()
    assert e4.stats.sparsity_realized > 0.2


@pytest.mark.parametrize("H,G", [(32, 32), (64, 64), (64, 32)], ids=["H32_G32", "H64_G64", "H64_G32"])
def test_int4_kernel_one_group_per_row(H, G):
    """sparse_fused's int4 mode where a row is one group (NG = 1: every hidden size <= 128, the tiny test models)
    and where it is two: the reference's output. Triton 3.8's interpreter drops all but the first element under a
    broadcast one-element atomic mask, which once lost every column but 0 of the NG = 1 rows."""
    pytest.importorskip("triton")
    from localmoe.kernels.sparse_fused import sparse_fused, sparse_fused_ref

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(H + G)
    E, I = 6, 16
    x = torch.randn(1, H, generator=gen).to(dev)
    ws = [quantize(torch.randn(E, I, H, generator=gen) / H**0.5, group=G, device=dev) for _ in range(3)]
    ids, rw = torch.tensor([[4, 1]], device=dev), torch.tensor([[0.7, 0.3]], device=dev)
    for tau in (torch.zeros(E, device=dev), torch.full((E,), 0.05, device=dev)):
        want, want_cnt = sparse_fused_ref(x, *ws, ids, rw, tau)
        got, cnt = sparse_fused(x, *ws, ids, rw, tau)
        assert torch.equal(cnt, want_cnt)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _budget(model: str, slots: int) -> float:
    """--vram (GiB) that leaves exactly `slots` int4 expert slots."""
    from localmoe.experts.placement import WORKSPACE_RESERVE

    probe = Engine.load(model, device="cpu", sparsity=0.0, vram_gib=64.0, experts="int4").loaded.offload
    fixed = probe.non_expert_bytes + probe.state_bytes + WORKSPACE_RESERVE
    return (fixed + slots * probe.expert_bytes + probe.expert_bytes // 2) / 2**30


def _tokens(e, n=12):
    return [
        ev.token_id
        for ev in e.generate(e.encode_raw("Sparse experts skip most neurons."), GenerationSettings(max_new_tokens=n))
    ]


@pytest.mark.parametrize("mode,slots", [("copy", 5), ("cpu", 5), ("direct", 5), ("direct", 10)])
def test_int4_offloaded_equals_resident(mode, slots):
    """int4 experts offloaded behind the expert cache (int4 slots, int4 master copies in host memory): the resident
    int4 model's tokens with every miss mode; admitted slots hold the masters' packed bytes and scales."""
    if mode == "direct":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") == "0":
            pytest.skip("a CPU engine's Triton kernels need the interpreter (on a GPU: bench/int4_check.py)")
    model = repo_id("qwen3_moe")
    resident = Engine.load(model, device="cpu", sparsity=0.5, experts="int4")
    want = _tokens(resident)
    e = Engine.load(
        model, device="cpu", sparsity=0.5, experts="int4", vram_gib=_budget(model, slots), offload_miss=mode
    )
    cache = e.loaded.cache
    assert cache is not None and cache.mode == mode and e.experts_format == "int4"
    assert isinstance(cache.pool.w_up, Int4Tensor) and cache.row_bytes == 32 // 2 + 4
    assert _tokens(e) == want
    assert e.stats.h2d_bytes_per_token > 0
    if mode == "direct":  # the kernel read absent int4 rows in place; gates first, then up/down slots if any
        assert 0 < int(cache.host_rows) < int(cache.read_rows) and cache.gate_slots > 0
        assert (cache.slots > 0) == (slots == 10) and len(cache.lru) == cache.slots
    else:
        assert cache.hits + cache.misses > 0
    for (layer, ex), slot in cache.lru.items():
        master = cache.masters[layer]
        for name in ("w_up", "w_down_t") + (() if cache.gate_slots else ("w_gate",)):
            pool, src = getattr(cache.pool, name), getattr(master, name)
            assert all(torch.equal(p[slot], m[ex]) for p, m in zip(pool.parts(), src.parts()))
    assert e.stats.sparsity_realized == pytest.approx(resident.stats.sparsity_realized)


def test_int4_offload_notes_and_refusals(hub_cache):
    """A full-precision load that offloads where int4 would fit says so; int4 master copies are never mmapped."""
    from localmoe.experts.placement import WORKSPACE_RESERVE, state_bytes
    from localmoe.models.loaded import int4_hint
    from localmoe.models.loader import LoadOptions, load_model

    e4 = Engine.load(repo_id("qwen3_moe"), device="cpu", sparsity=0.0, experts="int4")
    non_expert = sum(p.numel() * 4 for p in e4.model.parameters())
    fits = int(WORKSPACE_RESERVE) + non_expert + state_bytes(e4.loaded.config, 8192, torch.float32)
    full = load_model(
        e4.resolved.path,
        device=torch.device("cpu"),
        dtype=torch.float32,
        options=LoadOptions(vram_bytes=fits + e4.loaded.expert_bytes()),
    )
    assert full.offload.offloading and "--experts int4 would keep every expert in VRAM" in int4_hint(full)
    assert int4_hint(e4.loaded) is None
    half = load_model(
        e4.resolved.path,
        device=torch.device("cpu"),
        dtype=torch.float32,
        options=LoadOptions(experts_format="int4", vram_bytes=fits + e4.loaded.expert_bytes() // 2),
    )
    assert half.offload.offloading and int4_hint(half) is None
    with pytest.raises(UsageError, match="--host-storage mmap keeps full-precision experts"):
        load_model(
            e4.resolved.path,
            device=torch.device("cpu"),
            dtype=torch.float32,
            options=LoadOptions(
                experts_format="int4", vram_bytes=fits + e4.loaded.expert_bytes() // 2, host_storage="mmap"
            ),
        )
    with pytest.raises(UsageError, match="--experts must be one of full, int4"):
        load_model(
            e4.resolved.path,
            device=torch.device("cpu"),
            dtype=torch.float32,
            options=LoadOptions(experts_format="int8"),
        )


def test_put_quantizes_one_expert_in_place():
    w = torch.randn(3, 4, 64)
    dst = Int4Tensor.empty((3, 4, 64), torch.float32, "cpu")
    for e in range(3):
        dst.put(e, w[e])
    ref = quantize(w)
    assert torch.equal(dst.packed, ref.packed) and torch.equal(dst.scale, ref.scale)
    assert torch.equal(dst.minimum, ref.minimum)


def test_dequantize_matches_indexing():
    w = quantize(torch.randn(3, 4, 32))
    torch.testing.assert_close(dequantize(w.packed[2], w.scale[2], w.minimum[2], torch.float32), w[2])
