"""What the parts of `moe_front` cost (GPU, not a test): the lead for the MoE front's latency.

`moe_front` is ~5.5 µs per decoder layer in the step (step_breakdown.py) for ~1 MB of router weights (0.25 µs of
bytes). Its path after the PDL wait: residual add + norm in every program, the router rows' logits, a ticket, then
the last program's top-k (softmax, k rounds of a block-wide max). This times chains of 12 launches over 12 weight
sets at Qwen3.5-35B-A3B shapes (H 2048, E 256), bf16, as CUDA graphs, for k = 8 (the model), 4 and 1 (the rounds
of the top-k), without the shared expert's gate, at 1 / 2 / 4 / 8 warps, and with the shared expert in the launch
(`shared_expert=`, as the decoder layer runs it).
Usage: PYTHONUNBUFFERED=1 python bench/moe_front_parts.py
"""

from __future__ import annotations

import torch

from graph_timing import graph_us
from moe_inputs import random_bf16
from localmoe.kernels.moe_front import moe_front


def main() -> None:
    dev, dt, N, H, E, I_S = torch.device("cuda"), torch.bfloat16, 12, 2048, 256, 512
    rnd = random_bf16(torch.Generator(device=dev).manual_seed(0), dev, dt)
    xs = [rnd(1, H, scale=1.0) for _ in range(N)]
    res = [rnd(1, H, scale=1.0) for _ in range(N)]
    nw = [rnd(H, scale=0.1) for _ in range(N)]
    wr = [rnd(E, H) for _ in range(N)]
    wsg = [rnd(1, H) for _ in range(N)]
    shared = [tuple(rnd(I_S, H, scale=0.05) for _ in range(3)) for _ in range(N)]
    acc = torch.zeros(N, H, device=dev)
    ticks = torch.zeros(N, 64, dtype=torch.int32, device=dev)

    def chain(k=8, gate=True, se=False, **kw):
        def call(i):
            extra = {"shared_expert": shared[i], "acc": acc[i]} if se else {}
            return moe_front(xs[i], res[i], nw[i], 1e-6, "zero_centred", wr[i], k, True, wsg[i] if gate else None,
                             tickets=ticks[i], residual_early=True, **extra, **kw)
        return [lambda i=i: call(i) for i in range(N)]

    rows = [("k 8, block_e 4, 4 warps (the tuned launch)", chain(8, block_e=4, num_warps=4)),
            ("k 4", chain(4, block_e=4, num_warps=4)),
            ("k 1", chain(1, block_e=4, num_warps=4)),
            ("k 8, no shared gate", chain(8, False, block_e=4, num_warps=4)),
            ("k 8, block_e 4, 1 warp", chain(8, block_e=4, num_warps=1)),
            ("k 8, block_e 4, 2 warps", chain(8, block_e=4, num_warps=2)),
            ("k 8, block_e 4, 8 warps", chain(8, block_e=4, num_warps=8)),
            ("k 8, block_e 8, 4 warps", chain(8, block_e=8, num_warps=4)),
            ("k 8 + shared expert (block 2), 4 warps", chain(8, se=True, block_e=4, num_warps=4, shared_block=2)),
            ("k 8 + shared expert (block 4), 4 warps", chain(8, se=True, block_e=4, num_warps=4, shared_block=4))]
    print("| moe_front chain (12 weight sets, bf16) | µs per launch |\n|---|---:|")
    for name, calls in rows:
        print(f"| {name} | {graph_us(calls):.2f} |", flush=True)


if __name__ == "__main__":
    main()
