"""kernels/embedding_gather.py against its torch reference and F.embedding: odd T, H not a power of two, bf16 and
fp32, int32/int64 ids, a table at a row stride, the table in (pinned) host memory, the output buffer reused, a
CUDA-graph capture (GPU), bad arguments refused. Runs under TRITON_INTERPRET=1 on the CPU, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEV

from localmoe.kernels.embedding_gather import embedding_gather, embedding_gather_ref

CUDA = DEV == "cuda"


def _table(V, H, dtype, seed=0, host=False):
    w = torch.randn(V, H, generator=torch.Generator().manual_seed(seed)).to(dtype)
    if host:  # a host master copy: pinned when the GPU reads it
        return w.pin_memory() if CUDA else w
    return w.to(DEV)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,V,H,host", [(7, 101, 2880 // 32, True), (1, 37, 1500, False), (13, 64, 3, True)])
def test_matches_reference_and_f_embedding(dtype, T, V, H, host):
    w = _table(V, H, dtype, seed=T, host=host)
    ids = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(H)).to(DEV)
    got = embedding_gather(ids, w)
    assert got.shape == (T, H) and got.dtype == dtype and got.device == ids.device
    assert torch.equal(got.cpu(), embedding_gather_ref(ids, w).cpu())
    assert torch.equal(got.cpu(), torch.nn.functional.embedding(ids.cpu(), w.cpu()))


def test_int32_ids_strided_table_and_out_buffer():
    V, H = 50, 200
    big = _table(V, 2 * H + 3, torch.bfloat16, host=True)
    w = big[:, 5 : 5 + H]  # rows contiguous, row stride 2H+3
    ids = torch.tensor([49, 0, 0, 17, 3], dtype=torch.int32, device=DEV)
    out = torch.full((5, H), 7.0, dtype=torch.bfloat16, device=DEV)
    assert embedding_gather(ids, w, out=out) is out
    assert torch.equal(out.cpu(), w.cpu()[ids.long().cpu()])
    assert embedding_gather(ids[:0], w).shape == (0, H)


@pytest.mark.skipif(not CUDA, reason="a CUDA graph")
def test_captured_in_a_cuda_graph_reads_the_host_table():
    """The decode step's one token inside a CUDA graph: the table in pinned host memory, the id written between
    replays, no sync; ids out of range give a row of zeros on the GPU."""
    w = _table(1000, 2880, torch.bfloat16, host=True)
    ids = torch.zeros(1, dtype=torch.long, device="cuda")
    out = torch.empty(1, 2880, dtype=torch.bfloat16, device="cuda")
    embedding_gather(ids, w, out=out)  # compiled outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        embedding_gather(ids, w, out=out)
    for tok in (5, 999, 0, 1000, -1):
        ids.fill_(tok)
        g.replay()
        want = w[tok] if 0 <= tok < 1000 else torch.zeros(2880, dtype=torch.bfloat16)
        assert torch.equal(out[0].cpu(), want), tok


def test_checks():
    w = _table(10, 8, torch.float32)
    ids = torch.tensor([1, 2], device=DEV)
    with pytest.raises(ValueError, match="ids must be \\[T\\]"):
        embedding_gather(ids.view(1, 2), w)
    with pytest.raises(ValueError, match="int32/int64"):
        embedding_gather(ids.float(), w)
    with pytest.raises(ValueError, match="contiguous int32"):
        embedding_gather(torch.arange(4, device=DEV)[::2], w)
    with pytest.raises(ValueError, match="bf16/fp16/fp32"):
        embedding_gather(ids, w.to(torch.int32))
    with pytest.raises(ValueError, match="rows must be contiguous"):
        embedding_gather(ids, w.t())
    with pytest.raises(ValueError, match="out must be"):
        embedding_gather(ids, w, out=torch.empty(2, 8, dtype=torch.bfloat16, device=DEV))
    if CUDA:
        with pytest.raises(ValueError, match="pinned"):
            embedding_gather(ids, w.cpu())
    else:
        with pytest.raises(ValueError, match="in \\[0, 10\\)"):
            embedding_gather(torch.tensor([3, 10]), w)
        with pytest.raises(ValueError, match="in \\[0, 10\\)"):
            embedding_gather(torch.tensor([-1]), w)
