"""Launch sweep of kernels/decode_attention.py at Qwen3.5-35B-A3B's full-attention shape (16 query / 2 KV heads,
head dim 256, bf16) on a static cache (GPU, not a test): cache lengths 1024 and 8192 with 140 / 640 positions used,
against torch's SDPA over the whole cache with the same boolean mask (what transformers' "sdpa" does at decode).
Each launch is checked against SDPA and timed as a CUDA graph of 10 calls over 10 caches (`do_bench` median, µs
per call). Prints the table; writes `$OUT/decode_attention_params.json` with the best launch.

Usage: PYTHONUNBUFFERED=1 python bench/decode_attention_sweep.py
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import torch
from graph_timing import graph_us

from localmoe.kernels.decode_attention import decode_attention

DEV, DT, N = torch.device("cuda"), torch.bfloat16, 10
HQ, HKV, D = 16, 2, 256
SPACE = dict(chunk=[32, 64, 128, 256], block_l=[16, 32, 64], num_warps=[4, 8])


rows, best_all = [], {}
for L, n in ((1024, 140), (8192, 640)):
    q = torch.randn(HQ, D, device=DEV, dtype=DT)
    ks = [torch.randn(HKV, L, D, device=DEV, dtype=DT) for _ in range(N)]
    vs = [torch.randn(HKV, L, D, device=DEV, dtype=DT) for _ in range(N)]
    mask = torch.arange(L, device=DEV) < n
    m4 = mask.view(1, 1, 1, L)
    q4 = q.view(1, HQ, 1, D)
    want = torch.nn.functional.scaled_dot_product_attention(
        q4, ks[0][None], vs[0][None], attn_mask=m4, enable_gqa=True
    )[0, :, 0]
    sdpa = graph_us(
        [
            lambda k=k, v=v: torch.nn.functional.scaled_dot_product_attention(
                q4, k[None], v[None], attn_mask=m4, enable_gqa=True
            )
            for k, v in zip(ks, vs)
        ],
        warmup=10,
        rep=50,
    )
    best = (float("inf"), None)
    for combo in itertools.product(*SPACE.values()):
        kw = dict(zip(SPACE, combo))
        if kw["block_l"] > kw["chunk"]:
            continue
        got = decode_attention(q, ks[0], vs[0], mask, **kw)
        err = (got.float() - want.float()).abs().max().item()
        if err > 3e-2:
            print(f"  L={L} {kw}: WRONG ({err:.1e})", flush=True)
            continue
        us = graph_us(
            [lambda k=k, v=v, kw=kw: decode_attention(q, k, v, mask, **kw) for k, v in zip(ks, vs)], warmup=10, rep=50
        )
        if us < best[0]:
            best = (us, kw)
    rows.append((L, n, sdpa, *best))
    best_all[f"L{L}"] = best[1]
    print(f"  L={L} n={n}: sdpa {sdpa:.1f} us, decode_attention {best[0]:.1f} us {best[1]}", flush=True)

print("| cache L | used | SDPA (masked, whole cache) µs | decode_attention µs | best launch |")
print("|---:|---:|---:|---:|---|")
for L, n, sd, us, kw in rows:
    print(f"| {L} | {n} | {sd:.1f} | {us:.1f} | {kw} |")
if os.environ.get("OUT"):
    Path(os.environ["OUT"], "decode_attention_params.json").write_text(json.dumps(best_all, indent=1))
