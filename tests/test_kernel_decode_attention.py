"""Tests of kernels/decode_attention.py: one query token's attention over a KV cache (split over key chunks, then
combined) against its torch reference and torch's SDPA, with GQA, Dk != Dv (DeepSeek's MLA), a static-cache mask
whose unused tail is skipped, no mask, odd sizes, bf16 and fp32. CPU under TRITON_INTERPRET=1; never times.

Shape legend: Hq query heads, Hkv KV heads, L cache length, Dk / Dv key / value head dims.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from localmoe.kernels.decode_attention import decode_attention, decode_attention_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0" else "cpu"
# (Hq, Hkv, L, Dk, Dv, valid keys, chunk): Qwen3.5-35B's full attention (16 q / 2 kv heads, d 256) on a static cache
# with 300 of 1024 positions used; MHA odd sizes; MLA-like Dk 24 / Dv 16; valid keys spanning several chunks
SHAPES = [
    (16, 2, 1024, 256, 256, 300, 256),
    (3, 3, 50, 40, 40, 50, 16),
    (4, 1, 70, 24, 16, 33, 16),
    (8, 2, 200, 64, 64, 200, 32),
]
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.mark.parametrize("tile", ["loop", "prefetch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "Hq{}Hkv{}L{}Dk{}Dv{}n{}".format(*s[:6]))
def test_matches_reference_and_sdpa(shape, dtype, tile):
    """ "loop": 16-key tiles walked after the wait; "prefetch": one tile per chunk, loaded before the wait."""
    Hq, Hkv, L, Dk, Dv, n, chunk = shape
    gen = torch.Generator().manual_seed(Hq + L + Dk)
    q = torch.randn(Hq, Dk, generator=gen).to(DEV, dtype)
    k = torch.randn(Hkv, L, Dk, generator=gen).to(DEV, dtype)
    v = torch.randn(Hkv, L, Dv, generator=gen).to(DEV, dtype)
    mask = torch.arange(L, device=DEV) < n  # a static cache: the first n positions hold tokens
    want = decode_attention_ref(q, k, v, mask)
    if n < L:
        k[:, n:] = float("nan")  # never read: a chunk past the last token returns before loading
        v[:, n:] = float("nan")
    if tile == "loop":
        got = decode_attention(q, k, v, mask, chunk=chunk, block_l=16, prefetch=False)
    else:
        got = decode_attention(q, k, v, mask, chunk=min(chunk, 64), block_l=min(chunk, 64), prefetch=True)
    assert got.dtype == dtype and got.shape == (Hq, Dv) and torch.isfinite(got.float()).all()
    torch.testing.assert_close(got, want, **TOL[dtype])
    if Dk == Dv:  # torch's SDPA with the same boolean mask (GQA by repeating KV heads)
        r = Hq // Hkv
        kk, vv = k[:, :n].repeat_interleave(r, 0), v[:, :n].repeat_interleave(r, 0)
        sdpa = torch.nn.functional.scaled_dot_product_attention(q[:, None].float(), kk.float(), vv.float())[:, 0]
        torch.testing.assert_close(got.float(), sdpa, **TOL[dtype])


@pytest.mark.parametrize("prefetch", [False, True])
def test_holes_in_the_mask(prefetch):
    """A mask with holes (sliding window, padding): masked keys are never read, on both paths; a chunk with nothing
    kept contributes nothing."""
    gen = torch.Generator().manual_seed(7)
    Hq, Hkv, L, D = 8, 2, 96, 32
    q = torch.randn(Hq, D, generator=gen).to(DEV)
    k = torch.randn(Hkv, L, D, generator=gen).to(DEV)
    v = torch.randn(Hkv, L, D, generator=gen).to(DEV)
    mask = (torch.rand(L, generator=gen) < 0.4).to(DEV)
    mask[32:48] = False  # one whole chunk of 16 masked
    mask[70] = True
    want = decode_attention_ref(q, k, v, mask)
    k[:, ~mask] = float("nan")
    v[:, ~mask] = float("nan")
    got = decode_attention(q, k, v, mask, chunk=16, block_l=16 if prefetch else 8, prefetch=prefetch)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("max_splits", [1, 3, 4, 64])
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("masked", [True, False], ids=["mask", "no-mask"])
def test_programs_walk_several_chunks(max_splits, prefetch, masked):
    """Fewer programs than chunks (a long static cache): program p takes chunks p, p + NP, ...; kept keys in the
    later chunks (a long context), a chunk with nothing kept among them, and the ragged last chunk all count."""
    gen = torch.Generator().manual_seed(max_splits)
    Hq, Hkv, L, D = 4, 2, 200, 32  # 13 chunks of 16
    q = torch.randn(Hq, D, generator=gen).to(DEV)
    k = torch.randn(Hkv, L, D, generator=gen).to(DEV)
    v = torch.randn(Hkv, L, D, generator=gen).to(DEV)
    mask = None
    if masked:
        mask = torch.arange(L) < 150
        mask[64:80] = False  # chunk 4: nothing kept
        mask[100:110] = False
        mask = mask.to(DEV)
    want = decode_attention_ref(q, k, v, mask)
    if masked:
        k[:, ~mask] = float("nan")  # never read
        v[:, ~mask] = float("nan")
    got = decode_attention(
        q, k, v, mask, chunk=16, block_l=16 if prefetch else 8, prefetch=prefetch, max_splits=max_splits
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_no_mask_scale_and_out():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (
        torch.randn(4, 32, generator=gen),
        torch.randn(2, 45, 32, generator=gen),
        torch.randn(2, 45, 8, generator=gen),
    )
    q, k, v = q.to(DEV), k.to(DEV), v.to(DEV)
    out = torch.empty(4, 8, device=DEV)
    got = decode_attention(q, k, v, None, scale=0.3, out=out, chunk=16)
    assert got is out
    torch.testing.assert_close(got, decode_attention_ref(q, k, v, None, scale=0.3), rtol=1e-4, atol=1e-5)


def test_strided_views():
    """A [B=1, H, L, D] cache's head views and a transposed query, as transformers' attention passes them."""
    gen = torch.Generator().manual_seed(9)
    cache_k = torch.randn(1, 2, 64, 16, generator=gen).to(DEV)
    cache_v = torch.randn(1, 2, 64, 16, generator=gen).to(DEV)
    q = torch.randn(1, 1, 4, 16, generator=gen).to(DEV).transpose(1, 2)  # [B, H, 1, D], non-contiguous
    mask = torch.arange(64, device=DEV) < 40
    got = decode_attention(q[0, :, 0], cache_k[0], cache_v[0], mask, chunk=16)
    torch.testing.assert_close(
        got, decode_attention_ref(q[0, :, 0], cache_k[0], cache_v[0], mask), rtol=1e-4, atol=1e-5
    )


def test_launcher_checks():
    q, k, v = torch.randn(4, 8, device=DEV), torch.randn(3, 10, 8, device=DEV), torch.randn(3, 10, 8, device=DEV)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(q, k, v)
    k2, v2 = k[:2], v[:2]
    with pytest.raises(ValueError, match="mask"):
        decode_attention(q, k2, v2, torch.ones(9, dtype=torch.bool, device=DEV))
    with pytest.raises(ValueError, match="dtype"):
        decode_attention(q, k2.double(), v2)
    with pytest.raises(ValueError, match="out"):
        decode_attention(q, k2, v2, out=torch.empty(4, 7, device=DEV))
    with pytest.raises(ValueError, match="max_splits"):
        decode_attention(q, k2, v2, max_splits=0)
    with pytest.raises(ValueError, match="prefetch"):
        decode_attention(q, k2, v2, chunk=32, block_l=16, prefetch=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_output_gate(dtype):
    """gate=: out · sigmoid(gate) in the combine kernel, as Qwen3.5's attention does after the core (bf16: equal to
    the torch ops on bf16 tensors but for rare one-step differences of the core's own rounding)."""
    gen = torch.Generator().manual_seed(11)
    Hq, Hkv, L, D = 16, 2, 70, 32
    q = torch.randn(Hq, D, generator=gen).to(DEV, dtype)
    k, v = (torch.randn(Hkv, L, D, generator=gen).to(DEV, dtype) for _ in range(2))
    mask = torch.arange(L, device=DEV) < 53
    gate = (torch.randn(Hq * 2, D, generator=gen) * 2).to(DEV, dtype)[::2]  # a strided row view, as de-interleaved
    got = decode_attention(q, k, v, mask, gate=gate, chunk=16)
    want = decode_attention(q, k, v, mask, chunk=16) * torch.sigmoid(gate)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=0, atol=0)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(
        got,
        decode_attention_ref(q, k, v, mask, gate=gate),
        **(tol if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)),
    )
    with pytest.raises(ValueError, match="gate"):
        decode_attention(q, k, v, mask, gate=gate[:, :8])


