"""Where a model's weights go before any is read: the VRAM plan for a budget (`plan_offload`, experts/placement.py),
which non-expert units spill to host memory (accelerate's device map) and the hooks that run them, where buffers
live, and where offloaded experts' master copies live (pinned or pageable host memory, or memory-mapped files:
experts/store.py). `plan_placement` is the loader's and random_weights' one step for all of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from localmoe.errors import UsageError
from localmoe.experts import placement, store
from localmoe.experts.int4 import expert_bytes as int4_expert_bytes
from localmoe.models.families import family_for_model_type
from localmoe.models.skeleton import units

HOST_STORAGE = ("auto", "pinned", "mmap")


@dataclass
class Placement:
    """The plan for one load: the VRAM budget's plan (None without a budget), the non-expert device map ({} when
    nothing spills) and whether host memory pins (a one-element list, cleared when pinning fails)."""

    budget: placement.OffloadPlan | None
    dmap: dict[str, torch.device]
    pinned: list[bool] = field(default_factory=list)

    @property
    def host(self) -> bool:
        """Experts are offloaded: their master copies live in host memory (or files)."""
        return self.budget is not None and self.budget.offloading


def plan_placement(
    model, text_config, experts: dict, device: torch.device, dtype, options, on_notice=None
) -> Placement:
    """The VRAM plan for `options.vram_bytes` (none without a budget) and the non-expert units' places."""
    budget = (
        plan_offload(
            model,
            text_config,
            experts,
            dtype,
            options.vram_bytes,
            options.context,
            on_notice,
            options.experts_format,
        )
        if options.vram_bytes
        else None
    )
    dmap = place_non_experts(model, budget, device, dtype)
    return Placement(budget, dmap, [device.type == "cuda"])


def plan_offload(
    model, text_config, experts: dict, dtype, vram_bytes: int, context: int, on_notice=None, fmt: str = "full"
):
    """The VRAM plan for `vram_bytes`, with experts of format `fmt` ("full" or "int4")."""
    el = torch.finfo(dtype).bits // 8
    non_expert = sum(p.numel() * el for p in model.parameters())
    mods = list(experts.values())
    if hasattr(mods[0], "num_departments"):  # DeaMoE: resident only, for now
        return _departments_resident(text_config, mods, non_expert, el, vram_bytes, context, dtype)
    E, I, H = mods[0].num_experts, mods[0].intermediate_size, mods[0].hidden_size
    if any((m.num_experts, m.intermediate_size, m.hidden_size) != (E, I, H) for m in mods):
        raise UsageError("expert offloading needs every MoE layer to have the same expert shape")
    expert_bytes = 3 * I * H * el
    if fmt == "int4":
        try:
            expert_bytes = int4_expert_bytes(I, H)
        except ValueError as e:
            raise UsageError(f"{e}; use --experts full") from None
    largest = max(units(model).values(), default=0)
    budget = placement.plan(
        budget_bytes=vram_bytes,
        non_expert_bytes=non_expert,
        state=placement.state_bytes(text_config, context, dtype),
        expert_bytes=expert_bytes,
        total_experts=E * len(mods),
        top_k=int(getattr(text_config, "num_experts_per_tok", 1)),
        largest_module_bytes=largest,
    )
    warning = placement.host_ram_notice(budget, placement.available_ram())
    if warning and on_notice:
        on_notice(warning)
    return budget


