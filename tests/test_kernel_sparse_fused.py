"""Tests of kernels/sparse_fused.py: the one-launch gate + threshold + up/down kernel vs its torch reference,
its two output modes (self-cleaning overwrite, caller-zeroed accumulate), offload-aware addressing, and int4
experts (Int4Tensor weights from localmoe/experts/int4.py), resident or offloaded.

Runs on CPU under TRITON_INTERPRET=1 (set below before triton is imported when no GPU is present); never
asserts a time. Shape legend: T = tokens, k = experts per token, E = experts, I = expert width, H = hidden,
S = pool slots, G = int4 group size.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kernel_cases import DEV, SPARSITIES, expert_inputs, rel_err  # noqa: E402

from localmoe.experts.int4 import Int4Tensor, quantize  # noqa: E402
from localmoe.kernels.dense_experts import dense_experts_ref  # noqa: E402
from localmoe.kernels.sparse_fused import sparse_fused, sparse_fused_ref  # noqa: E402

# (T, H, I, E, k, BLOCK_I); the real shape is Qwen3.5-35B-A3B's expert (E cut to 16)
SHAPES = [(1, 72, 40, 5, 3, 8), (3, 72, 40, 5, 3, 16), (1, 2048, 512, 16, 8, 64)]


def gate_abs(x, w_gate, ids):
    return torch.nn.functional.silu(torch.einsum("th,tkih->tki", x.float(), w_gate[ids.long()].float())).abs()


def tau_for(g_abs, ids, sparsity, E):
    """Per-expert thresholds: for each routed expert the midpoint between two adjacent |g| values at the given
    quantile of its own gate values (so rounding cannot flip a neuron); unrouted experts get 0."""
    if sparsity == "all":
        return torch.full((E,), float("inf"), device=DEV)
    tau = torch.zeros(E)
    if sparsity == 0.0:
        return tau.to(DEV)
    for e in ids.unique().tolist():
        a = torch.sort(g_abs[ids == e].flatten().cpu()).values
        m = max(1, int(sparsity * a.numel()))
        tau[e] = float(a[m - 1] + a[m]) / 2
    return tau.to(DEV)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}_H{}_I{}_E{}_k{}".format(*s[:5]))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sparse_fused_matches_reference(shape, dtype):
    T, H, I, E, k, bi = shape
    x, wg, wu, wd, ids, rw = expert_inputs(T, H, I, E, k, dtype, seed=T * 100 + I)
    ga = gate_abs(x, wg, ids)
    out = torch.empty(T, H, device=DEV)
    cnt = torch.empty(T, k, dtype=torch.int32, device=DEV)
    for s in SPARSITIES if H < 100 else (0.0, 0.9):  # the same buffers and workspace every time: each launch must
        # leave it clean (35B's shape: dense and 90% only, interpreter time; the odd shapes run every case)
        tau = tau_for(ga, ids, s, E)
        y_ref, c_ref = sparse_fused_ref(x, wg, wu, wd, ids, rw, tau)
        out.fill_(float("nan"))  # poisoned: the kernel must overwrite every element
        cnt.fill_(-7)
        y, c = sparse_fused(x, wg, wu, wd, ids, rw, tau, out, count=cnt, BLOCK_I=bi)
        assert y is out and c is cnt and y.dtype == torch.float32 and not torch.isnan(y).any()
        assert torch.equal(c, c_ref), f"sparsity {s}"
        if s == "all":
            assert torch.count_nonzero(y) == 0 and torch.count_nonzero(c) == 0
        else:
            assert rel_err(y, y_ref) < 1e-5, f"sparsity {s}"
            if s == 0.0:
                assert torch.equal(c, torch.full_like(c, I))
            elif s == 0.9:
                assert abs(float(c.sum()) / (T * k * I) - 0.1) < 0.05


def test_dense_equivalence_and_defaults():
    # tau = 0 keeps everything: the fused kernel computes the dense SwiGLU experts; default out/count allocated
    T, H, I, E, k = 3, 72, 40, 5, 3
    x, wg, wu, wd, ids, rw = expert_inputs(T, H, I, E, k, torch.float32, seed=5)
    y, c = sparse_fused(x, wg, wu, wd, ids.long(), rw, torch.zeros(E, device=DEV), BLOCK_I=4, num_warps=2)
    assert y.dtype == torch.float32 and c.dtype == torch.int32 and tuple(c.shape) == (T, k)
    assert rel_err(y, dense_experts_ref(x, wg, wu, wd, ids, rw)) < 1e-5
    assert torch.equal(c, torch.full((T, k), I, dtype=torch.int32, device=DEV))


def test_low_precision_out():
    # the last program writes y in out's dtype: a bf16 caller needs no cast kernel
    T, H, I, E, k = 3, 72, 40, 5, 3
    x, wg, wu, wd, ids, rw = expert_inputs(T, H, I, E, k, torch.bfloat16, seed=11)
    tau = tau_for(gate_abs(x, wg, ids), ids, 0.5, E)
    y_ref, c_ref = sparse_fused_ref(x, wg, wu, wd, ids, rw, tau)
    out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=DEV)
    y, c = sparse_fused(x, wg, wu, wd, ids, rw, tau, out)
    assert y is out and torch.equal(c, c_ref)
    assert rel_err(y, y_ref) < 1e-2


def accumulates_twice(launch, y_ref, c_ref):
    """accumulate=True: `launch(out, count)` twice into a pre-filled fp32 out and int32 count adds y_ref and c_ref
    twice (the caller owns and pre-fills both)."""
    T, H = y_ref.shape
    base = torch.randn(T, H, device=DEV)
    out = base.clone()
    cnt = torch.full(tuple(c_ref.shape), 5, dtype=torch.int32, device=DEV)
    for _ in range(2):
        launch(out, cnt)
    assert rel_err(out, base + 2 * y_ref) < 1e-5
    assert torch.equal(cnt, 5 + 2 * c_ref)


def test_accumulate_mode():
    # caller-zeroed (here: pre-filled) out and count are added to, twice
    T, H, I, E, k = 3, 72, 40, 5, 3
    x, wg, wu, wd, ids, rw = expert_inputs(T, H, I, E, k, torch.float32, seed=13)
    tau = tau_for(gate_abs(x, wg, ids), ids, 0.5, E)
    y_ref, c_ref = sparse_fused_ref(x, wg, wu, wd, ids, rw, tau)
    accumulates_twice(
        lambda out, cnt: sparse_fused(x, wg, wu, wd, ids, rw, tau, out, count=cnt, accumulate=True, BLOCK_I=8),
        y_ref,
        c_ref,
    )
    # the default mode still works after accumulate launches (its workspace was never touched)
    y, c = sparse_fused(x, wg, wu, wd, ids, rw, tau)
    assert rel_err(y, y_ref) < 1e-5 and torch.equal(c, c_ref)


def offload_layout(wg, wu, wd, table, S):
    """Pools [S,I,H] holding the resident experts at their slots (other slots NaN), and master copies whose
    resident experts are NaN: any read from the wrong side poisons the result."""
    E = wg.shape[0]
    pools, masters = [], []
    for w in (wg, wu, wd):
        p = torch.full((S,) + tuple(w.shape[1:]), float("nan"), dtype=w.dtype, device=DEV)
        m = w.clone()
        for e in range(E):
            s = int(table[e])
            if s >= 0:
                p[s] = w[e]
                m[e] = float("nan")
        pools.append(p)
        masters.append(m if DEV == "cpu" else m.cpu().pin_memory())
    return pools, masters


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_offload_addressing_equals_resident(T, dtype):
    H, I, E, k = 72, 40, 5, 3
    x, wg, wu, wd, ids, rw = expert_inputs(T, H, I, E, k, dtype, seed=17 + T)
    ga = gate_abs(x, wg, ids)
    tables = {
        "mixed": torch.tensor([3, -1, 0, -1, 1]),  # slots permuted, one slot (2) unused
        "all_absent": torch.full((E,), -1),
        "all_resident": torch.tensor([4, 2, 0, 1, 3]),
    }
    for s in (0.0, 0.5, "all"):
        tau = tau_for(ga, ids, s, E)
        y_res, c_res = sparse_fused(x, wg, wu, wd, ids, rw, tau, BLOCK_I=16)
        for name, table in tables.items():
            for tdt in (torch.int64, torch.int32):
                (pg, pu, pd), (mg, mu, md) = offload_layout(wg, wu, wd, table, S=5)
                y, c = sparse_fused(
                    x,
                    mg,
                    mu,
                    md,
                    ids,
                    rw,
                    tau,
                    slot_table=table.to(tdt).to(DEV),
                    pool_gate=pg,
                    pool_up=pu,
                    pool_down_t=pd,
                    BLOCK_I=16,
                )
                assert torch.equal(c, c_res), (name, s)
                if DEV == "cpu":  # the interpreter runs programs in order: same arithmetic, bit-identical
                    assert torch.equal(y, y_res), (name, s)
                else:  # fp32 atomics land in any order on a GPU: equal up to the order of the sums
                    torch.testing.assert_close(y, y_res, rtol=1e-5, atol=1e-5, msg=f"{name} {s}")


@pytest.mark.parametrize("T", [1, 3])
def test_running_totals(T):
    """kept_total / host_rows grow by each launch's kept neurons / host rows (I gate rows + 2 per kept neuron of
    every absent routed expert), counted in the kernel's tail; two launches add up."""
    H, I, E, k = 72, 40, 5, 3
    x, wg, wu, wd, ids, rw = expert_inputs(T, H, I, E, k, torch.float32, seed=41 + T)
    tau = tau_for(gate_abs(x, wg, ids), ids, 0.5, E)
    table = torch.tensor([3, -1, 0, -1, 1])
    (pg, pu, pd), (mg, mu, md) = offload_layout(wg, wu, wd, table, S=5)
    kept = torch.zeros(1, dtype=torch.int64, device=DEV)
    host = torch.full((1,), 7, dtype=torch.int64, device=DEV)  # totals run on from any start
    for launch in (1, 2):
        y, c = sparse_fused(
            x,
            mg,
            mu,
            md,
            ids,
            rw,
            tau,
            slot_table=table.to(DEV),
            pool_gate=pg,
            pool_up=pu,
            pool_down_t=pd,
            kept_total=kept,
            host_rows=host,
            BLOCK_I=16,
        )
        absent = (table.to(DEV)[ids.long()] < 0).long()
        assert int(kept) == launch * int(c.sum())
        assert int(host) == 7 + launch * int((absent * (I + 2 * c.long())).sum())
    y2, c2 = sparse_fused(x, wg, wu, wd, ids, rw, tau, kept_total=kept, BLOCK_I=16)  # resident: kept only
    assert torch.equal(c2, c) and int(kept) == 3 * int(c.sum())
    with pytest.raises(ValueError, match="slot_table"):
        sparse_fused(x, wg, wu, wd, ids, rw, tau, host_rows=host)
    with pytest.raises(ValueError, match="int64"):
        sparse_fused(x, wg, wu, wd, ids, rw, tau, kept_total=torch.zeros(1, dtype=torch.int32, device=DEV))


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gate_table_addressing_equals_resident(T, dtype):
    """Gates in their own pool and table (Sg != S): gate resident with up/down absent, the reverse, both, neither;
    host_rows counts I for each absent gate and 2 per kept neuron of absent up/down; read_rows counts everything."""
    H, I, E, k = 72, 40, 5, 3
    x, wg, wu, wd, ids, rw = expert_inputs(T, H, I, E, k, dtype, seed=29 + T)
    ga = gate_abs(x, wg, ids)
    gtable = torch.tensor([0, 5, -1, 2, -1])  # gate slots, Sg = 6
    utable = torch.tensor([-1, 1, -1, 0, 2])  # up/down slots, S = 3
    for s in (0.0, 0.5, "all"):
        tau = tau_for(ga, ids, s, E)
        y_res, c_res = sparse_fused(x, wg, wu, wd, ids, rw, tau, BLOCK_I=16)
        (pg, _, _), (mg, _, _) = offload_layout(wg, wu, wd, gtable, S=6)
        (_, pu, pd), (_, mu, md) = offload_layout(wg, wu, wd, utable, S=3)
        host = torch.zeros(1, dtype=torch.int64, device=DEV)
        rows = torch.zeros(1, dtype=torch.int64, device=DEV)
        y, c = sparse_fused(
            x,
            mg,
            mu,
            md,
            ids,
            rw,
            tau,
            slot_table=utable.to(DEV),
            pool_gate=pg,
            pool_up=pu,
            pool_down_t=pd,
            gate_table=gtable.to(torch.int32).to(DEV),
            host_rows=host,
            read_rows=rows,
            BLOCK_I=16,
        )
        assert torch.equal(c, c_res), s
        if DEV == "cpu":
            assert torch.equal(y, y_res), s
        else:
            torch.testing.assert_close(y, y_res, rtol=1e-5, atol=1e-5)
        cl = c.long().cpu()
        g_abs = (gtable[ids.long().cpu()] < 0).long()
        u_abs = (utable[ids.long().cpu()] < 0).long()
        assert int(host) == int((g_abs * I + u_abs * 2 * cl).sum()), s
        assert int(rows) == int((I + 2 * cl).sum()), s
    with pytest.raises(ValueError, match="gate_table"):
        sparse_fused(x, wg, wu, wd, ids, rw, tau, gate_table=gtable.to(DEV))
    with pytest.raises(ValueError, match="gate_table"):
        sparse_fused(
            x,
            mg,
            mu,
            md,
            ids,
            rw,
            tau,
            slot_table=utable.to(DEV),
            pool_gate=pg,
            pool_up=pu,
            pool_down_t=pd,
            gate_table=gtable[:-1].to(DEV),
        )


