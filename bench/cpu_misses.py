"""Could the CPU compute some of an offloaded prompt piece's absent experts while the GPU stages the rest? (Not a test.)

In a piece of T tokens each of the E experts gets m = T·k/E rows. The GPU's cost of an absent expert is at least its
bytes over PCIe (bytes / pinned host->device bandwidth; the grouped GEMMs run beside the staging); the CPU's is the
expert's SwiGLU MLP on its m rows, reading the expert from host memory (torch's CPU matmuls on every core). With the
CPU taking a share f of the n absent experts while the GPU stages the rest, the staging takes max((1-f)·n·t_pcie,
f·n·t_cpu): best at f = t_pcie / (t_pcie + t_cpu), a gain of at most 1 / (1 - f) over the GPU alone, and only where
the piece is bound by its staging; the activations' and results' copies and the syncs between the two come off it.
Prints per expert format (bf16 and int4, dequantized on the CPU first) and m: ms an expert on the CPU and on PCIe, f
and the bound.

Usage: python bench/cpu_misses.py [--shape qwen3.5-35b] [--tokens 512,2048,8192] [--pcie-gbs GB/s] [--threads N]
       [--contention]
On CUDA the pinned host->device bandwidth is measured (256 MB copies); without CUDA it is --pcie-gbs (default 25, a
PCIe 4.0 x16 slot). `--contention` (CUDA) asks whether the two sides slow each other down, as the engine's CPU share
runs them (experts/cpu_share.py): pinned host->device copies alone and while a thread computes bf16 experts (the
--tokens' first length's rows, 64 distinct experts in pinned memory: past the CPU's caches), and those experts alone
and beside the copies. If the copies slow down by about the share of bytes the CPU takes, the share cannot shorten a
piece bound by them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch
import torch.nn.functional as F

from localmoe.devices import host_bandwidth
from localmoe.kernels.dequant_int4 import dequant_int4_ref
from localmoe.kernels.int4 import quantize
from localmoe.models.shapes import shape_config

EXPERTS = 8  # distinct experts cycled through, more bytes than the CPU's caches hold


def expert_ms(x: torch.Tensor, experts: list, int4: bool, reps: int) -> float:
    """Median ms of one expert's SwiGLU MLP on the rows x, cycling through distinct experts."""
    times = []
    for r in range(reps + 2):
        wg, wu, wd = experts[r % len(experts)]
        t0 = time.perf_counter()
        if int4:
            wg, wu, wd = (dequant_int4_ref(w.packed, w.scale, w.minimum, x.dtype) for w in (wg, wu, wd))
        h = F.silu(x @ wg.T) * (x @ wu.T)
        (h @ wd).sum().item()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) * 1e3


def contention(x: torch.Tensor, I: int, H: int, seconds: float = 2.0) -> None:
    """Pinned host->device GB/s alone and beside a thread computing experts, and that thread's ms an expert alone and
    beside the copies (module doc)."""
    gen = torch.Generator().manual_seed(1)
    experts = [
        tuple((torch.randn(I, H, generator=gen) / H**0.5).to(torch.bfloat16).pin_memory() for _ in range(3))
        for _ in range(64)
    ]
    src = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    dst = torch.empty_like(src, device="cuda")
    stop = threading.Event()
    done = []

    def cpu_loop() -> None:
        t0, n = time.perf_counter(), 0
        while not stop.is_set():
            wg, wu, wd = experts[n % len(experts)]
            ((F.silu(x @ wg.T) * (x @ wu.T)) @ wd).sum().item()
            n += 1
        done.append((time.perf_counter() - t0) / max(n, 1) * 1e3)

    def copies() -> float:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            n += 1
        return src.numel() * n / (time.perf_counter() - t0) / 1e9

    alone_gbs = copies()
    worker = threading.Thread(target=cpu_loop)
    worker.start()
    time.sleep(seconds)  # the CPU alone
    stop.set()
    worker.join()
    cpu_alone = done.pop()
    stop.clear()
    worker = threading.Thread(target=cpu_loop)
    worker.start()
    both_gbs = copies()
    stop.set()
    worker.join()
    cpu_both = done.pop()
    print(f"contention ({x.shape[0]} rows an expert, 64 experts in pinned memory):")
    print(f"  pinned host->device {alone_gbs:.1f} GB/s alone, {both_gbs:.1f} beside the CPU's experts "
          f"({both_gbs / alone_gbs:.2f}x)")  # fmt: skip
    print(f"  CPU {cpu_alone:.3f} ms an expert alone, {cpu_both:.3f} beside the copies ({cpu_alone / cpu_both:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3.5-35b")
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--pcie-gbs", type=float, default=25.0)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: every core)")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--contention", action="store_true", help="CUDA: copies and CPU experts alone and together")
    a = ap.parse_args()
    torch.set_num_threads(a.threads or len(os.sched_getaffinity(0)))
    c = shape_config(a.shape)
    c = getattr(c, "text_config", c)
    H, k = c.hidden_size, c.num_experts_per_tok
    I = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    E = getattr(c, "num_experts", None) or c.num_local_experts
    gbs = host_bandwidth(torch.device("cuda")) / 1e9 if torch.cuda.is_available() else a.pcie_gbs
    where = "measured" if torch.cuda.is_available() else "given"
    print(
        f"{a.shape}: H {H}, I {I}, E {E}, k {k}; CPU threads {torch.get_num_threads()}; PCIe {gbs:.1f} GB/s ({where})"
    )
    gen = torch.Generator().manual_seed(0)
    bf16 = [
        tuple((torch.randn(I, H, generator=gen) / H**0.5).to(torch.bfloat16) for _ in range(2))
        + ((torch.randn(I, H, generator=gen) / I**0.5).to(torch.bfloat16),)
        for _ in range(EXPERTS)
    ]
    int4 = [tuple(quantize(w[None]) for w in ws) for ws in bf16]
    int4 = [tuple(type(w)(w.packed[0], w.scale[0], w.minimum[0], w.dtype) for w in ws) for ws in int4]
    nbytes = {
        "bf16": 3 * I * H * 2,
        "int4": sum(t.numel() * t.element_size() for t in (int4[0][0].packed, int4[0][0].scale, int4[0][0].minimum))
        * 3,
    }
    print("| format | tokens | rows an expert | CPU ms an expert | PCIe ms an expert | CPU share f | bound 1/(1-f) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for T in (int(t) for t in a.tokens.split(",")):
        m = max(1, T * k // E)
        x = torch.randn(m, H, generator=gen).to(torch.bfloat16)
        for fmt, experts in (("bf16", bf16), ("int4", int4)):
            cpu = expert_ms(x, experts, fmt == "int4", a.reps)
            pcie = nbytes[fmt] / (gbs * 1e9) * 1e3
            f = pcie / (pcie + cpu)
            print(f"| {fmt} | {T} | {m} | {cpu:.3f} | {pcie:.3f} | {f:.1%} | {1 / (1 - f):.2f}x |")
    if a.contention and torch.cuda.is_available():
        T = int(a.tokens.split(",")[0])
        contention(torch.randn(max(1, T * k // E), H, generator=gen).to(torch.bfloat16), I, H)


if __name__ == "__main__":
    main()
