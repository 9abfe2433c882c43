"""Tests of kernels/mxfp4_sparse.py: GPT-OSS's one-launch sparse decode over MXFP4 experts vs its torch reference,
and the reference itself vs the model's formula on transformers' own dequantization of the hub layout.

Covers bf16 and fp32 activations, thresholds at ~0 / ~50 / ~90 % sparsity and all-dropped, both output modes
(self-cleaning overwrite, caller-filled accumulate), the counts, the down-scale row shared or per neuron, H in chunks,
and the offload addressing (pool slots + host master copies, a separate gate table, the running totals, residual).
Runs on CPU under TRITON_INTERPRET=1; never asserts a time. Shape legend: T tokens, k experts per token, E experts,
I expert width, H hidden, S pool slots.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from kernel_cases import DEV, rel_err  # noqa: E402
from transformers.integrations.mxfp4 import _convert_moe_packed_tensors  # noqa: E402

from localmoe.kernels.mxfp4 import Mxfp4Tensor, down_t_to_hub, gate_up_to_hub, quantize_mxfp4  # noqa: E402
from localmoe.kernels.mxfp4_dequant import dequant_mxfp4_ref  # noqa: E402
from localmoe.kernels.mxfp4_sparse import ALPHA, LIMIT, sparse_mxfp4, sparse_mxfp4_ref  # noqa: E402

E, I, H, K = 5, 96, 160, 3
SPARSITIES = [0.0, 0.5, 0.9]


@pytest.fixture(scope="module")
def experts():
    """(w_gate, w_up, w_down_t Mxfp4Tensors, b_gate, b_up, b_down bf16) on DEV; gate and up pre-activations reach
    past the clamp limit."""
    gen = torch.Generator().manual_seed(0)
    ws = [quantize_mxfp4(torch.randn(E, I, H, generator=gen) * 0.4, along) for along in (True, True, False)]
    ws = [Mxfp4Tensor(w.blocks.to(DEV), w.scales.to(DEV), torch.bfloat16, w.along_rows) for w in ws]
    bs = [(torch.randn(E, n, generator=gen) * 0.5).to(torch.bfloat16).to(DEV) for n in (I, I, H)]
    return (*ws, *bs)


def problem(T, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype).to(DEV)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to(torch.int32).to(DEV)
    rw = torch.softmax(torch.randn(T, K, generator=gen), -1).to(dtype).to(DEV)
    return x, ids, rw


def act_abs(x, w_gate, b_gate, ids):
    """|a| [T, k, I]: the clamped SwiGLU activation the threshold reads."""
    eid = ids.long()
    wg = dequant_mxfp4_ref(w_gate.blocks[eid], w_gate.scales[eid], True, torch.float32)
    g = (torch.einsum("th,tkih->tki", x.float(), wg) + b_gate.float()[eid]).clamp(max=LIMIT)
    return (g * torch.sigmoid(ALPHA * g)).abs()


def tau_for(a_abs, ids, sparsity):
    """Per-expert thresholds at the midpoint between two adjacent |a| at the sparsity's quantile of the expert's own
    values (rounding cannot flip a neuron); unrouted experts 0; "all" drops everything."""
    if sparsity == "all":
        return torch.full((E,), float("inf"), device=DEV)
    tau = torch.zeros(E)
    for e in ids.unique().tolist() if sparsity else []:
        a = torch.sort(a_abs[ids == e].flatten().cpu()).values
        m = max(1, int(sparsity * a.numel()))
        tau[e] = float(a[m - 1] + a[m]) / 2
    return tau.to(DEV)


def test_reference_equals_model_formula(experts):
    """The reference against gpt-oss's expert formula, run per token and expert on transformers' dequantization of
    the hub tensors (gate_up interleaved [H, 2I], down [I, H])."""
    wg, wu, wd, bg, bu, bd = experts
    x, ids, rw = problem(2, torch.float32, seed=1)
    gu = _convert_moe_packed_tensors(*(t.cpu() for t in gate_up_to_hub(wg, wu)), dtype=torch.float32)  # [E, H, 2I]
    down = _convert_moe_packed_tensors(*(t.cpu() for t in down_t_to_hub(wd)), dtype=torch.float32)  # [E, I, H]
    b_gu = torch.stack((bg, bu), dim=-1).flatten(-2).float().cpu()  # checkpoint order: gate 0::2, up 1::2
    a_abs = act_abs(x, wg, bg, ids)
    for s in SPARSITIES:
        tau = tau_for(a_abs, ids, s)
        y = torch.zeros(2, H)
        cnt = torch.zeros(2, K, dtype=torch.int32)
        for t in range(2):
            for j, e in enumerate(ids[t].tolist()):
                v = x[t].float().cpu() @ gu[e] + b_gu[e]
                gate, up = v[0::2].clamp(max=LIMIT), v[1::2].clamp(-LIMIT, LIMIT)
                glu = gate * torch.sigmoid(gate * ALPHA)
                keep = glu.abs() >= float(tau[e])
                h = torch.where(keep, (up + 1) * glu, 0.0)
                y[t] += float(rw[t, j]) * (h @ down[e] + bd[e].float().cpu())
                cnt[t, j] = int(keep.sum())
        y_ref, c_ref = sparse_mxfp4_ref(x, wg, wu, wd, bg, bu, bd, ids, rw, tau)
        assert torch.equal(c_ref.cpu(), cnt), f"sparsity {s}"
        assert rel_err(y_ref.cpu(), y) < 1e-5, f"sparsity {s}"
        if s == 0.9:
            assert abs(float(cnt.sum()) / cnt.numel() / I - 0.1) < 0.05


@pytest.mark.parametrize(
    "T,dtype,sparsities",
    [(2, torch.float32, [0.5, 0.9, "all"]), (1, torch.bfloat16, [0.0, 0.9])],  # the interpreter is slow: 5 launches
    ids=["T2-fp32", "T1-bf16"],
)
def test_matches_reference(experts, T, dtype, sparsities):
    wg, wu, wd, bg, bu, bd = experts
    x, ids, rw = problem(T, dtype, seed=T)
    a_abs = act_abs(x, wg, bg, ids)
    out = torch.empty(T, H, device=DEV)
    cnt = torch.empty(T, K, dtype=torch.int32, device=DEV)
    for s in sparsities:  # the same buffers and workspace every time: each launch must leave it clean
        tau = tau_for(a_abs, ids, s)
        y_ref, c_ref = sparse_mxfp4_ref(x, wg, wu, wd, bg, bu, bd, ids, rw, tau)
        out.fill_(float("nan"))  # poisoned: the kernel must overwrite every element
        cnt.fill_(-7)
        y, c = sparse_mxfp4(x, wg, wu, wd, bg, bu, bd, ids, rw, tau, out, count=cnt, BLOCK_I=32)
        assert y is out and c is cnt and not torch.isnan(y).any()
        assert torch.equal(c, c_ref), f"sparsity {s}"
        assert rel_err(y, y_ref) < 1e-5, f"sparsity {s}"
        if s == "all":  # nothing kept: the down biases alone
            assert torch.count_nonzero(c) == 0 and rel_err(y, (rw.float()[..., None] * bd.float()[ids]).sum(1)) < 1e-6


@pytest.mark.parametrize("flat", [1, 2])
@pytest.mark.parametrize(
    "T,dtype,block_i", [(2, torch.float32, 8), (1, torch.bfloat16, 32)], ids=["T2-fp32-B8", "T1-bf16-B32"]
)
def test_flat_tiles_match_reference(experts, flat, T, dtype, block_i):
    """`flat` 1 (gate / up rows as 2-D word tiles, x per nibble position) and 2 (the down rows too, strided atomic
    adds): the same outputs and counts as the reference at ~0 / ~90 % sparsity and all-dropped."""
    wg, wu, wd, bg, bu, bd = experts
    x, ids, rw = problem(T, dtype, seed=T + 10)
    a_abs = act_abs(x, wg, bg, ids)
    out = torch.empty(T, H, device=DEV)
    cnt = torch.empty(T, K, dtype=torch.int32, device=DEV)
    for s in [0.0, 0.9, "all"]:
        tau = tau_for(a_abs, ids, s)
        y_ref, c_ref = sparse_mxfp4_ref(x, wg, wu, wd, bg, bu, bd, ids, rw, tau)
        out.fill_(float("nan"))
        y, c = sparse_mxfp4(x, wg, wu, wd, bg, bu, bd, ids, rw, tau, out, count=cnt, BLOCK_I=block_i, flat=flat)
        assert torch.equal(c, c_ref) and rel_err(y, y_ref) < 1e-5, f"sparsity {s}"


@pytest.mark.parametrize("flat", [0, 2])
def test_real_hidden_size(flat):
    """gpt-oss's H 2880 (90 blocks: parts of 64 and 32, the second padded) with a narrow expert: both tile forms."""
    gen = torch.Generator().manual_seed(3)
    E2, I2, H2 = 4, 64, 2880
    ws = [quantize_mxfp4(torch.randn(E2, I2, H2, generator=gen) * 0.1, along) for along in (True, True, False)]
    ws = [Mxfp4Tensor(w.blocks.to(DEV), w.scales.to(DEV), torch.bfloat16, w.along_rows) for w in ws]
    bg, bu, bd = [(torch.randn(E2, n, generator=gen) * 0.5).to(torch.bfloat16).to(DEV) for n in (I2, I2, H2)]
    x = torch.randn(1, H2, generator=gen).to(torch.bfloat16).to(DEV)
    ids = torch.tensor([[2, 0]], dtype=torch.int32, device=DEV)
    rw = torch.tensor([[0.7, 0.3]], dtype=torch.bfloat16, device=DEV)
    tau = torch.full((E2,), 0.05, device=DEV)
    y_ref, c_ref = sparse_mxfp4_ref(x, *ws, bg, bu, bd, ids, rw, tau)
    y, c = sparse_mxfp4(x, *ws, bg, bu, bd, ids, rw, tau, BLOCK_I=32, flat=flat)
    assert torch.equal(c, c_ref) and 0 < int(c.sum()) < 2 * I2 and rel_err(y, y_ref) < 1e-5


