"""Tests of kernels/department_experts.py: DeaMoE's department-grouped sparse decode vs its torch reference.

Runs on CPU under TRITON_INTERPRET=1. Shape legend: T tokens, H hidden, h department width, D departments, n experts
per department, k experts per token.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from localmoe.experts.departments import step_slots  # noqa: E402
from localmoe.kernels.department_experts import department_experts, department_experts_ref  # noqa: E402
from localmoe.kernels.residual_publish import residual_publish_ref  # noqa: E402
from localmoe.kernels.workspace import zeroed_int32  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(T, H, h, D, n, k, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed + T + H + h)
    x = torch.randn(T, H, generator=gen).to(dtype).to(DEV)
    wg, wu, wd = [(torch.randn(D, h, H, generator=gen) / H**0.5).to(dtype).to(DEV) for _ in range(3)]
    private = (torch.eye(h) + torch.randn(D, n, h, h, generator=gen) / h**0.5).to(dtype).to(DEV)
    ids = torch.stack([torch.randperm(D * n, generator=gen)[:k] for _ in range(T)]).to(DEV)
    rw = torch.softmax(torch.randn(T, k, generator=gen), -1).to(DEV)
    dept, w = step_slots(ids, rw, n, min(D, T * k))
    return x, wg, wu, wd, private, dept, w


@pytest.mark.parametrize(
    "shape",
    [(1, 72, 40, 5, 3, 3), (4, 64, 24, 4, 3, 2), (1, 256, 120, 6, 5, 4)],
    ids=lambda s: "T{}_H{}_h{}_D{}_n{}_k{}".format(*s),
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tau", [0.0, 0.1], ids=["tau0", "tau0.1"])
@pytest.mark.parametrize("one", [False, True], ids=["two-launches", "one-launch"])
def test_department_experts_matches_reference(shape, dtype, tau, one):
    T, H, h, D, n, k = shape
    x, wg, wu, wd, private, dept, w = _case(T, H, h, D, n, k, dtype)
    taus = torch.full((D,), tau, device=DEV)
    kept = torch.zeros((), dtype=torch.int64, device=DEV)
    seen = torch.full((), 5, dtype=torch.int64, device=DEV)
    out = torch.full((T, H), float("nan"), device=DEV)
    y = department_experts(
        x, wg, wu, wd, private, dept, w, taus, out=out, kept_total=kept, seen_total=seen, ONE_LAUNCH=one
    )
    ref, kept_ref = department_experts_ref(x, wg, wu, wd, private, dept, w, taus)
    assert y is out and not torch.isnan(y).any()
    assert float((y.double() - ref.double()).norm() / ref.double().norm()) < 1e-5
    assert int(kept) == int(kept_ref)
    pairs = int((w.abs().sum(-1) > 0).sum())  # (token, department) pairs of the step
    assert int(seen) == 5 + pairs * h  # added to what was there
    assert (int(kept) == pairs * h) if tau == 0 else (0 < int(kept) < pairs * h)


@pytest.mark.parametrize("T", [1, 4])
def test_accumulate_adds_into_out(T):
    """accumulate=True: the experts are added to what out held (the shared expert's output from moe_front), which
    the launch does not zero; with no department in the step out is left as it was."""
    H, h, D, n, k = 72, 40, 5, 3, 3
    x, wg, wu, wd, private, dept, w = _case(T, H, h, D, n, k, torch.float32, seed=3)
    taus = torch.full((D,), 0.1, device=DEV)
    held = torch.randn(T, H, generator=torch.Generator().manual_seed(9)).to(DEV)
    out = held.clone()
    y = department_experts(x, wg, wu, wd, private, dept, w, taus, out=out, accumulate=True)
    ref, _ = department_experts_ref(x, wg, wu, wd, private, dept, w, taus)
    assert y is out
    torch.testing.assert_close(y, held + ref, rtol=1e-5, atol=1e-5)
    empty = torch.full((0,), -1, dtype=torch.int32, device=DEV)
    out = held.clone()
    department_experts(x, wg, wu, wd, private, empty, w[:0], taus, out=out, accumulate=True)
    assert torch.equal(out, held)
    with pytest.raises(ValueError, match="accumulate"):
        department_experts(x, wg, wu, wd, private, dept, w, taus, accumulate=True)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("one", [False, True], ids=["two-launches", "one-launch"])
def test_residual_tail_publishes_and_leaves_workspaces_zeroed(T, dtype, one):
    """residual= (a fused decoder layer's tail): residual + (row + experts) in residual's dtype, rounded once, the row
    zeroed, as residual_publish does; the launch leaves its z workspace and ticket zeroed for the next one."""
    H, h, D, n, k = 72, 40, 5, 3, 3
    x, wg, wu, wd, private, dept, w = _case(T, H, h, D, n, k, dtype, seed=5)
    taus = torch.full((D,), 0.1, device=DEV)
    gen = torch.Generator().manual_seed(11)
    held = torch.randn(T, H, generator=gen).to(DEV)
    residual = torch.randn(T, H, generator=gen).to(dtype).to(DEV)
    ref, _ = department_experts_ref(x, wg, wu, wd, private, dept, w, taus)
    expect = residual_publish_ref(held + ref, residual)
    for _ in range(2):  # the second launch starts from what the first left behind
        row = held.clone()
        y = department_experts(
            x, wg, wu, wd, private, dept, w, taus, out=row, accumulate=True, residual=residual, ONE_LAUNCH=one
        )
        assert y.dtype == dtype and tuple(y.shape) == (T, H)
        torch.testing.assert_close(y.float(), expect.float(), rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 2e-2)
        assert not row.any()
        assert not zeroed_int32("department_experts", DEV, 0).any()
    with pytest.raises(ValueError, match="accumulate"):
        department_experts(x, wg, wu, wd, private, dept, w, taus, residual=residual)


def test_padded_slots_and_repeated_departments():
    """Two experts of one department: one slot, the other slots padded with -1 (a fixed grid for CUDA graphs)."""
    T, H, h, D, n = 1, 32, 16, 4, 3
    x, wg, wu, wd, private, _, _ = _case(T, H, h, D, n, 2, torch.float32)
    ids = torch.tensor([[7, 6]], device=DEV)  # both in department 2
    dept, w = step_slots(ids, torch.tensor([[0.7, 0.3]], device=DEV), n, 2)
    assert dept.tolist() == [2, -1] and w[0, 0].tolist() == pytest.approx([0.3, 0.7, 0.0])
    taus = torch.zeros(D, device=DEV)
    y = department_experts(x, wg, wu, wd, private, dept, w, taus)
    u = torch.nn.functional.silu(wg[2] @ x[0]) * (wu[2] @ x[0])
    z = 0.3 * (u @ private[2, 0]) + 0.7 * (u @ private[2, 1])
    assert torch.allclose(y[0], z @ wd[2], rtol=1e-5, atol=1e-5)


def test_department_experts_rejects_bad_inputs():
    x, wg, wu, wd, private, dept, w = _case(1, 32, 16, 4, 3, 2, torch.float32)
    taus = torch.zeros(4, device=DEV)
    with pytest.raises(ValueError, match="private"):
        department_experts(x, wg, wu, wd, private[:, :, :-1], dept, w, taus)
    with pytest.raises(ValueError, match="dept"):
        department_experts(x, wg, wu, wd, private, dept.long(), w, taus)
    with pytest.raises(ValueError, match="weights"):
        department_experts(x, wg, wu, wd, private, dept, w[:, :, :-1], taus)
    with pytest.raises(ValueError, match="tau"):
        department_experts(x, wg, wu, wd, private, dept, w, taus[:-1])
    with pytest.raises(ValueError, match="w_up"):
        department_experts(x, wg, wu[:, :-1], wd, private, dept, w, taus)


@pytest.mark.parametrize(
    "T,tau", [(1, 0.0), (1, 0.1), (3, 0.1)], ids=["tau0-1", "tau0.1-1", "tau0.1-3"]
)  # (three tokens at threshold 0 added nothing the others do not cover: 8 s of interpreter)
def test_row_splits_equal_one_program_per_column_block(T, tau):
    """Row splits (several programs adding into z and y atomically, the last split partial) give the reference's y."""
    x, wg, wu, wd, private, dept, w = _case(T, 96, 40, 5, 3, 3, torch.float32)
    taus = torch.full((5,), tau, device=DEV)
    ref, _ = department_experts_ref(x, wg, wu, wd, private, dept, w, taus)
    for split_rows, block_i in ((16, 8), (24, 8), (40, 16)):
        y = department_experts(x, wg, wu, wd, private, dept, w, taus, SPLIT_ROWS=split_rows, BLOCK_I=block_i)
        assert float((y.double() - ref.double()).norm() / ref.double().norm()) < 1e-5


def _pooled(wg, wu, wd, private, resident_depts, resident_experts, n):
    """Pools holding the listed departments / experts (one spare slot of garbage each), and their maps."""
    D, h, H = wg.shape
    dmap = torch.full((D,), -1, dtype=torch.int32, device=DEV)
    pmap = torch.full((D * n,), -1, dtype=torch.int32, device=DEV)
    pools = [torch.full((len(resident_depts) + 1, h, H), 7.0, dtype=wg.dtype, device=DEV) for _ in range(3)]
    pp = torch.full((len(resident_experts) + 1, h, h), 7.0, dtype=private.dtype, device=DEV)
    for slot, d in enumerate(resident_depts):
        dmap[d] = slot + 1  # slot 0 is the spare
        for pool, src in zip(pools, (wg, wu, wd)):
            pool[slot + 1] = src[d]
    for slot, e in enumerate(resident_experts):
        pmap[e] = slot + 1
        pp[slot + 1] = private[e // n, e % n]
    return (*pools, pp, dmap, pmap)


@pytest.mark.parametrize("T,tier", [(1, ()), (3, (2,)), (2, (2, 2))], ids=["T1", "T3-up-tier", "T2-up-down-tier"])
@pytest.mark.parametrize("tau", [0.0, 0.1], ids=["tau0", "tau0.1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("one", [False, True], ids=["two-launches", "one-launch"])
def test_direct_reads_pools_and_host(T, tier, tau, dtype, one):
    """Direct offloading: resident units read from their pool slots (their host copies are NaN, so a wrong read
    shows), the others from the host master copies; y equals the reference on the true weights, and the elements
    read from host memory equal the reference's count. `tier` (up_slots[, down_slots]) 2: only the first resident
    department's up (and down) projection sits in its pool (slot 0 is a spare); the others' come from the host."""
    D, n, h, H, k = 5, 3, 40, 96, 3
    x, wg, wu, wd, private, dept, w = _case(T, H, h, D, n, k, dtype)
    taus = torch.full((D,), tau, device=DEV)
    want, kept_ref = department_experts_ref(x, wg, wu, wd, private, dept, w, taus)
    used = [d for d in dept.tolist() if d >= 0]
    resident_depts = used[::2]  # half of the step's departments resident
    chosen = sorted({e for e in range(D * n) if bool((w[:, :, e % n] != 0).any()) and e // n in used})
    resident_experts = chosen[1::2]
    pools = (*_pooled(wg, wu, wd, private, resident_depts, resident_experts, n), *tier)
    hg, hu, hd, hp = (t.clone() for t in (wg, wu, wd, private))
    for i, d in enumerate(resident_depts):
        hg[d] = float("nan")
        if not tier or i == 0:
            hu[d] = float("nan")
        if len(tier) < 2 or i == 0:
            hd[d] = float("nan")
    for e in resident_experts:
        hp[e // n, e % n] = float("nan")
    ref_pools = (*_pooled(wg, wu, wd, private, resident_depts, resident_experts, n), *tier)
    if tier:
        assert len(resident_depts) > 1
        for p in (pools, ref_pools):  # slots past up_slots / down_slots are never read from those pools
            for pool in (p[1], p[2])[: len(tier)]:
                pool[2:] = float("nan")
    hc_ref = torch.zeros((), dtype=torch.int64, device=DEV)
    ref, _ = department_experts_ref(x, hg, hu, hd, hp, dept, w, taus, pools=ref_pools, host_elems=hc_ref)
    hc = torch.zeros((), dtype=torch.int64, device=DEV)
    kept = torch.zeros((), dtype=torch.int64, device=DEV)
    y = department_experts(
        x, hg, hu, hd, hp, dept, w, taus, pools=pools, host_elems=hc, kept_total=kept, ONE_LAUNCH=one
    )
    assert not torch.isnan(y).any() and not torch.isnan(ref).any()
    for got in (y, ref):
        assert float((got.double() - want.double()).norm() / want.double().norm()) < 1e-5
    assert int(kept) == int(kept_ref) and int(hc) == int(hc_ref) > 0


@pytest.mark.parametrize("T,dtype", [(1, torch.bfloat16), (3, torch.float32)], ids=["T1-bf16", "T3-fp32"])
@pytest.mark.parametrize("one", [False, True], ids=["two-launches", "one-launch"])
def test_z_threshold_drops_entries_and_down_rows(T, dtype, one):
    """tau_z near the median |z|: the kernel equals the reference (z entries under it dropped per token), and read
    directly from host memory, the W_down rows no token keeps are not read (fewer host elements than without)."""
    D, n, h, H, k = 5, 3, 40, 96, 3
    x, wg, wu, wd, private, dept, w = _case(T, H, h, D, n, k, dtype)
    taus = torch.zeros(D, device=DEV)
    zs = []
    for s, d in enumerate(dept.tolist()):
        for t in range(T) if d >= 0 else ():
            if bool((w[s, t] != 0).any()):
                u = torch.nn.functional.silu(wg[d].float() @ x[t].float()) * (wu[d].float() @ x[t].float())
                zs.append(sum(w[s, t, j] * (u @ private[d, j].float()) for j in range(n)))
    v = torch.cat(zs).abs().sort().values
    m = v.numel() // 2
    tau_z = torch.full((D,), float(v[m - 1] + v[m]) / 2, device=DEV)  # between two values: no tie to round
    ref, _ = department_experts_ref(x, wg, wu, wd, private, dept, w, taus, tau_z=tau_z)
    full, _ = department_experts_ref(x, wg, wu, wd, private, dept, w, taus)
    y = department_experts(x, wg, wu, wd, private, dept, w, taus, tau_z=tau_z, ONE_LAUNCH=one)
    assert float((y.double() - ref.double()).norm() / ref.double().norm()) < 1e-5
    assert float((full.double() - ref.double()).norm() / full.double().norm()) > 1e-3  # it did drop something
    pools = _pooled(wg, wu, wd, private, [], [], n)  # nothing resident: every row from the host copies
    counts = []
    for tz in (None, tau_z):
        hc, hc_ref = (torch.zeros((), dtype=torch.int64, device=DEV) for _ in range(2))
        department_experts(x, wg, wu, wd, private, dept, w, taus, pools=pools, host_elems=hc, tau_z=tz, ONE_LAUNCH=one)
        department_experts_ref(x, wg, wu, wd, private, dept, w, taus, pools=pools, host_elems=hc_ref, tau_z=tz)
        assert int(hc) == int(hc_ref)
        counts.append(int(hc))
    assert counts[1] < counts[0]
