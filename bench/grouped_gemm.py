"""The device-side grouped GEMMs (`kernels/grouped_gemm.py`, `grouped_gate_up.py`: gate and up with the SwiGLU as
their epilogue) against torch's grouped_mm on one prefill piece's MoE layer
(GPU, not a test): does reading the group ends on the device cost GEMM speed, and what does the layer save by not
reading its routing back to the host?

Qwen3.5-35B-A3B shapes: a 2048-token piece, k 8, E 256, H 2048, I 512, bf16, uniform random routing; spans of
--span experts (60: int4 at `--vram 16`'s default span; 256: one span, resident bf16). First a check (each
projection's span output against torch's, relative error), then:
- per span and projection, median µs of a CUDA graph (`graph_timing.graph_us`) of torch's call (x[s0:s1] sliced with
  host offsets, offsets relative to it) and of `grouped_gemm` over the launch parameters below; then the span's
  gate, up and SwiGLU: torch's two GEMMs, silu and product against one `grouped_gate_up`;
- the layer as the dense path would issue it, eager, --reps layers back to back, wall time per layer: torch's
  (`ends.tolist()` once a layer, draining the queue, then per span gate, up and down) against the device-side one
  (no host read), alternating twice.

Usage: PYTHONUNBUFFERED=1 python bench/grouped_gemm.py [--span 60] [--reps 20]
"""

from __future__ import annotations

import argparse
import time

import torch
from graph_timing import graph_us

from localmoe.kernels.grouped_gate_up import grouped_gate_up
from localmoe.kernels.grouped_gemm import grouped_gemm

DEV, DT = torch.device("cuda"), torch.bfloat16
T, K_TOP, E, H, I = 2048, 8, 256, 2048, 512
LAUNCHES = [  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages
    (64, 64, 32, 4, 3),
    (64, 128, 64, 4, 3),
    (128, 128, 64, 8, 3),
    (64, 128, 32, 4, 4),
    (128, 64, 64, 4, 3),
]


