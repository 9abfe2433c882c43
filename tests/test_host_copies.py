"""experts/host_copies.py: rows of host stacks copied by runs (CPU: torch copies; the driver's copy engines are
checked on the GPU by bench/prefill_check.py through the layer stage)."""

import pytest
import torch

from localmoe.experts.host_copies import copy_rows, runs


def test_runs_merge_consecutive_rows():
    assert runs([]) == []
    assert runs([3]) == [(3, 0, 1)]
    assert runs([0, 1, 2, 5, 6, 9]) == [(0, 0, 3), (5, 3, 2), (9, 5, 1)]
    assert runs([4, 3]) == [(4, 0, 1), (3, 1, 1)]  # descending rows are not a run


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32])
def test_copy_rows_gathers_each_stack(dtype):
    gen = torch.Generator().manual_seed(0)
    srcs = [torch.randint(0, 100, (9, 3, 5), generator=gen).to(dtype), torch.randn(9, 7, generator=gen).to(dtype)]
    dsts = [torch.zeros(6, 3, 5, dtype=dtype), torch.zeros(6, 7, dtype=dtype)]
    rows = [0, 1, 4, 5, 6, 8]
    copy_rows(list(zip(dsts, srcs)), rows)
    for d, s in zip(dsts, srcs):
        assert torch.equal(d, s[rows])


def test_rows_with_gaps_between_them_copy_one_by_one():
    """Stacks whose rows are not back to back (views of an expert-major block) still take their rows."""
    block = torch.arange(6 * 10, dtype=torch.float32).view(6, 10)
    src = block[:, 2:7]  # rows of 5, 10 apart
    dst = torch.zeros(4, 12)[:, :5]
    copy_rows([(dst, src)], [1, 2, 3, 5])
    assert torch.equal(dst, src[[1, 2, 3, 5]])


def test_no_rows_copy_nothing():
    """A layer whose gates are all resident (a gate tier) stages none: its slot stacks hold no rows."""
    copy_rows([(torch.zeros(0, 8), torch.ones(4, 8))], [])


def test_copy_rows_refuses_what_it_cannot_copy():
    src = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="cannot take"):
        copy_rows([(torch.zeros(4, 8, dtype=torch.float16), src)], [0])
    with pytest.raises(ValueError, match="cannot take"):
        copy_rows([(torch.zeros(1, 8), src)], [0, 1])
    with pytest.raises(ValueError, match="each row contiguous"):
        copy_rows([(torch.zeros(8, 4).t(), src)], [0])
    with pytest.raises(ValueError, match="past"):
        copy_rows([(torch.zeros(2, 8), src)], [4])
