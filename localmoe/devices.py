"""Where a run executes, from the user's flags: the device (`--device`), the dtype (`--dtype`) and the VRAM budget
(`--vram`, else what the card has free minus a margin); and the pinned host-to-device bandwidth (`host_bandwidth`)."""

from __future__ import annotations

import time

import torch

from localmoe.errors import RuntimeFailure, UsageError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
VRAM_MARGIN = 1 << 30  # bytes left free on the card when --vram is not given


def pick_device(name: str | None) -> torch.device:
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeFailure("--device cuda was asked for but no CUDA GPU is available; use --device cpu")
    if not (name == "cpu" or name.startswith("cuda")):
        raise UsageError(f"unknown device {name!r}: use cpu or cuda")
    return torch.device(name)


def pick_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name in (None, "", "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise UsageError(f"unknown dtype {name!r}: use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def vram_budget(device: torch.device, vram_gib: float | None) -> int | None:
    """Bytes the model may use on the device: --vram, else what a CUDA card has free minus a 1 GiB margin."""
    if vram_gib is not None:
        if vram_gib <= 0:
            raise UsageError(f"--vram must be positive, got {vram_gib}")
        return int(vram_gib * (1 << 30))
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(0, free - VRAM_MARGIN)
    return None


def host_bandwidth(device: torch.device, nbytes: int = 256 << 20, copies: int = 8, rounds: int = 3) -> float:
    """Pinned host memory to the device, bytes per second (what bounds an offloaded prompt's expert copies): the best
    of `rounds` timings of `copies` copies of `nbytes`, after one to warm up (0.0 off CUDA). The best, not the mean:
    a round slowed by other work on the bus (a session-49 call read 36 GB/s once on a 55 GB/s link) would make the
    PCIe-bound time it sets look shorter than the link allows, and a prompt's fraction of it look better."""
    if device.type != "cuda":
        return 0.0
    a = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    b = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b.copy_(a, non_blocking=True)
    torch.cuda.synchronize(device)
    bw = 0.0
    for _ in range(max(1, rounds)):
        t = time.perf_counter()
        for _ in range(copies):
            b.copy_(a, non_blocking=True)
        torch.cuda.synchronize(device)
        bw = max(bw, nbytes * copies / (time.perf_counter() - t))
    del a, b
    return bw
