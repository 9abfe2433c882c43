"""The routed experts' gate pass with more bytes in flight per SM (GPU, not a test): a lead for `sparse_fused`.

`sparse_fused` is ~13.6 µs per launch at 85 % against ~5.2 µs of bytes, and its gate pass alone (8 experts x 512 gate
rows x 2048, 16.8 MB) is most of it: 512 programs of one [8, 2048] tile each, one program per SM (register-bound),
so ~4 waves each waiting a full DRAM round trip. Triton does not software-pipeline plain loads (checked offline:
no cp.async for a tl.range(num_stages=...) loop over H), but it does pipeline TMA tensor-descriptor loads
(cp.async.bulk.tensor into shared memory, mbarrier waits): a program can keep STAGES tiles in flight without
registers. This times, as CUDA graphs of 12 launches chained by PDL over 12 weight sets of all 256 experts (so L2
holds none of it), each launch waiting for the one before and then reading the routing:

* the product's gate pass: `sparse_fused` with every neuron masked (tau = inf: gate rows only, then the ticket and
  the publish of y = 0), BLOCK_I 8 / 8 warps;
* the same tile as a bare kernel (`_gate_oneshot`: the gate GEMV + SiLU, g stored), BLOCK_I 8, 8 and 4 warps;
* `_gate_tma`: one program per BLOCK_I neurons of a routed expert, a loop over H in BLOCK_H tiles loaded through a
  host TensorDescriptor with num_stages=STAGES.

Each variant's g is checked against torch first. Byte floor = 16.8 MB / copy bandwidth (as `localmoe bench`).
Usage: PYTHONUNBUFFERED=1 python bench/gate_tma.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from graph_timing import graph_us
from moe_inputs import random_bf16

from localmoe.benchmark import copy_bandwidth
from localmoe.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_kw
from localmoe.kernels.sparse_fused import fused_workspace, sparse_fused


@triton.jit
def _gate_oneshot(x_ptr, w_ptr, ids_ptr, g_ptr, H: tl.constexpr, I: tl.constexpr, BLOCK_I: tl.constexpr,
                  PDL: tl.constexpr):
    j = tl.program_id(0)  # routed expert slot
    nb = tl.program_id(1)  # neuron block
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    e = tl.load(ids_ptr + j).to(tl.int64)
    rows = nb * BLOCK_I + tl.arange(0, BLOCK_I)
    cols = tl.arange(0, H)
    w = tl.load(w_ptr + (e * I + rows)[:, None] * H + cols[None, :])  # [BLOCK_I, H]
    x = tl.load(x_ptr + cols).to(tl.float32)
    z = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(g_ptr + j * I + rows, z / (1.0 + tl.exp(-z)))


@triton.jit
def _gate_tma(x_ptr, w_desc, ids_ptr, g_ptr, H: tl.constexpr, I: tl.constexpr, BLOCK_I: tl.constexpr,
              BLOCK_H: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr):
    blk = tl.program_id(0)  # (routed expert slot, neuron block) flattened
    j = blk // (I // BLOCK_I)
    nb = blk % (I // BLOCK_I)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    e = tl.load(ids_ptr + j)
    row0 = e * I + nb * BLOCK_I
    acc = tl.zeros([BLOCK_I], dtype=tl.float32)
    for h0 in tl.range(0, H, BLOCK_H, num_stages=STAGES):
        w = w_desc.load([row0, h0])  # [BLOCK_I, BLOCK_H] through TMA into shared memory
        xv = tl.load(x_ptr + h0 + tl.arange(0, BLOCK_H)).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * xv[None, :], axis=1)
    rows = nb * BLOCK_I + tl.arange(0, BLOCK_I)
    tl.store(g_ptr + j * I + rows, acc / (1.0 + tl.exp(-acc)))


def main() -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    dev, dt, N, H, I, E, K = torch.device("cuda"), torch.bfloat16, 12, 2048, 512, 256, 8
    rnd = random_bf16(torch.Generator(device=dev).manual_seed(0), dev, dt)
    sets = []
    for _ in range(N):
        w = rnd(E, I, H, scale=0.05)
        sets.append(dict(x=rnd(1, H, scale=1.0), w=w, up=rnd(E, I, H, scale=0.05), down=rnd(E, I, H, scale=0.05),
                         ids=torch.randperm(E, device=dev)[:K].to(torch.int32).view(1, K),
                         rw=torch.full((1, K), 1.0 / K, device=dev, dtype=dt), g=torch.empty(K, I, device=dev),
                         out=torch.empty(1, H, device=dev, dtype=dt), cnt=torch.empty(1, K, device=dev,
                                                                                      dtype=torch.int32)))
    inf = torch.full((E,), float("inf"), device=dev)
    ws = fused_workspace(dev, H + K + 1)
    bw = copy_bandwidth(dev) / 1e9
    floor = K * I * H * 2 / bw / 1e3
    print(f"copy bandwidth {bw:.0f} GB/s; gate bytes {K * I * H * 2 / 1e6:.1f} MB; byte floor {floor:.2f} µs")

    def want(m):
        return torch.nn.functional.silu(torch.einsum("h,kih->ki", m["x"][0].float(), m["w"][m["ids"][0].long()].float()))

    def oneshot(m, block_i, warps):
        _gate_oneshot[(K, I // block_i)](m["x"], m["w"], m["ids"], m["g"], H=H, I=I, BLOCK_I=block_i,
                                         num_warps=warps, **pdl_kw(m["x"]))

    descs: dict = {}

    def tma(m, block_i, block_h, stages, warps):
        key = (m["w"].data_ptr(), block_i, block_h)
        if key not in descs:
            descs[key] = TensorDescriptor.from_tensor(m["w"].view(E * I, H), [block_i, block_h])
        _gate_tma[(K * I // block_i,)](m["x"], descs[key], m["ids"], m["g"], H=H, I=I, BLOCK_I=block_i,
                                       BLOCK_H=block_h, STAGES=stages, num_warps=warps, **pdl_kw(m["x"]))

    def product(m):
        sparse_fused(m["x"], m["w"], m["up"], m["down"], m["ids"], m["rw"], inf, m["out"], count=m["cnt"],
                     workspace=ws)

    variants = [("sparse_fused, every neuron masked (the product's gate pass + ticket + publish)", product, False)]
    variants += [(f"oneshot BLOCK_I {bi}, {nw} warps", lambda m, bi=bi, nw=nw: oneshot(m, bi, nw), True)
                 for bi, nw in ((8, 8), (8, 4), (16, 8))]
    variants += [(f"TMA BLOCK_I {bi}, BLOCK_H {bh}, {st} stages, {nw} warps",
                  lambda m, bi=bi, bh=bh, st=st, nw=nw: tma(m, bi, bh, st, nw), True)
                 for bi, bh, st, nw in ((32, 256, 4, 4), (32, 256, 3, 4), (32, 128, 4, 4), (16, 256, 4, 4),
                                        (16, 128, 6, 4), (64, 128, 4, 8), (64, 256, 3, 8), (8, 256, 4, 4),
                                        (32, 256, 6, 8))]
    print("\n| gate pass, 8 routed experts, Qwen3.5-35B shapes, bf16 | max err | µs per launch | GB/s | × floor |")
    print("|---|---:|---:|---:|---:|")
    for name, fn, check in variants:
        try:
            err = "–"
            if check:
                m = sets[0]
                m["g"].zero_()
                fn(m)
                torch.cuda.synchronize()
                ref = want(m)
                err = f"{float((m['g'] - ref).abs().max() / ref.abs().max()):.1e}"
            us = graph_us([lambda i=i: fn(sets[i]) for i in range(N)])
            print(f"| {name} | {err} | {us:.2f} | {K * I * H * 2 / us / 1e3:.0f} | {us / floor:.2f} |", flush=True)
        except Exception as ex:  # noqa: BLE001 - a variant this Triton cannot build: say so, go on
            print(f"| {name} | {type(ex).__name__}: {str(ex).splitlines()[0][:80] if str(ex) else ''} | – | – | – |",
                  flush=True)


if __name__ == "__main__":
    main()
