"""Host memory for one load's expert master copies: stacks carved from few large blocks, pinned while pinning works.

torch rounds every pinned allocation up to a power of two (its caching host allocator, by default), so a stack
allocated alone wastes up to half of itself: Qwen3-30B-A3B's bf16 [128, 768, 2048] stacks are 384 MiB each and took
512 (72 GiB of pinned memory for 54 GiB of experts), DeepSeek-V2-Lite's 352 MiB took 512. `HostMemory` asks for
blocks whose sizes are powers of two already, as large as the bytes still to come allow (at most MAX_BLOCK), and
carves the stacks out of them at ALIGN-byte offsets, the first block with room first: the waste is at most about one
stack a block. Where pinning a block fails, one just large enough for the stack is tried; where that fails too (no
CUDA, a container's limit), it and all later blocks are pageable and `pinned` is cleared (direct misses need every
master copy pinned; the loader reads it).

Imports: torch only.
"""

from __future__ import annotations

import math

import torch

ALIGN = 4096  # bytes: each stack starts at a multiple (a page)
MAX_BLOCK = 8 << 30  # bytes: the largest block asked for at once


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _power_of_two_at_most(n: int) -> int:
    return 1 << (n.bit_length() - 1) if n > 0 else 0


def host_block(nbytes: int, pin: bool) -> tuple[torch.Tensor, bool]:
    """(uint8 tensor of `nbytes`, pinned): pinned host memory when asked and possible, else pageable."""
    if pin:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), True
        except RuntimeError:
            pass
    return torch.empty(nbytes, dtype=torch.uint8), False


class HostMemory:
    """alloc(shape, dtype) for a load's master copies (module doc). `total`: the bytes the load will ask for (the
    plan's master copies; 0 when unknown: each block then fits the stack that asks for it); `block(nbytes, pin)`
    makes a block (tests pass their own)."""

    def __init__(self, pin: bool, total: int = 0, block=host_block):
        self.pinned = pin
        self.left = total
        self.block = block
        self.free: list[torch.Tensor] = []  # the blocks' unused tails (uint8), in the order made

    def __call__(self, shape, dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        need = -(-nbytes // ALIGN) * ALIGN
        self.left = max(0, self.left - need)
        i = next((i for i, t in enumerate(self.free) if t.numel() >= need), None)
        if i is None:
            least = _power_of_two_at_least(need)
            size = max(least, min(MAX_BLOCK, _power_of_two_at_most(self.left + need)))
            t, ok = self.block(size, self.pinned)
            if self.pinned and not ok and size > least:  # near the limit a smaller block may still pin
                size = least
                t, ok = self.block(size, True)
            self.pinned = self.pinned and ok
            self.free.append(t)
            i = len(self.free) - 1
        tail = self.free[i]
        out = tail[:nbytes].view(dtype).view(shape)
        if tail.numel() - need >= ALIGN:
            self.free[i] = tail[need:]
        else:
            del self.free[i]
        return out
