"""Random inputs of a Qwen3.5-35B-A3B MoE block for the kernel benches (GPU): N weight sets (so L2 cannot hold them
between calls), each with the block's front (mixer output, residual, norm, router, shared-expert gate), `moe_front`
run once on them, the experts (EX of them per set: the routed k are drawn from those), the shared expert weighted
by the front's gate, and per-set thresholds at a sparsity quantile of the gate activations.

Imported by `sparse_variants.py` and `prefetch_try.py` (run as `python bench/<script>.py`, so this directory is on
the path). Shape legend: N weight sets, H hidden, I expert width, K experts per token, EX experts per set.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from localmoe.kernels.moe_front import moe_front
from localmoe.kernels.sparse_fused import SharedExpert


def random_bf16(gen: torch.Generator, device, dtype=torch.bfloat16):
    """rnd(*shape, scale=0.02): normal values times scale, in dtype, from one generator."""
    def rnd(*shape, scale=0.02):
        return torch.randn(shape, device=device, dtype=torch.float32, generator=gen).mul_(scale).to(dtype)
    return rnd


def moe_block_inputs(rnd, N=12, H=2048, I=512, K=8, EX=64, sparsity=0.85, device="cuda", dtype=torch.bfloat16):
    """SimpleNamespace of lists (one entry per set): x, res, nw, wr, wsg (front inputs), ew (w_gate, w_up, w_down_t
    [EX, I, H]), ticks [N, 64] int32, s, h ([1, H] moe_front outputs), tw, ti (routing), sh (SharedExpert), taus."""
    xs = [rnd(1, H, scale=1.0) for _ in range(N)]
    res = [rnd(1, H, scale=1.0) for _ in range(N)]
    nw = [rnd(H, scale=0.1) for _ in range(N)]
    wr = [rnd(EX, H) for _ in range(N)]
    wsg = [rnd(1, H) for _ in range(N)]
    ew = [(rnd(EX, I, H, scale=0.05), rnd(EX, I, H, scale=0.05), rnd(EX, I, H, scale=0.05)) for _ in range(N)]
    ticks = torch.zeros(N, 64, dtype=torch.int32, device=device)
    front = [moe_front(xs[i], res[i], nw[i], 1e-6, "zero_centred", wr[i], K, True, wsg[i], tickets=ticks[i])
             for i in range(N)]
    sh = [SharedExpert(rnd(I, H, scale=0.05), rnd(I, H, scale=0.05), rnd(I, H, scale=0.05), front[i][5])
          for i in range(N)]
    taus = []
    for i in range(N):  # one threshold per set: the sparsity quantile of |silu(h . W_gate)| over its experts
        gate = torch.nn.functional.silu(torch.einsum("h,eih->ei", front[i][1].float(), ew[i][0].float())).abs()
        taus.append(torch.full((EX,), float(torch.quantile(gate.flatten()[:1 << 20], sparsity)), device=device))
    return SimpleNamespace(x=xs, res=res, nw=nw, wr=wr, wsg=wsg, ew=ew, ticks=ticks, sh=sh, taus=taus,
                           s=[f[0].view(1, H) for f in front], h=[f[1].view(1, H) for f in front],
                           tw=[f[3] for f in front], ti=[f[4] for f in front])