# (Hq, Hkv, L, D, valid keys, window): a window shorter than the tokens so far; longer (no effect); GPT-OSS's head
# dim and group of 8 on a full cache of 130 rows with a window of 40 (the interpreter's time limits the heads)
SINK_SHAPES = [(4, 2, 37, 24, 30, 5), (3, 3, 20, 16, 20, 40), (8, 1, 130, 64, 100, 40)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SINK_SHAPES, ids=lambda s: "Hq{}Hkv{}L{}D{}n{}w{}".format(*s))
def test_sinks_and_window(shape, dtype):
    """Learned sinks in the denominator and a sliding window, with and without a mask, on both tile paths; keys
    outside the window or the mask are never read (NaN there)."""
    Hq, Hkv, L, D, n, win = shape
    c = 16 if L < 100 else 32
    gen = torch.Generator().manual_seed(Hq + L)
    q = torch.randn(Hq, D, generator=gen).to(DEV, dtype)
    k = torch.randn(Hkv, L, D, generator=gen).to(DEV, dtype)
    v = torch.randn(Hkv, L, D, generator=gen).to(DEV, dtype)
    sinks = (torch.randn(Hq, generator=gen) * 2).to(DEV)
    for mask in (torch.arange(L, device=DEV) < n, None):
        want = decode_attention_ref(q, k, v, mask, sinks=sinks, window=win)
        kept = (torch.arange(L, device=DEV) < (n if mask is not None else L)) & (
            torch.arange(L, device=DEV) > (n if mask is not None else L) - 1 - win
        )
        kn, vn = k.clone(), v.clone()
        kn[:, ~kept], vn[:, ~kept] = float("nan"), float("nan")
        for prefetch in (False, True):
            got = decode_attention(
                q, kn, vn, mask, sinks=sinks, window=win, chunk=c, block_l=c if prefetch else 8, prefetch=prefetch
            )
            assert torch.isfinite(got.float()).all()
            torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("win", [None, 3], ids=["full", "window3"])
