"""DeaMoE's VRAM plan (department-aware offloading): what a budget holds of a DeaMoE model's routed experts.

A DeaMoE layer's experts are two kinds of unit (localmoe.experts.departments): a department's shared gate/up/down
projections (3·h·H weights, read once per step by every token routed into the department, whichever of its experts they
chose) and an expert's private [h, h] (h² weights, read only when that expert is chosen). A department unit is therefore
worth more VRAM than any one private unit: it serves every expert of its department. Under a budget, what is left after
the non-expert weights, the KV/recurrent state and the workspace reserve holds department units first (all of them when
they fit), then private units; every unit's master copy stays in host memory (pinned when possible, as for vanilla MoEs:
experts/host_memory.py). Direct offloading (misses read in place from pinned host memory, experts/department_cache.py)
spends the same bytes by what a miss costs (`direct_split`): a department's gate is read whole on every step that
touches it, its down_t whole too (only the rows of kept z entries with DeaMoE's second threshold `tau_z`), its up_t and
the private parts only at kept rows, so the gates of as many departments as fit come first, then their down
projections, then their up projections, then private parts (without tau_z, gates then downs saves what gate/down
pairs would: a byte of either is read on every touch). Below one token's need of a layer
(`max_departments_per_token` department units and k private units) the budget is refused in one line that says what
would fit. The cache that fills the plan is localmoe.experts.department_cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from localmoe.errors import UsageError
from localmoe.experts.placement import WORKSPACE_RESERVE, GiB, OffloadPlan


def _size(b: float) -> str:
    return f"{b / GiB:.2f} GiB" if b >= GiB / 10 else f"{b / (1 << 20):.2f} MiB"


@dataclass(frozen=True)
class DepartmentPlan(OffloadPlan):
    """The plan for a DeaMoE model. OffloadPlan's fields keep their meaning for the rest of localmoe (`expert_bytes`
    one expert's share of its layer's expert weights, `total_experts` routed experts, `slots` private slots); the
    department fields say what VRAM holds of each kind of unit."""

    departments_total: int = 0  # department units (D per MoE layer)
    department_bytes: int = 0  # one department's shared gate + up + down_t (3·h·H weights)
    department_slots: int = 0  # department units resident in VRAM
    private_bytes: int = 0  # one expert's private [h, h]
    private_slots: int = 0  # private units resident in VRAM (== slots)

    @property
    def offloading(self) -> bool:
        return self.department_slots < self.departments_total or self.private_slots < self.total_experts

    @property
    def host_bytes(self) -> int:
        """Host memory of the master copies when offloading (every unit: the copies are the model's weights)."""
        return self.departments_total * self.department_bytes + self.total_experts * self.private_bytes

    @property
    def cache_bytes(self) -> int:
        return self.department_slots * self.department_bytes + self.private_slots * self.private_bytes

    def summary(self) -> str:
        gib = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
        return (
            f"VRAM budget {gib(self.budget_bytes)}: non-expert weights {gib(self.non_expert_bytes)}, "
            f"KV/state {gib(self.state_bytes)}, {self.department_slots} of {self.departments_total} departments' "
            f"shared projections and {self.private_slots} of {self.total_experts} experts' private parts cached on "
            f"the GPU ({gib(self.cache_bytes)}; departments first{self._direct_text()}); host RAM for the master "
            f"copies {gib(self.host_bytes)}"
        )

    def _direct_text(self) -> str:
        """How direct offloading spends the same bytes (`direct_split`), when it differs."""
        if not self.offloading:
            return ""
        gates, downs, ups, privs = direct_split(self)
        return (
            f"; with direct misses, the gate projections of {gates} departments, the down projections of {downs}, "
            f"the up projections of {ups}, and {privs} private parts"
        )


def direct_split(plan: DepartmentPlan) -> tuple[int, int, int, int]:
    """Direct offloading's use of the plan's cache bytes: (departments whose gate is resident, how many of those
    (the first ones) have their down projection resident too, how many of those their up projection, private parts
    resident); module doc."""
    total = plan.departments_total
    if not plan.offloading:
        return total, total, total, plan.total_experts
    third = plan.department_bytes // 3  # one of the department's three [h, H] projections
    room = plan.cache_bytes
    gates = min(total, room // third)
    downs = min(gates, (room - gates * third) // third)
    ups = min(downs, (room - (gates + downs) * third) // third)
    room -= (gates + downs + ups) * third
    return int(gates), int(downs), int(ups), int(min(plan.total_experts, room // plan.private_bytes))


def plan_departments(
    *,
    budget_bytes: int,
    non_expert_bytes: int,
    state: int,
    departments: int,
    per_department: int,
    hidden: int,
    width: int,
    layers: int,
    element_bytes: int,
    departments_per_token: int,
    top_k: int,
) -> DepartmentPlan:
    """The plan at `budget_bytes` for `layers` MoE layers of `departments` departments x `per_department` experts
    (hidden H, width h): everything resident when it fits, else department units first, then private units, with
    at least one token's need of a layer (`departments_per_token` departments, `top_k` private parts)."""
    dept_bytes = 3 * width * hidden * element_bytes
    priv_bytes = width * width * element_bytes
    n_dept, n_priv = departments * layers, departments * per_department * layers
    expert_total = n_dept * dept_bytes + n_priv * priv_bytes
    room = int(budget_bytes - non_expert_bytes - state - WORKSPACE_RESERVE)
    min_d, min_p = min(departments_per_token, departments), min(top_k, departments * per_department)
    if room >= expert_total:
        d_slots, p_slots = n_dept, n_priv
    else:
        d_slots = max(0, min(n_dept, (room - min_p * priv_bytes) // dept_bytes))
        p_slots = max(0, min(n_priv, (room - d_slots * dept_bytes) // priv_bytes))
        if d_slots < min_d or p_slots < min_p:
            need = non_expert_bytes + state + WORKSPACE_RESERVE + min_d * dept_bytes + min_p * priv_bytes
            raise UsageError(
                f"--vram {budget_bytes / GiB:.3f} GiB leaves {_size(max(0, room))} for DeaMoE experts after the "
                f"non-expert weights ({_size(non_expert_bytes)}), KV/state ({_size(state)}) and workspace "
                f"({_size(WORKSPACE_RESERVE)}): room for {d_slots} department(s)' shared projections "
                f"({_size(dept_bytes)} each) beside {min_p} private parts ({_size(priv_bytes)} each), but one token "
                f"needs {min_d} departments and {min_p} private parts of a layer: give at least --vram "
                f"{need / GiB:.3f}, a shorter --context, or --device cpu"
            )
    return DepartmentPlan(
        budget_bytes=budget_bytes,
        non_expert_bytes=non_expert_bytes,
        state_bytes=state,
        expert_bytes=expert_total // max(1, n_priv),
        total_experts=n_priv,
        slots=int(p_slots),
        departments_total=n_dept,
        department_bytes=dept_bytes,
        department_slots=int(d_slots),
        private_bytes=priv_bytes,
        private_slots=int(p_slots),
    )
