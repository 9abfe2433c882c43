"""Tests of kernels/gate_predictor.py (stage 1, `department_basis`) and of kernels/sparse_fused.py's `predictor=`
(stages 2 + 3): each against its torch reference, the references against the app-level one
(localmoe/experts/predicted.py's `predicted_reference`), and every sparse_fused mode with a predictor: default and
accumulate, the decoder-layer tail, offload addressing with host masters and a gate table, copy mode (expert ids are
cache slots), int4; thresholds differ from neuron to neuron (fp16 [E, I]); tau' = 0 is the launch without a
predictor.

Runs on CPU under TRITON_INTERPRET=1 (set below before triton is imported when no GPU is present); never asserts a
time. Shape legend: T = tokens, k = experts per token, E = experts, N = departments, r = predictor rank, I = expert
width, H = hidden, S = pool slots, G = int4 group size.
"""

import os
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kernel_cases import (  # noqa: E402
    DEV,
    accumulates_twice,
    expert_inputs,
    gate_abs,
    int4_inputs,
    int4_offload_layout,
    offload_layout,
    rel_err,
    tau_for,
)

from localmoe.experts.predicted import LayerPredictor, predicted_reference  # noqa: E402
from localmoe.kernels.gate_predictor import (  # noqa: E402
    GatePredictor,
    candidates_ref,
    department_basis,
    department_basis_ref,
    quantize_rows,
)
from localmoe.kernels.sparse_fused import sparse_fused, sparse_fused_ref  # noqa: E402
from localmoe.kernels.token_tail import SharedExpert, shared_expert_term  # noqa: E402


def predictor_inputs(H, I, E, N, r, seed, dept_of=None):
    """(B [N,r,H] int8, its scales [N,r], C [E,I,r] int8, its scales [E,I], dept_of [E] int64): random maps scaled so
    that C_e B_d x is O(1), stored as the predictor stores them (quantize_rows)."""
    gen = torch.Generator().manual_seed(seed)
    B, Bs = quantize_rows(torch.randn(N, r, H, generator=gen) / H**0.5)
    C, Cs = quantize_rows(torch.randn(E, I, r, generator=gen) * 2.0 / r**0.5)
    if dept_of is None:
        dept_of = torch.randint(0, N, (E,), generator=gen)
    return B.to(DEV), Bs.to(DEV), C.to(DEV), Cs.to(DEV), torch.as_tensor(dept_of, dtype=torch.int64).to(DEV)


def predicted_abs(x, B, Bs, C, Cs, dept_of, ids):
    """|silu(C_e . z_d(e))| [T, k, I] in fp32 (the reference's stage 2 before the threshold)."""
    z = department_basis_ref(x, B, Bs, dept_of, ids)
    d = dept_of[ids.long()]
    zt = z.gather(1, d[:, :, None].expand(-1, -1, z.shape[2]))
    e = ids.long()
    return torch.nn.functional.silu(torch.einsum("tkir,tkr->tki", C[e].float(), zt) * Cs[e]).abs()


def tau_prime_for(p_abs, share):
    """tau' between two adjacent predicted values so that about `share` of the routed neurons are candidates (a
    midpoint: rounding cannot flip a neuron)."""
    a = torch.sort(p_abs.flatten().cpu()).values
    m = max(1, min(a.numel() - 1, int((1.0 - share) * a.numel())))
    return float(a[m - 1] + a[m]) / 2


def row_taus(p_abs, ids, E, I, share, seed):
    """fp16 [E, I] thresholds, each neuron's its own (0.5-1.5x a tau' that makes about `share` of the routed neurons
    candidates), none within 0.1% of a predicted value it is compared with (the kernel's and the reference's sums
    may differ in their last bits)."""
    base = tau_prime_for(p_abs, share)
    t = (base * (0.5 + torch.rand(E, I, generator=torch.Generator().manual_seed(seed)))).half()
    e, p = ids.long().cpu(), p_abs.cpu()
    for _ in range(20):
        near = ((p - t[e].float()).abs() < 1e-3 * base).nonzero()  # [n, 3]: token, slot, neuron
        if not len(near):
            return t.to(DEV)
        t[e[near[:, 0], near[:, 1]], near[:, 2]] *= 1.01
    raise AssertionError("no thresholds clear of the predicted values")