def test_offload_real_shape():
    T, H, I, E, k = 1, 2048, 512, 16, 8
    x, wg, wu, wd, ids, rw = expert_inputs(T, H, I, E, k, torch.bfloat16, seed=23)
    tau = tau_for(gate_abs(x, wg, ids), ids, 0.85, E)
    routed = ids[0].tolist()
    table = torch.full((E,), -1)
    for j, e in enumerate(routed[::2]):  # half of the routed experts resident, the other half absent
        table[e] = j
    y_ref, c_ref = sparse_fused_ref(x, wg, wu, wd, ids, rw, tau)
    (pg, pu, pd), (mg, mu, md) = offload_layout(wg, wu, wd, table, S=4)
    y, c = sparse_fused(
        x, mg, mu, md, ids, rw, tau, slot_table=table.to(DEV), pool_gate=pg, pool_up=pu, pool_down_t=pd, BLOCK_I=64
    )
    assert torch.equal(c, c_ref)
    assert rel_err(y, y_ref) < 1e-5


def test_empty_batch():
    H, I, E = 72, 40, 5
    x, wg, wu, wd, _, _ = expert_inputs(1, H, I, E, 3, torch.float32, seed=1)
    y, c = sparse_fused(
        x[:0],
        wg,
        wu,
        wd,
        torch.zeros(0, 3, dtype=torch.int32, device=DEV),
        torch.zeros(0, 3, device=DEV),
        torch.zeros(E, device=DEV),
    )
    assert tuple(y.shape) == (0, H) and tuple(c.shape) == (0, 3)


