"""Expert offloading on CPU with a small cache: outputs never change, the cache hits/misses/evicts as LRU should,
the slot tables stay consistent, stats are reported, and a budget too small for the non-expert part is refused."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import repo_id
from offload_support import GiB, budget_for, few_slots_engine, small_cache, tokens

from localmoe.cli.main import main
from localmoe.engine.engine import Engine
from localmoe.events import GenerationSettings
from localmoe.experts import placement
from localmoe.models.loaded import attach_cache


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe"])
@pytest.mark.parametrize("sparsity", [0.0, 0.5])
def test_greedy_tokens_equal_all_resident(family, sparsity):
    model = repo_id(family)
    resident = Engine.load(model, device="cpu", sparsity=sparsity)
    want = tokens(resident)
    k = resident.loaded.config.num_experts_per_tok
    total = sum(m.num_experts for m in resident.loaded.experts)
    for slots in (k, k + 3, total - 1):
        e = Engine.load(model, device="cpu", sparsity=sparsity, vram_gib=budget_for(model, slots))
        assert e.loaded.cache is not None and e.loaded.cache.slots == slots
        assert tokens(e) == want, slots
        assert 0.0 <= e.stats.cache_hit_rate <= 1.0 and e.stats.h2d_bytes_per_token >= 0


def test_whole_model_fits_means_no_offloading():
    e = Engine.load(repo_id("olmoe"), device="cpu", sparsity=0.0, vram_gib=64.0)
    assert not e.loaded.offload.offloading and e.loaded.cache is None


def test_cache_hits_misses_eviction_and_slot_table():
    cache, masters = small_cache()
    cache.fetch(0, [1, 2])
    assert (cache.hits, cache.misses) == (0, 2)
    cache.fetch(0, [1])
    assert (cache.hits, cache.misses) == (1, 2)
    cache.fetch(1, [4])  # fills the last free slot
    cache.fetch(1, [5])  # evicts the least recently used: (0, 2)
    assert (0, 2) not in cache.lru and int(cache.tables[0][2]) == -1
    assert set(cache.lru) == {(0, 1), (1, 4), (1, 5)}
    for (layer, e), slot in cache.lru.items():  # slot tables and pool agree with the masters
        assert int(cache.tables[layer][e]) == slot
        assert torch.equal(cache.pool.w_up[slot], masters[layer].w_up[e])
    assert cache.h2d_bytes == 4 * cache.expert_bytes
    for layer in (0, 1):  # the host view the staging reads (rebuilt after each change) agrees with the device tables
        assert cache.sources(layer)[1] == cache.tables[layer].tolist()
    cache.place_experts([])  # every slot freed
    assert not cache.lru and cache.sources(1)[1] == [-1] * cache.num_experts == cache.tables[1].tolist()
    cache.fetch(1, [4, 5])
    ids = cache.slot_ids(1, torch.tensor([[4, 5]]))
    assert ids.tolist() == [[cache.lru[(1, 4)], cache.lru[(1, 5)]]]


def test_cache_never_evicts_what_the_call_needs():
    cache, _ = small_cache(slots=2)
    cache.fetch(0, [0, 1])
    cache.fetch(0, [1, 2])  # must evict 0, not 1
    assert set(cache.lru) == {(0, 1), (0, 2)}
    with pytest.raises(RuntimeError):
        cache.fetch(0, [3, 4, 5])


def test_budget_too_small_is_one_line_with_numbers(capsys):
    code = main(["run", repo_id("qwen3_moe"), "hi", "--vram", "0.01"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(
        "localmoe: error: --vram 0.01 GiB cannot hold the non-expert weights' largest module"
    )
    assert "give at least --vram" in err and err.count("\n") == 1


def test_non_expert_modules_spill_through_accelerate(capsys):
    """A budget that holds the largest non-expert module, the state and one token's experts, but not all non-expert
    weights: accelerate places what fits on the device and the rest in host memory; tokens are unchanged."""
    model = repo_id("qwen3_moe")
    resident = Engine.load(model, device="cpu", sparsity=0.0)
    want = tokens(resident, n=8)
    probe = Engine.load(model, device="cpu", sparsity=0.0, vram_gib=64.0).loaded
    from localmoe.models.skeleton import units as _units

    plan = probe.offload
    units = _units(probe.model)
    k = probe.config.num_experts_per_tok
    gpu_share = 3 * max(units.values())  # accelerate keeps one largest unit free to run host-resident units in
    vram = (plan.state_bytes + placement.WORKSPACE_RESERVE + k * plan.expert_bytes + gpu_share) / GiB
    e = Engine.load(model, device="cpu", sparsity=0.0, vram_gib=vram)
    p = e.loaded.offload
    assert p.spills and p.slots == k and 0 < p.non_expert_gpu_bytes < p.non_expert_bytes
    from localmoe.models.offload import place_non_experts

    dmap = place_non_experts(probe.model, p, torch.device("cuda", 0), torch.float32)
    assert {d.type for d in dmap.values()} == {"cuda", "cpu"}  # some units on the device, the rest on the host
    assert tokens(e, n=8) == want
    with pytest.raises(Exception, match="largest module"):
        placement.plan(
            budget_bytes=int(vram * GiB) - gpu_share,
            non_expert_bytes=p.non_expert_bytes,
            state=p.state_bytes,
            expert_bytes=p.expert_bytes,
            total_experts=p.total_experts,
            top_k=k,
            largest_module_bytes=max(units.values()),
        )


def test_run_json_reports_cache_stats(capsys):
    vram = budget_for(repo_id("mixtral"), 3)
    code = main(
        ["run", repo_id("mixtral"), "hi", "--json", "--max-new-tokens", "6", "--vram", f"{vram:.9f}", "--device", "cpu"]
    )
    cap = capsys.readouterr()
    stats = json.loads(cap.out.strip().splitlines()[-1])["stats"]
    assert code == 0 and stats["cache_hit_rate"] is not None and stats["h2d_bytes_per_token"] is not None
    assert "experts cached on the GPU" in cap.err


@pytest.mark.parametrize("sparsity", [0.0, 0.5])
@pytest.mark.parametrize("layout", ["whole", "gates", "gates+ud"])
def test_direct_misses_equal_all_resident(sparsity, layout):
    """Direct mode: absent experts are read in place by the fused kernel (Triton interpreter on CPU). Layouts:
    whole-expert slots; a gate tier holding some gates (no up/down slots); every gate plus some up/down slots."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "0":
        pytest.skip("a CPU engine's Triton kernels need the interpreter (on a GPU: bench/gpu_engine_check.py)")

    model = repo_id("qwen3_moe")
    resident = Engine.load(model, device="cpu", sparsity=sparsity)
    want = tokens(resident, n=12)
    total = sum(m.num_experts for m in resident.loaded.experts)
    whole = total // 3 + 2 if layout == "gates+ud" else 3
    e = Engine.load(model, device="cpu", sparsity=sparsity, vram_gib=budget_for(model, whole), offload_miss="direct")
    if layout == "whole":
        attach_cache(e.loaded, torch.float32, "cpu", False, "direct", gate_tier=False)
    cache = e.loaded.cache
    gates, ud = {"whole": (0, 3), "gates": (9, 0), "gates+ud": (total, (3 * whole - total) // 2)}[layout]
    assert cache.mode == "direct" and (cache.gate_slots, cache.slots) == (gates, ud) and ud <= whole
    assert cache.admits == (ud > 0)
    got = tokens(e, n=12)
    assert got == want
    if ud:
        assert cache.hits + cache.misses == 2 * len(e.loaded.experts) * (len(got) - 1)  # k=2 per layer per step
        if sparsity or layout == "whole":  # (on CPU, sparsity 0 decodes on the dense path: nothing to admit)
            assert len(cache.lru) == ud  # misses were admitted into the free slots
    for (layer, ex), slot in cache.lru.items():
        assert int(cache.tables[layer][ex]) == slot
        assert torch.equal(cache.pool.w_up[slot], cache.masters[layer].w_up[ex])
        if not gates:
            assert torch.equal(cache.pool.w_gate[slot], cache.masters[layer].w_gate[ex])
    placed = [
        (layer, ex, int(s)) for layer, t in cache.gate_tables.items() for ex, s in enumerate(t.tolist()) if s >= 0
    ]
    assert len(placed) == gates and len({s for *_, s in placed}) == gates
    for layer, ex, s in placed:
        assert torch.equal(cache.pool.w_gate[s], cache.masters[layer].w_gate[ex])
    assert 0.0 <= e.stats.cache_hit_rate <= 1.0 and e.stats.h2d_bytes_per_token >= 0
    if sparsity:  # the fused direct kernel ran (on CPU, sparsity 0 takes the dense path from the cache)
        host, rows = int(cache.host_rows), int(cache.read_rows)
        # rows read from the host: at most every routed expert's gate and kept rows; the rest are admission copies
        assert 0 < host < rows and e.stats.cache_hit_rate == pytest.approx(1 - host / rows)
        read = e.stats.h2d_bytes_per_token * (len(got) - 1)
        admitted = read - host * cache.row_bytes
        assert admitted >= 0 and round(admitted) % cache.expert_bytes == 0
        assert abs(e.stats.sparsity_realized - resident.stats.sparsity_realized) < 1e-9


def test_gate_tier_split_holds_gates_first():
    plan = placement.plan(
        budget_bytes=64 << 30, non_expert_bytes=1 << 30, state=0, expert_bytes=3 << 20, total_experts=10_000, top_k=8
    )
    assert plan.offloading is False
    small = placement.OffloadPlan(0, 0, 0, 3 << 20, 10_000, 3000)  # 3000 whole experts' bytes
    assert placement.gate_tier_split(small) == (9000, 0)
    big = placement.OffloadPlan(0, 0, 0, 3 << 20, 10_000, 5000)  # 15000 gates' bytes: all gates + 2500 up/down
    assert placement.gate_tier_split(big) == (10_000, 2500)


@pytest.mark.parametrize("sparsity", [0.0, 0.5])
def test_cpu_misses_equal_all_resident(sparsity):
    """CPU mode: hits run from the cache pool, misses on the CPU from the master copies; then misses are admitted."""
    model = repo_id("qwen3_5_moe")
    resident = Engine.load(model, device="cpu", sparsity=sparsity)
    want = tokens(resident, n=12)
    e = Engine.load(model, device="cpu", sparsity=sparsity, vram_gib=budget_for(model, 4), offload_miss="cpu")
    cache = e.loaded.cache
    assert tokens(e, n=12) == want
    assert cache.mode == "cpu" and len(cache.lru) == 4 and cache.hits + cache.misses > 0
    assert e.stats.h2d_bytes_per_token >= 0  # only admissions move weights
    if sparsity:
        assert abs(e.stats.sparsity_realized - resident.stats.sparsity_realized) < 1e-9


def test_live_stats_carry_cache_figures_while_decoding():
    """The status bar's figures (hit rate, host→GPU bytes per token) update every few tokens, not only at the end."""
    from localmoe.engine.stats import LIVE_STATS_EVERY

    model = repo_id("qwen3_moe")
    e = Engine.load(model, device="cpu", sparsity=0.0, vram_gib=budget_for(model, 3))
    e.eos_ids = set()
    seen = []
    for ev in e.generate(e.encode_raw("Sparse experts skip most neurons."), GenerationSettings(max_new_tokens=20)):
        if ev.index == LIVE_STATS_EVERY:  # the event after the live update
            seen.append((e.stats.cache_hit_rate, e.stats.h2d_bytes_per_token))
    assert seen and seen[0][0] is not None and seen[0][1] is not None and seen[0][1] > 0


def test_host_ram_shortage_is_announced_before_the_load():
    plan = placement.plan(
        budget_bytes=4 << 30, non_expert_bytes=1 << 30, state=0, expert_bytes=100 << 20, total_experts=1000, top_k=8
    )
    assert plan.offloading
    assert placement.host_ram_notice(plan, None) is None  # unknown: nothing to say
    assert placement.host_ram_notice(plan, 200 << 30) is None
    msg = placement.host_ram_notice(plan, 50 << 30)
    assert "need 97.7 GiB of host RAM and 50.0 GiB is available now" in msg and "\n" not in msg
    assert placement.available_ram() is None or placement.available_ram() > 0


@pytest.mark.parametrize("mode", ["direct", "cpu"])
def test_background_admissions_go_live_a_step_later(mode):
    """Background admissions (copy on a side stream, slot live from the next step boundary): same tokens as all
    resident; an admitted expert counts as a miss until it is live; the tables end up consistent."""
    if mode == "direct" and os.environ.get("TRITON_INTERPRET") == "0":
        pytest.skip("a CPU engine's Triton kernels need the interpreter")
    e, want, _ = few_slots_engine(mode, 12)
    cache = e.loaded.cache
    assert cache.slots > 0
    cache.background = True
    live_after = []
    orig = cache._settle

    def settle(key, wait):
        went = orig(key, wait)
        live_after.append(went)
        return went

    cache._settle = settle
    assert tokens(e, n=12) == want
    assert live_after and all(live_after)  # off CUDA a copy is done when queued: live at the next boundary
    assert not cache.pending or all(k in cache.lru for k in cache.pending)
    for (layer, ex), slot in cache.lru.items():
        if (layer, ex) not in cache.pending:
            assert int(cache.tables[layer][ex]) == slot
            assert torch.equal(cache.pool.w_down_t[slot], cache.masters[layer].w_down_t[ex])


def test_gate_tier_follows_calibration_routing():
    """Gates that do not all fit: after calibration the most-routed experts' gates hold the tier's slots (the counts
    travel in the cached thresholds file), already-resident gates stay put, and tokens still equal all-resident."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "0":
        pytest.skip("a CPU engine's Triton kernels need the interpreter")
    from localmoe.experts import thresholds

    model = repo_id("qwen3_moe")
    want = tokens(Engine.load(model, device="cpu", sparsity=0.5), n=8)
    e = Engine.load(model, device="cpu", sparsity=0.5, vram_gib=budget_for(model, 3), offload_miss="direct")
    cache = e.loaded.cache
    assert 0 < cache.gate_slots < cache.num_experts * len(cache.masters)
    table = thresholds.thresholds_for(e, 0.5)  # from the file written by the load's calibration
    counts = table.meta["routing_counts"]
    assert sum(map(sum, counts)) > 0
    placed = {(layer, ex) for layer, t in cache.gate_tables.items() for ex, s in enumerate(t.tolist()) if s >= 0}
    by_layer = {m.layer_idx: row for m, row in zip(e.loaded.experts, counts)}
    hot = [by_layer[layer][ex] for layer, ex in placed]
    cold = [c for layer, row in by_layer.items() for ex, c in enumerate(row) if (layer, ex) not in placed]
    assert len(placed) == cache.gate_slots and min(hot) >= max(cold)
    for layer, t in cache.gate_tables.items():
        for ex, s in enumerate(t.tolist()):
            if s >= 0:
                assert torch.equal(cache.pool.w_gate[s], cache.masters[layer].w_gate[ex])
    before = {k: int(cache.gate_tables[k[0]][k[1]]) for k in placed}
    copied = cache.copied_bytes
    thresholds.apply(e.loaded, table, device=torch.device("cpu"))  # the same order again: nothing moves, nothing copied
    assert {k: int(cache.gate_tables[k[0]][k[1]]) for k in placed} == before and cache.copied_bytes == copied
    assert tokens(e, n=8) == want


@pytest.mark.parametrize("mode", ["direct", "copy"])
def test_up_down_slots_are_filled_at_load_by_calibration_routing(mode):
    """The load fills the up/down (copy: whole-expert) slots, so a first prompt finds them resident; once
    calibration's routing counts are known the most-routed experts hold them; after decode has admitted others, a
    later apply of the same thresholds keeps decode's working set; tokens equal all-resident."""
    if os.environ.get("TRITON_INTERPRET") == "0":
        pytest.skip("a CPU engine's Triton kernels need the interpreter")
    from localmoe.experts import thresholds

    e, want, total = few_slots_engine(mode, 8)
    cache = e.loaded.cache
    assert 0 < cache.slots < total and cache.placed and len(cache.lru) == cache.slots and not cache.free
    table = thresholds.thresholds_for(e, 0.5)
    by_layer = {m.layer_idx: row for m, row in zip(e.loaded.experts, table.meta["routing_counts"])}
    up = [by_layer[layer][ex] for layer, ex in cache.lru]
    rest = [c for layer, row in by_layer.items() for ex, c in enumerate(row) if (layer, ex) not in cache.lru]
    assert min(up) >= max(rest)
    for (layer, ex), slot in cache.lru.items():
        assert int(cache.tables[layer][ex]) == slot
        assert torch.equal(cache.pool.w_up[slot], cache.masters[layer].w_up[ex])
    absent = cache.absent_bytes()
    assert absent < cache.row_bytes * cache.width * (2 if cache.gate_slots else 3) * total
    assert tokens(e, n=8) == want
    assert not cache.placed  # decode looked experts up: what it admits stays
    lru = dict(cache.lru)
    thresholds.apply(e.loaded, table, device=torch.device("cpu"))
    assert dict(cache.lru) == lru