def every(value, E, I):
    """One threshold for every neuron, fp16 [E, I]."""
    return torch.full((E, I), value, dtype=torch.float16, device=DEV)


def case(T, H, I, E, k, N, r, dtype, seed, share=0.5, sparsity=0.5):
    """A routed-expert problem with a predictor: (x, w_gate, w_up, w_down_t, ids, rw, tau, B, B_scale, C, C_scale,
    dept_of, tau_rows [E, I], candidates [T,k,I] of the reference)."""
    x, wg, wu, wd, ids, rw = expert_inputs(T, H, I, E, k, dtype, seed=seed)
    B, Bs, C, Cs, dept = predictor_inputs(H, I, E, N, r, seed + 1)
    tau = tau_for(gate_abs(x, wg, ids), ids, sparsity, E)
    tp = row_taus(predicted_abs(x, B, Bs, C, Cs, dept, ids), ids, E, I, share, seed + 2)
    return x, wg, wu, wd, ids, rw, tau, B, Bs, C, Cs, dept, tp, candidates_ref(x, B, Bs, C, Cs, dept, ids, tp)


# ----------------------------------------------------------------------------------------------------------
# stage 1: department_basis
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_department_basis_matches_reference(dtype):
    """H 72, r 12, k 3, T 2: token 0's three experts share one department (computed once, by slot 0), token 1's
    touch two of them twice; rows of untouched departments are left as they were (NaN here)."""
    T, H, E, k, N, r = 2, 72, 7, 3, 4, 12
    x, *_ = expert_inputs(T, H, 8, E, k, dtype, seed=3)
    B, Bs, _, _, dept = predictor_inputs(H, 8, E, N, r, seed=4, dept_of=[0, 1, 0, 2, 1, 0, 2])
    ids = torch.tensor([[0, 2, 5], [1, 3, 4]], dtype=torch.int32, device=DEV)
    want = department_basis_ref(x, B, Bs, dept, ids)
    out = torch.full((T, N, r), float("nan"), device=DEV)
    z = department_basis(x, B, Bs, dept, ids, out)
    assert z is out
    touched = torch.tensor([[1, 0, 0, 0], [0, 1, 1, 0]], dtype=torch.bool, device=DEV)
    assert torch.isnan(z[~touched]).all()  # not written
    assert rel_err(z[touched], want[touched]) < 1e-6
    assert torch.count_nonzero(want[~touched]) == 0
    # int64 ids and dept_of int32, a BLOCK_R of one row
    z1 = department_basis(x, B, Bs, dept.to(torch.int32), ids.long(), BLOCK_R=1, num_warps=1)
    assert rel_err(z1[touched], want[touched]) < 1e-6


def test_department_basis_chunked_h():
    """A tile wider than 64 elements a thread (BLOCK_R 32 at 1 warp, H 72 -> 128): BLOCK_H-wide chunks along H;
    r 40 is not a power of two (a partial row block)."""
    T, H, E, k, N, r = 3, 72, 6, 2, 3, 40
    x, *_ = expert_inputs(T, H, 8, E, k, torch.float32, seed=5)
    B, Bs, _, _, dept = predictor_inputs(H, 8, E, N, r, seed=6)
    ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:k] for t in range(T)]).to(DEV)
    want = department_basis_ref(x, B, Bs, dept, ids)
    z = department_basis(x, B, Bs, dept, ids, torch.zeros(T, N, r, device=DEV), BLOCK_R=32, num_warps=1)
    assert rel_err(z, want) < 1e-6


def test_department_basis_real_shape():
    """Qwen3.5-35B-A3B's router (H 2048, E 256, k 8) with N 8 departments of rank 64, one token, fp32."""
    T, H, E, k, N, r = 1, 2048, 256, 8, 8, 64
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(T, H, generator=gen).to(DEV)
    B, Bs = (t.to(DEV) for t in quantize_rows(torch.randn(N, r, H, generator=gen) / H**0.5))
    dept = (torch.arange(E) % N).to(DEV)
    ids = torch.randperm(E, generator=gen)[:k][None].to(DEV)
    want = department_basis_ref(x, B, Bs, dept, ids)
    z = department_basis(x, B, Bs, dept, ids, torch.zeros(T, N, r, device=DEV))
    assert rel_err(z, want) < 1e-6