def test_validation_errors():
    T, H, I, E, k = 1, 72, 40, 5, 3
    x, wg, wu, wd, ids, rw = expert_inputs(T, H, I, E, k, torch.float32, seed=3)
    tau = torch.zeros(E, device=DEV)
    pools = [torch.zeros(2, I, H, device=DEV) for _ in range(3)]
    table = torch.tensor([0, -1, 1, -1, -1], device=DEV)
    bad = [
        dict(x=x[0]),  # not 2-D
        dict(x=x.to(torch.int32)),
        dict(wg=wg[:, :-1]),  # wrong I
        dict(wu=wu.transpose(1, 2).contiguous().transpose(1, 2)),  # rows not contiguous
        dict(wd=wd.to(torch.int8)),
        dict(ids=ids.float()),
        dict(ids=ids[:, None]),
        dict(rw=rw[:, :-1]),
        dict(tau=tau.double()),
        dict(tau=tau[:-1]),
        dict(out=torch.empty(T, H + 1, device=DEV)),
        dict(out=torch.empty(T, H, dtype=torch.int32, device=DEV)),
        dict(count=torch.empty(T, k, dtype=torch.int64, device=DEV)),
        dict(accumulate=True),  # needs out and count
        dict(
            accumulate=True,
            out=torch.zeros(T, H, dtype=torch.bfloat16, device=DEV),
            count=torch.zeros(T, k, dtype=torch.int32, device=DEV),
        ),
        dict(slot_table=table),  # pools missing
        dict(pool_gate=pools[0], pool_up=pools[1], pool_down_t=pools[2]),  # table missing
        dict(slot_table=table[:-1], pool_gate=pools[0], pool_up=pools[1], pool_down_t=pools[2]),
        dict(slot_table=table.float(), pool_gate=pools[0], pool_up=pools[1], pool_down_t=pools[2]),
        dict(slot_table=table, pool_gate=pools[0].bfloat16(), pool_up=pools[1], pool_down_t=pools[2]),
        dict(slot_table=table, pool_gate=pools[0][:, :, :-1], pool_up=pools[1], pool_down_t=pools[2]),
        dict(workspace=torch.zeros(10, dtype=torch.int32, device=DEV)),
        dict(workspace=torch.zeros(4096, dtype=torch.float32, device=DEV)),
    ]
    for case in bad:
        kw = dict(x=x, wg=wg, wu=wu, wd=wd, ids=ids, rw=rw, tau=tau)
        kw.update(case)
        args = [kw.pop(n) for n in ("x", "wg", "wu", "wd", "ids", "rw", "tau")]
        with pytest.raises(ValueError):
            sparse_fused(*args, **kw)


