"""kernels/gather_dequant.py against its reference: int4 and NF4 experts from the pool or the host copy by the slot
table, dequantized to bf16 and fp32, odd and real (Qwen3.5-35B-A3B) shapes, a pool at an expert stride, any number
of programs, bad arguments refused. Runs under TRITON_INTERPRET=1 on the CPU, compiled on a GPU."""

import gc

import pytest
import torch

import localmoe.kernels.gather_dequant as gd
from localmoe.kernels.gather_dequant import gather_dequant, gather_dequant_projections, gather_dequant_ref
from localmoe.kernels.int4 import Int4Tensor, quantize
from localmoe.kernels.nf4 import Nf4Tensor, nf4_code

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TABLE = [2, -1, -1, 0, -1, 3, -1, 1, -1]  # experts 0, 3, 5, 7 resident in slots 2, 0, 3, 1


def _pin(w):
    parts = [t.pin_memory() if DEV == "cuda" else t for t in w.parts()]
    return Int4Tensor(*parts, w.dtype) if len(parts) == 3 else Nf4Tensor(*parts, None, w.dtype)


def _int4(E, I, H, seed, group=None):
    w = torch.randn(E, I, H, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    return quantize(w, group=group)


def _nf4(E, I, H, block, seed):
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (E, I, H // 2), generator=gen, dtype=torch.uint8)
    return Nf4Tensor(packed, torch.rand(E, I, H // block, generator=gen), None, torch.bfloat16)


def _run(host, pool, dtype, ids, code=None):
    table = torch.tensor(TABLE, device=DEV)
    ids = torch.tensor(ids, dtype=torch.int32, device=DEV)
    n, (_, I, H) = len(ids), host.shape
    want = gather_dequant_ref(torch.zeros((n + 1, I, H), dtype=dtype), pool, host, table.cpu(), ids.cpu(), code)
    dst = torch.zeros((n + 1, I, H), dtype=dtype, device=DEV)
    got = gather_dequant(dst, pool, _pin(host), table, ids, code=None if code is None else code.to(DEV))
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-6)  # a GPU's fma
    torch.testing.assert_close(got.cpu(), want, **tol)  # may round once where torch rounds twice; exact on the CPU
    assert not got[n].any()  # rows past n untouched
    return got


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(
    "I, H, group",
    [(5, 256, 128), (3, 64, 16), (3, 384, 32), (2, 12, 2), (512, 2048, 128)],
    ids=["odd", "small", "12-groups", "pairs", "real"],
)
def test_int4_matches_reference(dtype, I, H, group):
    """12 groups a row (a row's bytes not a power of two); groups of 2 weights (one byte a group)."""
    host = _int4(9, I, H, 0, group)
    pool = _int4(4, I, H, 1, group)
    pool = Int4Tensor(*(t.to(DEV) for t in pool.parts()), pool.dtype)
    got = _run(host, pool, dtype, [0, 1, 3, 4, 7, 8])
    torch.testing.assert_close(got[1].cpu(), host[1].to(dtype), rtol=8e-3, atol=1e-6)  # host expert 1
    torch.testing.assert_close(got[2].cpu(), pool[0].cpu().to(dtype), rtol=8e-3, atol=1e-6)  # expert 3, slot 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_nf4_matches_reference(dtype):
    host, pool = _nf4(9, 6, 256, 64, 2), _nf4(4, 6, 256, 64, 3)
    pool = Nf4Tensor(*(t.to(DEV) for t in pool.parts()), None, pool.dtype)
    _run(host, pool, dtype, [8, 5, 0, 2], code=nf4_code("cpu"))


@pytest.mark.parametrize("programs,rows", [(1, 4), (3, 4), (1000, 4), (3, 8), (2, 1)])
def test_any_number_of_programs_and_a_pool_at_a_stride(monkeypatch, programs, rows):
    """One program for every tile, a few striding over them, or more programs than tiles, with tiles of 4 rows (the
    default), 8 (a partial last tile at I 7) or 1 (`bench/staging_ab.py --dequant-grid` sets both); the pool a view
    of every other expert of a larger stack (an expert stride that is not its size)."""
    monkeypatch.setattr(gd, "PROGRAMS", programs)
    monkeypatch.setattr(gd, "DEVICE_PROGRAMS", programs)  # the host stack on the device (the CPU here)
    monkeypatch.setattr(gd, "BLOCK_R", rows)
    host = _int4(9, 7, 128, 4, 32)
    big = _int4(8, 7, 128, 5, 32)
    pool = Int4Tensor(*(t.to(DEV)[::2] for t in big.parts()), big.dtype)
    _run(host, pool, torch.bfloat16, [7, 0, 3, 4, 8])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("fmt", ["int4", "nf4"])
def test_a_stage_of_the_absent_experts(fmt, dtype):
    """`host_rows`: `host` is a device stack of the absent experts only (experts/layer_stage.py), expert e in row
    host_rows[e]; the result equals the gather from the whole host copy. int4 at the real shape, NF4."""
    if fmt == "int4":
        host, pool, code = _int4(9, 512, 2048, 20, 128), _int4(4, 512, 2048, 21, 128), None
        pool = Int4Tensor(*(t.to(DEV) for t in pool.parts()), pool.dtype)
    else:
        host, pool, code = _nf4(9, 6, 256, 64, 22), _nf4(4, 6, 256, 64, 23), nf4_code(DEV)
        pool = Nf4Tensor(*(t.to(DEV) for t in pool.parts()), None, pool.dtype)
    absent = [e for e, s in enumerate(TABLE) if s < 0][::-1]  # any order: rows by host_rows
    rows = torch.full((len(TABLE),), -1, dtype=torch.int32)
    rows[absent] = torch.arange(len(absent), dtype=torch.int32)
    parts = [t[absent].to(DEV) for t in host.parts()]
    stage = Int4Tensor(*parts, host.dtype) if fmt == "int4" else Nf4Tensor(*parts, None, host.dtype)
    table = torch.tensor(TABLE, device=DEV)
    ids = torch.tensor([8, 0, 1, 3, 4, 7, 6], dtype=torch.int32, device=DEV)
    I, H = host.shape[1:]
    cpu_code = None if code is None else code.cpu()
    want = gather_dequant_ref(torch.zeros((8, I, H), dtype=dtype), pool, host, TABLE, ids.cpu(), cpu_code)
    got = gather_dequant(torch.zeros((8, I, H), dtype=dtype, device=DEV), pool, stage, table, ids, code=code,
                         host_rows=rows.to(DEV))  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-6)
    ref = gather_dequant_ref(torch.zeros((8, I, H), dtype=dtype), pool, stage, TABLE, ids.cpu(), cpu_code, rows)
    torch.testing.assert_close(ref, want, rtol=0, atol=0)


# odd shapes in every mode; the real shape (~13 s a case under the interpreter) staged in bf16 and from the host in fp32
JOINED_CASES = [
    pytest.param(5, 256, 128, stage, dtype, id=f"odd-{'stage' if stage else 'host'}-{name}")
    for stage in (False, True)
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32"))
] + [
    pytest.param(512, 2048, 128, True, torch.bfloat16, id="real-stage-bf16"),
    pytest.param(512, 2048, 128, False, torch.float32, id="real-host-fp32"),
]


@pytest.mark.parametrize("I, H, group, stage, dtype", JOINED_CASES)
def test_three_projections_in_one_launch(I, H, group, stage, dtype, monkeypatch):
    """A span's three projections, each its own pool, host stack and table (the gate tier's table differs), in one
    launch equal three references; from a stage (`host_rows`, one per projection), the gate's stage empty (every
    gate resident) as the layer stage lays it. A few programs striding over the three projections' tiles."""
    monkeypatch.setattr(gd, "PROGRAMS", 3)
    monkeypatch.setattr(gd, "DEVICE_PROGRAMS", 3)
    monkeypatch.setattr(gd, "JOINED", True)
    launches = []
    real = gd._gather_dequant_kernel
    monkeypatch.setattr(
        gd, "_gather_dequant_kernel", type("K", (), {"__getitem__": lambda _, g: launches.append(g) or real[g]})()
    )
    tables = [[0, 1, 2, 3, 0, 1, 2, 3, 0], TABLE, TABLE]  # the gate tier: every gate resident
    hosts = [_int4(9, I, H, 30 + q, group) for q in range(3)]
    pools = [_int4(4, I, H, 40 + q, group) for q in range(3)]
    pools = [Int4Tensor(*(t.to(DEV) for t in w.parts()), w.dtype) for w in pools]
    ids = torch.tensor([8, 0, 1, 3, 4, 7, 6], dtype=torch.int32, device=DEV)
    wants = [gather_dequant_ref(torch.zeros((8, I, H), dtype=dtype), pools[q], hosts[q], tables[q], ids.cpu())
             for q in range(3)]  # fmt: skip
    rows = None
    if stage:  # each projection's absent experts only, in a device stack
        rows, srcs = [], []
        for q in range(3):
            absent = [e for e, s in enumerate(tables[q]) if s < 0]
            r = torch.full((9,), -1, dtype=torch.int32)
            r[absent] = torch.arange(len(absent), dtype=torch.int32)
            rows.append(r.to(DEV))
            srcs.append(Int4Tensor(*(t[absent].to(DEV) for t in hosts[q].parts()), hosts[q].dtype))
        assert srcs[0].packed.shape[0] == 0
    else:
        srcs = [_pin(w) for w in hosts]
    dsts = [torch.zeros((8, I, H), dtype=dtype, device=DEV) for _ in range(3)]
    tabs = [torch.tensor(t, device=DEV) for t in tables]
    gather_dequant_projections(dsts, pools, srcs, tabs, ids, host_rows=rows)
    assert len(launches) == 1
    for got, want in zip(dsts, wants):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-6 if dtype == torch.float32 else 8e-3, atol=1e-6)


@pytest.mark.parametrize("joined", [True, False])
def test_projections_at_other_strides_launch_each(joined, monkeypatch):
    """A pool at another expert stride than the others' (a view of every other expert), or `JOINED` off: one launch
    a projection, the same results."""
    monkeypatch.setattr(gd, "JOINED", joined)
    hosts = [_int4(9, 3, 64, 50 + q, 16) for q in range(3)]
    pools = [_int4(4, 3, 64, 60 + q, 16) for q in range(2)]
    big = _int4(8, 3, 64, 62, 16)
    pools.append(Int4Tensor(*(t[::2] for t in big.parts()), big.dtype))
    pools = [Int4Tensor(*(t.to(DEV) for t in w.parts()), w.dtype) for w in pools]
    table = torch.tensor(TABLE, device=DEV)
    ids = torch.arange(9, dtype=torch.int32, device=DEV)
    dsts = [torch.zeros((9, 3, 64), device=DEV) for _ in range(3)]
    gather_dequant_projections(dsts, pools, [_pin(w) for w in hosts], [table] * 3, ids)
    for q in range(3):
        want = gather_dequant_ref(torch.zeros((9, 3, 64)), pools[q], hosts[q], TABLE, ids.cpu())
        torch.testing.assert_close(dsts[q].cpu(), want, rtol=1e-6, atol=1e-7)


def test_refuses_bad_arguments():
    host, pool = _int4(9, 4, 64, 6, 16), _int4(4, 4, 64, 7, 16)
    table, ids = torch.full((9,), -1), torch.arange(3)
    dst = torch.zeros(3, 4, 64)
    with pytest.raises(ValueError, match="contiguous float"):
        gather_dequant(dst.to(torch.int32), pool, host, table, ids)
    with pytest.raises(ValueError, match="groups of a power-of-two size"):
        gather_dequant(torch.zeros(3, 4, 66), pool, host, table, ids)
    with pytest.raises(ValueError, match=r"pool.packed must be torch.uint8 \[N, 5, 32\]"):
        gather_dequant(torch.zeros(3, 5, 64), pool, host, table, ids)
    with pytest.raises(ValueError, match="one to three projections"):
        gather_dequant_projections([dst] * 4, [pool] * 4, [host] * 4, [table] * 4, ids)
    with pytest.raises(ValueError, match="every dst must be"):
        gather_dequant_projections([dst, torch.zeros(3, 4, 64, dtype=torch.bfloat16)], [pool] * 2, [host] * 2,
                                   [table] * 2, ids)  # fmt: skip
    with pytest.raises(ValueError, match="n <= 3"):
        gather_dequant(dst, pool, host, table, torch.arange(4))
    with pytest.raises(ValueError, match="table"):
        gather_dequant(dst, pool, host, torch.full((5,), -1), ids)
    with pytest.raises(ValueError, match="int32/int64"):
        gather_dequant(dst, pool, host, table, ids.float())
    with pytest.raises(ValueError, match="host_rows must be"):
        gather_dequant(dst, pool, host, table, ids, host_rows=torch.zeros(9))
    with pytest.raises(ValueError, match="table"):
        gather_dequant(dst, pool, host, table, ids, host_rows=torch.zeros(5, dtype=torch.int32))
    with pytest.raises(ValueError, match="Nf4Tensor"):
        gather_dequant(dst, _nf4(4, 4, 64, 16, 8), _nf4(9, 4, 64, 16, 9), table, ids, code=None)
    odd = Int4Tensor(host.packed, host.scale.transpose(1, 2).contiguous().transpose(1, 2), host.minimum, host.dtype)
    with pytest.raises(ValueError, match="contiguous"):
        gather_dequant(dst, pool, odd, table, ids)


def test_a_stack_is_checked_once_while_it_lives():
    """The launcher's checks of a pool or host stack run once for that stack (a staged prefill's host time) and are
    dropped with it; another stack of the same shapes is checked again (a bad one still refused)."""
    host, pool = _int4(9, 4, 64, 10, 16), _int4(4, 4, 64, 11, 16)
    pool = Int4Tensor(*(t.to(DEV) for t in pool.parts()), pool.dtype)
    table, ids = torch.full((9,), -1, device=DEV), torch.arange(3, device=DEV)
    dst = torch.zeros(3, 4, 64, device=DEV)
    host = _pin(host)
    gather_dequant(dst, pool, host, table, ids)
    keys = {k for k in gd._CHECKED if k[0] in (id(pool), id(host))}
    assert len(keys) == 2  # the pool and the host stack
    first = dst.clone()
    gather_dequant(dst.zero_(), pool, host, table, ids)  # from the memo: the same launch
    torch.testing.assert_close(dst, first, rtol=0, atol=0)
    host_keys = {k for k in keys if k[0] == id(host)}
    del host
    gc.collect()
    assert not host_keys & gd._CHECKED.keys() and keys - host_keys <= gd._CHECKED.keys()  # gone with its stack
    odd = _int4(9, 4, 64, 12, 16)
    odd = Int4Tensor(odd.packed, odd.scale.transpose(1, 2).contiguous().transpose(1, 2), odd.minimum, odd.dtype)
    with pytest.raises(ValueError, match="contiguous"):
        gather_dequant(dst, pool, odd, table, ids)
    if DEV == "cpu":
        with pytest.raises(ValueError, match="host must be on dst.s device cpu"):
            far = _int4(9, 4, 64, 13, 16)
            gather_dequant(dst, pool, Int4Tensor(*(t.to("meta") for t in far.parts()), far.dtype), table, ids)
