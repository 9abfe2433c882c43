"""Tests of kernels/department_slots.py: a DeaMoE step's departments in fixed slots, one launch vs its reference.

Runs on CPU under TRITON_INTERPRET=1. Shape legend: T tokens, k experts per token, D departments, n experts per
department, S slots.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from localmoe.experts.departments import group_limited_topk, step_slots  # noqa: E402
from localmoe.kernels.department_slots import department_slots, department_slots_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    "T, k, D, n, g",
    [(1, 4, 6, 5, 2), (1, 8, 48, 20, 4), (4, 8, 48, 20, 4), (3, 3, 5, 3, 5), (8, 8, 12, 16, 4), (2, 1, 7, 2, 7)],
    ids=lambda v: str(v),
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_equals_reference(T, k, D, n, g, dtype):
    gen = torch.Generator().manual_seed(T * 100 + k)
    probs = torch.softmax(torch.randn(T, D * n, generator=gen), -1)
    idx, w = group_limited_topk(probs, n, k, g)
    idx, w = idx.to(DEV), w.to(dtype).to(DEV)
    S = min(D, T * min(k, g))
    dept, ws = department_slots(idx, w, n, S)
    want_dept, want_w = department_slots_ref(idx, w, n, S)
    assert dept.dtype == torch.int32 and ws.dtype == torch.float32 and ws.shape == (S, T, n)
    assert torch.equal(dept, want_dept) and torch.equal(ws, want_w)
    used = dept[dept >= 0]
    assert torch.equal(used, used.sort().values) and len(set(used.tolist())) == len(used)  # ascending, distinct
    assert set(used.tolist()) == set((idx // n).reshape(-1).tolist())


def test_repeats_and_padding():
    """Two experts of one department take one slot; unused slots are -1 with zero weights; idx int32 works too."""
    idx = torch.tensor([[7, 6], [1, 8]], dtype=torch.int32, device=DEV)  # n=3: departments 2, 2 | 0, 2
    w = torch.tensor([[0.7, 0.3], [0.6, 0.4]], device=DEV)
    dept, ws = department_slots(idx, w, 3, 4)
    assert dept.tolist() == [0, 2, -1, -1]
    assert ws[1, 0].tolist() == pytest.approx([0.3, 0.7, 0.0]) and ws[0, 1].tolist() == pytest.approx([0.0, 0.6, 0.0])
    assert ws[1, 1].tolist() == pytest.approx([0.0, 0.0, 0.4]) and not ws[2:].any()
    d2, w2 = step_slots(idx.long(), w, 3, 4, kernel=False)
    assert torch.equal(dept, d2) and torch.equal(ws, w2)


def test_bad_inputs():
    idx, w = torch.zeros(1, 2, dtype=torch.long, device=DEV), torch.ones(1, 2, device=DEV)
    with pytest.raises(ValueError):
        department_slots(idx.float(), w, 3, 2)
    with pytest.raises(ValueError):
        department_slots(idx, w[:, :1], 3, 2)
    with pytest.raises(ValueError):
        department_slots(torch.zeros(9, 8, dtype=torch.long, device=DEV), torch.ones(9, 8, device=DEV), 3, 2)
    with pytest.raises(ValueError):
        department_slots(idx, w, 3, 0)


@pytest.mark.parametrize("T", [1, 3])
def test_hit_and_miss_counts_against_the_maps(T):
    """With maps, the kernel adds department hits / misses (distinct departments) and private hits / misses
    ((token, expert) pairs) into counts, as the reference does."""
    D, n, k, g = 12, 4, 4, 2
    gen = torch.Generator().manual_seed(T)
    idx, w = group_limited_topk(torch.softmax(torch.randn(T, D * n, generator=gen), -1), n, k, g)
    idx, w = idx.to(DEV), w.to(DEV)
    dmap = torch.where(torch.arange(D) % 2 == 0, torch.arange(D), -1).to(torch.int32).to(DEV)
    pmap = torch.where(torch.arange(D * n) % 3 == 0, torch.arange(D * n), -1).to(torch.int32).to(DEV)
    got = torch.full((4,), 5, dtype=torch.int64, device=DEV)
    want = got.clone()
    S = min(D, T * g)
    a = department_slots(idx, w, n, S, maps=(dmap, pmap, got))
    b = department_slots_ref(idx, w, n, S, maps=(dmap, pmap, want))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and torch.equal(got, want)
    used = set((idx // n).reshape(-1).tolist())
    assert int(got[0] + got[1]) - 10 == len(used) and int(got[2] + got[3]) - 10 == T * k
