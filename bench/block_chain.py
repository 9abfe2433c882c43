"""The whole MoE block as a Qwen3.5 decoder layer runs it on the decode step (GPU, not a test): #3's block figure.

One block = `moe_front` (residual add, post-attention norm, router top-k over E 256, the shared expert into the
experts' workspace row) -> `sparse_fused` (the k routed experts, the residual added in its tail), two launches
chained by PDL. Timed as CUDA graphs of 12 blocks over 12 weight sets of all 256 experts each (~19 GB: L2 holds
none of it between blocks), Qwen3.5-35B-A3B shapes, bf16, per-set thresholds at 85 % of the gate activations of
the routed experts, against the same block at threshold 0 (every neuron kept: localmoe's dense decode path) and
the session-6 block (the shared expert in `sparse_fused`'s launch). Also the experts' launch alone (12 in a row).
Byte floors from the copy bandwidth measured in the same run. Usage: PYTHONUNBUFFERED=1 python bench/block_chain.py
"""

from __future__ import annotations

import torch
from graph_timing import graph_us

from localmoe.kernels.moe_front import moe_front
from localmoe.kernels.sparse_fused import sparse_fused
from localmoe.kernels.token_tail import SharedExpert, fused_workspace
from localmoe.measure.benchmark import copy_bandwidth


def random_bf16(gen: torch.Generator, device, dtype=torch.bfloat16):
    """rnd(*shape, scale=0.02): normal values times scale, in dtype, from one generator."""

    def rnd(*shape, scale=0.02):
        return torch.randn(shape, device=device, dtype=torch.float32, generator=gen).mul_(scale).to(dtype)

    return rnd


def main() -> None:
    dev, dt, N, H, I, E, K = torch.device("cuda"), torch.bfloat16, 12, 2048, 512, 256, 8
    rnd = random_bf16(torch.Generator(device=dev).manual_seed(0), dev, dt)
    sets = []
    for _ in range(N):
        x, res, nw = rnd(1, H, scale=1.0), rnd(1, H, scale=1.0), rnd(H, scale=0.1)
        wr, wsg = rnd(E, H), rnd(1, H)
        ew = tuple(rnd(E, I, H, scale=0.05) for _ in range(3))
        sh = tuple(rnd(I, H, scale=0.05) for _ in range(3))
        s, h, _, _, ti, _ = moe_front(x, res, nw, 1e-6, "zero_centred", wr, K, True, wsg)
        g = torch.nn.functional.silu(torch.einsum("h,kih->ki", h.float(), ew[0][ti[0]].float())).abs()
        tau = torch.full((E,), float(torch.quantile(g.flatten(), 0.85)), device=dev)
        sets.append(
            dict(
                x=x,
                res=res,
                nw=nw,
                wr=wr,
                wsg=wsg,
                ew=ew,
                sh=sh,
                tau=tau,
                zero=torch.zeros_like(tau),
                out=torch.empty(1, H, device=dev, dtype=dt),
                cnt=torch.empty(1, K, device=dev, dtype=torch.int32),
            )
        )
    ticks = torch.zeros(N, 64, dtype=torch.int32, device=dev)
    ws = fused_workspace(dev, H + K + 1)
    acc = ws[:H].view(torch.float32)
    kept = torch.zeros((), dtype=torch.int64, device=dev)

    def block(i, dense=False, in_front=True):
        m = sets[i]
        front = {"shared_expert": m["sh"], "acc": acc} if in_front else {}
        s, h, _, tw, ti, sg = moe_front(
            m["x"],
            m["res"],
            m["nw"],
            1e-6,
            "zero_centred",
            m["wr"],
            K,
            True,
            m["wsg"],
            tickets=ticks[i],
            residual_early=True,
            block_e=4,
            num_warps=4,
            **front,
        )
        shared = None if in_front else SharedExpert(*m["sh"], sg)
        sparse_fused(
            h.view(1, H),
            *m["ew"],
            ti,
            tw,
            m["zero"] if dense else m["tau"],
            m["out"],
            count=m["cnt"],
            workspace=ws,
            shared=shared,
            residual=s.view(1, H),
            kept_total=None if dense else kept,
        )

    def experts(i, dense=False):
        m = sets[i]
        h = m["x"]  # any [1, H] input: the routing below is fixed per set
        sparse_fused(
            h,
            *m["ew"],
            ti_fixed[i],
            tw_fixed[i],
            m["zero"] if dense else m["tau"],
            m["out"],
            count=m["cnt"],
            workspace=ws,
        )

    ti_fixed = [torch.randperm(E, device=dev)[:K].view(1, K) for _ in range(N)]
    tw_fixed = [torch.full((1, K), 1.0 / K, device=dev, dtype=dt) for _ in range(N)]
    kept.zero_()
    block(0)
    torch.cuda.synchronize()
    frac = float(kept) / (K * I)
    bw = copy_bandwidth(dev) / 1e9  # GB/s as `localmoe bench` measures it (a copy captured in a graph ran slower)
    mb = 1e6
    gate, updown, shared_b, router = K * I * H * 2, 2 * K * I * H * 2, 3 * I * H * 2, (E + 1) * H * 2
    floors = {
        "85": (gate + updown * frac + shared_b + router) / bw / 1e3,
        "0": (gate + updown + shared_b + router) / bw / 1e3,
    }
    sparse_mb, dense_mb = (gate + updown * frac + shared_b + router) / mb, (gate + updown + shared_b + router) / mb
    print(
        f"copy bandwidth {bw:.0f} GB/s; kept fraction at the 85 % threshold {frac:.3f}; whole-block bytes "
        f"{sparse_mb:.1f} MB at 85 %, {dense_mb:.1f} MB at 0 %"
    )
    rows = [
        (
            "whole block, 85 % (moe_front with the shared expert -> sparse_fused)",
            [lambda i=i: block(i) for i in range(N)],
            floors["85"],
        ),
        (
            "whole block, threshold 0 (localmoe's dense decode path)",
            [lambda i=i: block(i, dense=True) for i in range(N)],
            floors["0"],
        ),
        (
            "whole block, 85 %, shared expert in sparse_fused (session 6)",
            [lambda i=i: block(i, in_front=False) for i in range(N)],
            floors["85"],
        ),
        (
            "whole block, threshold 0, shared expert in sparse_fused",
            [lambda i=i: block(i, dense=True, in_front=False) for i in range(N)],
            floors["0"],
        ),
        (
            "routed experts alone, 85 % (12 launches in a row)",
            [lambda i=i: experts(i) for i in range(N)],
            (gate + updown * frac) / bw / 1e3,
        ),
        (
            "routed experts alone, threshold 0",
            [lambda i=i: experts(i, dense=True) for i in range(N)],
            (gate + updown) / bw / 1e3,
        ),
    ]
    print("\n| Qwen3.5-35B-A3B shapes, bf16, batch 1 | µs per block | byte floor µs | × floor |")
    print("|---|---:|---:|---:|")
    res = {}
    for name, calls, floor in rows:
        us = graph_us(calls)
        res[name] = us
        print(f"| {name} | {us:.2f} | {floor:.2f} | {us / floor:.2f} |", flush=True)
    names = list(res)
    print(
        f"\nsparse / dense: whole block {res[names[1]] / res[names[0]]:.2f}x, routed experts alone "
        f"{res[names[5]] / res[names[4]]:.2f}x"
    )


if __name__ == "__main__":
    main()
