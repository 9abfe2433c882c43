"""What goes where under a VRAM budget (batch-1 decode): the offload plan, the gate tier's share, host buffers.

The KV/recurrent state and a workspace reserve (at least WORKSPACE_RESERVE; the loader passes what a prefill piece
needs: experts/prefill_budget.reserve_bytes) come first, then the non-expert weights, then experts. When the
non-expert weights do not fit beside one token's experts they spill: accelerate keeps what fits on the GPU (at
least the largest module, which it never splits) and the rest in host memory (`models.offload.place_non_experts`); below
that, a one-line error with the numbers. With direct misses the experts' bytes hold gates first
(`gate_tier_split`). Every expert's master copy lives in host memory, pinned when possible (experts/host_memory.py),
and a notice comes before the load when the copies look larger than the RAM available (`host_ram_notice`).

Shape legend: E experts per layer, I expert width, H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localmoe.errors import UsageError

GiB = 1 << 30
WORKSPACE_RESERVE = 0.5 * GiB  # activations, kernels' workspaces, allocator slack


@dataclass(frozen=True)
class OffloadPlan:
    budget_bytes: int
    non_expert_bytes: int
    state_bytes: int
    expert_bytes: int  # one expert (gate + up + down)
    total_experts: int
    slots: int  # GPU cache slots (== total_experts: everything resident, no offloading)
    non_expert_gpu_bytes: int = -1  # < non_expert_bytes: accelerate keeps the rest in host memory (-1: all)
    workspace_bytes: int = int(WORKSPACE_RESERVE)  # set aside for activations (prefill pieces) and kernels

    @property
    def gpu_non_expert_bytes(self) -> int:
        """Non-expert weights on the GPU (all of them unless they spill)."""
        return self.non_expert_gpu_bytes if self.spills else self.non_expert_bytes

    @property
    def offloading(self) -> bool:
        return self.slots < self.total_experts

    @property
    def spills(self) -> bool:
        """Whether some non-expert modules live in host memory (placed by accelerate, moved per forward)."""
        return 0 <= self.non_expert_gpu_bytes < self.non_expert_bytes

    def summary(self) -> str:
        gib = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
        spill = (
            f" (only {gib(self.non_expert_gpu_bytes)} of them on the GPU: accelerate keeps the rest in host memory)"
            if self.spills
            else ""
        )
        return (
            f"VRAM budget {gib(self.budget_bytes)}: non-expert weights {gib(self.non_expert_bytes)}{spill}, "
            f"KV/state {gib(self.state_bytes)}, {self.slots} of {self.total_experts} experts cached on the GPU "
            f"({gib(self.slots * self.expert_bytes)}); host RAM for expert master copies "
            f"{gib(self.total_experts * self.expert_bytes)}"
        )


def state_bytes(config, context: int, dtype: torch.dtype) -> int:
    """KV cache of full-attention layers for `context` tokens, plus linear-attention states (batch 1)."""
    el = torch.finfo(dtype).bits // 8
    layers = int(config.num_hidden_layers)
    types = getattr(config, "layer_types", None) or ["full_attention"] * layers
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    full = sum(1 for t in types if t != "linear_attention")
    linear = layers - full
    kv = full * 2 * context * heads * head_dim * el
    lin_state = 0
    if linear:
        vh = int(getattr(config, "linear_num_value_heads", 0))
        kd, vd = int(getattr(config, "linear_key_head_dim", 0)), int(getattr(config, "linear_value_head_dim", 0))
        lin_state = linear * vh * kd * vd * 4 * 2  # recurrent state (fp32) + conv state, generous
    return kv + lin_state


def plan(
    *,
    budget_bytes: int,
    non_expert_bytes: int,
    state: int,
    expert_bytes: int,
    total_experts: int,
    top_k: int,
    largest_module_bytes: int = 0,
    workspace: int = int(WORKSPACE_RESERVE),
    resident_workspace: int | None = None,
) -> OffloadPlan:
    """Experts' GPU cache slots under the budget. Every expert stays resident when they fit beside the weights,
    KV/state and `resident_workspace` (default `workspace`: a resident model prefills in shorter pieces rather than
    offload); otherwise `workspace` is set aside (prefill_budget.reserve_bytes: the longest piece's activations and
    staging buffers) and the cache gets the rest. When the non-expert modules do not fit beside KV/state, the
    workspace and one token's experts, they spill: the GPU keeps what fits (at least the largest module, which
    accelerate never splits) and the cache gets one token's experts. Below that, a one-line error."""
    workspace = int(max(workspace, 0))
    least = workspace if resident_workspace is None else int(resident_workspace)
    if budget_bytes >= state + least + non_expert_bytes + total_experts * expert_bytes:
        return OffloadPlan(
            budget_bytes, non_expert_bytes, state, expert_bytes, total_experts, total_experts, workspace_bytes=least
        )
    fixed = state + workspace
    if budget_bytes >= fixed + non_expert_bytes + top_k * expert_bytes:
        slots = min(total_experts, int((budget_bytes - fixed - non_expert_bytes) // expert_bytes))
        return OffloadPlan(
            budget_bytes, non_expert_bytes, state, expert_bytes, total_experts, slots, workspace_bytes=workspace
        )
    room = budget_bytes - fixed - top_k * expert_bytes
    if room < max(largest_module_bytes, 1):
        need = (fixed + top_k * expert_bytes + max(largest_module_bytes, 1)) / GiB
        raise UsageError(
            f"--vram {budget_bytes / GiB:.2f} GiB cannot hold the non-expert weights' largest module "
            f"({largest_module_bytes / GiB:.2f} GiB of {non_expert_bytes / GiB:.2f} GiB), KV/state "
            f"({state / GiB:.2f} GiB), workspace ({workspace / GiB:.2f} GiB) and one token's {top_k} experts: "
            f"give at least --vram {need:.2f}, a shorter --context, or --device cpu"
        )
    return OffloadPlan(
        budget_bytes,
        non_expert_bytes,
        state,
        expert_bytes,
        total_experts,
        min(top_k, total_experts),
        non_expert_gpu_bytes=int(room),
        workspace_bytes=workspace,
    )


def gate_tier_split(plan: OffloadPlan) -> tuple[int, int]:
    """(gate slots, up/down slots) for direct misses: the cache's bytes hold gates first, every gate if they fit,
    and up/down pairs with the rest. Routed experts read their whole gate but only kept up/down rows, so a gate
    byte in VRAM saves 1/(1-s) times the host reads of an up/down byte at sparsity s (6.7x at 85 %) and never less."""
    cache_bytes = plan.slots * plan.expert_bytes
    gate_bytes = plan.expert_bytes // 3
    gates = min(plan.total_experts, cache_bytes // gate_bytes)
    return gates, int((cache_bytes - gates * gate_bytes) // (2 * gate_bytes))


def _meminfo(field: str) -> int | None:
    """Bytes of a Linux /proc/meminfo field, or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def available_ram() -> int | None:
    """Bytes of host memory available to a new allocation (MemAvailable), or None where unknown."""
    return _meminfo("MemAvailable")


def total_ram() -> int | None:
    """Bytes of physical memory (MemTotal), or None where unknown."""
    return _meminfo("MemTotal")


def host_ram_notice(plan: OffloadPlan, available: int | None) -> str | None:
    """A one-line warning, before the load, when the expert master copies look larger than the host RAM available
    now (a warning, not a refusal: VMs whose memory grows on demand report too little up front)."""
    need = plan.total_experts * plan.expert_bytes
    if not plan.offloading or available is None or need <= available:
        return None
    return (
        f"the expert master copies need {need / GiB:.1f} GiB of host RAM and {available / GiB:.1f} GiB is "
        "available now: if loading fails, close other programs or run a smaller model"
    )
