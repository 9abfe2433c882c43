"""NF4 routed experts (kernels/nf4.py, `--experts nf4`): bitsandbytes' bytes and absmax kept as bitsandbytes writes
them, the dequantizing kernel and the sparse decode kernel's NF4 mode against their torch references under the
interpreter, and whole engines: NF4 gives the same tokens as the model whose experts are the dequantized weights, with
its own thresholds file, offloaded as resident. CPU; never a time.

Shape legend: E experts, I expert width, H hidden, T tokens, k experts per token, G block size.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import repo_id

from localmoe.engine.engine import Engine
from localmoe.events import GenerationSettings
from localmoe.experts import thresholds
from localmoe.experts.expert_weights import ExpertWeights
from localmoe.kernels.dequant_int4 import dequant_nf4_ref
from localmoe.kernels.nf4 import NF4_CODE, Nf4Tensor, block_for, nf4_code, quantize_nf4

bnb_f = pytest.importorskip("bitsandbytes.functional")


def test_layout_is_bitsandbytes():
    """quantize_nf4 keeps bitsandbytes' own bytes and absmax; the reference dequantizes as bitsandbytes does."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 5, 128, generator=gen).to(torch.bfloat16)
    q = quantize_nf4(w)
    assert q.group == 64 and q.minimum is None and q.element_size() == 0.5625
    assert torch.equal(nf4_code("cpu"), bnb_f.get_4bit_type("nf4", device="cpu").float())
    for e in range(3):
        qb, st = bnb_f.quantize_4bit(w[e].contiguous(), blocksize=64, quant_type="nf4")
        assert torch.equal(q.packed[e].flatten(), qb.flatten()) and torch.equal(q.scale[e].flatten(), st.absmax)
        assert torch.equal(q[e], bnb_f.dequantize_4bit(qb, st))  # bf16, rounded once from fp32 as bnb rounds
    assert block_for(96) == 32 and len(NF4_CODE) == 16
    with pytest.raises(ValueError, match="divisible by 32"):
        block_for(48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape,G", [((2, 3, 64), 32), ((1, 7, 192), 64), ((2, 4, 2048), 64)], ids=str)
def test_dequant_kernel_nf4(shape, G, dtype):
    """dequant_int4's NF4 mode (code=) equals dequant_nf4_ref, odd row counts and a real hidden size."""
    pytest.importorskip("triton")
    from localmoe.kernels.dequant_int4 import dequant_int4

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q = quantize_nf4(torch.randn(*shape, generator=torch.Generator().manual_seed(G)), block=G, device=dev)
    code = nf4_code(dev)
    got = dequant_int4(q.packed, q.scale, None, dtype, code=code)
    want = dequant_nf4_ref(q.packed, q.scale, code, dtype)
    # fp32 exact; bf16 within one ulp (the interpreter's fp32 -> bf16 conversion may not round to nearest)
    tol = dict(rtol=1e-2, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=0, atol=0)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    with pytest.raises(ValueError, match="no minimum"):
        dequant_int4(q.packed, q.scale, q.scale, dtype, code=code)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "T,H,I,E,k,G", [(1, 64, 13, 5, 2, 32), (3, 192, 24, 6, 2, 64), (1, 2048, 8, 4, 2, 64)], ids=str
)
def test_sparse_kernel_nf4(T, H, I, E, k, G, dtype):
    """sparse_fused reading Nf4Tensors in place (gate whole, kept up/down rows, the codebook applied in the kernel)
    equals sparse_fused_ref on the same bytes, dense and thresholded; odd widths and Qwen3.5's hidden size."""
    pytest.importorskip("triton")
    from localmoe.kernels.sparse_fused import sparse_fused, sparse_fused_ref

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(H + I)
    x = torch.randn(T, H, generator=gen).to(dtype).to(dev)
    ws = [quantize_nf4(torch.randn(E, I, H, generator=gen) * 2 / H**0.5, block=G, device=dev) for _ in range(3)]
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(dev)
    rw = torch.softmax(torch.randn(T, k, generator=gen), -1).to(dev)
    for tau in (torch.zeros(E, device=dev), torch.full((E,), 0.2, device=dev)):
        want, want_cnt = sparse_fused_ref(x, *ws, ids, rw, tau)
        got, cnt = sparse_fused(x, *ws, ids, rw, tau)
        assert torch.equal(cnt, want_cnt)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert 0 < int(cnt.sum()) < T * k * I
    from localmoe.kernels.int4 import quantize

    with pytest.raises(ValueError, match="all Nf4Tensors"):
        sparse_fused(x, ws[0], ws[1], quantize(torch.randn(E, I, H), device=dev), ids, rw, tau)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_engine_nf4_equals_dequantized_model(family):
    """`--experts nf4`: greedy tokens at sparsity 0 and 0.5 equal those of the same model with the dequantized
    experts; thresholds cached apart from full precision's and int4's."""
    e4 = Engine.load(repo_id(family), device="cpu", sparsity=0.0, experts="nf4")
    ref = Engine.load(repo_id(family), device="cpu", sparsity=0.0)
    assert e4.experts_format == "nf4" and isinstance(e4.loaded.experts[0].weights.w_up, Nf4Tensor)
    assert e4.loaded.expert_bytes() < ref.loaded.expert_bytes() / 3
    assert_same_as_dequantized(e4, ref)
    rev = e4.resolved.revision
    assert thresholds.cache_path(e4.model_name, rev, 0.5, experts="nf4").is_file()
    assert not thresholds.cache_path(e4.model_name, rev, 0.5, experts="int4").exists()


