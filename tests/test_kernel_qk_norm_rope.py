"""Tests of kernels/qk_norm_rope.py: one launch for the per-head q/k RMSNorm + (partial) RoPE of a decode token vs its
torch reference, and the reference vs transformers' own Qwen3.5 and Qwen3-MoE modules (`Qwen3_5MoeRMSNorm` /
`Qwen3MoeRMSNorm`, `apply_rotary_pos_emb`), OLMoE's whole-projection norms (`OlmoeRMSNorm` over Hq*D / Hkv*D) and
Mixtral's / GraniteMoE's attention without q/k norms (kind "none": RoPE alone);
the k/v write into a static cache at Qwen3.5-35B's gated layout, at Qwen3-30B-A3B's plain one (32 query / 4
key-value heads of 128, full rotary, standard norms) and at OLMoE-1B-7B's (16 / 16 heads of 128, whole norms).

Runs on CPU under TRITON_INTERPRET=1. bf16: bit-equal (every product and sum is rounded as torch rounds it); fp32:
within a few ulp (the mean of squares sums in another order).
Shape legend: Hq query heads, Hkv key/value heads, D head dim, ROT rotary dims; qkv [Hq*QW + 2*Hkv*D], QW = 2D
(gated) or D.
"""

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from localmoe.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Hq, Hkv, D, ROT: Qwen3.5-35B-A3B full attention (partial_rotary_factor 0.25), full rotary, odd small heads
SHAPES = [(16, 2, 256, 64), (4, 4, 128, 128), (3, 1, 24, 8), (5, 1, 6, 2)]
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=0, atol=0)}