# (T, H, I, E, k, I_s, BLOCK_I): shared expert narrower, wider and as wide as the routed ones; the last is 35B's
TAIL_SHAPES = [(1, 72, 40, 5, 3, 24, 8), (2, 72, 40, 5, 3, 56, 16), (1, 2048, 512, 16, 8, 512, 8)]


# interpreter time: 35B's shape resident and in bf16 only (the odd shapes take fp32 and offloading)
TAIL_CASES = [
    (s, o, dt)
    for s in TAIL_SHAPES
    for o in (False, True)
    for dt in (torch.float32, torch.bfloat16)
    if not (s[1] > 100 and (o or dt == torch.float32))
]


@pytest.mark.parametrize(
    "shape,offload,dtype",
    TAIL_CASES,
    ids=[
        f"{'fp32' if dt == torch.float32 else 'bf16'}-T{c[0]}_H{c[1]}_I{c[2]}_Is{c[5]}-{'offload' if o else 'resident'}"
        for c, o, dt in TAIL_CASES
    ],
)
def test_shared_expert_and_residual_tail(shape, dtype, offload):
    """shared= runs a dense expert beside the routed ones (counts stay the routed experts'); residual= adds the
    residual stream in the tail: y = residual + (routed + shared), in the output dtype."""
    from localmoe.kernels.token_tail import SharedExpert, shared_expert_term

    T, H, I, E, k, I_s, bi = shape
    x, wg, wu, wd, ids, rw = expert_inputs(T, H, I, E, k, dtype, seed=17 + I_s)
    gen = torch.Generator().manual_seed(I_s)
    sw = [(torch.randn(I_s, H, generator=gen) * 2.0 / H**0.5).to(DEV, dtype) for _ in range(3)]
    shared = SharedExpert(*sw, weight=torch.rand(T, generator=gen).to(DEV, dtype))
    res = torch.randn(T, H, generator=gen).to(DEV, dtype)
    tau = tau_for(gate_abs(x, wg, ids), ids, 0.5, E)
    kw = {}
    if offload:  # half the experts in pool slots, the rest read from the master copies
        S = E // 2
        table = torch.full((E,), -1, dtype=torch.int32, device=DEV)
        table[:S] = torch.arange(S, dtype=torch.int32, device=DEV)
        kw = dict(slot_table=table, pool_gate=wg[:S].clone(), pool_up=wu[:S].clone(), pool_down_t=wd[:S].clone())
    y_ref, c_ref = sparse_fused_ref(x, wg, wu, wd, ids, rw, tau)
    want = (res.float() + (y_ref + shared_expert_term(x, shared)).to(dtype).float()).to(dtype)
    for _ in range(2 if H < 100 else 1):  # the workspace is clean again after each launch (odd shapes; 35B's: once)
        out = torch.full((T, H), float("nan"), dtype=dtype, device=DEV)
        y, c = sparse_fused(x, wg, wu, wd, ids, rw, tau, out, shared=shared, residual=res, BLOCK_I=bi, **kw)
        assert torch.equal(c, c_ref)
        assert rel_err(y.float() - res.float(), want.float() - res.float()) < (1e-5 if dtype == torch.float32 else 2e-2)
    if H > 100:
        return  # 35B's shape: one launch (interpreter time); the odd shapes also run it without the residual
    y2, _ = sparse_fused(
        x, wg, wu, wd, ids, rw, tau, torch.empty(T, H, dtype=dtype, device=DEV), shared=shared, BLOCK_I=bi, **kw
    )  # shared expert without the residual
    assert rel_err(y2.float(), (y_ref + shared_expert_term(x, shared)).float()) < (
        1e-5 if dtype == torch.float32 else 2e-2
    )


def test_tail_validation():
    from localmoe.kernels.token_tail import SharedExpert

    T, H, I, E, k = 1, 72, 40, 5, 3
    x, wg, wu, wd, ids, rw = expert_inputs(T, H, I, E, k, torch.float32, seed=3)
    tau = torch.zeros(E, device=DEV)
    good = SharedExpert(wg[0], wu[0], wd[0], torch.ones(T, device=DEV))
    with pytest.raises(ValueError, match="accumulate"):
        sparse_fused(
            x,
            wg,
            wu,
            wd,
            ids,
            rw,
            tau,
            torch.zeros(T, H, device=DEV),
            accumulate=True,
            count=torch.zeros(T, k, dtype=torch.int32, device=DEV),
            shared=good,
        )
    with pytest.raises(ValueError, match="shared.w_up"):
        sparse_fused(x, wg, wu, wd, ids, rw, tau, shared=SharedExpert(wg[0], wu[0][:, :8], wd[0], good.weight))
    with pytest.raises(ValueError, match="shared.weight"):
        sparse_fused(x, wg, wu, wd, ids, rw, tau, shared=SharedExpert(wg[0], wu[0], wd[0], torch.ones(2)))
    with pytest.raises(ValueError, match="residual"):
        sparse_fused(x, wg, wu, wd, ids, rw, tau, residual=torch.zeros(T, H, dtype=torch.bfloat16, device=DEV))


