"""What a publish-free expert tail would save and cost (GPU, not a test): the lead for the sparse/dense ratio.

`sparse_fused`'s last program of a token turns the fp32 sums into y = residual + output (ticket, then one program
over H): ~2.2 µs per layer (`sparse_variants.py --tickets`, session 6). Without it, the next layer's first GEMV
would form its input itself: every program reads s (moe_front's residual sum, bf16) and the fp32 sums, computes
x = round(s + round(sums)) and normalises it; program 0 stores x for the next moe_front (which would also zero the
sums). That costs every GEMV program 8 KB more of L2 reads (3088 programs for in_proj). This times both chains of
moe_front -> experts -> in_proj GEMV (its input norm inside) over 12 weight sets at Qwen3.5-35B-A3B shapes, 85 %:

  product  sparse_fused with the shared expert and the residual (publishes y), then kernels/gemv.py on y
  free     sparse_variants.py's variant kernel with TICKET 2 (sums only, no ticket, no publish), then
           `_gemv_sum_kernel` below (timing only: the sums are not zeroed between replays, as moe_front would)

and the GEMV alone both ways. First it checks that `_gemv_sum_kernel` on (s, sums) equals kernels/gemv.py on y.
Usage: PYTHONUNBUFFERED=1 python bench/publish_free.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graph_timing import graph_us
from moe_inputs import moe_block_inputs, random_bf16
from sparse_variants import variant
from localmoe.kernels.gemv import gemv
from localmoe.kernels.moe_front import moe_front
from localmoe.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_kw
from localmoe.kernels.rounding import round_to
from localmoe.kernels.sparse_fused import fused_workspace, sparse_fused


@triton.jit
def _gemv_sum_kernel(s_ptr, sum_ptr, w_ptr, y_ptr, nw_ptr, x_ptr, N, K, eps, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """y = RMSNorm(x) W^T (zero_centred) with x = round(s + round(sums)) formed by every program; program 0 stores
    x. s [K] bf16, sums [K] fp32, w [N, K], y [N], x [K] (out)."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    cols = tl.arange(0, BLOCK_K)
    kmask = cols < K
    w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=rmask[:, None] & kmask[None, :],
                other=0.0)
    nw = tl.load(nw_ptr + cols, mask=kmask, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    XT = s_ptr.dtype.element_ty
    sv = tl.load(s_ptr + cols, mask=kmask, other=0.0).to(tl.float32)
    av = tl.load(sum_ptr + cols, mask=kmask, other=0.0)
    xv = round_to(sv + round_to(av, XT), XT)  # what sparse_fused's publish writes as y
    first = (tl.zeros([BLOCK_K], dtype=tl.int32) + pid) == 0
    tl.store(x_ptr + cols, xv.to(XT), mask=kmask & first)
    n = xv * tl.math.rsqrt(tl.sum(xv * xv, axis=0) / K + eps)
    xv = round_to(n * (1.0 + nw), XT)
    acc = tl.sum(w.to(tl.float32) * xv[None, :], axis=1)
    tl.store(y_ptr + rows, round_to(acc, XT).to(XT), mask=rmask)


def gemv_sum(s, sums, weight, norm_weight, y, x_out, BLOCK_N=4, num_warps=4):
    N, K = weight.shape
    _gemv_sum_kernel[(triton.cdiv(N, BLOCK_N),)](s, sums, weight, y, norm_weight, x_out, N, K, 1e-6,
                                                 BLOCK_N=BLOCK_N, BLOCK_K=triton.next_power_of_2(K),
                                                 num_warps=num_warps, **pdl_kw(s))
    return y


def main() -> None:
    dev, dt, NS = torch.device("cuda"), torch.bfloat16, 12
    H, I, K, EX, N_IN = 2048, 512, 8, 64, 12352  # N_IN: the DeltaNet in_proj (q|k|v|z|b|a)
    rnd = random_bf16(torch.Generator(device=dev).manual_seed(0), dev, dt)
    m = moe_block_inputs(rnd, NS, H, I, K, EX, device=dev, dtype=dt)
    w_in = [rnd(N_IN, H) for _ in range(NS)]
    nw_in = [rnd(H, scale=0.1) for _ in range(NS)]
    outs = [torch.empty(1, H, device=dev, dtype=dt) for _ in range(NS)]
    cnts = [torch.empty(1, K, device=dev, dtype=torch.int32) for _ in range(NS)]
    ws = [torch.zeros(H + 2 * K + 1088, dtype=torch.int32, device=dev) for _ in range(NS)]
    ys = [torch.empty(1, N_IN, device=dev, dtype=dt) for _ in range(NS)]
    xo = [torch.empty(H, device=dev, dtype=dt) for _ in range(NS)]
    fused_workspace(dev, H + K + 1)
    free_kw = {"BLOCK_I": 8, "NB": 1, "num_warps": 8, "TICKET": 2}

    def front(i):
        return moe_front(m.x[i], m.res[i], m.nw[i], 1e-6, "zero_centred", m.wr[i], K, True, m.wsg[i],
                         tickets=m.ticks[i])

    def experts(i):
        return sparse_fused(m.h[i], *m.ew[i], m.ti[i], m.tw[i], m.taus[i], outs[i], count=cnts[i], shared=m.sh[i],
                            residual=m.s[i])

    def experts_free(i):
        return variant(m.h[i], *m.ew[i], m.ti[i], m.tw[i], m.taus[i], outs[i], cnts[i], m.sh[i], m.s[i], ws[i],
                       **free_kw)

    def proj(i):
        return gemv(outs[i], w_in[i], ys[i], norm_weight=nw_in[i], norm_kind="zero_centred", BLOCK_N=4, num_warps=4)

    def proj_free(i):
        return gemv_sum(m.s[i].view(H), ws[i][:H].view(torch.float32), w_in[i], nw_in[i], ys[i].view(N_IN), xo[i])

    # check: the GEMV on (s, sums) equals kernels/gemv.py on the published y
    sums = torch.randn(H, device=dev) * 0.5
    y_pub = (m.s[0].float().view(H) + sums.to(dt).float()).to(dt).view(1, H)
    want = gemv(y_pub, w_in[0], norm_weight=nw_in[0], norm_kind="zero_centred", BLOCK_N=4, num_warps=4)
    got = gemv_sum(m.s[0].view(H), sums, w_in[0], nw_in[0], torch.empty(N_IN, device=dev, dtype=dt), xo[0])
    diff = float((got.float() - want.float().view(-1)).abs().max())
    print(f"gemv on (s, sums) vs gemv on y: max abs diff {diff:.2e}, x stored equal: "
          f"{torch.equal(xo[0], y_pub.view(H))}", flush=True)

    rows = [
        ("in_proj GEMV alone, on y", [lambda i=i: proj(i) for i in range(NS)], 1),
        ("in_proj GEMV alone, on (s, sums)", [lambda i=i: proj_free(i) for i in range(NS)], 1),
        ("experts alone, product (publishes y)", [lambda i=i: experts(i) for i in range(NS)], 1),
        ("experts alone, no ticket / publish", [lambda i=i: experts_free(i) for i in range(NS)], 1),
        ("moe_front + experts + in_proj, product",
         [c for i in range(NS) for c in (lambda i=i: front(i), lambda i=i: experts(i), lambda i=i: proj(i))], 3),
        ("moe_front + experts + in_proj, publish-free",
         [c for i in range(NS) for c in (lambda i=i: front(i), lambda i=i: experts_free(i), lambda i=i: proj_free(i))],
         3),
    ]
    print("\n| chain (12 weight sets, 85 %, bf16) | µs per layer |\n|---|---:|")
    for name, calls, per in rows:
        print(f"| {name} | {graph_us(calls) * per:.2f} |", flush=True)


if __name__ == "__main__":
    main()