def _departments_resident(text_config, mods, all_bytes: int, el: int, vram_bytes: int, context: int, dtype):
    """DeaMoE's plan: every department resident (its experts are parameters of the model, counted in `all_bytes`);
    a budget that would offload them is refused in one line (department-aware offloading is not written yet)."""
    expert_total = sum(p.numel() * el for m in mods for p in m.parameters())
    state = placement.state_bytes(text_config, context, dtype)
    need = all_bytes + state + placement.WORKSPACE_RESERVE
    if vram_bytes < need:
        spec = family_for_model_type(text_config.model_type)
        why = spec.not_offloadable if spec is not None and spec.not_offloadable else "offloading is not supported"
        gib = placement.GiB
        raise UsageError(
            f"{why}: every department must stay resident, which needs {need / gib:.2f} GiB of VRAM (weights "
            f"{all_bytes / gib:.2f}, KV/state {state / gib:.2f}, workspace {placement.WORKSPACE_RESERVE / gib:.2f}) "
            f"and --vram gives {vram_bytes / gib:.2f} GiB: raise --vram, leave it out, or use --device cpu"
        )
    total = sum(m.num_experts for m in mods)
    return placement.OffloadPlan(vram_bytes, all_bytes - expert_total, state, expert_total // total, total, total)


def place_non_experts(model, budget, device: torch.device, dtype) -> dict[str, torch.device]:
    """Where each non-expert unit lives when the plan spills: accelerate's `infer_auto_device_map` fills the GPU's
    share of the budget in model order and puts the rest in host memory. {} when nothing spills."""
    if budget is None or not budget.spills:
        return {}
    from accelerate import infer_auto_device_map

    no_split = list(getattr(model, "_no_split_modules", None) or [])
    dmap = infer_auto_device_map(
        model,
        max_memory={0: budget.non_expert_gpu_bytes, "cpu": 1 << 50},
        no_split_module_classes=no_split,
        dtype=dtype,
    )
    return {name: torch.device("cpu") if where in ("cpu", "disk") else device for name, where in dmap.items()}


def device_of(name: str, dmap: dict[str, torch.device], device: torch.device) -> torch.device:
    """The device of parameter/buffer `name` under a device map (its longest matching module prefix)."""
    best, at = -1, device
    for prefix, dev in dmap.items():
        if (prefix == "" or name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
            best, at = len(prefix), dev
    return at


def place_buffers(model, dmap: dict[str, torch.device], device: torch.device) -> None:
    """Every buffer on its unit's device (the skeleton made them on the host)."""
    from accelerate.utils import set_module_tensor_to_device

    for name, buf in model.named_buffers():
        if buf.device != device_of(name, dmap, device):
            set_module_tensor_to_device(model, name, device_of(name, dmap, device), value=buf)


def dispatch_spilled(model, dmap: dict[str, torch.device], device: torch.device) -> None:
    """Attach accelerate's hooks so the host-resident units run on `device` (their weights copied in per forward)."""
    if not dmap or device.type == "cpu":
        return
    from accelerate import dispatch_model

    dispatch_model(
        model, device_map={k: ("cpu" if v.type == "cpu" else v) for k, v in dmap.items()}, main_device=device
    )


def expert_store(placed: Placement, options, path: Path, files: list[Path], dtype, on_notice=None):
    """Where offloaded experts' master copies go: the memory-mapped store (`store.ExpertStore`, keyed by
    `options.store_key`, else the folder) or None for host memory. Int4 master copies are never memory-mapped; with
    files, host memory is not pinned."""
    if options.experts_format == "int4" and placed.host and options.host_storage == "mmap":
        raise UsageError(
            "--host-storage mmap keeps full-precision experts; int4 master copies live in host memory: "
            "drop --host-storage mmap (or use --experts full)"
        )
    if options.experts_format == "int4":
        return None
    key = options.store_key or (str(path), "local")
    files_store = _expert_files(placed.host, options.host_storage, placed.budget, key, files, dtype, on_notice)
    if files_store is not None:
        placed.pinned[0] = False
    return files_store


def _expert_files(host: bool, storage: str, budget, key: tuple[str, str], files: list[Path], dtype, on_notice):
    """The memory-mapped expert store when the master copies go to files ("mmap", or "auto" with too little RAM);
    None for host memory."""
    if not host or storage == "pinned":
        return None
    need = budget.total_experts * budget.expert_bytes
    if storage == "auto" and not store.needs_files(need, placement.total_ram()):
        return None
    files_store = store.ExpertStore(key[0], key[1], files, dtype)
    if on_notice:
        on_notice(
            f"expert master copies ({need / (1 << 30):.1f} GiB) are memory-mapped files under "
            f"{files_store.dir} (host RAM {'is short' if storage == 'auto' else 'not used: --host-storage mmap'})"
            "; the first load writes them, misses are copied in (slower than pinned memory)"
        )
    return files_store
