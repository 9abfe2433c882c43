"""Tests of kernels/sparse_fused.py: the one-launch gate + threshold + up/down kernel vs its torch reference,
its two output modes (self-cleaning overwrite, caller-zeroed accumulate), offload-aware addressing, the shared
expert and residual tail, and the caller's workspace. int4 experts: tests/test_kernel_sparse_fused_int4.py.

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

from kernel_cases import (  # noqa: E402
    DEV,
    SPARSITIES,
    accumulates_twice,
    expert_inputs,
    gate_abs,
    offload_layout,
    rel_err,
    tau_for,
)

from localmoe.kernels.dense_experts import dense_experts_ref  # noqa: E402
from localmoe.kernels.sparse_fused import sparse_fused, sparse_fused_ref  # noqa: E402

# (T, H, I, E, k, BLOCK_I); the real shape is Qwen3.5-35B-A3B's expert (E cut to 16)
SHAPES = [(1, 72, 40, 5, 3, 8), (3, 72, 40, 5, 3, 16), (1, 2048, 512, 16, 8, 64)]


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
