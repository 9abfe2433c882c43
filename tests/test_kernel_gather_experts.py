"""kernels/gather_experts.py against its reference: pool or host per expert by the slot table, word and element
copies, experts at a stride, bad arguments refused. Runs under TRITON_INTERPRET=1 on the CPU, compiled on a GPU."""

import pytest
import torch

import localmoe.kernels.gather_experts as ge
from localmoe.kernels.gather_experts import gather_experts, gather_experts_ref
from localmoe.kernels.int4 import quantize

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _stacks(E, S, shape, dtype, gen):
    def make(n):
        if dtype == torch.uint8:
            return torch.randint(0, 256, (n, *shape), generator=gen, dtype=torch.uint8)
        return torch.randn((n, *shape), generator=gen).to(dtype)

    host = make(E)
    if DEV == "cuda":
        host = host.pin_memory()
    return host, make(S).to(DEV)


@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((512, 2048), torch.bfloat16),  # a real expert projection (Qwen3.5-35B-A3B)
        ((3, 5), torch.float32),  # odd
        ((7, 3), torch.bfloat16),  # 42 bytes: not whole words, copied element by element
        ((4, 9), torch.uint8),  # int4 packed bytes, 36 per expert: words
        ((5, 3), torch.uint8),  # 15 bytes: elements
    ],
)
def test_gather_matches_reference(shape, dtype):
    gen = torch.Generator().manual_seed(0)
    E, S, n = 9, 4, 6
    host, pool = _stacks(E, S, shape, dtype, gen)
    table = torch.tensor([2, -1, -1, 0, -1, 3, -1, 1, -1], device=DEV)  # experts 0, 3, 5, 7 resident
    ids = torch.tensor([0, 1, 3, 4, 7, 8], dtype=torch.int32, device=DEV)
    want = gather_experts_ref(torch.zeros((n + 1, *shape), dtype=dtype), pool.cpu(), host.cpu(), table.cpu(), ids)
    got = gather_experts(torch.zeros((n + 1, *shape), dtype=dtype, device=DEV), pool, host, table, ids)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(got[2].cpu(), pool[0].cpu()) and torch.equal(got[3].cpu(), host[4])  # pool, host
    assert not got[n].any()  # rows past n untouched


def test_gather_int4_parts_at_a_stride():
    """An int4 stack's parts (packed bytes, bf16 scales and minima), the pool a view at an expert stride."""
    gen = torch.Generator().manual_seed(1)
    E, I, H = 5, 4, 256
    host = quantize(torch.randn(E, I, H, generator=gen, dtype=torch.bfloat16))
    big = quantize(torch.randn(2 * E, I, H, generator=gen, dtype=torch.bfloat16).to(DEV))
    table = torch.tensor([-1, 1, -1, 3, -1], device=DEV)  # the pool is big's even experts: slot s = big[2 s]
    ids = torch.arange(E, device=DEV)
    for h, b in zip(host.parts(), big.parts()):
        pool = b[::2]
        dst = torch.empty((E, *h.shape[1:]), dtype=h.dtype, device=DEV)
        want = gather_experts_ref(dst.cpu().clone(), pool.cpu(), h, table.cpu(), ids.cpu())
        gather_experts(dst, pool, h.pin_memory() if DEV == "cuda" else h, table, ids)
        assert torch.equal(dst.cpu(), want)


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("block", [8, 4096], ids=["several-tiles", "one-tile"])
def test_parts_in_one_launch(monkeypatch, parts, block):
    """An int4 stack's parts (packed bytes as words, bf16 scales and minimums; an odd group count: scales copied
    element by element) in one launch, the pool at an expert stride; each part as the reference gathers it. Two parts:
    the packed bytes and scales only."""
    monkeypatch.setattr(ge, "BLOCK", block)
    gen = torch.Generator().manual_seed(3)
    E, I, H = 7, 3, 96  # 3 groups of 32 a row: 9 scales an expert, 18 bytes, not whole words
    host = quantize(torch.randn(E, I, H, generator=gen, dtype=torch.bfloat16), group=32)
    big = quantize(torch.randn(2 * E, I, H, generator=gen, dtype=torch.bfloat16).to(DEV), group=32)
    table = torch.tensor([-1, 1, -1, 3, 0, -1, 2], device=DEV)
    ids = torch.tensor([6, 0, 3, 4, 1], dtype=torch.int32, device=DEV)
    hosts = [t.pin_memory() if DEV == "cuda" else t for t in host.parts()][:parts]
    pools = [b[::2] for b in big.parts()][:parts]
    dsts = [torch.zeros((6, *h.shape[1:]), dtype=h.dtype, device=DEV) for h in hosts]
    want = gather_experts_ref([d.cpu().clone() for d in dsts], [p.cpu() for p in pools], [h.cpu() for h in hosts],
                              table.cpu(), ids.cpu())  # fmt: skip
    gather_experts(tuple(dsts), tuple(pools), tuple(hosts), table, ids)
    for got, w in zip(dsts, want):
        assert torch.equal(got.cpu(), w) and not got[5].any()


def test_gather_refuses_bad_arguments():
    host, pool = torch.zeros(4, 2, 3), torch.zeros(2, 2, 3)
    dst, table, ids = torch.zeros(3, 2, 3), torch.full((4,), -1), torch.arange(3)
    with pytest.raises(ValueError, match="dtype"):
        gather_experts(dst, pool.double(), host, table, ids)
    with pytest.raises(ValueError, match="n <= 3"):
        gather_experts(dst, pool, host, table, torch.arange(4))
    with pytest.raises(ValueError, match="table"):
        gather_experts(dst, pool, host, torch.full((5,), -1), ids)
    with pytest.raises(ValueError, match="int32/int64"):
        gather_experts(dst, pool, host, table, ids.float())
    with pytest.raises(ValueError, match="contiguous"):
        gather_experts(dst, pool, torch.zeros(4, 3, 2).transpose(1, 2), table, ids)
    with pytest.raises(ValueError, match="one to three parts"):
        gather_experts((dst,) * 4, (pool,) * 4, (host,) * 4, table, ids)
    with pytest.raises(ValueError, match="one to three parts"):
        gather_experts((dst, dst), (pool,), (host, host), table, ids)


@pytest.mark.parametrize("programs", [0, 1, 5])
def test_any_number_of_programs(monkeypatch, programs):
    """One program a tile (0), one program for every tile, or a few striding over them: the same gather."""
    monkeypatch.setattr(ge, "PROGRAMS", programs)
    monkeypatch.setattr(ge, "BLOCK", 8)  # several tiles an expert
    gen = torch.Generator().manual_seed(2)
    host, pool = _stacks(9, 4, (4, 9), torch.float32, gen)
    table = torch.tensor([2, -1, -1, 0, -1, 3, -1, 1, -1], device=DEV)
    ids = torch.tensor([8, 0, 1, 3, 4, 7], dtype=torch.int32, device=DEV)
    want = gather_experts_ref(torch.zeros((6, 4, 9)), pool.cpu(), host.cpu(), table.cpu(), ids)
    assert torch.equal(gather_experts(torch.zeros((6, 4, 9), device=DEV), pool, host, table, ids).cpu(), want)