def test_reference_is_transformers_eager_with_sinks(win):
    """The reference with sinks (and a window) equals GPT-OSS's own eager_attention_forward (s_aux) with
    transformers' additive mask, fp32; the window as transformers' sliding mask for one query at position n - 1."""
    from torch import nn
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    Hq, Hkv, L, D, n = 6, 2, 12, 16, 9
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(*s, generator=gen) for s in ((Hq, D), (Hkv, L, D), (Hkv, L, D)))
    module = nn.Module()
    module.num_key_value_groups, module.sinks = Hq // Hkv, nn.Parameter(torch.randn(Hq, generator=gen))
    idx = torch.arange(L)
    keep = (idx < n) & (idx > n - 1 - win if win else True)
    additive = torch.zeros(1, 1, 1, L).masked_fill(~keep, torch.finfo(torch.float32).min)
    want, _ = eager_attention_forward(module, q[None, :, None], k[None], v[None], additive, scaling=D**-0.5)
    got = decode_attention_ref(q, k, v, idx < n, sinks=module.sinks.detach(), window=win)
    torch.testing.assert_close(got, want[0, 0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="sinks"):
        decode_attention(q, k, v, sinks=torch.zeros(Hq + 1))
    with pytest.raises(ValueError, match="window"):
        decode_attention(q, k, v, window=0)