@pytest.mark.parametrize("T,shared", [(1, True), (3, False), (2, True)])
def test_caller_workspace_left_zeroed(T, shared):
    """A caller's workspace of exactly T*H + T*k + T elements: repeated launches give the same output and leave it
    zeroed for the next launch (what a captured graph's replays rely on)."""
    from localmoe.kernels.token_tail import SharedExpert

    H, I, E, k, bi = 72, 40, 6, 3, 8
    x, wg, wu, wd, ids, rw = expert_inputs(T, H, I, E, k, torch.float32, seed=21 + T)
    tau = tau_for(gate_abs(x, wg, ids), ids, 0.5, E)
    gen = torch.Generator().manual_seed(T)
    kw = {"BLOCK_I": bi}
    if shared:
        kw["shared"] = SharedExpert(
            *[(torch.randn(56, H, generator=gen) / H**0.5).to(DEV) for _ in range(3)],
            weight=torch.rand(T, generator=gen).to(DEV),
        )
    want, c_want = sparse_fused(x, wg, wu, wd, ids, rw, tau, **kw)
    ws = torch.zeros(T * H + T * k + T, dtype=torch.int32, device=DEV)
    for _ in range(2):
        y, c = sparse_fused(x, wg, wu, wd, ids, rw, tau, workspace=ws, **kw)
        assert torch.equal(c, c_want)
        assert rel_err(y, want) < 1e-6
        assert int(ws.abs().sum()) == 0


# ----------------------------------------------------------------------------------------------------------
# int4 experts
# ----------------------------------------------------------------------------------------------------------
# (T, H, I, E, k, G, BLOCK_I): NG = H / G = 3 and 5 groups (not powers of two), I = 37 (a partial neuron block);
# the last is Qwen3.5-35B-A3B's expert (E cut to 10) at its group size
INT4_SHAPES = [
    (1, 96, 37, 5, 3, 32, 8),
    (1, 32, 16, 8, 2, 32, 16),
    (3, 80, 37, 5, 3, 16, 16),
    (1, 2048, 512, 10, 8, 128, 64),
]


def int4_inputs(T, H, I, E, k, G, dtype, seed):
    """(x [T,H] in dtype, int4 w_gate, w_up, w_down_t (Int4Tensor [E,I,H], group G), ids [T,k], weights [T,k])."""
    x, wg, wu, wd, ids, rw = expert_inputs(T, H, I, E, k, dtype, seed=seed)
    return (x, *(quantize(w, group=G) for w in (wg, wu, wd)), ids, rw)


@pytest.mark.parametrize("shape", INT4_SHAPES, ids=lambda s: "T{}_H{}_I{}_E{}_k{}_G{}".format(*s[:6]))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int4_matches_reference(shape, dtype):
    """Packed rows + per-group scales vs the reference on the exactly dequantized weights: dense (tau 0), ~20 %
    kept, nothing kept; the same poisoned buffers and workspace every launch."""
    T, H, I, E, k, G, bi = shape
    x, qg, qu, qd, ids, rw = int4_inputs(T, H, I, E, k, G, dtype, seed=T * 100 + I)
    exact = [w.dequantize(torch.float32) for w in (qg, qu, qd)]
    ga = gate_abs(x, exact[0], ids)
    out = torch.empty(T, H, device=DEV)
    cnt = torch.empty(T, k, dtype=torch.int32, device=DEV)
    for s in (0.0, 0.8, "all"):
        tau = tau_for(ga, ids, s, E)
        y_ref, c_ref = sparse_fused_ref(x, qg, qu, qd, ids, rw, tau)
        if s == 0.0:  # the reference reads the int4 weights in fp32 exactly (not rounded to their dtype)
            assert torch.equal(y_ref, sparse_fused_ref(x, *exact, ids, rw, tau)[0])
        out.fill_(float("nan"))
        cnt.fill_(-7)
        y, c = sparse_fused(x, qg, qu, qd, ids, rw, tau, out, count=cnt, BLOCK_I=bi)
        assert y is out and c is cnt and not torch.isnan(y).any()
        assert torch.equal(c, c_ref), f"sparsity {s}"
        if s == "all":
            assert torch.count_nonzero(y) == 0 and torch.count_nonzero(c) == 0
        else:
            assert rel_err(y, y_ref) < 1e-5, f"sparsity {s}"
            if s == 0.0:
                assert torch.equal(c, torch.full_like(c, I))
            else:
                assert 0.15 <= float(c.sum()) / (T * k * I) <= 0.3


def test_int4_modes():
    """fp16 x through accumulate=True (pre-filled, twice), then the finalising tail with residual= into a bf16 out,
    a caller workspace (left zeroed), kept_total and read_rows."""
    T, H, I, E, k, G = 3, 96, 37, 5, 3, 32
    x, qg, qu, qd, ids, rw = int4_inputs(T, H, I, E, k, G, torch.float16, seed=31)
    tau = tau_for(gate_abs(x, qg.dequantize(torch.float32), ids), ids, 0.7, E)
    y_ref, c_ref = sparse_fused_ref(x, qg, qu, qd, ids, rw, tau)
    accumulates_twice(
        lambda out, cnt: sparse_fused(x, qg, qu, qd, ids, rw, tau, out, count=cnt, accumulate=True, BLOCK_I=8),
        y_ref,
        c_ref,
    )
    res = torch.randn(T, H, generator=torch.Generator().manual_seed(3)).to(DEV, torch.bfloat16)
    want = (res.float() + y_ref.to(torch.bfloat16).float()).to(torch.bfloat16)
    ws = torch.zeros(T * H + T * k + T, dtype=torch.int32, device=DEV)
    kept = torch.zeros(1, dtype=torch.int64, device=DEV)
    rows = torch.zeros(1, dtype=torch.int64, device=DEV)
    for launch in (1, 2):
        out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=DEV)
        y, c = sparse_fused(
            x,
            qg,
            qu,
            qd,
            ids,
            rw,
            tau,
            out,
            residual=res,
            workspace=ws,
            kept_total=kept,
            read_rows=rows,
            BLOCK_I=16,
            num_warps=4,
        )
        assert y is out and torch.equal(c, c_ref)
        assert rel_err(y.float() - res.float(), want.float() - res.float()) < 2e-2
        assert int(ws.abs().sum()) == 0
        assert int(kept) == launch * int(c_ref.sum())
        assert int(rows) == launch * int((I + 2 * c_ref.long()).sum())


