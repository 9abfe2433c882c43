"""Does offloaded prefill's staging overlap the grouped GEMMs? (GPU, not a test.)

One staging span at Qwen3.5-35B-A3B's int4 shape (60 experts, a third resident in a device pool, the rest in pinned
host memory) and the grouped GEMMs of a 2048-token piece's share of rows for those experts, each on its own stream
with no dependency between them, K times: the GEMMs alone, the staging alone, and both together (ideal: the longer of
the two; serial: their sum). The staging three ways:
- `gather_dequant` (what int4 spans use: SMs read the pinned rows through unified addressing and dequantize),
- `gather_experts` of the packed parts (spans staged packed: SMs read, no dequantization),
- a copy-engine copy of the same host bytes (`Tensor.copy_` from pinned memory, one per projection) then a
  dequantize launch: the DMA engines move the bytes, the SMs only dequantize.
If the SM reads overlap the GEMMs much less than the copy engine's, staging absent experts by DMA is the lever.

Usage: PYTHONUNBUFFERED=1 python bench/staging_overlap.py [--reps 20]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from localmoe.kernels.dequant_int4 import dequant_int4
from localmoe.kernels.gather_dequant import gather_dequant
from localmoe.kernels.gather_experts import gather_experts
from localmoe.kernels.grouped_gate_up import grouped_gate_up
from localmoe.kernels.grouped_gemm import grouped_gemm
from localmoe.kernels.int4 import Int4Tensor

E, I, H, NG, SLOTS, SPAN, TOKENS, K_TOP = 256, 512, 2048, 16, 128, 60, 2048, 8
DEV, DT = torch.device("cuda"), torch.bfloat16


def stack(n: int, pinned: bool, gen) -> Int4Tensor:
    parts = [
        torch.randint(0, 256, (n, I, H // 2), generator=gen, dtype=torch.uint8),
        torch.rand(n, I, NG, generator=gen).to(DT),
        torch.rand(n, I, NG, generator=gen).to(DT),
    ]
    return Int4Tensor(*[t.pin_memory() if pinned else t.to(DEV) for t in parts], DT)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    host, pool = stack(E, True, gen), stack(SLOTS, False, gen)
    ids = torch.arange(0, 2 * SPAN, 2, dtype=torch.int32, device=DEV)
    table = torch.full((E,), -1, dtype=torch.int32, device=DEV)
    resident = ids[::3].long()
    table[resident] = torch.arange(len(resident), dtype=torch.int32, device=DEV)
    absent = SPAN - len(resident)
    plain = [torch.empty(SPAN, I, H, dtype=DT, device=DEV) for _ in range(3)]
    packed = [Int4Tensor(*(torch.empty_like(t[:SPAN], device=DEV) for t in pool.parts()), DT) for _ in range(3)]
    rows = TOKENS * K_TOP * SPAN // E
    x = torch.randn(rows, H, dtype=DT, device=DEV)
    w = [(torch.randn(SPAN, I, H, dtype=torch.float32, device=DEV) / H**0.5).to(DT) for _ in range(3)]
    ends = (torch.arange(1, SPAN + 1, device=DEV) * (rows // SPAN)).to(torch.int32)
    h = torch.empty(rows, I, dtype=DT, device=DEV)
    y = torch.empty(rows, H, dtype=DT, device=DEV)
    nbytes = absent * I * (H // 2 + 4 * NG)
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=DEV)

    def gemms():
        grouped_gate_up(x, w[0], w[1], ends, 0, h)
        grouped_gemm(h, w[2].transpose(1, 2), ends, 0, y)

    def sm_dequant():
        for out in plain:
            gather_dequant(out, pool, host, table, ids)

    def sm_packed():
        for out in packed:
            gather_experts(out.parts(), pool.parts(), host.parts(), table, ids)

    def dma():
        for out, p in zip(plain, packed):
            dst.copy_(src, non_blocking=True)
            dequant_int4(p.packed.view(-1, H // 2), p.scale.view(-1, NG), p.minimum.view(-1, NG), DT,
                         out=out.view(-1, H))  # fmt: skip

    compute, side = torch.cuda.Stream(), torch.cuda.Stream()

    def run(k: int, first, second) -> float:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for stream, fn in ((compute, first), (side, second)):
            stream.wait_event(start)
            if fn is not None:
                with torch.cuda.stream(stream):
                    for _ in range(k):
                        fn()
        torch.cuda.current_stream().wait_stream(compute)
        torch.cuda.current_stream().wait_stream(side)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / k

    def median(fn) -> float:
        return statistics.median(fn() for _ in range(5))

    copy_ms = median(lambda: run(a.reps, None, lambda: dst.copy_(src, non_blocking=True)))
    print(f"{torch.cuda.get_device_name()}: a span of {SPAN} experts ({absent} absent, {nbytes / 1e6:.1f} MB of host "
          f"bytes a projection), {rows} rows; pinned copy {nbytes / copy_ms / 1e6:.1f} GB/s")  # fmt: skip
    print("| staging | GEMMs ms | staging ms | both ms | ideal (longer) | serial (sum) | overlap hidden |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, fn in (("gather_dequant (SM reads)", sm_dequant), ("gather_experts packed (SM reads)", sm_packed),
                     ("copy engine + dequantize", dma)):  # fmt: skip
        run(2, gemms, fn)
        c, s = median(lambda: run(a.reps, gemms, None)), median(lambda fn=fn: run(a.reps, None, fn))
        b = median(lambda fn=fn: run(a.reps, gemms, fn))
        hidden = (c + s - b) / min(c, s)  # 1: the shorter wholly under the longer; 0: serial
        print(f"| {name} | {c:.3f} | {s:.3f} | {b:.3f} | {max(c, s):.3f} | {c + s:.3f} | {hidden:.0%} |")


if __name__ == "__main__":
    main()
