"""Tests of kernels/moe_front.py: residual add + RMSNorm + router top-k + shared-expert gate in one launch, against
its torch reference and against transformers' own modules (Qwen3_5MoeRMSNorm, Qwen3_5MoeTopKRouter).

Runs on CPU under TRITON_INTERPRET=1 (on a GPU with TRITON_INTERPRET=0, compiled). Shapes: Qwen3.5-35B-A3B
(H 2048, E 256, k 8), Qwen3-30B-A3B (E 128, no shared-expert gate: its decoder layer's front) and odd sizes; fp32
and bf16; both norm kinds; with and without the shared-expert gate; block_e 1 and 4.
Shape legend: H hidden, E experts, k top-k.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from localmoe.kernels.department_slots import department_slots_ref  # noqa: E402
from localmoe.kernels.gate_predictor import department_basis_ref, quantize_rows  # noqa: E402
from localmoe.kernels.moe_front import moe_front, moe_front_ref  # noqa: E402
from localmoe.kernels.router_topk import router_tickets, router_topk_ref  # noqa: E402
from localmoe.kernels.token_tail import SharedExpert, shared_expert_term  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0" else "cpu"
SHAPES = [(2048, 256, 8), (2048, 128, 8), (100, 60, 4), (33, 7, 1)]  # H, E, k (E 128: Qwen3-30B-A3B, no shared expert)


def _inputs(H, E, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 1, H, generator=gen).to(DEV, dtype)
    r = (torch.randn(1, 1, H, generator=gen) * 2).to(DEV, dtype)
    nw = (torch.randn(H, generator=gen) * 0.1).to(DEV, dtype)
    w = (torch.randn(E, H, generator=gen) / H**0.5).to(DEV, dtype)
    sg = (torch.randn(1, H, generator=gen) / H**0.5).to(DEV, dtype)
    return x, r, nw, w, sg


@pytest.mark.parametrize("block_e", [1, 4])
@pytest.mark.parametrize("kind", ["zero_centred", "standard"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "H{}E{}k{}".format(*s))
@torch.no_grad()
def test_matches_reference(shape, dtype, kind, block_e):
    H, E, k = shape
    x, r, nw, w, sg = _inputs(H, E, dtype, seed=H + E + k)
    with_gate = H != 33 and E != 128  # Qwen3-30B-A3B's front: no shared expert gate
    got = moe_front(
        x, r, nw, 1e-6, kind, w, k, True, sg if with_gate else None, block_e=block_e, residual_early=block_e == 4
    )  # the residual loaded before the PDL wait: same results
    want = moe_front_ref(x, r, nw, 1e-6, kind, w, k, True, sg if with_gate else None)
    s, h, logits, tw, ti, g = got
    torch.testing.assert_close(s, want[0], rtol=0, atol=0)  # one rounding of x + residual
    one_step = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(h, want[1], **one_step)
    torch.testing.assert_close(logits[0], want[2], **one_step)
    # selection and weights exactly as the reference computes them from the kernel's own logits
    _, rw, ri = router_topk_ref(h[None], w, k, True, logits=logits)
    assert torch.equal(ti, ri)
    torch.testing.assert_close(tw, rw, rtol=1e-6, atol=1e-7)  # fp32: softmax sums in another order; bf16: equal
    if with_gate:
        torch.testing.assert_close(g, want[5], **one_step)
    else:
        assert g is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.no_grad()
def test_matches_transformers_modules(dtype):
    """s, h and routing against Qwen3.5's RMSNorm and router modules; tickets are zero again afterwards."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm, Qwen3_5MoeTopKRouter

    H, E, k = 64, 16, 4
    cfg = Qwen3_5MoeTextConfig(hidden_size=H, num_experts=E, num_experts_per_tok=k)
    x, r, nw, w, sg = _inputs(H, E, dtype, seed=7)
    norm = Qwen3_5MoeRMSNorm(H, eps=1e-6).to(DEV, dtype)
    norm.weight.copy_(nw)
    router = Qwen3_5MoeTopKRouter(cfg).to(DEV, dtype)
    router.weight.copy_(w)
    tickets = router_tickets(DEV, 1)
    s, h, logits, tw, ti, g = moe_front(x, r, nw, 1e-6, "zero_centred", w, k, True, sg, tickets=tickets)
    want_s = x + r
    want_h = norm(want_s)
    torch.testing.assert_close(s, want_s.reshape(-1), rtol=0, atol=0)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(h, want_h.reshape(-1), **tol)
    _, want_w, want_i = router(h[None])
    assert set(ti[0].tolist()) == set(want_i[0].tolist())
    torch.testing.assert_close(tw, want_w, **tol)
    torch.testing.assert_close(g, torch.sigmoid(torch.nn.functional.linear(h[None], sg)).reshape(1), **tol)
    assert int(tickets.abs().sum()) == 0


