"""Does an L2 prefetch during latency-bound kernels make the projection after them faster? (GPU, not a test.)

Chains as the decode step runs them, Qwen3.5-35B-A3B shapes, bf16, timed as CUDA graphs over 12 weight sets
(`graph_timing.graph_us`, µs per chain), each with and without `kernels/l2_prefetch.py` launched first:
  delta  : Gated DeltaNet step -> out_proj GEMV [2048 x 4096] (16.8 MB)   prefetch: out_proj's weight
  moe    : moe_front -> sparse_fused (85 %, shared expert, residual) -> next in_proj GEMV [12352 x 2048] (50.6 MB)
           prefetch: the first P MB of in_proj
  gemv   : the GEMV alone, and right after a prefetch of its own weight (no time to hide it)
  layer  : in_proj -> step -> out_proj -> moe_front -> sparse_fused, with the prefetches placed in it
Measured in session 5 (bench/RESULTS.md): every placement made the layer slower (56.6 -> 58.6..63.4 µs): PDL
already lets each kernel load its weights while the one before runs, and the prefetch adds a launch. The prefetch
kernel lives here, not in kernels/, for that reason.

Usage: PYTHONUNBUFFERED=1 python bench/prefetch_try.py
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from graph_timing import graph_us
from localmoe.kernels.delta_rule_step import gated_deltanet_step
from localmoe.kernels.gemv import gemv
from localmoe.kernels.moe_front import moe_front
from localmoe.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_kw
from localmoe.kernels.sparse_fused import sparse_fused
from localmoe.decode_ops import tuned
from moe_inputs import moe_block_inputs, random_bf16


@triton.jit
def _l2_prefetch_kernel(base, nbytes, BLOCK: tl.constexpr, CHUNK_B: tl.constexpr, EVICT_LAST: tl.constexpr,
                        AFTER_WAIT: tl.constexpr, PDL: tl.constexpr):
    # base: the tensor's address as int64; nbytes: bytes from base to prefetch (16-byte multiple)
    if PDL:
        if AFTER_WAIT:  # issue once the kernel before is done (its bandwidth is free), then let the next run
            gdc_wait()
            gdc_launch_dependents()
    offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK_B  # [BLOCK] chunk starts
    on = (offs < nbytes).to(tl.int32)
    size = tl.minimum(nbytes - offs, CHUNK_B).to(tl.int32)
    if EVICT_LAST:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b64 pol; setp.ne.b32 p, $3, 0; "
            "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
            "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }",
            "=r,l,r,r", [base + offs, size, on], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r,r", [base + offs, size, on], dtype=tl.int32, is_pure=False, pack=1)
    if PDL:
        if not AFTER_WAIT:
            gdc_launch_dependents()
            gdc_wait()  # complete only after the kernel before: later kernels' waits stay transitive


@functools.lru_cache(maxsize=None)
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(t: torch.Tensor) -> bool:
    """Whether `l2_prefetch` does anything for tensor t's device."""
    return (triton is not None and t.is_cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
            and os.environ.get("LOCALMOE_PREFETCH", "1") != "0" and _capable(t.device.index or 0))


def l2_prefetch(t: torch.Tensor, max_bytes: int | None = None, *, evict_last: bool = False, after_wait: bool = True,
                chunk: int = 4096, num_warps: int = 1) -> None:
    """Start moving t's bytes (or its first `max_bytes`) into L2; returns at once, nothing waits for the bytes.
    One bulk prefetch of `chunk` bytes per thread, 32 * num_warps per program, the programs spread over the SMs
    (one SM's bulk-copy unit alone moved ~0.4 TB/s). `after_wait`: issue once the kernel before has finished (its
    bandwidth is free), else before it. t must be contiguous (a weight). No host sync: capturable. A no-op where
    `enabled(t)` is False."""
    if not t.is_contiguous():
        raise ValueError("l2_prefetch needs a contiguous tensor")
    if not enabled(t):
        return
    nbytes = t.numel() * t.element_size()
    if max_bytes is not None:
        nbytes = min(nbytes, max(0, int(max_bytes)))
    nbytes -= nbytes % 16
    if nbytes == 0 or t.data_ptr() % 16:
        return
    block = 32 * num_warps
    chunks = triton.cdiv(nbytes, chunk)
    _l2_prefetch_kernel[(triton.cdiv(chunks, block),)](t.data_ptr(), nbytes, BLOCK=block, CHUNK_B=chunk,
                                                       EVICT_LAST=evict_last, AFTER_WAIT=after_wait,
                                                       num_warps=num_warps, **pdl_kw(t))


DEV, DT, N = torch.device("cuda"), torch.bfloat16, 12
H, I, K, EX = 2048, 512, 8, 64
HK, HV, D, KS = 16, 32, 128, 4
C = 2 * HK * D + HV * D
g = torch.Generator(device=DEV).manual_seed(0)
rnd = random_bf16(g, DEV, DT)

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
m = moe_block_inputs(rnd, N, H, I, K, EX, device=DEV, dtype=DT)
xs, res, nw, wr, wsg, ew, ticks, sh, taus = m.x, m.res, m.nw, m.wr, m.wsg, m.ew, m.ticks, m.sh, m.taus
outs = [torch.empty(1, H, device=DEV, dtype=DT) for _ in range(N)]


p_gd = tuned(x_out[0], "gated_deltanet_step", f"HK{HK}_HV{HV}_D{D}")


def delta(i):
    gated_deltanet_step(**gd[i], **p_gd)


def moe(i):  # as the decoder layer runs them
    s, h, _, tw, ti, _ = moe_front(xs[i], res[i], nw[i], 1e-6, "zero_centred", wr[i], K, True, wsg[i],
                                   tickets=ticks[i])
    sparse_fused(h.view(1, H), *ew[i], ti, tw, taus[i], outs[i], shared=sh[i], residual=s.view(1, H))


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
