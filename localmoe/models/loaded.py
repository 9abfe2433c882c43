"""What a load hands the engine (`LoadedModel`: the model, its text config and family, its experts, the offload plan,
the expert cache and where the host copies live), the GPU expert cache put in front of offloaded experts' host
copies (`attach_cache`, experts/cache.py; the loader's last step, and again when a bench or test changes the miss
mode) and the int4 hint for a full-precision load that offloads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localmoe.errors import UsageError
from localmoe.experts import cache as offload
from localmoe.experts import placement
from localmoe.experts.department_cache import DepartmentCache
from localmoe.experts.department_placement import DepartmentPlan, direct_split
from localmoe.experts.int4 import expert_bytes, format_of
from localmoe.experts.local_experts import LocalExperts
from localmoe.models.families import FamilySpec


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: object  # the text config
    family: FamilySpec
    # one per MoE layer, in layer order: LocalExperts, or DeaMoE's DepartmentExperts (same names for what the engine
    # reads: num_experts, tau_groups, tau, sparse_enabled, max_sparse_tokens, recorder, kept/seen, weights, cache)
    experts: list[LocalExperts]
    offload: object = None  # localmoe.experts.placement.OffloadPlan when a VRAM budget was given
    cache: object = None  # experts/cache.py ExpertCache (DeaMoE: experts/department_cache.py) when offloaded
    host_pinned: bool = False  # expert master copies in pinned host memory
    host_storage: str = ""  # where offloaded experts' master copies live: pinned, pageable or mmap (files)

    def expert_bytes(self) -> int:
        return sum(m.weights.nbytes() for m in self.experts)


def int4_hint(loaded: LoadedModel) -> str | None:
    """For offloaded full-precision experts that would all fit the budget in 4 bits: the notice naming the flag."""
    plan, m = loaded.offload, loaded.experts[0]
    if plan is None or not plan.offloading or isinstance(plan, DepartmentPlan) or m.weights.quantized:
        return None
    try:
        need = (
            plan.non_expert_bytes
            + plan.state_bytes
            + placement.WORKSPACE_RESERVE
            + plan.total_experts * expert_bytes(m.intermediate_size, m.hidden_size)
        )
    except ValueError:  # no 4-bit format for this hidden size
        return None
    if need > plan.budget_bytes:
        return None
    return (
        f"--experts int4 would keep every expert in VRAM ({need / 2**30:.1f} GiB of the "
        f"{plan.budget_bytes / 2**30:.1f} GiB budget; 4-bit weights, a small accuracy cost)"
    )


def attach_cache(loaded: LoadedModel, dtype, device, pinned: bool, miss: str = "auto", gate_tier: bool = True) -> None:
    """Experts' weights are host master copies: put the GPU expert cache in front of them (replacing one attached
    before). Miss mode "auto": direct reads from pinned host memory on CUDA (the fastest measured), else
    copy-then-compute. Direct misses with `gate_tier` split the cache's bytes gates first
    (`placement.gate_tier_split`)."""
    if isinstance(loaded.offload, DepartmentPlan):
        attach_department_cache(loaded, dtype, device, pinned, miss)
        return
    m0 = loaded.experts[0]
    if miss == "auto":
        miss = "direct" if torch.device(device).type == "cuda" and pinned and m0.direct_misses else "copy"
    elif miss == "direct" and not m0.direct_misses:
        raise UsageError(
            f'direct expert misses have no kernel for {m0.hidden_act} experts yet: use offload_miss "copy" or '
            '"cpu" (or "auto")'
        )
    for m in loaded.experts:
        m.cache = None
    loaded.cache = None  # the old pools go before the new ones are allocated
    gates, slots = (
        placement.gate_tier_split(loaded.offload) if miss == "direct" and gate_tier else (0, loaded.offload.slots)
    )
    cache = offload.ExpertCache(
        slots,
        (m0.num_experts, m0.intermediate_size, m0.hidden_size),
        dtype,
        device,
        mode=miss,
        gate_slots=gates,
        int4=format_of(m0.weights.w_gate),
    )
    for m in loaded.experts:
        cache.add_layer(m.layer_idx, m.weights)
        m.cache = cache
    cache.place_gates()
    cache.place_experts()
    loaded.cache = cache
    loaded.host_pinned = pinned


def attach_department_cache(loaded: LoadedModel, dtype, device, pinned: bool, miss: str = "auto") -> None:
    """An offloaded DeaMoE: the department cache (department and private pools sized by the plan) in front of the
    experts' parameters, which the loader left in host memory; pinned first when `pinned` (asynchronous copies).
    Miss mode "auto": direct (pools filled once, misses read from pinned host memory inside the CUDA graph) on CUDA
    with pinned memory, else copy-then-compute (least-recently-used pools, eager); "direct" / "copy" force one."""
    plan, m0 = loaded.offload, loaded.experts[0]
    for m in loaded.experts:
        m.cache = None
    loaded.cache = None
    if pinned:
        try:
            for m in loaded.experts:
                for p in m.parameters():
                    if not p.is_pinned():
                        p.data = p.data.pin_memory()
        except RuntimeError:
            pinned = False
    shape = (m0.num_departments, m0.per_department, m0.width, m0.hidden_size)
    direct = miss == "direct" or (miss == "auto" and torch.device(device).type == "cuda" and pinned)
    if direct:  # the same bytes, spent by what a miss costs there: gate/down pairs, then up, then private parts
        gates, downs, ups, privs = direct_split(plan)
        cache = DepartmentCache(gates, privs, shape, dtype, device, direct=True, up_slots=ups, down_slots=downs)
    else:
        cache = DepartmentCache(plan.department_slots, plan.private_slots, shape, dtype, device)
    for m in loaded.experts:
        cache.add_layer(m.layer_idx, m.weights)
        m.cache = cache
    if direct:
        cache.place()
    loaded.cache = cache
    loaded.host_pinned = pinned