def test_int4_reads_only_kept_rows():
    """Scales and minimums of every row the reference drops set to NaN (all rows of unrouted experts, the gates'
    too): a masked-off row must issue no load, or the NaN reaches y."""
    T, H, I, E, k, G = 1, 80, 37, 5, 3, 16
    x, qg, qu, qd, ids, rw = int4_inputs(T, H, I, E, k, G, torch.bfloat16, seed=37)
    ga = gate_abs(x, qg.dequantize(torch.float32), ids)
    tau = tau_for(ga, ids, 0.75, E)
    y_ref, c_ref = sparse_fused_ref(x, qg, qu, qd, ids, rw, tau)
    keep = ga >= tau[ids.long()].unsqueeze(-1)  # [T, k, I]
    dropped = torch.ones(E, I, dtype=torch.bool, device=DEV)
    dropped[ids[0].long()] = ~keep[0]
    routed = torch.zeros(E, dtype=torch.bool, device=DEV)
    routed[ids[0].long()] = True
    for w, rows in ((qg, ~routed[:, None].expand(E, I)), (qu, dropped), (qd, dropped)):
        w.scale[rows] = float("nan")
        w.minimum[rows] = float("nan")
    y, c = sparse_fused(x, qg, qu, qd, ids, rw, tau, BLOCK_I=8)
    assert torch.equal(c, c_ref) and 0 < int(c.sum()) < k * I
    assert not torch.isnan(y).any() and rel_err(y, y_ref) < 1e-5


