"""The CPU's share of an offloaded prompt piece (experts/cpu_share.py, `Staging.cpu_share`): some absent experts of
each layer computed on the CPU from their host copies while the rest are staged; the logits and greedy tokens equal
the resident model's, those experts cross no bus (fewer bytes copied), the layer ahead is filled without them, and
4-bit experts, decode-sized calls and a share of 0 leave the path as it was. Real engines on the tiny checkpoints
of conftest, on the CPU (the staging and the grouped GEMMs run there too; the worker is a thread either way)."""

from __future__ import annotations

import pytest
import torch
from conftest import repo_id
from offload_support import budget_for, tokens

from localmoe.engine.engine import Engine
from localmoe.experts import cpu_share
from localmoe.experts.cpu_share import CpuRates
from localmoe.experts.staging import Staging

PROMPT = "Departments share weights, experts keep their own. " * 2


def _logits(e: Engine, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return e.model(input_ids=ids).logits


def _engines():
    """(the resident qwen3_moe engine, PROMPT's ids, its logits, an offloaded engine: 3 slots, spans of 2)."""
    model = repo_id("qwen3_moe")
    resident = Engine.load(model, device="cpu", sparsity=0.0)
    ids = torch.tensor([resident.encode_raw(PROMPT)])
    e = Engine.load(model, device="cpu", sparsity=0.0, vram_gib=budget_for(model, 3))
    e.loaded.cache.staging.span = 2
    return resident, ids, _logits(resident, ids), e


@pytest.mark.parametrize("share", [0.5, 1.0])
def test_cpu_experts_give_the_resident_logits_with_fewer_bytes_copied(share, monkeypatch):
    resident, ids, want, e = _engines()
    cache = e.loaded.cache
    layers = len(e.loaded.experts)
    figures = {}
    for s in (0.0, share):
        monkeypatch.setattr(Staging, "cpu_share", s)
        cache.reset_stats()
        got = _logits(e, ids)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        figures[s] = (cache.hits, cache.misses, cache.copied_bytes)
    on_cpu = [cache.staging.cpu_experts(cache, layer) for layer in range(layers)]
    absent = [sum(s < 0 for s in cache.sources(layer)[1]) for layer in range(layers)]
    assert [len(c) for c in on_cpu] == [int(n * share) for n in absent] and all(on_cpu)
    assert all(c == sorted(c) and c[-1] == max(e for e, s in enumerate(cache.sources(i)[1]) if s < 0)
               for i, c in enumerate(on_cpu))  # fmt: skip
    assert figures[share][:2] == figures[0.0][:2]  # the same experts looked up, hits and misses
    assert figures[share][2] < figures[0.0][2]  # their bytes did not cross
    if share == 1.0:
        assert figures[share][2] == 0
    assert tokens(e, n=8) == tokens(resident, n=8)


def test_the_layer_ahead_is_filled_without_the_cpu_experts(monkeypatch):
    monkeypatch.setattr(Staging, "cpu_share", 0.5)
    model = repo_id("qwen3_moe")
    e = Engine.load(model, device="cpu", sparsity=0.0, vram_gib=budget_for(model, 3))
    cache, staging = e.loaded.cache, e.loaded.cache.staging
    staging.span = 2
    E = cache.num_experts
    cpu = staging.cpu_experts(cache, 0)
    staged = [x for x in range(E) if x not in cpu]
    spans = [staged[first : first + n] for first, n, _, _ in cache.stream(0, staged, cpu=cpu)]
    assert [x for s in spans for x in s] == staged
    ahead = staging.ahead
    want = [x for x in range(E) if x not in staging.cpu_experts(cache, 1)]
    assert ahead[0] == 1 and ahead[1] == [want[:2], want[2:4]]
    assert staging._take_ahead(1, [want[:2], want[2:4]]).keys() == {0, 1}


def test_int4_experts_and_a_share_of_0_take_none(monkeypatch):
    model = repo_id("qwen3_moe")
    e = Engine.load(model, device="cpu", sparsity=0.0, experts="int4", vram_gib=budget_for(model, 3, "int4"))
    cache = e.loaded.cache
    monkeypatch.setattr(Staging, "cpu_share", 0.5)
    assert cache.staging.cpu_experts(cache, 0) == [] and e.loaded.experts[0]._cpu_experts(64) == []
    f = Engine.load(model, device="cpu", sparsity=0.0, vram_gib=budget_for(model, 3))
    assert f.loaded.experts[0]._cpu_experts(64)
    monkeypatch.setattr(Staging, "cpu_share", 0.0)
    assert f.loaded.experts[0]._cpu_experts(64) == []
    monkeypatch.setattr(Staging, "cpu_share", None)  # automatic: off the GPU, no rates measured, no share
    assert f.loaded.experts[0]._cpu_experts(64) == [] and f.loaded.cache.staging.rates is None


def test_the_automatic_share_balances_the_rates():
    """f = t_pcie / (t_pcie + fixed + rows·row), none below MIN_SHARE, at most MAX_SHARE: more rows an expert (a
    longer piece), a smaller share."""
    rates = CpuRates(pcie=1.0, fixed=1.0, row=0.5)
    assert rates.share(0) == cpu_share.MAX_SHARE
    assert rates.share(8) == pytest.approx(1 / 6)
    assert rates.share(16) == pytest.approx(1 / 10)
    assert CpuRates(pcie=1.0, fixed=1.0, row=1.0).share(16) == 0.0  # 1/18 < MIN_SHARE
    assert CpuRates(pcie=1.0, fixed=0.0, row=0.0).share(cpu_share.MAX_ROWS + 1) == 0.0  # a long piece: none
    assert CpuRates(0.0, 0.0, 0.0).share(10) == 0.0


def test_the_rates_are_measured_on_the_machine():
    """`measure` times a master copy's expert at two row counts; with no GPU nothing crosses a bus (no share)."""
    model = repo_id("qwen3_moe")
    e = Engine.load(model, device="cpu", sparsity=0.0, vram_gib=budget_for(model, 3))
    cache = e.loaded.cache
    rates = cpu_share.measure(cache.masters[0], 3 * cache.row_bytes * cache.width, cache.device)
    assert rates.pcie == 0.0 and rates.fixed >= 0.0 and rates.row >= 0.0 and rates.fixed + rates.row > 0
    assert rates.share(1) == 0.0


def test_the_automatic_share_follows_the_piece(monkeypatch):
    """With rates given (as CUDA measures them), a short piece's layers give the CPU a share and a long one's none
    (more rows an expert than MAX_ROWS), and the logits stay the resident model's."""
    monkeypatch.setattr(Staging, "cpu_share", None)
    _, ids, want, e = _engines()
    cache = e.loaded.cache
    k = e.loaded.config.num_experts_per_tok
    rows = ids.numel() * k / cache.num_experts  # the prompt's rows an expert
    cache.staging.rates = CpuRates(pcie=1.0, fixed=0.0, row=1.0 / rows)  # the balance at 0.5 for this prompt
    monkeypatch.setattr(cpu_share, "MAX_ROWS", rows)  # the tiny model's few experts: more rows an expert
    assert cache.staging.cpu_experts(cache, 0, ids.numel() * k)
    assert cache.staging.cpu_experts(cache, 0, 100 * ids.numel() * k) == []
    cache.reset_stats()
    torch.testing.assert_close(_logits(e, ids), want, rtol=1e-4, atol=1e-4)
    assert cache.copied_bytes < cache.misses * 3 * cache.row_bytes * cache.width
