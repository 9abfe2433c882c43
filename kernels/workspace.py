"""Zeroed int32 scratch buffers for the decode kernels that finish with tickets (self-cleaning workspaces).

`zeroed_int32(tag, device, numel)` returns one buffer per (tag, device, stream) with at least `numel` elements,
grown on demand. The kernels using it leave it zeroed when they return (the last program re-zeroes what it used),
so no memset runs between launches and a CUDA graph can replay them. An outgrown buffer is kept alive: a captured
graph may still point at it. Create it before capture (a warm-up call): a first allocation during capture lands in
the graph's private pool.
"""

from __future__ import annotations

import torch

_BUFFERS: dict = {}
_RETIRED: list = []


def zeroed_int32(tag: str, device, numel: int, minimum: int = 64) -> torch.Tensor:
    device = torch.device(device)
    key = (tag, str(device), torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < numel:
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(numel, minimum), dtype=torch.int32, device=device)
        _BUFFERS[key] = buf
    return buf
