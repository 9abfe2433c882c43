"""Tests of kernels/slot_sort.py (a piece's slots sorted by expert, one launch) and kernels/token_combine.py (the
expert rows weighted and summed back into their tokens) against their torch references.

slot_sort must equal torch's stable argsort exactly (the grouped GEMMs' row order): odd slot counts (a partial last
block), several blocks, experts no slot routes to (first, last, inside), int32 and int64 ids, E not a power of two and
at Qwen3.5-35B-A3B's 256 with k 8. token_combine: fp32 and bf16 rows, bf16 / fp32 weights and outputs, odd H (a
partial column tile). Runs on CPU under TRITON_INTERPRET=1; never asserts a time. Shape legend: T tokens, k experts
per token, E experts, H hidden.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kernel_cases import DEV  # noqa: E402

from localmoe.kernels.slot_sort import slot_sort, slot_sort_ref  # noqa: E402
from localmoe.kernels.token_combine import token_combine, token_combine_ref  # noqa: E402


def routing(T, k, E, seed, skip=()):
    """[T, k] distinct experts per token, none of `skip`."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(E) if e not in skip])
    return torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:k]] for _ in range(T)])


@pytest.mark.parametrize(
    "T,k,E,block,chunk,skip",
    [
        (1, 1, 3, 16, 16, ()),  # one slot
        (37, 3, 11, 16, 32, (0, 5, 10)),  # 7 blocks, the last partial, blocks starting mid-chunk; empty experts
        (64, 8, 256, 128, 1024, ()),  # Qwen3.5-35B-A3B's routing width, the default tiles (one partial chunk)
        (50, 4, 160, 32, 64, (159,)),  # DeepSeek-V2-Lite's E (not a power of two)
    ],
    ids=["one", "odd", "qwen3.5", "E160"],
)
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
def test_slot_sort_equals_stable_argsort(T, k, E, block, chunk, skip, id_dtype):
    idx = routing(T, k, E, seed=T + E, skip=skip).to(DEV, id_dtype)
    got = slot_sort(idx, E, block=block, chunk=chunk)
    want = slot_sort_ref(idx, E)
    for name, g, w in zip(("order", "tok", "pos", "ends"), got, want):
        assert g.dtype == w.dtype and torch.equal(g, w), name


def test_slot_sort_repeated_experts_keep_slot_order():
    """Many slots of one expert across blocks keep their slot order (stable), as argsort(stable=True)."""
    idx = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 0]] * 9, device=DEV)
    order, tok, pos, ends = slot_sort(idx, 4, block=16, chunk=32)
    torch.testing.assert_close(order, torch.argsort(idx.reshape(-1), stable=True), rtol=0, atol=0)
    assert ends.tolist() == [27, 36, 72, 72]


def test_slot_sort_refuses():
    with pytest.raises(ValueError, match="int32/int64"):
        slot_sort(torch.zeros(4, 2, device=DEV), 4)
    with pytest.raises(ValueError, match="num_experts"):
        slot_sort(torch.zeros(4, 2, dtype=torch.long, device=DEV), 0)
    with pytest.raises(ValueError, match="block"):
        slot_sort(torch.zeros(4, 2, dtype=torch.long, device=DEV), 4, block=48)
    with pytest.raises(ValueError, match="chunk"):
        slot_sort(torch.zeros(4, 2, dtype=torch.long, device=DEV), 4, block=64, chunk=32)
    order, tok, pos, ends = slot_sort(torch.zeros(0, 2, dtype=torch.long, device=DEV), 5)
    assert order.numel() == 0 and ends.tolist() == [0] * 5


@pytest.mark.parametrize("T,k,H,block_h", [(5, 3, 33, 16), (9, 8, 2048, 1024)], ids=["odd", "qwen3.5"])
@pytest.mark.parametrize(
    "y_dtype,w_dtype,out_dtype",
    [
        (torch.float32, torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32, torch.bfloat16),  # Mixtral / DeepSeek-V2's fp32 weights
    ],
    ids=["fp32", "bf16", "bf16-w32"],
)
def test_token_combine_matches_reference(T, k, H, block_h, y_dtype, w_dtype, out_dtype):
    gen = torch.Generator().manual_seed(H + k)
    E = 2 * k + 1
    idx = routing(T, k, E, seed=3).to(DEV)
    _, _, pos, _ = slot_sort_ref(idx, E)
    y = torch.randn(T * k, H, generator=gen).to(DEV, y_dtype)
    w = torch.softmax(torch.randn(T, k, generator=gen), -1).to(DEV, w_dtype)
    got = token_combine(y, pos, w, out_dtype, block_h=block_h)
    want = token_combine_ref(y, pos, w, out_dtype)
    assert got.dtype == out_dtype and got.shape == (T, H)
    if y_dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:  # the same roundings; the k-term fp32 sums may differ in order by an ulp, rarely visible after rounding
        assert (got.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()
        assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_token_combine_adds_the_shared_expert(dtype, gated):
    """`shared` (+ sigmoid(`shared_gate`)): the block's shared expert term on the rounded routed sum, as Qwen3.5's
    block adds it; the gate logit read through a [T, 1] column view of a wider GEMM output."""
    T, k, H, E = 7, 4, 40, 9
    gen = torch.Generator().manual_seed(21)
    _, _, pos, _ = slot_sort_ref(routing(T, k, E, seed=4).to(DEV), E)
    y = torch.randn(T * k, H, generator=gen).to(DEV, dtype)
    w = torch.softmax(torch.randn(T, k, generator=gen), -1).to(DEV, dtype)
    s = torch.randn(T, H, generator=gen).to(DEV, dtype)
    g = torch.randn(T, 3, generator=gen).to(DEV, dtype)[:, 1:2] if gated else None
    got = token_combine(y, pos, w, shared=s, shared_gate=g, block_h=16)
    want = token_combine_ref(y, pos, w, dtype, shared=s, shared_gate=g)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert (got.float() - want.float()).abs().max() <= 2**-7 * want.float().abs().max()
    with pytest.raises(ValueError, match="shared must be"):
        token_combine(y, pos, w, shared=s[:, :8])
    with pytest.raises(ValueError, match="shared_gate"):
        token_combine(y, pos, w, shared_gate=torch.zeros(T, dtype=dtype, device=DEV))


def test_token_combine_refuses():
    y = torch.zeros(6, 4, device=DEV)
    pos = torch.arange(6, device=DEV)
    with pytest.raises(ValueError, match="rows"):
        token_combine(y, pos, torch.zeros(2, 2, device=DEV))
    with pytest.raises(TypeError, match="int64"):
        token_combine(y, pos.int(), torch.zeros(3, 2, device=DEV))
    with pytest.raises(ValueError, match="power of two"):
        token_combine(y, pos, torch.zeros(3, 2, device=DEV), block_h=48)
