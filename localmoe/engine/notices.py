"""What a load tells the user in one-line notices, beside the plan line (plan.py): how experts are offloaded and
what that costs (pinning failures, the int4 hint, spilled non-expert units, the expert cache's miss mode and whether
it decodes through a CUDA graph), and the record of every notice a load gave (`Engine.notes`).
"""

from __future__ import annotations

import torch

from localmoe.errors import RuntimeFailure
from localmoe.models.loaded import LoadedModel, int4_hint


def recording(notes: list[str], on_notice):
    """on_notice that also keeps each notice in `notes`."""

    def notice(text: str) -> None:
        notes.append(text)
        if on_notice is not None:
            on_notice(text)

    return notice


def offload_notices(loaded: LoadedModel, device: torch.device, plan_shown: bool, notice) -> bool:
    """The offloaded load's notices, to `notice` in order (`plan_shown`: the plan line has said what the VRAM holds)
    -> whether decoding must go eager (no CUDA graph). A RuntimeFailure when direct misses cannot have pinned memory.
    Nothing without offloaded experts."""
    if loaded.cache is None:
        return False
    eager = False
    pin_failed = device.type == "cuda" and not loaded.host_pinned and loaded.host_storage != "mmap"
    if not plan_shown:
        notice(loaded.offload.summary())
    if pin_failed:
        notice("pinning host memory failed, using pageable memory (slower misses)")
    hint = int4_hint(loaded)
    if hint:
        notice(hint)
    if loaded.offload.spills and device.type == "cuda":
        eager = True  # accelerate's hooks copy the host-resident units' weights in on every forward
        notice(
            "non-expert modules that do not fit run through accelerate's offload hooks: decoding eagerly "
            "(no CUDA graph, no fused modules); a larger --vram keeps them on the GPU"
        )
    if loaded.cache.mode == "direct":
        if device.type == "cuda" and not loaded.host_pinned:
            # only a forced offload_miss="direct" gets here ("auto" picks direct only with pinned memory)
            if loaded.host_storage == "mmap":
                why, fix = (
                    "the expert master copies are memory-mapped files",
                    'keep them in RAM (host_storage="pinned")',
                )
            else:
                why, fix = "pinned host memory could not be allocated", "free RAM"
            raise RuntimeFailure(
                f'offload_miss="direct" reads expert misses from pinned host memory, but {why}: {fix}, or leave '
                'offload_miss at "auto" (misses are copied in)'
            )
        cache = loaded.cache
        tier = (
            f"; VRAM holds {cache.gate_slots} of {cache.num_experts * len(cache.masters)} experts' gates "
            f"and {cache.slots} experts' up/down rows (gates first: read whole for every routed expert)"
            if cache.gate_slots
            else ""
        )
        notice("expert misses are read straight from pinned host memory inside the CUDA graph" + tier)
    elif loaded.cache.mode == "cpu":
        notice("expert misses are computed on the CPU; decoding eagerly (no CUDA graph)")
        eager = True
    else:
        notice("copy-then-compute offloading decodes eagerly (no CUDA graph)")
        eager = True
    return eager
