"""Where a model's weights go before any is read: the token embeddings (host memory on CUDA unless tied:
models/host_embedding.py, `--embeddings`), the VRAM plan for a budget (`plan_offload`, experts/placement.py; a
host-resident embedding table counts as host bytes), which non-expert units spill to host memory (accelerate's
device map) and the hooks that run them, where buffers live, and where offloaded experts' master copies live
(pinned or pageable host memory, or memory-mapped files: experts/store.py). `plan_placement` is the loader's and
random_weights' one step for all of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from localmoe.errors import UsageError
from localmoe.experts import department_placement, placement, prefill_budget, store
from localmoe.experts.host_memory import HostMemory
from localmoe.experts.int4 import expert_bytes as int4_expert_bytes
from localmoe.models import host_embedding
from localmoe.models.skeleton import units

HOST_STORAGE = ("auto", "pinned", "mmap")
# where the input embedding table lives: "auto" host memory on CUDA (the CPU: unchanged), "host" host memory on any
# device, "gpu" with the rest of the non-expert weights (a tied table always: it is lm_head's weight too)
EMBEDDINGS = ("auto", "host", "gpu")


@dataclass
class Placement:
    """The plan for one load: the VRAM budget's plan (None without a budget), the non-expert device map ({} when
    nothing spills) and the host memory the master copies are carved from (its `pinned` cleared when pinning
    fails)."""

    budget: placement.OffloadPlan | None
    dmap: dict[str, torch.device]
    memory: HostMemory = field(default_factory=lambda: HostMemory(False))
    host_params: tuple[str, ...] = ()  # offloaded DeaMoE: the experts modules whose parameters load to host memory
    host_embedding: str = ""  # the HostEmbedding module's name when the token embeddings live in host memory

    @property
    def host(self) -> bool:
        """Experts are offloaded: their master copies live in host memory (or files)."""
        return self.budget is not None and self.budget.offloading

    def device_for(self, name: str, device: torch.device) -> torch.device:
        """Where parameter `name` loads: host memory for an offloaded DeaMoE experts module's (the department
        cache's master copies) and for the host-resident embedding table, else its unit's device under the device
        map."""
        if any(name.startswith(prefix + ".") for prefix in self.host_params):
            return torch.device("cpu")
        if self.host_embedding and name.startswith(self.host_embedding + "."):
            return torch.device("cpu")
        return device_of(name, self.dmap, device)


def plan_placement(
    model, text_config, experts: dict, device: torch.device, dtype, options, on_notice=None
) -> Placement:
    """The token embeddings' place (`embeddings_to_host`), the VRAM plan for `options.vram_bytes` (none without a
    budget) and the non-expert units' places."""
    emb = embeddings_to_host(model, text_config, device, dtype, options.embeddings, on_notice)
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
    host = tuple(experts) if isinstance(budget, department_placement.DepartmentPlan) and budget.offloading else ()
    memory = HostMemory(device.type == "cuda", _master_bytes(budget))
    return Placement(budget, dmap, memory, host, emb or "")


def _master_bytes(budget) -> int:
    """Bytes the offloaded experts' master copies take in host memory (0: nothing offloaded, or no plan)."""
    if budget is None or not budget.offloading:
        return 0
    if isinstance(budget, department_placement.DepartmentPlan):
        return budget.host_bytes
    return budget.total_experts * budget.expert_bytes