def assert_same_as_dequantized(e4, ref, n=8):
    """ref's experts replaced by e4's dequantized (fp32): greedy tokens equal at sparsity 0 and 0.5, each engine
    calibrated on its own experts."""
    for a, b in zip(e4.loaded.experts, ref.loaded.experts):
        w = a.weights
        b.weights = ExpertWeights(*(t.dequantize(torch.float32) for t in (w.w_gate, w.w_up, w.w_down_t)))
    ids = e4.encode_raw("four bits per weight")
    s = GenerationSettings(max_new_tokens=n)
    for sparsity in (0.0, 0.5):
        e4.set_sparsity(sparsity)
        ref.set_sparsity(sparsity)
        assert [ev.token_id for ev in e4.generate(ids, s)] == [ev.token_id for ev in ref.generate(ids, s)]


def _tokens(e, n=8):
    return [
        ev.token_id
        for ev in e.generate(e.encode_raw("Sparse experts skip most neurons."), GenerationSettings(max_new_tokens=n))
    ]


@pytest.mark.parametrize("mode", ["copy", "direct"])
def test_nf4_offloaded_equals_resident(mode):
    """NF4 experts offloaded behind the expert cache (NF4 slots, NF4 master copies in host memory; direct: the
    kernel reads absent experts' rows from the masters in place): the resident NF4 model's tokens."""
    if mode == "direct":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") == "0":
            pytest.skip("a CPU engine's Triton kernels need the interpreter (on a GPU: bench/nf4_check.py)")
    from localmoe.experts.placement import WORKSPACE_RESERVE

    model = repo_id("qwen3_moe")
    resident = Engine.load(model, device="cpu", sparsity=0.5, experts="nf4")
    want = _tokens(resident)
    probe = resident.loaded
    # a budget of 5 slots: the non-expert weights, the state and the workspace reserve, then 5.5 experts
    el = 4  # fp32 on CPU
    from localmoe.experts.int4 import expert_bytes
    from localmoe.experts.placement import state_bytes

    one = expert_bytes(probe.experts[0].intermediate_size, probe.experts[0].hidden_size, "nf4")
    fixed = sum(p.numel() * el for p in resident.model.parameters()) + state_bytes(probe.config, 8192, torch.float32)
    vram = (fixed + WORKSPACE_RESERVE + 5 * one + one // 2) / 2**30
    e = Engine.load(model, device="cpu", sparsity=0.5, experts="nf4", vram_gib=vram, offload_miss=mode)
    cache = e.loaded.cache
    assert cache is not None and cache.mode == mode and e.experts_format == "nf4"
    assert isinstance(cache.pool.w_up, Nf4Tensor) and cache.row_bytes == 32 // 2 + 4
    assert _tokens(e) == want
    if mode == "direct":
        assert 0 < int(cache.host_rows) < int(cache.read_rows)
    else:
        assert cache.hits + cache.misses > 0
    for (layer, ex), slot in cache.lru.items():
        master = cache.masters[layer]
        for name in ("w_up", "w_down_t"):
            pool, src = getattr(cache.pool, name), getattr(master, name)
            assert all(torch.equal(p[slot], m[ex]) for p, m in zip(pool.parts(), src.parts()))