def _shared_weights(I_s, H, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(I_s, H, generator=gen) / H**0.5).to(DEV, dtype) for _ in range(3))


# the launch's parameters (4 neurons / 4 warps) at the real shape; 1 / 2 as well on the odd one (at the real shape its
# 512 programs of one neuron cost the interpreter ~15 s)
SHARED_CASES = [((2048, 256, 8, 512), 4, 4), ((100, 60, 4, 37), 4, 4), ((100, 60, 4, 37), 1, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "shape,block_s,num_warps", SHARED_CASES, ids=["H{}E{}k{}Is{}-{}-{}".format(*s, b, w) for s, b, w in SHARED_CASES]
)
@torch.no_grad()
def test_shared_expert_into_acc(shape, dtype, block_s, num_warps):
    """shared_expert=: acc += sg * the shared expert's output (fp32, as sparse_fused's shared programs), added to
    what acc held; the routing outputs are those of the launch without it."""
    H, E, k, I_s = shape
    x, r, nw, w, sg = _inputs(H, E, dtype, seed=H + I_s)
    sw = _shared_weights(I_s, H, dtype, seed=I_s)
    acc = torch.randn(H, generator=torch.Generator().manual_seed(1)).to(DEV)
    before = acc.clone()
    got = moe_front(
        x,
        r,
        nw,
        1e-6,
        "zero_centred",
        w,
        k,
        True,
        sg,
        block_e=4,
        num_warps=num_warps,
        residual_early=True,
        shared_expert=sw,
        acc=acc,
        shared_block=block_s,
    )
    plain = moe_front(x, r, nw, 1e-6, "zero_centred", w, k, True, sg, block_e=4, num_warps=num_warps)
    for a, b in zip(got[:5], plain[:5]):
        assert torch.equal(a, b)
    assert got[5] is None  # the gate is applied inside: not returned
    h, g = plain[1], plain[5]
    want = shared_expert_term(h[None], SharedExpert(*sw, g))[0]
    torch.testing.assert_close(acc - before, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "shape", [(2048, 80, 8, 20, 2, 768), (40, 12, 3, 3, 2, 0)], ids=lambda s: "H{}E{}k{}n{}g{}Is{}".format(*s)
)
@torch.no_grad()
def test_group_limited_routing(shape, dtype):
    """DeaMoE's front: the group-limited top-k (experts of the g best departments of n only), with its shared
    expert added into the department output row, as router_topk's group mode selects from the kernel's logits, and
    the step's department slots (`slots=`) as kernels/department_slots.py writes them from that top-k."""
    H, E, k, n, g, I_s = shape
    x, r, nw, w, sg = _inputs(H, E, dtype, seed=E + n)
    S = min(E // n, g)  # the slots a one-token step needs (DepartmentExperts: min(D, T * topk_group))
    dept = torch.full((S,), 7, dtype=torch.int32, device=DEV)  # garbage: every value is written
    sw = torch.full((S, 1, n), 3.0, device=DEV)
    kw = dict(group_size=n, topk_group=g, block_e=4, residual_early=True, slots=(n, dept, sw))
    if I_s:
        acc = torch.zeros(H, device=DEV)
        s, h, logits, tw, ti, _ = moe_front(
            x, r, nw, 1e-6, "zero_centred", w, k, True, sg, shared_expert=_shared_weights(I_s, H, dtype, seed=n),
            acc=acc, **kw
        )  # fmt: skip
        assert acc.abs().sum() > 0
    else:
        s, h, logits, tw, ti, _ = moe_front(x, r, nw, 1e-6, "standard", w, k, True, None, **kw)
    _, rw, ri = router_topk_ref(h[None], w, k, True, logits=logits, group_size=n, topk_group=g)
    assert torch.equal(ti, ri)
    torch.testing.assert_close(tw, rw, rtol=1e-6, atol=1e-7)
    assert len(set((ti[0] // n).tolist())) <= g
    want_dept, want_w = department_slots_ref(ti, tw, n, S)  # slots=: what the slotting launch writes
    assert torch.equal(dept, want_dept) and torch.equal(sw, want_w)
    want = moe_front_ref(x, r, nw, 1e-6, "zero_centred" if I_s else "standard", w, k, True, group_size=n, topk_group=g)
    one_step = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(logits[0], want[2], **one_step)


@pytest.mark.parametrize("shape", [(2048, 64, 6, 8, 1), (40, 12, 3, 3, 2)], ids=lambda s: "H{}E{}k{}n{}g{}".format(*s))
@torch.no_grad()
def test_fp32_router_with_bf16_activations(shape):
    """DeepSeek-V2's front: a bf16 token and an fp32 router (transformers computes its logits in fp32): logits and
    top-k weights stay fp32 (no rounding to x's dtype), as router_topk's reference on the kernel's h, group-limited."""
    H, E, k, n, g = shape
    x, r, nw, w, _ = _inputs(H, E, torch.bfloat16, seed=E)
    w = w.float()
    s, h, logits, tw, ti, _ = moe_front(x, r, nw, 1e-6, "standard", w, k, False, None, group_size=n, topk_group=g)
    assert logits.dtype == torch.float32 and tw.dtype == torch.float32 and h.dtype == torch.bfloat16
    want_logits, rw, ri = router_topk_ref(h[None], w, k, False, group_size=n, topk_group=g)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    _, rw, ri = router_topk_ref(h[None], w, k, False, logits=logits, group_size=n, topk_group=g)
    assert torch.equal(ti, ri)
    torch.testing.assert_close(tw, rw, rtol=1e-6, atol=1e-7)
    want = moe_front_ref(x, r, nw, 1e-6, "standard", w, k, False, group_size=n, topk_group=g)
    assert torch.equal(s, want[0]) and torch.equal(h, want[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.no_grad()
def test_granite_scales(dtype):
    """GraniteMoE's residual_multiplier on both branches inside the launch: s = round(x · m) + residual (as
    transformers' `h * m`, then the add) and the top-k weights times m, each rounded as the two multiplies did."""
    H, E, k, m = 96, 10, 4, 0.22
    x, r, nw, w, _ = _inputs(H, E, dtype, seed=9)
    s, h, logits, tw, ti, _ = moe_front(x, r, nw, 1e-6, "standard", w, k, True, None, x_scale=m, w_scale=m)
    plain = moe_front(x * m, r, nw, 1e-6, "standard", w, k, True, None)  # the scale as its own multiply, before
    want = moe_front_ref(x, r, nw, 1e-6, "standard", w, k, True, x_scale=m, w_scale=m)
    if dtype == torch.float32:  # compiled for a GPU, x·m + residual may contract into one FMA: one rounding fewer
        for got, ref in ((s, plain[0]), (h, plain[1]), (s, want[0])):
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    else:  # bf16: the product is rounded to x's dtype before the add, as transformers' `h * m`, so no FMA forms
        assert torch.equal(s, plain[0]) and torch.equal(h, plain[1]) and torch.equal(s, want[0])
    assert torch.equal(ti, plain[4]) and torch.equal(ti[0], want[4])
    assert torch.equal(tw, plain[3] * m)  # and after
    torch.testing.assert_close(tw[0], want[3], rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)


def test_launcher_checks():
    x, r, nw, w, sg = _inputs(32, 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match="one token"):
        moe_front(torch.cat([x, x], 1), r, nw, 1e-6, "standard", w, 2)
    with pytest.raises(TypeError, match="dtype"):
        moe_front(x, r.double(), nw, 1e-6, "standard", w, 2)
    with pytest.raises(ValueError, match="kind"):
        moe_front(x, r, nw, 1e-6, "gated", w, 2)
    with pytest.raises(ValueError, match="top_k"):
        moe_front(x, r, nw, 1e-6, "standard", w, 9)
    with pytest.raises(ValueError, match="router_weight"):
        moe_front(x, r, nw, 1e-6, "standard", w[:, :16], 2)
    with pytest.raises(ValueError, match="block_e"):
        moe_front(x, r, nw, 1e-6, "standard", w, 2, block_e=3)
    sw = _shared_weights(16, 32, torch.float32, seed=2)
    acc = torch.zeros(32, device=DEV)
    with pytest.raises(ValueError, match="w_sg"):
        moe_front(x, r, nw, 1e-6, "standard", w, 2, shared_expert=sw, acc=acc)
    with pytest.raises(ValueError, match="acc"):
        moe_front(x, r, nw, 1e-6, "standard", w, 2, True, sg, shared_expert=sw, acc=acc[:16])
    with pytest.raises(ValueError, match="give both"):
        moe_front(x, r, nw, 1e-6, "standard", w, 2, True, sg, acc=acc)
    with pytest.raises(ValueError, match="shared_expert w_up"):
        moe_front(x, r, nw, 1e-6, "standard", w, 2, True, sg, shared_expert=(sw[0], sw[1][:, :16], sw[2]), acc=acc)
    with pytest.raises(ValueError, match="shared_block"):
        moe_front(x, r, nw, 1e-6, "standard", w, 2, True, sg, shared_expert=sw, acc=acc, shared_block=3)


BASIS_CASES = [((2048, 256, 8, 512), 8, 64, None), ((2048, 128, 8, 0), 8, 64, 4), ((100, 60, 4, 37), 3, 5, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "shape,N,r,block", BASIS_CASES, ids=["H{}E{}k{}Is{}-N{}r{}-b{}".format(*s, n, r, b) for s, n, r, b in BASIS_CASES]
)
@torch.no_grad()
def test_basis_is_department_basis_of_h(shape, dtype, N, r, block):
    """basis=: z = sB · (qB · h) for every department, h the launch's own normed row (department_basis' reference
    over all N departments); the routing outputs (and the shared expert's row) are those of the launch without it."""
    H, E, k, I_s = shape
    x, r_, nw, w, sg = _inputs(H, E, dtype, seed=H + N + r)
    gen = torch.Generator().manual_seed(N * r)
    B, B_scale = (t.to(DEV) for t in quantize_rows(torch.randn(N, r, H, generator=gen)))
    z = torch.full((1, N, r), float("nan"), device=DEV)
    shared = {}
    if I_s:
        shared = {"shared_expert": _shared_weights(I_s, H, dtype, seed=I_s), "acc": torch.zeros(H, device=DEV)}
    got = moe_front(x, r_, nw, 1e-6, "zero_centred", w, k, True, sg, basis=(B, B_scale, z), basis_block=block, **shared)
    plain_shared = {"shared_expert": shared["shared_expert"], "acc": torch.zeros(H, device=DEV)} if I_s else {}
    plain = moe_front(x, r_, nw, 1e-6, "zero_centred", w, k, True, sg, **plain_shared)
    for a, b in zip(got[:5], plain[:5]):
        assert torch.equal(a, b)
    if I_s:
        torch.testing.assert_close(shared["acc"], plain_shared["acc"], rtol=1e-5, atol=1e-5)
    every = torch.arange(N, device=DEV)[None]  # one "expert" a department: every row of z is computed
    want = department_basis_ref(got[1].view(1, H), B, B_scale, torch.arange(N, device=DEV), every)
    torch.testing.assert_close(z, want, rtol=1e-5, atol=1e-4)


def test_basis_refusals():
    x, r, nw, w, sg = _inputs(64, 8, torch.float32, seed=3)
    B, B_scale = (t.to(DEV) for t in quantize_rows(torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(0))))
    z = torch.empty(1, 2, 4, device=DEV)
    with pytest.raises(ValueError, match="basis B must be a contiguous int8"):
        moe_front(x, r, nw, 1e-6, "standard", w, 2, basis=(B.float(), B_scale, z))
    with pytest.raises(ValueError, match="basis z must be"):
        moe_front(x, r, nw, 1e-6, "standard", w, 2, basis=(B, B_scale, z[:, :1]))
    with pytest.raises(ValueError, match="basis_block must be a power of two"):
        moe_front(x, r, nw, 1e-6, "standard", w, 2, basis=(B, B_scale, z), basis_block=3)
    dept, sw = torch.empty(2, dtype=torch.int32, device=DEV), torch.empty(2, 1, 4, device=DEV)
    with pytest.raises(ValueError, match="slots= is DeaMoE's"):
        moe_front(x, r, nw, 1e-6, "standard", w, 2, slots=(4, dept, sw))
    with pytest.raises(ValueError, match="slots weights must be"):
        moe_front(x, r, nw, 1e-6, "standard", w, 2, group_size=4, topk_group=1, slots=(4, dept, sw[:, :, :2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(2880, 32, 4), (100, 60, 4)], ids=lambda s: "H{}E{}k{}".format(*s))
@torch.no_grad()
def test_router_bias(shape, dtype):
    """router_bias= (GPT-OSS's router): logits h · Wᵀ + b rounded once, the top-k as router_topk's reference with
    that bias selects and weights from the kernel's logits (GPT-OSS: E 32, k 4, H 2880; its norm as zero_centred)."""
    H, E, k = shape
    x, r, nw, w, _ = _inputs(H, E, dtype, seed=H + E)
    b = (torch.randn(E, generator=torch.Generator().manual_seed(E)) * 0.5).to(DEV, dtype)
    s, h, logits, tw, ti, _ = moe_front(x, r, nw, 1e-6, "zero_centred", w, k, True, None, router_bias=b)
    want = moe_front_ref(x, r, nw, 1e-6, "zero_centred", w, k, True, router_bias=b)
    one_step = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(logits[0], want[2], **one_step)
    torch.testing.assert_close(logits[0].float(), (h.float() @ w.float().T + b.float()).to(dtype).float(), **one_step)
    _, rw, ri = router_topk_ref(h[None], w, k, True, logits=logits)
    assert torch.equal(ti, ri)
    torch.testing.assert_close(tw, rw, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="router_bias must hold"):
        moe_front(x, r, nw, 1e-6, "zero_centred", w, k, True, None, router_bias=b[:-1])
