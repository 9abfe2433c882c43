"""Tests of kernels/sparse_fused.py with int4 experts (Int4Tensor weights from localmoe/experts/int4.py): packed rows
and per-group scales against the reference on the exactly dequantized weights, the output modes, kept rows only
read, resident or offloaded (pool slots and pinned master copies, one slot table or a gate table), bad arguments.

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
    accumulates_twice,
    gate_abs,
    int4_inputs,
    int4_offload_layout,
    int4_parts,
    rel_err,
    tau_for,
)

from localmoe.experts.int4 import Int4Tensor, quantize  # noqa: E402
from localmoe.kernels.sparse_fused import sparse_fused, sparse_fused_ref  # noqa: E402

# (T, H, I, E, k, G, BLOCK_I): NG = H / G = 3 and 5 groups (not powers of two), I = 37 (a partial neuron block);
# the last is Qwen3.5-35B-A3B's expert (E cut to 10) at its group size
INT4_SHAPES = [
    (1, 96, 37, 5, 3, 32, 8),
    (1, 32, 16, 8, 2, 32, 16),
    (3, 80, 37, 5, 3, 16, 16),
    (1, 2048, 512, 10, 8, 128, 64),
]


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