def test_department_basis_validation():
    T, H, E, k, N, r = 1, 72, 5, 3, 2, 8
    x, *_ = expert_inputs(T, H, 8, E, k, torch.float32, seed=1)
    B, Bs, _, _, dept = predictor_inputs(H, 8, E, N, r, seed=1)
    ids = torch.tensor([[0, 1, 2]], device=DEV)
    bad = [
        dict(x=x[0]),
        dict(x=x.to(torch.int32)),
        dict(B=B[:, :, :-1]),  # H is not x's
        dict(B=B.transpose(1, 2).contiguous().transpose(1, 2)),  # rows not contiguous
        dict(B=B.float()),  # the maps are int8
        dict(Bs=Bs[:, :-1]),
        dict(Bs=Bs.double()),
        dict(Bs=Bs.t().contiguous().t()),
        dict(dept=dept.float()),
        dict(ids=ids[0]),
        dict(ids=ids.float()),
        dict(out=torch.zeros(T, N, r, dtype=torch.bfloat16, device=DEV)),
        dict(out=torch.zeros(T, N + 1, r, device=DEV)),
    ]
    for c in bad:
        kw = dict(x=x, B=B, Bs=Bs, dept=dept, ids=ids, out=None) | c
        with pytest.raises(ValueError):
            department_basis(kw["x"], kw["B"], kw["Bs"], kw["dept"], kw["ids"], kw["out"])


# ----------------------------------------------------------------------------------------------------------
# the references against the app-level one
# ----------------------------------------------------------------------------------------------------------
def test_references_agree_with_predicted_reference():
    """sparse_fused_ref with candidates_ref's mask is localmoe.experts.predicted's predicted_reference (fp32)."""
    T, H, I, E, k, N, r = 3, 72, 40, 7, 3, 3, 12
    x, wg, wu, wd, ids, rw, tau, B, Bs, C, Cs, dept, tp, cand = case(T, H, I, E, k, N, r, torch.float32, seed=9)
    assert 0.3 < float(cand.float().mean()) < 0.7
    y, c = sparse_fused_ref(x, wg, wu, wd, ids, rw, tau, cand)
    pred = LayerPredictor(B, Bs, C, Cs, dept, tp)
    w = types.SimpleNamespace(w_gate=wg, w_up=wu, w_down_t=wd)
    y_app, kept = predicted_reference(x, w, ids, rw, tau, torch.nn.functional.silu, pred)
    assert int(kept) == int(c.sum()) and rel_err(y, y_app) < 1e-5
    assert pred.counts["candidates"] == int(cand.sum())
    y_all, _ = sparse_fused_ref(x, wg, wu, wd, ids, rw, tau)
    assert rel_err(y, y_all) > 1e-3  # the predictor dropped kept neurons: the comparison sees the mask


# ----------------------------------------------------------------------------------------------------------
# stages 2 + 3: sparse_fused(predictor=)
# ----------------------------------------------------------------------------------------------------------
# (T, H, I, E, k, N, r, BLOCK_I): r 12 padded to 16, r 16; the last is Qwen3.5-35B-A3B's expert (E cut to 16)
PRED_SHAPES = [(1, 72, 40, 7, 3, 3, 12, 8), (3, 72, 40, 7, 3, 2, 16, 16), (1, 2048, 512, 16, 8, 8, 64, 64)]
PRED_CASES = [
    (s, dt) for s in PRED_SHAPES for dt in (torch.float32, torch.bfloat16) if s[1] < 100 or dt != torch.bfloat16
]