def test_accumulate_small_blocks(experts):
    """accumulate=True adds to what the caller put in out / count; BLOCK_I 8: four programs share a down scale row
    (H = 160 is 5 blocks of 32: a first part of 4 and a second of 1); both word layouts."""
    wg, wu, wd, bg, bu, bd = experts
    x, ids, rw = problem(1, torch.float32, seed=5)
    tau = tau_for(act_abs(x, wg, bg, ids), ids, 0.5)
    y_ref, c_ref = sparse_mxfp4_ref(x, wg, wu, wd, bg, bu, bd, ids, rw, tau)
    out = torch.full((1, H), 0.25, device=DEV)
    cnt = torch.full((1, K), 3, dtype=torch.int32, device=DEV)
    sparse_mxfp4(x, wg, wu, wd, bg, bu, bd, ids, rw, tau, out, count=cnt, accumulate=True, BLOCK_I=8)
    assert torch.equal(cnt, c_ref + 3) and rel_err(out, y_ref + 0.25) < 1e-5


def pooled(w: Mxfp4Tensor, experts_in_slots, host: bool) -> tuple[Mxfp4Tensor, Mxfp4Tensor]:
    """(a device pool holding the given experts in slots 0.., the master copy: in host memory, pinned on CUDA)."""
    pool = Mxfp4Tensor(*(t[experts_in_slots].clone() for t in w.parts()), w.dtype, w.along_rows)
    parts = [t.cpu().pin_memory() if host and DEV == "cuda" else t.clone() for t in w.parts()]
    return pool, Mxfp4Tensor(*parts, w.dtype, w.along_rows)


