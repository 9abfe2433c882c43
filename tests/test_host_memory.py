"""experts/host_memory.py: master copies carved from blocks whose sizes are powers of two (torch rounds a pinned
allocation up to one), so the blocks hold little more than the stacks; stacks never overlap, start aligned, and read
back what was written. Blocks are counted through an injected maker (meta tensors for the large shapes); the real
engines' master copies go through it on every offloaded load of the suite (pageable here: no CUDA)."""

import pytest
import torch

from localmoe.experts.host_memory import ALIGN, MAX_BLOCK, HostMemory

MiB, GiB = 1 << 20, 1 << 30


def _meta_blocks(made: list):
    def block(nbytes: int, pin: bool):
        made.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, device="meta"), pin

    return block


@pytest.mark.parametrize(
    "stack, count",
    [
        ((128, 768, 2048), 3 * 48),  # Qwen3-30B-A3B bf16: 384 MiB stacks (one alone took 512)
        ((64, 1408, 2048), 3 * 26),  # DeepSeek-V2-Lite: 352 MiB
        ((256, 512, 2048), 3 * 40),  # Qwen3.5-35B-A3B: 512 MiB, a power of two already
    ],
)
def test_blocks_hold_little_more_than_the_stacks(stack, count):
    made = []
    nbytes = 2 * stack[0] * stack[1] * stack[2]
    memory = HostMemory(True, total=count * nbytes, block=_meta_blocks(made))
    views = [memory(stack, torch.bfloat16) for _ in range(count)]
    assert all(n & (n - 1) == 0 and n <= MAX_BLOCK for n in made)  # powers of two: torch rounds nothing up
    assert sum(made) <= 1.1 * count * nbytes  # each alone: up to 1.45x
    assert memory.pinned and all(v.shape == stack for v in views)


def test_stacks_do_not_overlap_and_read_back():
    memory = HostMemory(False, total=10 * MiB)
    shapes = [((3, 5, 7), torch.float32), ((1000,), torch.uint8), ((4, 4096), torch.bfloat16), ((0, 8), torch.int32)]
    made = [(memory(s, dt), s, dt) for s, dt in shapes * 3]
    spans = []
    for i, (t, s, dt) in enumerate(made):
        assert t.shape == s and t.dtype == dt and t.is_contiguous()
        if t.numel():
            assert t.storage_offset() * t.element_size() % ALIGN == 0  # from its block's start
            spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
            t.copy_(torch.full(s, i).to(dt))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    for i, (t, s, dt) in enumerate(made):
        assert torch.equal(t, torch.full(s, i).to(dt))


def test_unknown_totals_and_failed_pinning():
    made = []

    def unpinnable(nbytes, pin):
        made.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, device="meta"), False

    memory = HostMemory(True, block=unpinnable)
    memory((3, MiB), torch.uint8)
    assert made == [4 * MiB] and not memory.pinned  # no total: a block fits the stack that asks
    memory((1, MiB), torch.uint8)
    assert made == [4 * MiB]  # the tail holds the next stack
    memory((2, GiB), torch.uint8)
    assert made[-1] == 2 * GiB


def test_a_block_that_will_not_pin_is_tried_smaller_first():
    asked = []

    def pins_up_to_1_gib(nbytes, pin):
        asked.append((nbytes, pin))
        return torch.empty(nbytes, dtype=torch.uint8, device="meta"), pin and nbytes <= GiB

    memory = HostMemory(True, total=16 * GiB, block=pins_up_to_1_gib)
    memory((384, MiB), torch.uint8)
    assert asked == [(8 * GiB, True), (512 * MiB, True)] and memory.pinned