@pytest.mark.parametrize(
    "shape,dtype",
    PRED_CASES,
    ids=[
        f"{'fp32' if dt == torch.float32 else 'bf16'}-T{s[0]}_H{s[1]}_I{s[2]}_N{s[5]}_r{s[6]}" for s, dt in PRED_CASES
    ],
)
def test_predictor_matches_reference(shape, dtype):
    """Default mode (poisoned out, self-cleaning workspace) at ~50 % candidates and 50 % sparsity: y, counts and
    kept_total / read_rows (the candidates' gate rows + 2 per kept neuron); then nothing a candidate."""
    T, H, I, E, k, N, r, bi = shape
    x, wg, wu, wd, ids, rw, tau, B, Bs, C, Cs, dept, tp, cand = case(T, H, I, E, k, N, r, dtype, seed=T * 10 + r)
    y_ref, c_ref = sparse_fused_ref(x, wg, wu, wd, ids, rw, tau, cand)
    assert 0 < int(c_ref.sum()) < int(sparse_fused_ref(x, wg, wu, wd, ids, rw, tau)[1].sum())  # some dropped
    z = department_basis(x, B, Bs, dept, ids)
    out = torch.full((T, H), float("nan"), device=DEV)
    cnt = torch.full((T, k), -7, dtype=torch.int32, device=DEV)
    kept = torch.zeros(1, dtype=torch.int64, device=DEV)
    rows = torch.zeros(1, dtype=torch.int64, device=DEV)
    pred = GatePredictor(z, C, Cs, dept, tp)
    y, c = sparse_fused(x, wg, wu, wd, ids, rw, tau, out, count=cnt, kept_total=kept, read_rows=rows, predictor=pred,
                        BLOCK_I=bi)  # fmt: skip
    assert y is out and c is cnt and torch.equal(c, c_ref)
    assert rel_err(y, y_ref) < 1e-5
    assert int(kept) == int(c_ref.sum())
    assert int(rows) == int((cand.sum(-1) + 2 * c_ref).sum())
    none = GatePredictor(z, C, Cs, dept, every(float("inf"), E, I))  # no candidate: every block stops after stage 2
    y, c = sparse_fused(x, wg, wu, wd, ids, rw, tau, out, count=cnt, read_rows=rows, predictor=none, BLOCK_I=bi)
    assert torch.count_nonzero(y) == 0 and torch.count_nonzero(c) == 0
    assert int(rows) == int((cand.sum(-1) + 2 * c_ref).sum())  # nothing read