@pytest.mark.parametrize("gates", ["same-table", "gate-table"])
def test_offload_addressing_totals_and_residual(experts, gates):
    """Experts 0 and 2 in pool slots (gates: also 4 when the gates have their own table), the rest read from the host
    copies in place; y (bf16, + residual) equals the resident reference; the running totals count kept neurons,
    rows read and rows read from the host."""
    wg, wu, wd, bg, bu, bd = experts
    x, ids, rw = problem(2, torch.bfloat16, seed=7)
    tau = tau_for(act_abs(x, wg, bg, ids), ids, 0.5)
    y_ref, c_ref = sparse_mxfp4_ref(x, wg, wu, wd, bg, bu, bd, ids, rw, tau)
    table = torch.tensor([1, -1, 0, -1, -1], device=DEV)
    gate_slots = [2, 0, 4] if gates == "gate-table" else [2, 0]
    gate_table = torch.tensor([1, -1, 0, -1, 2], device=DEV) if gates == "gate-table" else None
    (pg, mg), (pu, mu), (pd, md) = pooled(wg, gate_slots, True), pooled(wu, [2, 0], True), pooled(wd, [2, 0], True)
    residual = torch.randn(2, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(DEV)
    totals = [torch.zeros((), dtype=torch.int64, device=DEV) for _ in range(3)]
    y, c = sparse_mxfp4(
        x, mg, mu, md, bg, bu, bd, ids, rw, tau, torch.empty(2, H, dtype=torch.bfloat16, device=DEV),
        slot_table=table, pool_gate=pg, pool_up=pu, pool_down_t=pd, gate_table=gate_table,
        kept_total=totals[0], read_rows=totals[1], host_rows=totals[2], residual=residual, BLOCK_I=32,
    )  # fmt: skip
    assert torch.equal(c, c_ref)
    assert rel_err(y, (residual.float() + y_ref.to(torch.bfloat16).float()).to(torch.bfloat16)) < 1e-2
    absent = (table[ids.long()] < 0).cpu()
    g_absent = absent if gate_table is None else (gate_table[ids.long()] < 0).cpu()
    cc = c_ref.cpu().long()
    assert int(totals[0]) == int(cc.sum()) and int(totals[1]) == int((I + 2 * cc).sum())
    assert int(totals[2]) == int((g_absent * I + absent * 2 * cc).sum())


@pytest.mark.parametrize(
    "case,match",
    [
        ("down-along-rows", "w_down_t must have along_rows=False"),
        ("plain-weights", "must be Mxfp4Tensors"),
        ("bias-shape", "b_up must be a contiguous float"),
        ("tau-dtype", "tau must be a float32"),
        ("accumulate-no-out", "accumulate=True needs out="),
        ("pools-partial", "must be given together"),
        ("block-i", "BLOCK_I must be a power of two <= 32"),
        ("flat", "flat must be 0"),
    ],
)
def test_rejects(experts, case, match):
    wg, wu, wd, bg, bu, bd = experts
    x, ids, rw = problem(1, torch.float32, seed=0)
    tau = torch.zeros(E, device=DEV)
    args = [x, wg, wu, wd, bg, bu, bd, ids, rw, tau]
    kw = {}
    if case == "down-along-rows":
        args[3] = wu
    elif case == "plain-weights":
        args[1] = wg.dequantize()
    elif case == "bias-shape":
        args[5] = bu[:, :64]
    elif case == "tau-dtype":
        args[9] = tau.double()
    elif case == "accumulate-no-out":
        kw = {"accumulate": True}
    elif case == "pools-partial":
        kw = {"slot_table": torch.zeros(E, dtype=torch.int32, device=DEV), "pool_gate": wg}
    elif case == "flat":
        kw = {"flat": 3}
    else:
        kw = {"BLOCK_I": 64}
    with pytest.raises(ValueError, match=match):
        sparse_mxfp4(*args, **kw)
