"""Tests of kernels/router_topk.py: the one-launch softmax top-k router vs transformers' router modules.

Runs on CPU under TRITON_INTERPRET=1 (on a GPU with TRITON_INTERPRET=0, compiled). Checks, at Qwen3.5-35B shapes
(E 256, H 2048, k 8), Qwen3-30B-like (E 128, k 8) and odd sizes, fp32 and bf16, several tokens per launch:
* logits vs F.linear: fp32 within a few ulp, bf16 equal or one rounding step apart;
* selection and weights exactly equal to `router_topk_ref` (stable sort: ties -> lowest index) computed from the
  kernel's own logits: the softmax/top-k/renormalise/cast part is exact;
* vs transformers' `Qwen3_5MoeTopKRouter` (renormalises) / `OlmoeTopKRouter` (norm_topk_prob False): same indices in
  the same order on every row without a tie at the k-th value (torch.topk on CPU breaks ties by nth_element, not by
  index; on CUDA every row is compared), weights close;
* `router_topk_of_logits` (a prompt piece's logits from F.linear, strided rows) exactly equal to the reference on the
  same logits, plain and group-limited, and the transformers router's picks on tie-free rows;
* forced ties: lowest indices win; the ticket buffer is zero after each launch (reusable, graph-capturable);
* group-limited top-k (DeaMoE departments: group_size n, topk_group g): kernel == ref (tiny DeaMoE E 30 n 5, odd
  and E 768 n 12 shapes), ref == departments.group_limited_topk on tie-free rows, department ties -> lowest
  department, g >= D == plain routing, bad group arguments -> ValueError.
Shape legend: T tokens, H hidden, E experts, k top-k.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from localmoe.kernels.router_topk import (  # noqa: E402
    router_tickets,
    router_topk,
    router_topk_of_logits,
    router_topk_ref,
)

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "0" else "cpu"
# T, H, E, k
SHAPES = [(1, 2048, 256, 8), (4, 2048, 128, 8), (3, 100, 60, 4), (2, 33, 7, 1), (1, 32, 8, 2)]


def _hf_router(E, H, k, norm):
    from transformers import OlmoeConfig, Qwen3_5MoeTextConfig
    from transformers.models.olmoe.modeling_olmoe import OlmoeTopKRouter
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter

    if norm:
        return Qwen3_5MoeTopKRouter(Qwen3_5MoeTextConfig(hidden_size=H, num_experts=E, num_experts_per_tok=k))
    return OlmoeTopKRouter(OlmoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=k, norm_topk_prob=False))


def _tie_at_kth(logits, idx):
    kth = logits.gather(1, idx[:, -1:])
    return (logits == kth).sum(1) > 1


@pytest.mark.parametrize("norm", [True, False], ids=["renorm", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}H{}E{}k{}".format(*s))
@torch.no_grad()
def test_matches_transformers_router(shape, dtype, norm):
    T, H, E, k = shape
    gen = torch.Generator().manual_seed(T * 1000 + E + k)
    router = _hf_router(E, H, k, norm).to(DEV, dtype)
    router.weight.copy_((torch.randn(E, H, generator=gen) / H**0.5).to(dtype))
    x = torch.randn(T, H, generator=gen).to(DEV, dtype)
    want_logits, want_w, want_i = router(x)
    logits, w, idx = router_topk(x, router.weight, k, norm)
    assert logits.dtype == want_logits.dtype and w.dtype == want_w.dtype and idx.dtype == torch.int64
    assert w.shape == want_w.shape and idx.shape == want_i.shape
    if dtype == torch.float32:
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    else:  # one bf16 rounding step at most (accumulation order)
        torch.testing.assert_close(logits.float(), want_logits.float(), rtol=8e-3, atol=1e-3)
    # the selection / weights part is exact given the logits
    _, ref_w, ref_i = router_topk_ref(x, router.weight, k, norm, logits=logits)
    assert torch.equal(idx, ref_i)
    exact = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=0, atol=0)
    torch.testing.assert_close(w, ref_w, **exact)
    # vs transformers' torch.topk: rows where both saw the same logits and no tie sits at the k-th value
    # (the same experts with the same weights; the order of equal logits inside the top k is torch.topk's own choice
    # on CUDA, so the comparison goes by expert id)
    rows = (logits == want_logits).all(1) & ~_tie_at_kth(want_logits.float(), want_i)  # ties: any index may win
    assert torch.equal(idx[rows].sort(1).values, want_i[rows].sort(1).values)
    dense = lambda i, v: torch.zeros(int(rows.sum()), E, device=DEV).scatter(1, i[rows], v[rows].float())  # noqa: E731
    torch.testing.assert_close(
        dense(idx, w),
        dense(want_i, want_w),
        rtol=1e-5 if dtype == torch.float32 else 8e-3,
        atol=1e-6 if dtype == torch.float32 else 1e-3,
    )
    assert int(router_tickets(DEV).abs().sum()) == 0


@torch.no_grad()
def test_ties_take_lowest_index_and_tickets_reset():
    E, H, k = 16, 8, 3
    w = torch.zeros(E, H, device=DEV)
    w[:, 0] = torch.tensor([0.0, 2, 1, 2, 2, 0, 1, 2, 0, 0, 0, 0, 3, 0, 0, 2], device=DEV)
    x = torch.zeros(1, H, device=DEV)
    x[0, 0] = 1.0
    tickets = torch.zeros(4, dtype=torch.int32, device=DEV)
    for _ in range(2):  # the second launch reuses the (self-cleaned) tickets
        _, tw, ti = router_topk(x, w, k, True, tickets=tickets, block_e=4)
        assert ti.tolist() == [[12, 1, 3]]  # 3, then the two lowest of the tied 2s (1, 3, 4, 7, 15)
        assert int(tickets.abs().sum()) == 0
    p = torch.softmax(w[:, 0], 0)[[12, 1, 3]]
    torch.testing.assert_close(tw[0], p / p.sum())


@torch.no_grad()
def test_checks():
    x = torch.randn(1, 16, device=DEV)
    with pytest.raises(ValueError):
        router_topk(x, torch.randn(8, 15, device=DEV), 2)
    with pytest.raises(ValueError):
        router_topk(x, torch.randn(8, 16, device=DEV), 9)
    with pytest.raises(TypeError):
        router_topk(x, torch.randn(8, 16, device=DEV, dtype=torch.bfloat16), 2)
    with pytest.raises(ValueError):
        router_topk(x, torch.randn(8, 16, device=DEV), 2, tickets=torch.zeros(1, dtype=torch.int64, device=DEV))


# ----------------------------------------------------------------------------------------------------------
# group-limited top-k (DeaMoE departments)
# ----------------------------------------------------------------------------------------------------------
# T, H, E, n (group_size), k, g (topk_group)
GROUP_SHAPES = [(1, 64, 30, 5, 4, 2), (3, 96, 24, 6, 3, 2), (1, 2048, 768, 12, 8, 4)]


def _rand_router(T, H, E, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(E, H, generator=gen) / H**0.5).to(DEV, dtype)
    x = torch.randn(T, H, generator=gen).to(DEV, dtype)
    return x, w


@pytest.mark.parametrize("norm", [True, False], ids=["renorm", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", GROUP_SHAPES, ids=lambda s: "T{}H{}E{}n{}k{}g{}".format(*s))
@torch.no_grad()
def test_group_limited_matches_ref(shape, dtype, norm):
    T, H, E, n, k, g = shape
    x, w = _rand_router(T, H, E, dtype, T * 1000 + E + k + 3)  # seeds where the limit changes some row's pick
    logits, tw, ti = router_topk(x, w, k, norm, group_size=n, topk_group=g, block_e=64)
    if dtype == torch.float32:
        torch.testing.assert_close(logits, torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(logits.float(), torch.nn.functional.linear(x, w).float(), rtol=8e-3, atol=1e-3)
    _, ref_w, ref_i = router_topk_ref(x, w, k, norm, logits=logits, group_size=n, topk_group=g)
    assert torch.equal(ti, ref_i)
    exact = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=0, atol=0)
    torch.testing.assert_close(tw, ref_w, **exact)
    assert all(len(set((row // n).tolist())) <= g for row in ti)  # at most g departments per token
    plain = router_topk_ref(x, w, k, norm, logits=logits)[2]
    assert (ti.sort(1).values != plain.sort(1).values).any()  # the limit mattered on some row
    assert int(router_tickets(DEV).abs().sum()) == 0


@pytest.mark.parametrize("norm", [True, False], ids=["renorm", "plain"])
@pytest.mark.parametrize("cfg", [(30, 5, 4, 2), (24, 6, 3, 2), (768, 12, 8, 4), (64, 8, 6, 1)], ids=str)
@torch.no_grad()
def test_group_ref_matches_departments(cfg, norm):
    from localmoe.experts.departments import group_limited_topk

    E, n, k, g = cfg
    ranks = torch.rand(64, E, generator=torch.Generator().manual_seed(E + k)).argsort(-1)
    logits = ranks.float() * (8.0 / E) - 4.0  # distinct logits (no ties), each row a random permutation
    _, w, idx = router_topk_ref(None, None, k, norm, logits=logits, group_size=n, topk_group=g)
    want_i, want_p = group_limited_topk(torch.softmax(logits, -1), n, k, g)
    assert torch.equal(idx, want_i)
    want_w = want_p / want_p.sum(-1, keepdim=True) if norm else want_p
    torch.testing.assert_close(w, want_w, rtol=1e-6, atol=1e-7)


@torch.no_grad()
def test_group_ties_and_limit():
    # departments of 3 (D 4), g 2, k 3: dept 3 (max 5) and, of the tied depts 1 and 2 (max 2), the lower one
    E, H, k = 12, 8, 3
    row = torch.tensor([1.0, 0, 0, 0, 2, 0, 2, 0, 0, 0, 0, 5], device=DEV)
    w = torch.zeros(E, H, device=DEV)
    w[:, 0] = row
    x = torch.zeros(1, H, device=DEV)
    x[0, 0] = 1.0
    tickets = torch.zeros(2, dtype=torch.int32, device=DEV)
    for _ in range(2):
        _, tw, ti = router_topk(x, w, k, True, tickets=tickets, block_e=4, group_size=3, topk_group=2)
        assert ti.tolist() == [[11, 4, 3]]  # plain top-3 would be [11, 4, 6]; the 0s tie: lowest allowed index 3
        assert int(tickets.abs().sum()) == 0
    _, ref_w, ref_i = router_topk_ref(x, w, k, True, group_size=3, topk_group=2)
    assert ref_i.tolist() == [[11, 4, 3]]
    p = torch.softmax(row, 0)[[11, 4, 3]]  # softmax over all 12 logits
    torch.testing.assert_close(tw[0], p / p.sum())
    torch.testing.assert_close(ref_w[0], p / p.sum())
    assert router_topk(x, w, k, True, block_e=4)[2].tolist() == [[11, 4, 6]]


@torch.no_grad()
def test_topk_group_covering_all_departments_is_plain():
    T, H, E, n, k = 2, 64, 24, 6, 5
    x, w = _rand_router(T, H, E, torch.bfloat16, 7)
    plain = router_topk(x, w, k, True, block_e=32)
    for g in (E // n, E // n + 3):
        got = router_topk(x, w, k, True, block_e=32, group_size=n, topk_group=g)
        assert all(torch.equal(a, b) for a, b in zip(got, plain))
        ref = router_topk_ref(x, w, k, True, logits=plain[0], group_size=n, topk_group=g)
        assert all(torch.equal(a, b) for a, b in zip(ref, router_topk_ref(x, w, k, True, logits=plain[0])))


@pytest.mark.parametrize(
    "kw",
    [
        dict(group_size=5, topk_group=2),  # 24 % 5
        dict(group_size=6, topk_group=0),  # no groups kept
        dict(group_size=6),  # topk_group missing
        dict(group_size=2, topk_group=1),  # k 3 > 1 * 2
        dict(group_size=-6, topk_group=2),
        dict(topk_group=2),  # no group_size
    ],
    ids=str,
)
@torch.no_grad()
def test_group_checks(kw):
    x, w = torch.randn(1, 16, device=DEV), torch.randn(24, 16, device=DEV)
    with pytest.raises(ValueError):
        router_topk(x, w, 3, **kw)
    with pytest.raises(ValueError):
        router_topk_ref(x, w, 3, **kw)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
@torch.no_grad()
def test_deepseek_fp32_router(method):
    """DeepSeek-V2's router: fp32 weight over bf16 hidden states, softmax top-k without renormalisation, optionally
    group-limited (n_group groups scored by their best expert): transformers' DeepseekV2TopkRouter (before its
    routed_scaling_factor, which the block applies)."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    E, H, k, groups = 16, 64, 3, 4
    cfg = DeepseekV2Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=k, topk_method=method,
                           n_group=groups, topk_group=2, routed_scaling_factor=1.0)  # fmt: skip
    router = DeepseekV2TopkRouter(cfg).to(DEV)
    gen = torch.Generator().manual_seed(4)
    router.weight.copy_(torch.randn(E, H, generator=gen) / H**0.5)
    x = torch.randn(5, H, generator=gen).to(DEV, torch.bfloat16)
    logits, w, idx = router(x)
    group = {"group_size": E // groups, "topk_group": 2} if method != "greedy" else {}
    got_l, got_w, got_i = router_topk(x, router.weight, k, False, **group)
    assert got_l.dtype == got_w.dtype == torch.float32
    torch.testing.assert_close(got_l, logits, rtol=1e-5, atol=1e-5)
    order = idx.sort(-1)
    assert torch.equal(got_i.sort(-1).values, order.values)
    torch.testing.assert_close(got_w.gather(1, got_i.sort(-1).indices), w.gather(1, order.indices))


@pytest.mark.parametrize("group", [(0, 0), (8, 4)], ids=["plain", "group"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@torch.no_grad()
def test_of_logits_matches_ref_and_transformers(dtype, group):
    """A prompt piece's routing from F.linear's logits (read through a strided view, as a joined GEMM's columns):
    equal to the reference on those logits; plain, the transformers router's picks on rows without a tie."""
    T, H, E, k = 37, 64, 256, 8
    n, g = group
    router = _hf_router(E, H, k, True).to(DEV, dtype)
    gen = torch.Generator().manual_seed(11)
    router.weight.copy_((torch.randn(E, H, generator=gen) / H**0.5).to(dtype))
    x = torch.randn(T, H, generator=gen).to(DEV, dtype)
    wide = torch.nn.functional.linear(x, torch.cat([router.weight, router.weight[:3]]))  # [T, E + 3]
    logits = wide[:, :E]
    tw, ti = router_topk_of_logits(logits, k, True, group_size=n, topk_group=g)
    _, ref_w, ref_i = router_topk_ref(x, router.weight, k, True, logits=logits, group_size=n, topk_group=g)
    assert tw.dtype == dtype and torch.equal(ti, ref_i)
    torch.testing.assert_close(
        tw, ref_w, **(dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else {"rtol": 0, "atol": 0})
    )
    if n == 0:
        want_logits, want_w, want_i = router(x)
        rows = (logits == want_logits).all(1) & ~_tie_at_kth(want_logits.float(), want_i)
        assert rows.sum() > T // 2
        assert torch.equal(ti[rows].sort(1).values, want_i[rows].sort(1).values)
    with pytest.raises(ValueError, match="top_k"):
        router_topk_of_logits(logits, E + 1)
    with pytest.raises(ValueError, match="contiguous last dim"):
        router_topk_of_logits(logits.t(), k)