def test_predictor_accumulate_mode():
    T, H, I, E, k, N, r = 3, 72, 40, 7, 3, 3, 12
    x, wg, wu, wd, ids, rw, tau, B, Bs, C, Cs, dept, tp, cand = case(T, H, I, E, k, N, r, torch.float32, seed=13)
    y_ref, c_ref = sparse_fused_ref(x, wg, wu, wd, ids, rw, tau, cand)
    pred = GatePredictor(department_basis(x, B, Bs, dept, ids), C, Cs, dept, tp)
    accumulates_twice(
        lambda out, cnt: sparse_fused(x, wg, wu, wd, ids, rw, tau, out, count=cnt, accumulate=True, predictor=pred),
        y_ref,
        c_ref,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_predictor_tail(dtype):
    """shared= (dense, no predictor rows) + residual= with the predictor, into a caller workspace left zeroed."""
    T, H, I, E, k, N, r, I_s = 2, 72, 40, 7, 3, 3, 12, 56
    x, wg, wu, wd, ids, rw, tau, B, Bs, C, Cs, dept, tp, cand = case(T, H, I, E, k, N, r, dtype, seed=17)
    gen = torch.Generator().manual_seed(I_s)
    sw = [(torch.randn(I_s, H, generator=gen) * 2.0 / H**0.5).to(DEV, dtype) for _ in range(3)]
    shared = SharedExpert(*sw, weight=torch.rand(T, generator=gen).to(DEV, dtype))
    res = torch.randn(T, H, generator=gen).to(DEV, dtype)
    y_ref, c_ref = sparse_fused_ref(x, wg, wu, wd, ids, rw, tau, cand)
    want = (res.float() + (y_ref + shared_expert_term(x, shared)).to(dtype).float()).to(dtype)
    pred = GatePredictor(department_basis(x, B, Bs, dept, ids), C, Cs, dept, tp)
    ws = torch.zeros(T * H + T * k + T, dtype=torch.int32, device=DEV)
    rows = torch.zeros(1, dtype=torch.int64, device=DEV)
    for launch in (1, 2):
        out = torch.full((T, H), float("nan"), dtype=dtype, device=DEV)
        y, c = sparse_fused(x, wg, wu, wd, ids, rw, tau, out, shared=shared, residual=res, workspace=ws,
                            read_rows=rows, predictor=pred, BLOCK_I=16)  # fmt: skip
        assert torch.equal(c, c_ref)
        assert rel_err(y.float() - res.float(), want.float() - res.float()) < (1e-5 if dtype == torch.float32 else 2e-2)
        assert int(ws.abs().sum()) == 0
        assert int(rows) == launch * int((cand.sum(-1) + 2 * c_ref).sum())  # routed rows only


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_predictor_offload(dtype):
    """Host masters (resident experts NaN) + pools (free slots NaN) + slot_table + gate_table, some experts absent:
    y and counts as the reference; host_rows counts the candidates' rows of each absent gate and 2 per kept neuron
    of absent up/down, read_rows all of them."""
    T, H, I, E, k, N, r = 3, 72, 40, 7, 3, 3, 12
    x, wg, wu, wd, ids, rw, tau, B, Bs, C, Cs, dept, tp, cand = case(T, H, I, E, k, N, r, dtype, seed=29)
    gtable = torch.tensor([0, 5, -1, 2, -1, 1, -1])  # gate slots, Sg = 6
    utable = torch.tensor([-1, 1, -1, 0, 2, -1, 3])  # up/down slots, S = 4
    (pg, _, _), (mg, _, _) = offload_layout(wg, wu, wd, gtable, S=6)
    (_, pu, pd), (_, mu, md) = offload_layout(wg, wu, wd, utable, S=4)
    y_ref, c_ref = sparse_fused_ref(x, wg, wu, wd, ids, rw, tau, cand)
    pred = GatePredictor(department_basis(x, B, Bs, dept, ids), C, Cs, dept, tp, experts=ids)
    host = torch.full((1,), 7, dtype=torch.int64, device=DEV)
    rows = torch.zeros(1, dtype=torch.int64, device=DEV)
    y, c = sparse_fused(x, mg, mu, md, ids, rw, tau, slot_table=utable.to(DEV), pool_gate=pg, pool_up=pu,
                        pool_down_t=pd, gate_table=gtable.to(torch.int32).to(DEV), host_rows=host, read_rows=rows,
                        predictor=pred, BLOCK_I=16)  # fmt: skip
    assert torch.equal(c, c_ref)
    assert not torch.isnan(y).any() and rel_err(y, y_ref) < 1e-5
    cl, nc, e = c.long().cpu(), cand.sum(-1).long().cpu(), ids.long().cpu()
    assert int(host) == 7 + int(((gtable[e] < 0).long() * nc + (utable[e] < 0).long() * 2 * cl).sum())
    assert int(rows) == int((nc + 2 * cl).sum())


def test_predictor_copy_mode():
    """expert_ids hold cache slots (the pool is the resident weights, tau per slot); predictor.experts the expert
    ids, which C and dept_of are indexed by."""
    T, H, I, E, k, N, r = 2, 72, 40, 7, 3, 3, 12
    x, wg, wu, wd, ids, rw, tau, B, Bs, C, Cs, dept, tp, cand = case(T, H, I, E, k, N, r, torch.float32, seed=31)
    routed = ids.long().cpu().unique()
    S = routed.numel() + 1
    slot_of = torch.full((E,), -1, dtype=torch.long)
    slot_of[routed] = torch.randperm(S, generator=torch.Generator().manual_seed(1))[: routed.numel()]
    expert_of = torch.zeros(S, dtype=torch.long)
    expert_of[slot_of[routed]] = routed
    pool = [w[expert_of.to(DEV)].clone() for w in (wg, wu, wd)]
    slots = slot_of.to(DEV)[ids.long()].to(torch.int32)
    y_ref, c_ref = sparse_fused_ref(x, wg, wu, wd, ids, rw, tau, cand)
    pred = GatePredictor(department_basis(x, B, Bs, dept, ids), C, Cs, dept, tp, experts=ids)
    y, c = sparse_fused(x, *pool, slots, rw, tau[expert_of.to(DEV)], predictor=pred, BLOCK_I=8)
    assert torch.equal(c, c_ref) and rel_err(y, y_ref) < 1e-5
    with pytest.raises(ValueError, match="predictor.experts"):  # C's experts are not the pool's slots
        sparse_fused(x, *pool, slots, rw, tau[expert_of.to(DEV)], predictor=GatePredictor(pred.z, C, Cs, dept, tp))


def test_tau_zero_is_no_predictor():
    """tau' = 0: every neuron a candidate (|silu| >= 0), the launch equals the one without a predictor: y, counts
    and every running total, offloaded with a gate table."""
    T, H, I, E, k, N, r = 3, 72, 40, 7, 3, 3, 12
    x, wg, wu, wd, ids, rw, tau, B, Bs, C, Cs, dept, _, _ = case(T, H, I, E, k, N, r, torch.bfloat16, seed=37)
    gtable = torch.tensor([0, 5, -1, 2, -1, 1, -1]).to(DEV)
    utable = torch.tensor([-1, 1, -1, 0, 2, -1, 3]).to(DEV)
    (pg, _, _), (mg, _, _) = offload_layout(wg, wu, wd, gtable.cpu(), S=6)
    (_, pu, pd), (_, mu, md) = offload_layout(wg, wu, wd, utable.cpu(), S=4)
    pred = GatePredictor(department_basis(x, B, Bs, dept, ids), C, Cs, dept, every(0.0, E, I))
    runs = []
    for p in (None, pred):
        tot = [torch.zeros(1, dtype=torch.int64, device=DEV) for _ in range(3)]
        y, c = sparse_fused(x, mg, mu, md, ids, rw, tau, slot_table=utable, pool_gate=pg, pool_up=pu, pool_down_t=pd,
                            gate_table=gtable, kept_total=tot[0], host_rows=tot[1], read_rows=tot[2], predictor=p,
                            BLOCK_I=16)  # fmt: skip
        runs.append((y, c, [int(t) for t in tot]))
    (y0, c0, t0), (y1, c1, t1) = runs
    assert torch.equal(c0, c1) and t0 == t1
    if DEV == "cpu":  # the interpreter runs programs in order: the same arithmetic, bit-identical
        assert torch.equal(y0, y1)
    else:
        torch.testing.assert_close(y0, y1, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_predictor_int4(dtype):
    """int4 experts: the candidates mask the packed gate rows and their scales as the kept mask does up/down; ~50 %
    candidates, H 96 / G 32 (3 groups), I 37 (a partial block); tau' = 0 equals no predictor."""
    T, H, I, E, k, G, N, r = 2, 96, 37, 5, 3, 32, 2, 16
    x, qg, qu, qd, ids, rw = int4_inputs(T, H, I, E, k, G, dtype, seed=41)
    B, Bs, C, Cs, dept = predictor_inputs(H, I, E, N, r, seed=42)
    tau = tau_for(gate_abs(x, qg.dequantize(torch.float32), ids), ids, 0.5, E)
    tp = row_taus(predicted_abs(x, B, Bs, C, Cs, dept, ids), ids, E, I, 0.5, seed=43)
    cand = candidates_ref(x, B, Bs, C, Cs, dept, ids, tp)
    y_ref, c_ref = sparse_fused_ref(x, qg, qu, qd, ids, rw, tau, cand)
    z = department_basis(x, B, Bs, dept, ids)
    rows = torch.zeros(1, dtype=torch.int64, device=DEV)
    y, c = sparse_fused(x, qg, qu, qd, ids, rw, tau, read_rows=rows, predictor=GatePredictor(z, C, Cs, dept, tp))
    assert torch.equal(c, c_ref) and 0 < int(c.sum())
    assert rel_err(y, y_ref) < 1e-5
    assert int(rows) == int((cand.sum(-1) + 2 * c_ref).sum())
    y0, c0 = sparse_fused(x, qg, qu, qd, ids, rw, tau)
    y1, c1 = sparse_fused(x, qg, qu, qd, ids, rw, tau, predictor=GatePredictor(z, C, Cs, dept, every(0.0, E, I)))
    assert torch.equal(c0, c1) and (torch.equal(y0, y1) if DEV == "cpu" else rel_err(y1, y0) < 1e-6)


def test_predictor_int4_offload():
    """int4 pools beside int4 host masters with a gate table and the predictor: host_rows counts candidates."""
    T, H, I, E, k, G, N, r = 1, 96, 37, 5, 3, 32, 2, 12
    x, qg, qu, qd, ids, rw = int4_inputs(T, H, I, E, k, G, torch.bfloat16, seed=43)
    B, Bs, C, Cs, dept = predictor_inputs(H, I, E, N, r, seed=44)
    tau = tau_for(gate_abs(x, qg.dequantize(torch.float32), ids), ids, 0.5, E)
    tp = row_taus(predicted_abs(x, B, Bs, C, Cs, dept, ids), ids, E, I, 0.5, seed=45)
    cand = candidates_ref(x, B, Bs, C, Cs, dept, ids, tp)
    y_ref, c_ref = sparse_fused_ref(x, qg, qu, qd, ids, rw, tau, cand)
    utable = torch.tensor([-1, 1, -1, 0, 2])
    gtable = torch.tensor([0, 3, -1, 1, -1])
    (_, pu, pd), (_, mu, md) = int4_offload_layout((qg, qu, qd), utable, S=3)
    (pg, _, _), (mg, _, _) = int4_offload_layout((qg, qu, qd), gtable, S=4, pad=5)
    host = torch.zeros(1, dtype=torch.int64, device=DEV)
    y, c = sparse_fused(x, mg, mu, md, ids, rw, tau, slot_table=utable.to(DEV), pool_gate=pg, pool_up=pu,
                        pool_down_t=pd, gate_table=gtable.to(DEV), host_rows=host,
                        predictor=GatePredictor(department_basis(x, B, Bs, dept, ids), C, Cs, dept, tp))  # fmt: skip
    assert torch.equal(c, c_ref) and not torch.isnan(y).any() and rel_err(y, y_ref) < 1e-5
    cl, nc, e = c.long().cpu(), cand.sum(-1).long().cpu(), ids.long().cpu()
    assert int(host) == int(((gtable[e] < 0).long() * nc + (utable[e] < 0).long() * 2 * cl).sum())


def test_predictor_validation():
    T, H, I, E, k, N, r = 1, 72, 40, 5, 3, 2, 12
    x, wg, wu, wd, ids, rw = expert_inputs(T, H, I, E, k, torch.float32, seed=3)
    B, Bs, C, Cs, dept = predictor_inputs(H, I, E, N, r, seed=3)
    tau = torch.zeros(E, device=DEV)
    z = department_basis(x, B, Bs, dept, ids)
    t = every(0.1, E, I)
    bad = {
        "predictor.z": [
            GatePredictor(z.bfloat16(), C, Cs, dept, t),
            GatePredictor(z[0], C, Cs, dept, t),
            GatePredictor(z.transpose(1, 2).contiguous().transpose(1, 2), C, Cs, dept, t),
            GatePredictor(z[:, :0], C[:, :, :0], Cs, dept, t),  # no department
        ],
        "predictor.C": [
            GatePredictor(z, C[:, :-1], Cs, dept, t),  # I is not the weights'
            GatePredictor(z, C[:, :, :-1], Cs, dept, t),  # r is not z's
            GatePredictor(z, C.to(torch.int32), Cs, dept, t),
            GatePredictor(z, C.float(), Cs, dept, t),  # the maps are int8
            GatePredictor(z, C.transpose(1, 2).contiguous().transpose(1, 2), Cs, dept, t),
            GatePredictor(z, C[:-1], Cs[:-1], dept[:-1], t),  # E is not the weights' (no experts=)
        ],
        "predictor.C_scale": [
            GatePredictor(z, C, Cs[:-1], dept, t),
            GatePredictor(z, C, Cs.bfloat16(), dept, t),
            GatePredictor(z, C, Cs.t().contiguous().t(), dept, t),
        ],
        "predictor.dept_of": [GatePredictor(z, C, Cs, dept[:-1], t), GatePredictor(z, C, Cs, dept.float(), t)],
        "predictor.experts": [GatePredictor(z, C, Cs, dept, t, experts=ids[:, :-1])],
        "predictor.tau_rows": [
            GatePredictor(z, C, Cs, dept, t[:, :-1]),
            GatePredictor(z, C, Cs, dept, t.float()),  # fp16
            GatePredictor(z, C, Cs, dept, t.t().contiguous().t()),
        ],
    }
    for match, preds in bad.items():
        for p in preds:
            with pytest.raises(ValueError, match=match):
                sparse_fused(x, wg, wu, wd, ids, rw, tau, predictor=p)
