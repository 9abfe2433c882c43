"""Launch sweep of kernels/decode_attention.py at a registry model's full-attention shape (GPU, not a test; default
Qwen3.5-35B-A3B: 16 query / 2 KV heads, head dim 256; `--shape qwen3-30b`: 32 / 4 of 128), bf16, on a static cache:
a bench-sized cache (1024 positions, 700 used: `localmoe bench`'s context is the prompt + decode + 64) and a chat-sized
one (8192, 640 used), against torch's SDPA over the whole cache with the same boolean mask (what transformers' "sdpa"
does at decode). Each launch is checked against SDPA and timed as a CUDA graph of 10 calls over 10 caches
(`do_bench` median, µs per call). The best launch is the one with the least summed time over both caches; it is kept
only when it beats the default launch. Prints the table; writes `$OUT/decode_attention_ALIAS.json` ({"decode_params":
{"decode_attention": {"Hq.._Hkv.._D..": kwargs}}}) to merge into kernels/tuned/<device>.json.

Usage: PYTHONUNBUFFERED=1 python bench/decode_attention_sweep.py [--shape ALIAS]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path

import torch
from graph_timing import graph_us

from localmoe.kernels.decode_attention import decode_attention
from localmoe.models.shapes import shape_config

ap = argparse.ArgumentParser(description="decode_attention launch sweep")
ap.add_argument("--shape", default="qwen3.5-35b", help="registry model whose attention shape is swept")
opts = ap.parse_args()
cfg = shape_config(opts.shape)
cfg = getattr(cfg, "text_config", None) or cfg
HQ, HKV = cfg.num_attention_heads, cfg.num_key_value_heads
D = getattr(cfg, "head_dim", None) or cfg.hidden_size // HQ
DEV, DT, N = torch.device("cuda"), torch.bfloat16, 10
SPACE = dict(chunk=[32, 64, 128], block_l=[32, 64, 128], num_warps=[4, 8], max_splits=[8, 16, 32])
CASES = ((1024, 700), (8192, 640))
DEFAULT = dict(chunk=64, block_l=64, num_warps=4, max_splits=16)
key = f"Hq{HQ}_Hkv{HKV}_D{D}"
print(f"{opts.shape}: {key}", flush=True)

times: dict[tuple, list[float]] = {}
sdpa_us = []
for L, n in CASES:
    q = torch.randn(HQ, D, device=DEV, dtype=DT)
    ks = [torch.randn(HKV, L, D, device=DEV, dtype=DT) for _ in range(N)]
    vs = [torch.randn(HKV, L, D, device=DEV, dtype=DT) for _ in range(N)]
    mask = torch.arange(L, device=DEV) < n
    m4 = mask.view(1, 1, 1, L)
    q4 = q.view(1, HQ, 1, D)
    want = torch.nn.functional.scaled_dot_product_attention(q4, ks[0][None], vs[0][None], attn_mask=m4, enable_gqa=True)
    want = want[0, :, 0]
    sdpa_us.append(
        graph_us(
            [
                lambda k=k, v=v: torch.nn.functional.scaled_dot_product_attention(
                    q4, k[None], v[None], attn_mask=m4, enable_gqa=True
                )
                for k, v in zip(ks, vs)
            ],
            warmup=10,
            rep=50,
        )
    )
    for combo in itertools.product(*SPACE.values()):
        kw = dict(zip(SPACE, combo))
        if kw["block_l"] > kw["chunk"] or (kw["block_l"] < kw["chunk"] and kw["chunk"] < 128):
            continue  # one tile a chunk (the prefetching launch), or 128-key chunks in two or four tiles
        got = decode_attention(q, ks[0], vs[0], mask, **kw)
        err = (got.float() - want.float()).abs().max().item()
        if err > 3e-2:
            print(f"  L={L} {kw}: WRONG ({err:.1e})", flush=True)
            times.setdefault(tuple(combo), []).append(float("inf"))
            continue
        us = graph_us(
            [lambda k=k, v=v, kw=kw: decode_attention(q, k, v, mask, **kw) for k, v in zip(ks, vs)], warmup=10, rep=30
        )
        times.setdefault(tuple(combo), []).append(us)

default = times[tuple(DEFAULT.values())]
best_combo, best = min(times.items(), key=lambda kv: sum(kv[1]))
best_kw = dict(zip(SPACE, best_combo))
print(f"\n{opts.shape} ({key}), µs per call")
print("| cache L | used | SDPA (masked, whole cache) | default launch | best launch |")
print("|---:|---:|---:|---:|---:|")
for (L, n), sd, d, b in zip(CASES, sdpa_us, default, best):
    print(f"| {L} | {n} | {sd:.1f} | {d:.1f} | {b:.1f} |")
print(f"best launch {best_kw}" + ("" if sum(best) < sum(default) else " (no faster than the default: none written)"))
if os.environ.get("OUT") and sum(best) < sum(default):
    out = {"decode_params": {"decode_attention": {key: best_kw}}}
    Path(os.environ["OUT"], f"decode_attention_{opts.shape}.json").write_text(json.dumps(out, indent=1))