def test_int4_validation():
    from localmoe.kernels.token_tail import SharedExpert

    T, H, I, E, k, G = 1, 96, 37, 5, 3, 32
    x, qg, qu, qd, ids, rw = int4_inputs(T, H, I, E, k, G, torch.float32, seed=3)
    tau = torch.zeros(E, device=DEV)
    plain = qu.dequantize()
    with pytest.raises(ValueError, match="Int4Tensors"):
        sparse_fused(x, qg, plain, qd, ids, rw, tau)
    with pytest.raises(ValueError, match="Int4Tensors"):
        sparse_fused(x, plain, plain, qd, ids, rw, tau)
    with pytest.raises(ValueError, match="group"):
        sparse_fused(x, qg, quantize(plain, group=16), qd, ids, rw, tau)
    shared = SharedExpert(plain[0], plain[0], plain[0], torch.ones(T, device=DEV))
    with pytest.raises(ValueError, match="shared"):
        sparse_fused(x, qg, qu, qd, ids, rw, tau, shared=shared)
    wide = torch.zeros(E, I, H, dtype=torch.uint8, device=DEV)
    bad = [
        Int4Tensor(qg.packed.to(torch.int16), qg.scale, qg.minimum, qg.dtype),  # not uint8
        Int4Tensor(wide[:, :, : H // 2], qg.scale, qg.minimum, qg.dtype),  # rows not contiguous
        Int4Tensor(qg.packed[:, :-1], qg.scale, qg.minimum, qg.dtype),  # wrong I
        Int4Tensor(qg.packed, qg.scale[:, :, :-1], qg.minimum[:, :, :-1], qg.dtype),  # G = 48: not a power of two
        Int4Tensor(qg.packed, qg.scale, qg.minimum[:, :, :1], qg.dtype),  # minimum's shape is not scale's
        Int4Tensor(qg.packed, qg.scale.transpose(1, 2).contiguous().transpose(1, 2), qg.minimum, qg.dtype),
        Int4Tensor(qg.packed, qg.scale.to(torch.int32), qg.minimum, qg.dtype),
    ]
    for w in bad:
        with pytest.raises(ValueError, match="w_gate"):
            sparse_fused(x, w, qu, qd, ids, rw, tau)
    with pytest.raises(ValueError, match="packed"):  # x's H is not the weights'
        sparse_fused(x[:, :-2], qg, qu, qd, ids, rw, tau)


# ----------------------------------------------------------------------------------------------------------
# int4 experts with offload: Int4Tensor pools beside Int4Tensor master copies
# ----------------------------------------------------------------------------------------------------------
def int4_parts(w):
    return (w.packed, w.scale, w.minimum)


def int4_offload_layout(qs, table, S, pad=0):
    """Int4Tensor pools [S,I,H] holding the resident experts' packed bytes, scales and minimums at their slots (other
    slots: bytes 0xFF, scales and minimums NaN), and master copies whose resident experts are poisoned the same way: a
    read from the wrong side puts NaN in y. Each pool part is cut from a buffer with its own number of spare rows per
    slot (pad + 1..9), so every pool tensor has an expert stride of its own, none the masters'."""
    pools, masters = [], []
    for j, w in enumerate(qs):
        E, I, _ = w.packed.shape
        pp, mp = [], []
        for i, t in enumerate(int4_parts(w)):
            bad = 255 if t.dtype == torch.uint8 else float("nan")
            buf = torch.empty((S, I + pad + 1 + 3 * j + i, t.shape[-1]), dtype=t.dtype, device=DEV)
            p = buf[:, :I]
            p.fill_(bad)
            m = t.clone()
            for e in range(E):
                if int(table[e]) >= 0:
                    p[int(table[e])].copy_(t[e])
                    m[e] = bad
            pp.append(p)
            mp.append(m if DEV == "cpu" else m.cpu().pin_memory())
        pools.append(Int4Tensor(*pp, w.dtype))
        masters.append(Int4Tensor(*mp, w.dtype))
    return pools, masters


def poison_dropped(pools, masters, tables, ids, keep):
    """NaN scales / minimums on every row the reference drops, on whichever side holds it (gates: all rows of the
    unrouted experts; up / down: rows no token keeps): a masked-off row must issue no load. tables: the gate's slot
    table, then up/down's."""
    E, I = masters[0].scale.shape[:2]
    kept = torch.zeros(E, I, dtype=torch.bool)
    routed = torch.zeros(E, dtype=torch.bool)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            routed[e] = True
            kept[e] |= keep[t, j].cpu()
    drop = [~routed[:, None].expand(E, I), ~kept, ~kept]
    for pool, master, table, rows in zip(pools, masters, (tables[0], tables[1], tables[1]), drop):
        for e in range(E):
            r = rows[e].nonzero().flatten()
            for part in (master.scale, master.minimum):
                part[e, r] = float("nan")
            if int(table[e]) >= 0:
                for part in (pool.scale, pool.minimum):
                    part[int(table[e]), r.to(DEV)] = float("nan")


# (T, H, I, E, k, G, BLOCK_I)
INT4_OFFLOAD_SHAPES = [(1, 96, 37, 5, 3, 32, 8), (3, 80, 37, 5, 3, 16, 16)]


@pytest.mark.parametrize("gate_table", [False, True], ids=["one_table", "gate_table"])
@pytest.mark.parametrize("shape", INT4_OFFLOAD_SHAPES, ids=lambda s: "T{}_H{}_I{}_E{}_k{}_G{}".format(*s[:6]))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_int4_offload_matches_reference(shape, dtype, gate_table):
    """int4 pools + int4 host masters (resident experts poisoned in the masters, free slots poisoned in the pools,
    dropped rows poisoned on both sides) vs the reference on the clean masters: dense and ~20 % kept; kept_total,
    host_rows and read_rows as the bf16 offload tests count them."""
    T, H, I, E, k, G, bi = shape
    x, qg, qu, qd, ids, rw = int4_inputs(T, H, I, E, k, G, dtype, seed=53 + T + H)
    ga = gate_abs(x, qg.dequantize(torch.float32), ids)
    utable = torch.tensor([-1, 1, -1, 0, 2])  # up/down slots (S = 3): experts 0 and 2 absent
    gtable = torch.tensor([0, 3, -1, 1, -1]) if gate_table else utable  # gate slots (Sg = 4): 2 and 4 absent
    routed = ids.long().cpu().flatten()
    assert (utable[routed] < 0).any() and (utable[routed] >= 0).any()  # both kinds routed
    for s in (0.0, 0.8):
        tau = tau_for(ga, ids, s, E)
        y_ref, c_ref = sparse_fused_ref(x, qg, qu, qd, ids, rw, tau)
        keep = ga >= tau[ids.long()].unsqueeze(-1)  # [T, k, I]
        (pg, pu, pd), (mg, mu, md) = int4_offload_layout((qg, qu, qd), utable, S=3)
        kw = {}
        if gate_table:
            (pg, _, _), (mg, _, _) = int4_offload_layout((qg, qu, qd), gtable, S=4, pad=5)
            kw["gate_table"] = gtable.to(torch.int32).to(DEV)
        poison_dropped((pg, pu, pd), (mg, mu, md), (gtable, utable), ids.cpu(), keep)
        kept = torch.zeros(1, dtype=torch.int64, device=DEV)
        host = torch.full((1,), 7, dtype=torch.int64, device=DEV)
        rows = torch.zeros(1, dtype=torch.int64, device=DEV)
        y, c = sparse_fused(
            x,
            mg,
            mu,
            md,
            ids,
            rw,
            tau,
            slot_table=utable.to(DEV),
            pool_gate=pg,
            pool_up=pu,
            pool_down_t=pd,
            kept_total=kept,
            host_rows=host,
            read_rows=rows,
            BLOCK_I=bi,
            **kw,
        )
        assert torch.equal(c, c_ref), s
        assert not torch.isnan(y).any() and rel_err(y, y_ref) < 1e-5, s
        if s == 0.0:
            assert torch.equal(c, torch.full_like(c, I))
        else:
            assert 0.15 <= float(c.sum()) / (T * k * I) <= 0.3
        cl = c.long().cpu()
        g_abs = (gtable[ids.long().cpu()] < 0).long()
        u_abs = (utable[ids.long().cpu()] < 0).long()
        assert int(kept) == int(cl.sum())
        assert int(host) == 7 + int((g_abs * I + u_abs * 2 * cl).sum()), s  # rows, not bytes
        assert int(rows) == int((I + 2 * cl).sum()), s


def test_int4_offload_modes():
    """int4 offload through accumulate=True (pre-filled, twice), then the finalising tail with residual= into a bf16
    out and a caller workspace (left zeroed), gates in their own pool."""
    T, H, I, E, k, G = 2, 96, 37, 5, 3, 32
    x, qg, qu, qd, ids, rw = int4_inputs(T, H, I, E, k, G, torch.bfloat16, seed=61)
    tau = tau_for(gate_abs(x, qg.dequantize(torch.float32), ids), ids, 0.7, E)
    y_ref, c_ref = sparse_fused_ref(x, qg, qu, qd, ids, rw, tau)
    utable = torch.tensor([2, -1, 0, -1, 1])
    gtable = torch.tensor([-1, 0, 1, -1, -1])
    (_, pu, pd), (_, mu, md) = int4_offload_layout((qg, qu, qd), utable, S=3)
    (pg, _, _), (mg, _, _) = int4_offload_layout((qg, qu, qd), gtable, S=2)
    kw = dict(slot_table=utable.to(DEV), pool_gate=pg, pool_up=pu, pool_down_t=pd, gate_table=gtable.to(DEV))
    accumulates_twice(
        lambda out, cnt: sparse_fused(x, mg, mu, md, ids, rw, tau, out, count=cnt, accumulate=True, BLOCK_I=8, **kw),
        y_ref,
        c_ref,
    )
    res = torch.randn(T, H, generator=torch.Generator().manual_seed(5)).to(DEV, torch.bfloat16)
    want = (res.float() + y_ref.to(torch.bfloat16).float()).to(torch.bfloat16)
    ws = torch.zeros(T * H + T * k + T, dtype=torch.int32, device=DEV)
    for _ in range(2):
        out = torch.full((T, H), float("nan"), dtype=torch.bfloat16, device=DEV)
        y, c = sparse_fused(x, mg, mu, md, ids, rw, tau, out, residual=res, workspace=ws, BLOCK_I=16, num_warps=4, **kw)
        assert y is out and torch.equal(c, c_ref)
        assert rel_err(y.float() - res.float(), want.float() - res.float()) < 2e-2
        assert int(ws.abs().sum()) == 0


def test_int4_offload_real_shape():
    """Qwen3.5-35B-A3B's expert (E cut to 10) at G = 128, ~20 % kept: half the routed experts' up/down resident,
    gates resident for a different half."""
    T, H, I, E, k, G = 1, 2048, 512, 10, 8, 128
    x, qg, qu, qd, ids, rw = int4_inputs(T, H, I, E, k, G, torch.bfloat16, seed=67)
    tau = tau_for(gate_abs(x, qg.dequantize(torch.float32), ids), ids, 0.8, E)
    y_ref, c_ref = sparse_fused_ref(x, qg, qu, qd, ids, rw, tau)
    routed = ids[0].tolist()
    utable = torch.full((E,), -1)
    gtable = torch.full((E,), -1)
    for j, e in enumerate(routed[::2]):
        utable[e] = j
    for j, e in enumerate(routed[1:6]):
        gtable[e] = j
    (_, pu, pd), (_, mu, md) = int4_offload_layout((qg, qu, qd), utable, S=4)
    (pg, _, _), (mg, _, _) = int4_offload_layout((qg, qu, qd), gtable, S=5)
    host = torch.zeros(1, dtype=torch.int64, device=DEV)
    y, c = sparse_fused(
        x,
        mg,
        mu,
        md,
        ids,
        rw,
        tau,
        slot_table=utable.to(DEV),
        pool_gate=pg,
        pool_up=pu,
        pool_down_t=pd,
        gate_table=gtable.to(DEV),
        host_rows=host,
        BLOCK_I=64,
    )
    assert torch.equal(c, c_ref)
    assert rel_err(y, y_ref) < 1e-5
    cl = c[0].long().cpu()
    ids0 = ids[0].long().cpu()
    assert int(host) == int(((gtable[ids0] < 0).long() * I + (utable[ids0] < 0).long() * 2 * cl).sum())


def test_int4_offload_validation():
    from localmoe.kernels.token_tail import SharedExpert

    T, H, I, E, k, G = 1, 96, 37, 5, 3, 32
    x, qg, qu, qd, ids, rw = int4_inputs(T, H, I, E, k, G, torch.float32, seed=3)
    tau = torch.zeros(E, device=DEV)
    table = torch.tensor([0, -1, 1, -1, -1], device=DEV)
    qpools, _ = int4_offload_layout((qg, qu, qd), table.cpu(), S=2)
    plain = [w.dequantize() for w in (qg, qu, qd)]
    ppools = [w[:2].clone() for w in plain]

    def run(masters, pools, **kw):
        return sparse_fused(
            x,
            *masters,
            ids,
            rw,
            tau,
            slot_table=table,
            pool_gate=pools[0],
            pool_up=pools[1],
            pool_down_t=pools[2],
            **kw,
        )

    run((qg, qu, qd), qpools)  # the good case runs
    with pytest.raises(ValueError, match="pool_gate is a plain tensor but the master copies are Int4Tensors"):
        run((qg, qu, qd), ppools)
    with pytest.raises(ValueError, match="pool_up is a plain tensor"):
        run((qg, qu, qd), (qpools[0], ppools[1], qpools[2]))
    with pytest.raises(ValueError, match="pool_gate is an Int4Tensor but the master copies are plain"):
        run(plain, qpools)
    with pytest.raises(ValueError, match="group size"):
        run((qg, qu, qd), (qpools[0], quantize(plain[1][:2], group=16), qpools[2]))
    s32 = Int4Tensor(qpools[2].packed, qpools[2].scale.float(), qpools[2].minimum, qg.dtype)
    with pytest.raises(ValueError, match=r"pool_down_t\.scale .* must share a dtype"):
        run((qg, qu, qd), (qpools[0], qpools[1], s32))
    with pytest.raises(ValueError, match="pool_up.packed"):  # wrong I
        run(
            (qg, qu, qd),
            (
                qpools[0],
                Int4Tensor(qpools[1].packed[:, :-1], qpools[1].scale[:, :-1], qpools[1].minimum[:, :-1], qg.dtype),
                qpools[2],
            ),
        )
    with pytest.raises(ValueError, match="pool_gate.packed"):  # one slot fewer than the up/down pools, no gate_table
        run((qg, qu, qd), (Int4Tensor(*(t[:1] for t in int4_parts(qpools[0])), qg.dtype), qpools[1], qpools[2]))
    with pytest.raises(ValueError, match="gate_table"):
        run((qg, qu, qd), qpools, gate_table=table[:-1])
    shared = SharedExpert(plain[0][0], plain[1][0], plain[2][0], torch.ones(T, device=DEV))
    with pytest.raises(ValueError, match="shared"):
        run((qg, qu, qd), qpools, shared=shared)