def embeddings_to_host(model, text_config, device: torch.device, dtype, embeddings: str, on_notice=None) -> str | None:
    """The input embedding swapped for a HostEmbedding on the skeleton when `embeddings` asks for host memory
    ("auto": on CUDA; "host": any device) and it is not tied to lm_head -> its module name, else None. On CUDA a
    notice says where the table went (or, asked for explicitly, why it stays on the GPU)."""
    if embeddings == "gpu" or (embeddings == "auto" and device.type != "cuda"):
        return None
    reason = host_embedding.keep_reason(model, text_config)
    if reason is not None:
        if on_notice and embeddings == "host" and device.type == "cuda":
            on_notice(f"token embeddings stay in VRAM: {reason}")
        return None
    name = host_embedding.install(model, text_config)
    if on_notice and device.type == "cuda":
        gb = host_embedding.host_bytes(model, torch.finfo(dtype).bits // 8) / 1e9
        on_notice(
            f"token embeddings ({gb:.2f} GB) live in pinned host memory, one row read per token "
            "(--embeddings gpu keeps them in VRAM)"
        )
    return name


def plan_offload(
    model, text_config, experts: dict, dtype, vram_bytes: int, context: int, on_notice=None, fmt: str = "full"
):
    """The VRAM plan for `vram_bytes`, with experts of format `fmt` ("full", "int4", "nf4" or "mxfp4")."""
    el = torch.finfo(dtype).bits // 8
    # a host-resident embedding table (models/host_embedding.py) holds no VRAM: host bytes, not in the plan
    non_expert = sum(p.numel() * el for p in model.parameters()) - host_embedding.host_bytes(model, el)
    mods = list(experts.values())
    if hasattr(mods[0], "num_departments"):  # DeaMoE: departments first, then private parts
        return _department_plan(text_config, mods, non_expert, el, vram_bytes, context, dtype, on_notice)
    E, I, H = mods[0].num_experts, mods[0].intermediate_size, mods[0].hidden_size
    if any((m.num_experts, m.intermediate_size, m.hidden_size) != (E, I, H) for m in mods):
        raise UsageError("expert offloading needs every MoE layer to have the same expert shape")
    expert_bytes = 3 * I * H * el
    if fmt != "full":
        try:
            expert_bytes = int4_expert_bytes(I, H, fmt)
        except ValueError as e:
            raise UsageError(f"{e}; use --experts full") from None
    with host_embedding.detached(model):
        largest = max(units(model).values(), default=0)
    # set aside what the longest prefill piece needs (its activations, the staging buffers), so the cache is sized
    # after it and the budget holds while a long prompt is prefilled
    workspace, resident = prefill_budget.workspaces(
        text_config, dtype, fmt, context, vram_bytes, experts=E, width=I, hidden=H
    )
    budget = placement.plan(
        budget_bytes=vram_bytes,
        non_expert_bytes=non_expert,
        state=placement.state_bytes(text_config, context, dtype),
        expert_bytes=expert_bytes,
        total_experts=E * len(mods),
        top_k=int(getattr(text_config, "num_experts_per_tok", 1)),
        largest_module_bytes=largest,
        workspace=workspace,
        resident_workspace=resident,
    )
    warning = placement.host_ram_notice(budget, placement.available_ram())
    if warning and on_notice:
        on_notice(warning)
    return budget


def _department_plan(text_config, mods, all_bytes: int, el: int, vram_bytes: int, context: int, dtype, on_notice):
    """DeaMoE's plan (experts/department_placement.py): every department resident when the budget holds them, else
    department units first, then private units, the rest in host memory; a one-line refusal below one token's need
    of a layer. Its experts are parameters of the model, counted in `all_bytes`."""
    m0 = mods[0]
    shape = (m0.num_departments, m0.per_department, m0.hidden_size, m0.width)
    if any((m.num_departments, m.per_department, m.hidden_size, m.width) != shape for m in mods):
        raise UsageError("DeaMoE offloading needs every MoE layer to have the same department shape")
    expert_total = sum(p.numel() * el for m in mods for p in m.parameters())
    budget = department_placement.plan_departments(
        budget_bytes=vram_bytes,
        non_expert_bytes=all_bytes - expert_total,
        state=placement.state_bytes(text_config, context, dtype),
        departments=m0.num_departments,
        per_department=m0.per_department,
        hidden=m0.hidden_size,
        width=m0.width,
        layers=len(mods),
        element_bytes=el,
        departments_per_token=int(getattr(text_config, "max_departments_per_token", m0.num_departments)),
        top_k=int(getattr(text_config, "num_experts_per_tok", 1)),
    )
    warning = placement.host_ram_notice(budget, placement.available_ram())
    if warning and on_notice:
        on_notice(warning)
    return budget


def place_non_experts(model, budget, device: torch.device, dtype) -> dict[str, torch.device]:
    """Where each non-expert unit lives when the plan spills: accelerate's `infer_auto_device_map` fills the GPU's
    share of the budget in model order and puts the rest in host memory. {} when nothing spills."""
    if budget is None or not budget.spills:
        return {}
    from accelerate import infer_auto_device_map

    no_split = list(getattr(model, "_no_split_modules", None) or [])
    with host_embedding.detached(model):  # a host-resident table takes none of the GPU's share
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

    with host_embedding.detached(model):  # no hook copies a host-resident table to the GPU per forward
        dispatch_model(
            model, device_map={k: ("cpu" if v.type == "cpu" else v) for k, v in dmap.items()}, main_device=device
        )


def expert_store(placed: Placement, options, path: Path, files: list[Path], dtype, on_notice=None):
    """Where offloaded experts' master copies go: the memory-mapped store (`store.ExpertStore`, keyed by
    `options.store_key`, else the folder) or None for host memory. Int4 master copies are never memory-mapped; with
    files, host memory is not pinned."""
    fmt = options.experts_format
    if fmt != "full" and placed.host and options.host_storage == "mmap":
        raise UsageError(
            f"--host-storage mmap keeps full-precision experts; {fmt} master copies live in host memory: "
            + ("drop --host-storage mmap" if fmt == "mxfp4" else "drop --host-storage mmap (or use --experts full)")
        )
    if fmt != "full" or placed.host_params:  # DeaMoE's master copies: parameters in host memory
        return None
    key = options.store_key or (str(path), "local")
    files_store = _expert_files(placed.host, options.host_storage, placed.budget, key, files, dtype, on_notice)
    if files_store is not None:
        placed.memory.pinned = False
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