def _inputs(Hq, Hkv, D, ROT, gated, dtype, seed=0, whole=False):
    """(qkv [1, 1, N], q/k norm weights [D] (whole: [Hq*D], [Hkv*D]), cos/sin [1, 1, ROT]) as the attention layer
    sees them."""
    gen = torch.Generator().manual_seed(seed + D + ROT)
    N = Hq * D * (2 if gated else 1) + 2 * Hkv * D
    qkv = (torch.randn(1, 1, N, generator=gen) * 3).to(DEV, dtype)
    wq, wk = ((torch.randn(n, generator=gen) * 0.3).to(DEV, dtype) for n in ((Hq * D, Hkv * D) if whole else (D, D)))
    ang = torch.rand(ROT // 2, generator=gen) * 40.0  # rotary angles: position x inverse frequencies, both halves
    ang = torch.cat([ang, ang]).view(1, 1, ROT)
    return qkv, wq, wk, ang.cos().to(DEV, dtype), ang.sin().to(DEV, dtype)


def _run(kernel_or_ref, qkv, wq, wk, cos, sin, Hq, Hkv, kind, gated, whole=False):
    D = wq.numel() // (Hq if whole else 1)
    if kind == "none":  # no norms: no weights, the head dim given
        wq = wk = None
    if kernel_or_ref is qk_norm_rope:
        call = dict(num_q_heads=Hq, num_kv_heads=Hkv, kind=kind, gated=gated, whole=whole, head_dim=D)
        return qk_norm_rope(qkv, wq, wk, cos, sin, 1e-6, **call)
    return qk_norm_rope_ref(qkv, wq, wk, cos, sin, 1e-6, Hq, Hkv, kind, gated, whole, head_dim=D)


@pytest.mark.parametrize(
    "kind,gated,whole",
    [
        ("zero_centred", True, False),
        ("standard", False, False),
        ("standard", True, False),
        ("standard", False, True),
        ("none", False, False),
    ],
    ids=["zero_centred-gated", "standard", "standard-gated", "standard-whole", "none"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "Hq{}_Hkv{}_D{}_rot{}".format(*s))
def test_matches_reference(shape, dtype, kind, gated, whole):
    """Every norm layout against the reference; "standard-whole": OLMoE's norms over the whole q / k projection;
    "none": Mixtral's / GraniteMoE's RoPE without norms."""
    Hq, Hkv, D, ROT = shape
    args = _inputs(Hq, Hkv, D, ROT, gated, dtype, whole=whole)
    q, k, v, gate = _run(qk_norm_rope, *args, Hq, Hkv, kind, gated, whole)
    rq, rk, rv, rgate = _run(qk_norm_rope_ref, *args, Hq, Hkv, kind, gated, whole)
    assert q.shape == (Hq, D) and k.shape == (Hkv, D) and v.shape == (Hkv, D)
    assert q.dtype == k.dtype == dtype
    torch.testing.assert_close(q, rq, **TOL[dtype])
    torch.testing.assert_close(k, rk, **TOL[dtype])
    assert torch.equal(v, rv) and v.data_ptr() == rv.data_ptr()  # value heads: a view of the projection
    if gated:
        assert gate.is_contiguous() and gate.shape == (Hq * D,) and torch.equal(gate, rgate)
    else:
        assert gate is None and rgate is None


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe", "olmoe", "mixtral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.no_grad()
def test_reference_is_transformers(dtype, family):
    """The reference equals what Qwen3_5MoeAttention (gated, partial rotary, zero-centred norms), Qwen3MoeAttention
    (plain, full rotary, standard norms), OlmoeAttention (standard norms over the whole projections) and
    MixtralAttention (no norms, Mixtral-8x7B's heads; GraniteMoE's is the same) do to q_proj/k_proj/v_proj outputs,
    bit for bit."""
    Hq, Hkv, D, ROT, gated, kind, norm = {
        "qwen3_5_moe": (16, 2, 256, 64, True, "zero_centred", "Qwen3_5MoeRMSNorm"),
        "qwen3_moe": (32, 4, 128, 128, False, "standard", "Qwen3MoeRMSNorm"),
        "olmoe": (16, 16, 128, 128, False, "standard", "OlmoeRMSNorm"),
        "mixtral": (32, 8, 128, 128, False, "none", None),
    }[family]
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    whole = family == "olmoe"
    qkv, wq, wk, cos, sin = _inputs(Hq, Hkv, D, ROT, gated, dtype, seed=1, whole=whole)
    if norm is None:  # Mixtral: the projections go straight to RoPE
        q_norm = k_norm = torch.nn.Identity()
    else:
        q_norm, k_norm = (getattr(mod, norm)(w.numel(), eps=1e-6).to(dtype) for w in (wq, wk))
        q_norm.weight.data, k_norm.weight.data = wq.clone(), wk.clone()
    q_out, k_out, v_out = qkv.split([Hq * D * (2 if gated else 1), Hkv * D, Hkv * D], dim=-1)
    query, gate = torch.chunk(q_out.view(1, 1, -1, 2 * D), 2, dim=-1) if gated else (q_out, None)
    if whole:  # OLMoE: normed as one [Hq*D] / [Hkv*D] row, then split into heads
        query, key = q_norm(query).view(1, 1, -1, D).transpose(1, 2), k_norm(k_out).view(1, 1, -1, D).transpose(1, 2)
    else:
        query = q_norm(query.reshape(1, 1, -1, D)).transpose(1, 2)
        key = k_norm(k_out.view(1, 1, -1, D)).transpose(1, 2)
    query, key = mod.apply_rotary_pos_emb(query, key, cos, sin)
    rq, rk, rv, rgate = _run(qk_norm_rope_ref, qkv, wq, wk, cos, sin, Hq, Hkv, kind, gated, whole)
    assert torch.equal(rq, query[0, :, 0]) and torch.equal(rk, key[0, :, 0])
    assert torch.equal(rv, v_out.view(Hkv, D))
    assert (rgate is None) if not gated else torch.equal(rgate, gate.reshape(-1))


def test_checks():
    qkv, wq, wk, cos, sin = _inputs(4, 2, 8, 4, True, torch.float32)
    call = dict(num_q_heads=4, num_kv_heads=2)

    def raises(match, *a, **kw):
        with pytest.raises(ValueError, match=match):
            qk_norm_rope(*a, **{**call, **kw})

    raises("kind", qkv, wq, wk, cos, sin, 1e-6, kind="gated")
    raises("features", qkv, wq, wk, cos, sin, 1e-6, num_q_heads=3)
    raises("features", qkv, wq, wk, cos, sin, 1e-6, gated=False)
    raises("one token", torch.cat([qkv, qkv], 1), wq, wk, cos, sin, 1e-6)
    raises("one token", qkv[..., ::2], wq, wk, cos, sin, 1e-6)
    raises(r"\[D\]", qkv, wq, wk[:4], cos, sin, 1e-6)
    raises("dtype", qkv, wq, wk.double(), cos, sin, 1e-6)
    raises("promote", qkv.bfloat16(), wq, wk, cos.bfloat16(), sin.bfloat16(), 1e-6, kind="standard")
    raises("ROT", qkv, wq, wk, cos[..., :3], sin[..., :3], 1e-6)
    raises("ROT", qkv, wq, wk, torch.ones(1, 1, 10), torch.ones(1, 1, 10), 1e-6)
    raises("cos/sin", qkv, wq, wk, cos.bfloat16(), sin.bfloat16(), 1e-6)
    raises("positive", qkv, wq, wk, cos, sin, 1e-6, num_kv_heads=0)
    raises("bf16/fp16/fp32", qkv.double(), wq, wk, cos, sin, 1e-6)
    raises("ungated", qkv, wq, wk, cos, sin, 1e-6, whole=True)
    plain = _inputs(4, 2, 8, 4, False, torch.float32)[0]
    raises(r"\[Hq\*D\] and \[Hkv\*D\]", plain, wq, wk, cos, sin, 1e-6, gated=False, whole=True)
    raises("head_dim", plain, None, None, cos, sin, 1e-6, gated=False, kind="none")  # no norms: the head dim given
    raises("no norm weights", plain, wq, wk, cos, sin, 1e-6, gated=False, kind="none", head_dim=8)
    raises("head_dim 4", plain, wq, wk, cos, sin, 1e-6, gated=False, kind="standard", head_dim=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "shape,kind,gated",
    [
        ((16, 2, 256, 64), "zero_centred", True),
        ((3, 1, 24, 8), "zero_centred", True),
        ((32, 4, 128, 128), "standard", False),
        ((16, 16, 128, 128), "whole", False),
        ((32, 8, 128, 128), "none", False),
    ],
    ids=["qwen3.5-35b", "odd", "qwen3-30b", "olmoe-1b-7b", "mixtral-8x7b"],
)
def test_kv_cache_write(shape, kind, gated, dtype):
    """kv_cache=: the key programs also write k and v at the position of a static cache layer's [1, Hkv, L, D]
    tensors (viewed [Hkv, L, D]) and advance the position by one; nothing else in the cache changes; a position past
    the end writes nothing. q and k as the reference (Qwen3-30B-A3B: its real shape, standard norms, full rotary)."""
    Hq, Hkv, D, ROT = shape
    whole = kind == "whole"  # standard norms over the whole q / k projections
    kind = "standard" if whole else kind
    args = _inputs(Hq, Hkv, D, ROT, gated, dtype, seed=4, whole=whole)
    head = {}
    if kind == "none":  # Mixtral-8x7B: no q/k norms
        args, head = (args[0], None, None, *args[3:]), dict(head_dim=D)
    L = 9
    keys, values = (torch.randn(1, Hkv, L, D).to(DEV, dtype) for _ in range(2))
    before_k, before_v = keys.clone(), values.clone()
    pos = torch.tensor(5, device=DEV)
    call = dict(num_q_heads=Hq, num_kv_heads=Hkv, kind=kind, gated=gated, whole=whole, **head)
    q, k, v, gate = qk_norm_rope(*args, 1e-6, **call, kv_cache=(keys[0], values[0], pos))
    rq, rk, rv, _ = qk_norm_rope_ref(*args, 1e-6, Hq, Hkv, kind, gated, whole, **head)
    torch.testing.assert_close(q, rq, **TOL[dtype])
    torch.testing.assert_close(k, rk, **TOL[dtype])
    assert torch.equal(keys[0, :, 5], k) and torch.equal(values[0, :, 5], v)
    assert int(pos) == 6  # advanced once, by the last key program
    others = [i for i in range(L) if i != 5]
    assert torch.equal(keys[:, :, others], before_k[:, :, others])
    assert torch.equal(values[:, :, others], before_v[:, :, others])
    after_k = keys.clone()
    end = torch.tensor(L, device=DEV)  # past the cache: nothing written
    qk_norm_rope(*args, 1e-6, **call, kv_cache=(keys[0], values[0], end))
    assert torch.equal(keys, after_k) and int(end) == L + 1
    with pytest.raises(ValueError, match="kv_cache keys"):
        qk_norm_rope(*args, 1e-6, **call, kv_cache=(keys[0, :, :, :8], values[0], pos))
    with pytest.raises(ValueError, match="position"):
        qk_norm_rope(*args, 1e-6, **call, kv_cache=(keys[0], values[0], pos.float()))
