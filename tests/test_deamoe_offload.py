"""Department-aware offloading of DeaMoE experts on CPU: the plan holds departments first, the department cache's two
pools are LRU each and never trade a department for a private part, an offloaded layer computes what the resident one
does (decode kernel and reference, dense path, sparse), the bundled localmoe-tiny-deamoe decodes the same greedy
tokens offloaded as resident, the hit figures reach `run --json`, and a budget with no room is refused in one line.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from localmoe.cli.main import main
from localmoe.engine.engine import Engine
from localmoe.errors import UsageError
from localmoe.events import EngineStats, GenerationSettings
from localmoe.experts import department_dense
from localmoe.experts.department_cache import DepartmentCache
from localmoe.experts.department_placement import direct_split, plan_departments
from localmoe.experts.departments import DepartmentExperts, group_limited_topk
from localmoe.experts.placement import WORKSPACE_RESERVE
from localmoe.experts.thresholds import sparse_token_limit
from localmoe.kernels.department_experts import MAX_TOKENS
from localmoe.tui.stats_view import stats_rows
from localmoe.tui.status_line import status_parts

GiB = 1 << 30
BUNDLED = "localmoe-tiny-deamoe"
D, N, H, W = 4, 3, 64, 32  # departments, experts per department, hidden, department width
DEPT, PRIV = 3 * W * H * 4, W * W * 4  # fp32 bytes of a department unit, of a private unit


def _plan(depts: float, privs: float, **kw):
    """The plan of 2 layers of the shape above at a budget with room for `depts` departments and `privs` privates."""
    fixed = 1000 + 2000 + WORKSPACE_RESERVE
    args = dict(non_expert_bytes=1000, state=2000, departments=D, per_department=N, hidden=H, width=W, layers=2)
    args |= dict(element_bytes=4, departments_per_token=2, top_k=3) | kw
    return plan_departments(budget_bytes=int(fixed + depts * DEPT + privs * PRIV), **args)


def test_plan_holds_departments_first_then_private_parts():
    p = _plan(3, 10)  # room for 3 departments and 10 privates: departments take all but one token's 3 privates
    assert p.offloading and p.department_slots == 3 + (7 * PRIV) // DEPT and p.department_slots >= 3
    assert p.private_slots == (3 * DEPT + 10 * PRIV - p.department_slots * DEPT) // PRIV >= 3
    p = _plan(8, 5)  # every department fits: the rest holds private parts
    assert (p.department_slots, p.private_slots, p.departments_total, p.total_experts) == (8, 5, 8, 24)
    p = _plan(8, 24)  # everything fits: nothing is offloaded
    assert not p.offloading and p.cache_bytes == 8 * DEPT + 24 * PRIV
    assert "departments first" in _plan(8, 5).summary()


def test_plan_refuses_a_budget_below_one_token_in_one_line():
    with pytest.raises(UsageError) as e:
        _plan(1.5, 3)  # one token touches up to 2 departments
    msg = str(e.value)
    assert "\n" not in msg and "one token needs 2 departments and 3 private parts" in msg and "--vram" in msg
    assert "room for 1 department(s)' shared projections" in msg


def _cache(d_slots=2, p_slots=3, layers=2):
    cache = DepartmentCache(d_slots, p_slots, (D, N, W, H), torch.float32, "cpu")
    masters = {}
    for layer in range(layers):
        m = DepartmentExperts(D, N, H, W, layer_idx=layer)
        for p in m.parameters():
            torch.nn.init.normal_(p, std=0.1)
        masters[layer] = m.requires_grad_(False)
        cache.add_layer(layer, m.weights)
    return cache, masters


def test_pools_are_lru_each_and_departments_never_leave_for_private_parts():
    cache, masters = _cache()
    assert cache.department_slots(0, [1, 2]) == [0, 1]
    cache.department_slots(0, [1])  # (0, 1) is now the most recent
    (s,) = cache.department_slots(1, [3])  # evicts the least recently used department: (0, 2)
    assert s == 1 and list(cache.departments.lru) == [(0, 1), (1, 3)]
    assert torch.equal(cache.gate[s], masters[1].gate_proj[3]) and torch.equal(cache.down_t[s], masters[1].down_t[3])
    for j in range(N):  # many private lookups: the department pool is untouched
        for d in range(D):
            cache.private_slots(0, [(d, j)])
    assert list(cache.departments.lru) == [(0, 1), (1, 3)] and len(cache.privates.lru) == 3
    assert list(cache.privates.lru) == [(0, 1, 2), (0, 2, 2), (0, 3, 2)]  # the three most recent
    slot = cache.privates.lru[(0, 3, 2)]
    assert torch.equal(cache.private[slot], masters[0].private[3, 2])
    f = cache.department_figures()
    assert (f["department_hits"], f["department_misses"], f["private_hits"], f["private_misses"]) == (1, 3, 0, 12)
    rate, moved = cache.figures()
    assert moved == 3 * DEPT + 12 * PRIV and rate == pytest.approx(DEPT / (4 * DEPT + 12 * PRIV))
    with pytest.raises(RuntimeError):
        cache.department_slots(0, [0, 1, 2])  # more departments at once than slots
    cache.reset_stats()
    assert cache.figures() == (0.0, 0) and cache.department_figures()["department_hit_rate"] is None


@pytest.mark.parametrize(
    "T, kernel",
    [(1, False), (1, True), (2, False), (5, False)],
    ids=["decode1-ref", "decode1-triton", "decode2-over-the-pool", "dense5"],  # only decode1 fits the pools' kernel
)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_offloaded_layer_equals_resident(T, kernel, sparse):
    if kernel and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernel on CPU tensors runs under TRITON_INTERPRET=1 only (compiled, it reads device memory)")
    cache, masters = _cache(d_slots=2, p_slots=4, layers=1)
    m = masters[0].eval()
    m.slots, m.max_sparse_tokens, m.kernel_on_cpu = 2, 2, kernel
    if sparse:
        m.tau, m.sparse_enabled = torch.rand(D, generator=torch.Generator().manual_seed(3)) * 0.05, True
    g = torch.Generator().manual_seed(T)
    idx, wts = group_limited_topk(torch.softmax(torch.randn(T, D * N, generator=g), -1), N, 3, 2)
    x = torch.randn(T, H, generator=g)
    want = m(x, idx, wts)
    m.cache = cache
    for _ in range(2):  # misses, then hits (T=2 may need more departments than the pool: the one-at-a-time path)
        torch.testing.assert_close(m(x, idx, wts), want, atol=1e-5, rtol=1e-5)
    f = cache.department_figures()
    assert f["department_misses"] > 0 and f["private_misses"] > 0
    if T == 1:  # two departments fit the pool: the second call hits
        assert f["department_hits"] > 0 and f["private_hits"] > 0


@pytest.mark.parametrize("mode", ["copy", "direct"])
@pytest.mark.parametrize("stage_bytes", [1, 1 << 30], ids=["a-department-a-group", "one-group"])
def test_dense_path_stages_groups_of_departments_and_equals_resident(monkeypatch, mode, stage_bytes):
    """A prompt piece offloaded: the touched departments staged in groups (pool slots where resident, the host copies
    otherwise; direct mode with some departments' up / down projections not in the pools), the grouped GEMMs on each
    group, the same output as the resident layer, masked too; the pools are left as they were."""
    monkeypatch.setattr(department_dense, "STAGE_BYTES", stage_bytes)
    direct = mode == "direct"
    cache = DepartmentCache(3, 4, (D, N, W, H), torch.float32, "cpu", direct=direct, up_slots=1, down_slots=2)
    m = DepartmentExperts(D, N, H, W, layer_idx=0)
    for prm in m.parameters():
        torch.nn.init.normal_(prm, std=0.1)
    m = m.requires_grad_(False).eval()
    cache.add_layer(0, m.weights)
    if direct:
        cache.place()
    else:  # two departments and three privates resident, through lookups
        cache.department_slots(0, [1, 3])
        cache.private_slots(0, [(1, 0), (3, 2), (0, 1)])
    g = torch.Generator().manual_seed(5)
    idx, wts = group_limited_topk(torch.softmax(torch.randn(9, D * N, generator=g), -1), N, 3, 2)
    x = torch.randn(9, H, generator=g)
    for masked in (False, True):
        m.cache = None
        m.tau, m.sparse_enabled, m.mask_all_tokens = torch.full((D,), 0.02), masked, masked
        want = m(x, idx, wts)
        m.cache = cache
        before = (cache.gate.clone(), cache.private.clone(), dict(cache.departments.lru))
        torch.testing.assert_close(m(x, idx, wts), want, atol=1e-5, rtol=1e-5)
        for now, then in zip((cache.gate, cache.private), before):  # (unfilled slots hold whatever memory did)
            torch.testing.assert_close(now, then, rtol=0, atol=0, equal_nan=True)
        assert dict(cache.departments.lru) == before[2]
    assert cache.copied_bytes > 0
    if not direct:
        f = cache.department_figures()
        assert f["department_hits"] > 0 and f["department_misses"] > 0 and f["private_hits"] > 0


# -- the bundled model through the engine and the CLI ----------------------------------------------------------------
def _tokens(engine, n=10):
    ids = engine.encode_raw("Sparse experts skip most neurons.")
    return [ev.token_id for ev in engine.generate(ids, GenerationSettings(max_new_tokens=n))]


def _sparse(engine, tau: float) -> None:
    for m in engine.loaded.experts:  # a fixed threshold (no calibration): the same on both engines
        m.tau = torch.full((m.tau_groups,), tau, dtype=torch.float32)
        m.sparse_enabled, m.max_sparse_tokens = tau > 0, 1


@pytest.fixture(scope="module")
def engines():
    resident = Engine.load(BUNDLED, device="cpu", sparsity=0.0, vram_gib=64.0)
    p = resident.loaded.offload
    assert type(p).__name__ == "DepartmentPlan" and not p.offloading and resident.loaded.cache is None
    fixed = p.non_expert_bytes + p.state_bytes + WORKSPACE_RESERVE
    budget = (fixed + p.departments_total * p.department_bytes + 60 * p.private_bytes + 100) / GiB
    return resident, Engine.load(BUNDLED, device="cpu", sparsity=0.0, vram_gib=budget), budget


@pytest.mark.parametrize("tau", [0.0, 0.05], ids=["sparsity0", "sparse"])
def test_offloaded_tokens_equal_resident(engines, tau):
    resident, offloaded, _ = engines
    plan, cache = offloaded.loaded.offload, offloaded.loaded.cache
    assert plan.offloading and (plan.department_slots, plan.private_slots) == (48, 60)
    assert all(m.cache is cache for m in offloaded.loaded.experts)
    assert all(p.device.type == "cpu" for m in offloaded.loaded.experts for p in m.parameters())
    for e in (resident, offloaded):
        _sparse(e, tau)
    try:
        assert _tokens(offloaded) == _tokens(resident)
        st = offloaded.stats
        if tau:
            assert st.sparsity_realized > 0.05
        assert 0.0 <= st.private_hit_rate < st.department_hit_rate <= 1.0  # every department fits, not every private
        assert 0.0 < st.cache_hit_rate < 1.0 and st.h2d_bytes_per_token > 0
        assert resident.stats.department_hit_rate is None and resident.stats.cache_hit_rate is None
    finally:
        for e in (resident, offloaded):
            _sparse(e, 0.0)


def test_run_json_reports_department_and_private_hit_rates(engines, capsys):
    budget = engines[2]
    flags = ["--json", "--max-new-tokens", "4", "--vram", f"{budget:.9f}", "--device", "cpu", "--sparsity", "0"]
    code = main(["run", BUNDLED, "hi", *flags])
    assert code == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["stats"]
    for key in ("department_hit_rate", "private_hit_rate", "cache_hit_rate"):
        assert 0.0 <= stats[key] <= 1.0, key
    assert stats["h2d_bytes_per_token"] >= 0


def test_show_describes_the_department_plan(capsys):
    assert main(["show", BUNDLED, "--vram", "0.52"]) == 0
    out = capsys.readouterr().out
    assert "departments first" in out and "of 48 departments' shared projections" in out


def test_status_bar_and_stats_show_the_pools_only_when_present():
    plain = EngineStats(generated_tokens=3, cache_hit_rate=0.5, h2d_bytes_per_token=1e6)
    dept = EngineStats(**{**plain.__dict__, "department_hit_rate": 0.9, "private_hit_rate": 0.25})
    assert not any("dept" in p for p in status_parts("m", "cuda", plain))
    assert "dept 90% / private 25%" in status_parts("m", "cuda", dept)

    class E:
        stats, device = dept, "cuda"

    rows = dict(stats_rows(E(), GenerationSettings(), model="m"))
    assert rows["Department cache"] == "90% of departments · 25% of private parts hit the GPU"
    assert dept.as_json()["department_hit_rate"] == 0.9 and plain.as_json()["private_hit_rate"] is None


# -- direct offloading: pools filled once, misses read from host memory by the kernels (graph capturable) ------------
@pytest.fixture(scope="module")
def direct(engines):
    _, _, budget = engines
    return Engine.load(BUNDLED, device="cpu", sparsity=0.0, vram_gib=budget, offload_miss="direct")


@pytest.mark.parametrize("tau", [0.0, 0.05], ids=["sparsity0", "sparse"])
def test_direct_offloading_tokens_equal_resident(engines, direct, tau):
    """Direct mode: the maps place every department (the budget holds them) and 60 private parts; the layer reads
    the rest from the host copies (here through the kernel's torch reference: the kernel's direct reads are tested
    in tests/test_kernel_department_experts.py). Tokens equal the resident engine's; hits, misses and host bytes are
    counted; the maps never change."""
    resident = engines[0]
    cache = direct.loaded.cache
    assert cache.mode == "direct" and all(m.cache is cache for m in direct.loaded.experts)
    maps = torch.stack(list(cache.dept_map.values()))
    assert (maps >= 0).all() and len(set(maps.reshape(-1).tolist())) == maps.numel()  # every department, own slot
    assert int((torch.stack(list(cache.priv_map.values())) >= 0).sum()) == 60
    for e in (resident, direct):
        _sparse(e, tau)
    try:
        assert _tokens(direct) == _tokens(resident)
        st = direct.stats
        assert st.department_hit_rate == 1.0 and 0.0 < st.private_hit_rate < 1.0
        assert st.h2d_bytes_per_token > 0 and 0.0 < st.cache_hit_rate < 1.0
        if tau:
            assert st.sparsity_realized > 0.05
    finally:
        for e in (resident, direct):
            _sparse(e, 0.0)


def test_direct_split_spends_the_plan_bytes_on_gates_then_downs_then_ups_then_private():
    """Direct misses read a department's gate whole, its down whole (kept z rows with tau_z), its up and the private
    parts at kept rows only: the plan's cache bytes go to gates first, then down projections, then up projections,
    then private parts."""
    p = _plan(2.5, 4)  # of 8 departments: bytes for 2.5 whole ones and 4 private parts
    assert (p.department_slots, p.private_slots) == (2, 7)  # copy mode: whole units (half a department: 3 privates)
    room, third = p.cache_bytes, DEPT // 3
    gates, downs, ups, privs = direct_split(p)
    assert gates == min(8, room // third) == 8 > p.department_slots  # room for 8 gates and a few downs
    assert 0 < downs == (room - gates * third) // third < 8 and ups == 0
    assert privs == (room - (gates + downs) * third) // PRIV
    assert f"gate projections of {gates} departments, the down projections of {downs}" in p.summary()
    gates, downs, ups, _ = direct_split(_plan(8 * 2 / 3 + 0.5, 4))  # every gate and down, then some ups
    assert (gates, downs) == (8, 8) and 0 < ups < 8
    full = _plan(8, 24)
    assert direct_split(full) == (8, 8, 8, 24) and "direct" not in full.summary()


@pytest.mark.parametrize("tier", ["up", "down"])
def test_direct_tiers_tokens_equal_resident(engines, tier):
    """A budget holding every department's gate, and the down and up projections of only some ("down": half the
    downs, no ups; "up": every down, half the ups) and a few private parts: the kernels read the other projections'
    rows from the host copies; tokens equal the resident engine's at a threshold."""
    resident, _, _ = engines
    p = resident.loaded.offload
    fixed = p.non_expert_bytes + p.state_bytes + WORKSPACE_RESERVE
    share = {"up": 5 / 6, "down": 1 / 2}[tier]  # of every department's three projections
    budget = (fixed + int(p.departments_total * p.department_bytes * share) + 10 * p.private_bytes) / GiB
    e = Engine.load(BUNDLED, device="cpu", sparsity=0.0, vram_gib=budget, offload_miss="direct")
    cache, total = e.loaded.cache, p.departments_total
    assert cache.departments.slots == total
    if tier == "up":
        assert cache.down_slots == total and 0 < cache.up_slots < total
    else:
        assert 0 < cache.down_slots < total and cache.up_slots == 0
    for x in (resident, e):
        _sparse(x, 0.05)
    try:
        assert _tokens(e) == _tokens(resident)
        assert e.stats.department_hit_rate == 1.0 and e.stats.h2d_bytes_per_token > 0
    finally:
        _sparse(resident, 0.0)


def test_direct_sparse_piece_limit_is_the_department_kernels(direct):
    """On CUDA, direct offloading sends prompt pieces up to the department kernel's token limit down the sparse path
    (the limit is computed, not run, here: no GPU)."""
    limit = sparse_token_limit(direct.loaded, torch.device("cuda"), 0.5)
    assert limit == MAX_TOKENS
    for m in direct.loaded.experts:
        assert m.max_sparse_tokens == 1  # this CPU engine: the decode step only


def test_direct_prefill_reads_non_resident_units_through_temporary_copies(direct):
    """Prefill (the one-department-at-a-time path) in direct mode: resident units from the pools, others copied for
    the call; the maps do not change."""
    cache = direct.loaded.cache
    before = [t.clone() for t in cache.priv_map.values()]
    ids = direct.encode_raw("Departments share their weights. " * 4)
    out = list(direct.generate(ids, GenerationSettings(max_new_tokens=2)))
    assert len(out) == 2
    assert all(torch.equal(a, b) for a, b in zip(before, cache.priv_map.values()))
