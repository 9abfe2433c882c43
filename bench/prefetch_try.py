"""Does an L2 prefetch during latency-bound kernels make the projection after them faster? (GPU, not a test.)

Chains as the decode step runs them, Qwen3.5-35B-A3B shapes, bf16, timed as CUDA graphs over 12 weight sets
(`graph_timing.graph_us`, µs per chain), each with and without `kernels/l2_prefetch.py` launched first:
  delta  : Gated DeltaNet step -> out_proj GEMV [2048 x 4096] (16.8 MB)   prefetch: out_proj's weight
  moe    : moe_front -> sparse_fused (85 %, shared expert, residual) -> next in_proj GEMV [12352 x 2048] (50.6 MB)
           prefetch: the first P MB of in_proj
  gemv   : the GEMV alone, and right after a prefetch of its own weight (no time to hide it)
  layer  : in_proj -> step -> out_proj -> moe_front -> sparse_fused, with the prefetches placed in it
Usage: PYTHONUNBUFFERED=1 python bench/prefetch_try.py
"""

from __future__ import annotations

import torch

from graph_timing import graph_us
from localmoe.kernels.delta_rule_step import gated_deltanet_step
from localmoe.kernels.gemv import gemv
from localmoe.kernels.l2_prefetch import l2_prefetch
from localmoe.kernels.moe_front import moe_front
from localmoe.kernels.sparse_fused import SharedExpert, sparse_fused
from localmoe.decode_ops import tuned

DEV, DT, N = torch.device("cuda"), torch.bfloat16, 12
H, I, K, EX = 2048, 512, 8, 64
HK, HV, D, KS = 16, 32, 128, 4
C = 2 * HK * D + HV * D
g = torch.Generator(device=DEV).manual_seed(0)


def rnd(*shape, scale=0.02):
    return torch.randn(shape, device=DEV, dtype=torch.float32, generator=g).mul_(scale).to(DT)


w_out = [rnd(H, HV * D) for _ in range(N)]
x_out = [rnd(1, HV * D, scale=1.0) for _ in range(N)]
w_in = [rnd(12352, H) for _ in range(N)]
x_in = [rnd(1, H, scale=1.0) for _ in range(N)]
y_out = torch.empty(1, H, device=DEV, dtype=DT)
y_in = torch.empty(1, 12352, device=DEV, dtype=DT)
p_out = tuned(x_out[0], "gemv", f"N{H}_K{HV * D}")
p_in = tuned(x_in[0], "gemv", f"N12352_K{H}")
gd = [dict(mixed_qkv=rnd(1, C, scale=1.0), z=rnd(1, HV * D, scale=1.0), a=rnd(1, HV, scale=1.0),
           b=rnd(1, HV, scale=1.0), conv_state=rnd(1, C, KS, scale=1.0), conv_weight=rnd(C, KS, scale=0.5),
           conv_bias=None, A_log=torch.rand(HV, device=DEV), dt_bias=torch.rand(HV, device=DEV),
           norm_weight=torch.ones(D, device=DEV, dtype=DT), norm_eps=1e-6,
           state=torch.randn(1, HV, D, D, device=DEV, generator=g) * 0.1,
           num_k_heads=HK, head_k_dim=D, num_v_heads=HV, head_v_dim=D) for _ in range(N)]
xs = [rnd(1, H, scale=1.0) for _ in range(N)]
res = [rnd(1, H, scale=1.0) for _ in range(N)]
nw = [rnd(H, scale=0.1) for _ in range(N)]
wr = [rnd(EX, H) for _ in range(N)]
wsg = [rnd(1, H) for _ in range(N)]
ew = [(rnd(EX, I, H, scale=0.05), rnd(EX, I, H, scale=0.05), rnd(EX, I, H, scale=0.05)) for _ in range(N)]
ticks = torch.zeros(N, 64, dtype=torch.int32, device=DEV)
front = [moe_front(xs[i], res[i], nw[i], 1e-6, "zero_centred", wr[i], K, True, wsg[i], tickets=ticks[i])
         for i in range(N)]
sh = [SharedExpert(rnd(I, H, scale=0.05), rnd(I, H, scale=0.05), rnd(I, H, scale=0.05), front[i][5])
      for i in range(N)]
taus = []
for i in range(N):
    gate = torch.nn.functional.silu(torch.einsum("h,eih->ei", front[i][1].float(), ew[i][0].float())).abs()
    taus.append(torch.full((EX,), float(torch.quantile(gate.flatten()[:1 << 20], 0.85)), device=DEV))
outs = [torch.empty(1, H, device=DEV, dtype=DT) for _ in range(N)]


p_gd = tuned(x_out[0], "gated_deltanet_step", f"HK{HK}_HV{HV}_D{D}")


def delta(i):
    gated_deltanet_step(**gd[i], **p_gd)


def moe(i):  # as the decoder layer runs them: the experts' launch makes the router's picks from the logits
    s, h, lg, tw, ti, _ = moe_front(xs[i], res[i], nw[i], 1e-6, "zero_centred", wr[i], K, True, wsg[i],
                                    tickets=ticks[i], topk=False)
    sparse_fused(h.view(1, H), *ew[i], ti, tw, taus[i], outs[i], shared=sh[i], residual=s.view(1, H),
                 router_logits=lg)


def chain(i, parts):
    return [lambda i=i, p=p: p(i) for p in parts]


rows = []


def measure(name, parts):
    us = graph_us([c for i in range(N) for c in chain(i, parts)], rep=200) * len(parts)
    rows.append((name, us))
    print(f"  {name:60s} {us:7.2f} µs per chain", flush=True)


def g_out(i):
    gemv(x_out[i], w_out[i], y_out, **p_out)


def g_in(i):
    gemv(x_in[i], w_in[i], y_in, **p_in)


def pf(w, mb=None, last=False):
    return lambda i: l2_prefetch(w[i], None if mb is None else int(mb * 2 ** 20), evict_last=last)


measure("out_proj GEMV", [g_out])
measure("prefetch -> out_proj GEMV", [pf(w_out), g_out])
measure("in_proj GEMV", [g_in])
measure("delta step -> out_proj", [delta, g_out])
measure("prefetch out_proj -> delta step -> out_proj", [pf(w_out), delta, g_out])
measure("moe_front -> sparse_fused -> in_proj", [moe, g_in])
# the whole DeltaNet decoder layer (in_proj -> step -> out_proj -> front -> experts), prefetches placed in it
nxt = lambda mb, last=False: (lambda i: l2_prefetch(w_in[(i + 1) % N], int(mb * 2 ** 20), evict_last=last))  # noqa
measure("layer", [g_in, delta, g_out, moe])
measure("layer, out_proj prefetched during the step", [g_in, pf(w_out), delta, g_out, moe])
measure("layer, out_proj prefetched during the step (evict_last)", [g_in, pf(w_out, last=True), delta, g_out, moe])
for mb in (8, 16, 24, 32):
    measure(f"layer, next in_proj {mb} MB during front+experts", [g_in, delta, g_out, nxt(mb), moe])
    measure(f"layer, next in_proj {mb} MB during front+experts (evict_last)", [g_in, delta, g_out, nxt(mb, True), moe])
measure("layer, both (16 MB, evict_last)", [g_in, pf(w_out, last=True), delta, g_out, nxt(16, True), moe])
measure("layer (again)", [g_in, delta, g_out, moe])
print("\n| chain | µs |\n|---|---:|")
for name, us in rows:
    print(f"| {name} | {us:.2f} |")
