"""kernels/decode_attention_qk.py's `decode_attention_qk`: q/k norm + RoPE, the k/v cache write and the attention core
in one launch, against the two launches it replaces (kernels/qk_norm_rope.py with kv_cache=, then `decode_attention`)
and against its torch reference. Every norm kind (Qwen3.5's gated zero-centred with partial rotary, Qwen3-MoE's
standard, OLMoE's whole-projection, Mixtral's none), GQA, odd head dims; the step's row in the first chunk of a program
or in a later one (contexts past the programs' first chunks), with and without the prefetch, a position past the
cache's end (nothing written, still advanced), two steps in a row (the second reads the first's write), bf16 and fp32.

Runs under TRITON_INTERPRET=1 on the CPU, compiled on a GPU. The step's cache row equals qk_norm_rope's to rounding,
the others are untouched; the outputs agree to rounding (the step's key is folded into program 0's softmax last instead
of in its chunk).
Shape legend: Hq query heads, Hkv key/value heads, D head dim, ROT rotary dims, L cache rows.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from localmoe.kernels.decode_attention import decode_attention  # noqa: E402
from localmoe.kernels.decode_attention_qk import decode_attention_qk, decode_attention_qk_ref  # noqa: E402
from localmoe.kernels.qk_norm_rope import qk_norm_rope  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
# name: Hq, Hkv, D, ROT, kind, gated, whole
LAYERS = {
    "qwen3.5": (8, 2, 64, 16, "zero_centred", True, False),
    "qwen3-moe": (8, 2, 32, 32, "standard", False, False),
    "olmoe": (4, 4, 32, 32, "standard", False, True),
    "mixtral": (6, 2, 24, 24, "none", False, False),
    "odd": (3, 1, 24, 8, "standard", False, False),
}


def _layer(name, dtype, L, seed=0):
    Hq, Hkv, D, ROT, kind, gated, whole = LAYERS[name]
    gen = torch.Generator().manual_seed(seed + D + L)
    qkv = (torch.randn(1, 1, Hq * D * (2 if gated else 1) + 2 * Hkv * D, generator=gen) * 2).to(DEV, dtype)
    wn = (Hq * D, Hkv * D) if whole else (D, D)
    wq, wk = ((torch.randn(n, generator=gen) * 0.3).to(DEV, dtype) for n in wn)
    if kind == "none":
        wq = wk = None
    ang = torch.rand(ROT // 2, generator=gen) * 40.0
    ang = torch.cat([ang, ang])
    keys, values = (torch.randn(Hkv, L, D, generator=gen).to(DEV, dtype) for _ in range(2))
    call = dict(
        q_weight=wq, k_weight=wk, cos=ang.cos().to(DEV, dtype), sin=ang.sin().to(DEV, dtype), eps=1e-6,
        num_q_heads=Hq, num_kv_heads=Hkv, kind=kind, gated=gated, whole=whole, head_dim=D,
    )  # fmt: skip
    return qkv, keys, values, call


def _two_launches(qkv, keys, values, pos, mask, scale, call, **kw):
    """What the attention layer ran before: qk_norm_rope with the cache write, then the core."""
    c = dict(call)
    wq, wk, cos, sin, eps = (c.pop(n) for n in ("q_weight", "k_weight", "cos", "sin", "eps"))
    q, _, _, gate = qk_norm_rope(qkv, wq, wk, cos, sin, eps, **c, kv_cache=(keys, values, pos))
    g = None if gate is None else gate.view(q.shape)
    return decode_attention(q, keys, values, mask, scale, gate=g, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize(
    "L, pos, launch",
    [
        (40, 17, dict(chunk=16, block_l=16)),  # prefetch: the row in program 1's first chunk
        (40, 39, dict(chunk=16, block_l=16, max_splits=1)),  # one program: the row in a later chunk
        (70, 33, dict(chunk=32, block_l=16)),  # no prefetch (two tiles a chunk)
        (9, 9, dict(chunk=16, block_l=16)),  # past the end: nothing written, still advanced
    ],
    ids=["prefetch", "later-chunk", "no-prefetch", "past-end"],
)
def test_equals_the_two_launches(name, dtype, L, pos, launch):
    qkv, keys, values, call = _layer(name, dtype, L)
    mask = torch.arange(L, device=DEV) <= pos  # the step's row and every one before
    scale = 0.3
    k2, v2, p2 = keys.clone(), values.clone(), torch.tensor([pos], device=DEV)
    want = _two_launches(qkv, k2, v2, p2, mask, scale, call, **launch)
    k1, v1, p1 = keys.clone(), values.clone(), torch.tensor([pos], device=DEV)
    got = decode_attention_qk(qkv, k1, v1, p1, mask, scale, **call, **launch)
    assert got.shape == want.shape and got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    # the same rows written: every other row untouched, bit for bit (none past the end); the step's row to rounding
    # (compiled, the two kernels may contract the fp32 norm and rotation's multiply-adds differently)
    rest = torch.arange(L, device=DEV) != pos
    assert torch.equal(k1[:, rest], k2[:, rest]) and torch.equal(v1[:, rest], v2[:, rest])
    torch.testing.assert_close(k1.float(), k2.float(), **TOL[dtype])
    torch.testing.assert_close(v1.float(), v2.float(), **TOL[dtype])
    assert int(p1) == int(p2) == pos + 1
    kr, vr, pr = keys.clone(), values.clone(), torch.tensor([pos], device=DEV)
    ref = decode_attention_qk_ref(qkv, kr, vr, pr, mask, scale, **call)
    torch.testing.assert_close(got.float(), ref.float(), **TOL[dtype])
    torch.testing.assert_close(k1.float(), kr.float(), **TOL[dtype])
    assert int(pr) == pos + 1


@pytest.mark.parametrize("name", ["qwen3.5", "olmoe"])
def test_two_steps_and_no_mask(name):
    """Step 2 attends to step 1's row, written by step 1's launch; without a mask every row counts."""
    dtype, L = torch.float32, 24
    qkv, keys, values, call = _layer(name, dtype, L, seed=3)
    pos = torch.tensor([10], device=DEV)
    kr, vr, pr = keys.clone(), values.clone(), pos.clone()
    for step in range(2):
        x = qkv * (1.0 + step)
        mask = torch.arange(L, device=DEV) <= int(pos)
        got = decode_attention_qk(x, keys, values, pos, mask, None, **call, chunk=16, block_l=16)
        want = decode_attention_qk_ref(x, kr, vr, pr, mask, None, **call)
        torch.testing.assert_close(got, want, **TOL[dtype])
    assert int(pos) == 12 and torch.allclose(keys, kr, **TOL[dtype])
    got = decode_attention_qk(qkv, keys, values, pos, None, None, **call, chunk=16, block_l=16)
    want = decode_attention_qk_ref(qkv, kr, vr, pr, None, None, **call)
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_refuses_bad_arguments():
    qkv, keys, values, call = _layer("qwen3-moe", torch.float32, 8)
    pos = torch.tensor([3], device=DEV)
    with pytest.raises(ValueError, match="position"):
        decode_attention_qk(qkv, keys, values, pos.float(), None, None, **call)
    with pytest.raises(ValueError, match="mask"):
        decode_attention_qk(qkv, keys, values, pos, torch.ones(7, dtype=torch.bool, device=DEV), None, **call)
    with pytest.raises(ValueError, match="qkv has"):
        decode_attention_qk(qkv[..., :-1], keys, values, pos, None, None, **call)
    with pytest.raises(ValueError, match="at least one row"):
        decode_attention_qk(qkv, keys[:, :0], values[:, :0], pos, None, None, **call)