def routing(gen):
    """(x sorted by expert [T*k, H], ends [E] int32 on the device, ends on the host)."""
    logits = torch.rand(T, E, device=DEV, generator=gen)
    ids = logits.topk(K_TOP, dim=-1).indices.reshape(-1)
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=E)
    ends = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(T, H, device=DEV, generator=gen).to(DT)[order // K_TOP]
    return x, ends, [0] + ends.tolist()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--span", type=int, default=60)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    x, ends, end = routing(gen)
    M = x.shape[0]
    gate, up, down_t = [(torch.randn(E, I, H, device=DEV, generator=gen) / H**0.5).to(DT) for _ in range(3)]
    spans = [(g0, min(E, g0 + a.span)) for g0 in range(0, E, a.span)]
    mm = torch.nn.functional.grouped_mm

    def torch_span(xin, w, g0, g1):  # the dense path's call: host slice, offsets relative to it
        s0, s1 = end[g0], end[g1]
        return mm(xin[s0:s1], w, offs=(ends[g0:g1] - s0))

    # ---- check ----
    g0, g1 = spans[len(spans) // 2]
    s0, s1 = end[g0], end[g1]
    h = torch.randn(M, I, device=DEV, generator=gen).to(DT)
    for name, xin, w, w_dev, n in (
        ("gate [N I, K H]", x, gate[g0:g1].transpose(1, 2), gate[g0:g1], I),
        ("down [N H, K I]", h, down_t[g0:g1], down_t[g0:g1].transpose(1, 2), H),
    ):
        ref = torch_span(xin, w, g0, g1).float()
        for launch in LAUNCHES:
            bm, bn, bk, nw, ns = launch
            out = torch.zeros(M, n, device=DEV, dtype=DT)
            grouped_gemm(xin, w_dev, ends, g0, out, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)
            err = float((out[s0:s1].float() - ref).norm() / ref.norm())
            assert err < 1e-2, f"{name} {launch}: relative error {err:.2e}"
    print(f"check passed: span [{g0}, {g1}), rows {s1 - s0}, every launch within 1e-2 of torch's grouped_mm")

    # ---- one span, one projection ----
    flop = 2 * (s1 - s0) * I * H
    print(f"\nspan of {g1 - g0} experts, {s1 - s0} rows: µs (TFLOP/s)")
    for name, xin, w, w_dev, n in (
        ("gate/up", x, gate[g0:g1].transpose(1, 2), gate[g0:g1], I),
        ("down", h, down_t[g0:g1], down_t[g0:g1].transpose(1, 2), H),
    ):
        us = graph_us([lambda xin=xin, w=w: torch_span(xin, w, g0, g1)])
        print(f"  {name:8s} torch grouped_mm                {us:8.1f} ({flop / us / 1e6:6.1f})")
        for launch in LAUNCHES:
            bm, bn, bk, nw, ns = launch
            out = torch.empty(M, n, device=DEV, dtype=DT)
            us = graph_us(
                [
                    lambda xin=xin, w_dev=w_dev, out=out, bm=bm, bn=bn, bk=bk, nw=nw, ns=ns: grouped_gemm(
                        xin, w_dev, ends, g0, out, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns
                    )
                ]
            )
            print(f"  {name:8s} grouped_gemm {str(launch):20s} {us:8.1f} ({flop / us / 1e6:6.1f})")

    # ---- gate, up and the SwiGLU of the span ----
    def torch_gate_up():
        return torch.nn.functional.silu(torch_span(x, gate[g0:g1].transpose(1, 2), g0, g1)) * torch_span(
            x, up[g0:g1].transpose(1, 2), g0, g1
        )

    hbuf = torch.empty(M, I, device=DEV, dtype=DT)
    ref = torch_gate_up().float()
    grouped_gate_up(x, gate[g0:g1], up[g0:g1], ends, g0, hbuf)
    err = float((hbuf[s0:s1].float() - ref).norm() / ref.norm())
    assert err < 2e-2, f"grouped_gate_up: relative error {err:.2e}"
    us = graph_us([torch_gate_up])
    print(f"  gate+up+silu torch (2 GEMMs, silu, product) {us:8.1f} ({2 * flop / us / 1e6:6.1f})")
    for launch in LAUNCHES:
        bm, bn, bk, nw, ns = launch
        us = graph_us(
            [
                lambda bm=bm, bn=bn, bk=bk, nw=nw, ns=ns: grouped_gate_up(
                    x,
                    gate[g0:g1],
                    up[g0:g1],
                    ends,
                    g0,
                    hbuf,
                    BLOCK_M=bm,
                    BLOCK_N=bn,
                    BLOCK_K=bk,
                    num_warps=nw,
                    num_stages=ns,
                )  # fmt: skip
            ]
        )
        print(f"  gate+up+silu grouped_gate_up {str(launch):20s} {us:8.1f} ({2 * flop / us / 1e6:6.1f})")

    # ---- the layer, eager, host included ----
    def layer_torch():
        e = [0] + ends.tolist()  # the host read the device-side GEMM removes
        for a0, a1 in spans:
            s0, s1 = e[a0], e[a1]
            xs = x[s0:s1]
            offs = ends[a0:a1] - s0
            g = mm(xs, gate[a0:a1].transpose(1, 2), offs=offs)
            u = mm(xs, up[a0:a1].transpose(1, 2), offs=offs)
            mm(torch.nn.functional.silu(g) * u, down_t[a0:a1], offs=offs)

    ybuf = torch.empty(M, H, device=DEV, dtype=DT)

    def layer_device():  # per span, as the staging buffers allow: gate+up+SwiGLU, then down
        for a0, a1 in spans:
            grouped_gate_up(x, gate[a0:a1], up[a0:a1], ends, a0, hbuf)
            grouped_gemm(hbuf, down_t[a0:a1].transpose(1, 2), ends, a0, ybuf)

    for name, fn in (("torch, host offsets", layer_torch), ("grouped_gemm, device ends", layer_device)) * 2:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.reps):  # back to back: torch's host read drains the queue each layer, as in a prefill
            fn()
        torch.cuda.synchronize()
        print(f"layer ({len(spans)} spans), {name:26s}: {(time.perf_counter() - t0) / a.reps * 1e3:7.3f} ms")


if __name__ == "__main__":
    main()
