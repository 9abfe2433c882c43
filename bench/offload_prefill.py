"""A chat turn's prefill with the experts offloaded (not a test; run on the H200): sparse path against dense path.

With prompt reuse a turn prefills only its new tokens (the last reply and the new message: tens to hundreds of
tokens). Offloaded, the dense path (tokens grouped by expert, each expert fetched through the cache) copies nearly
every routed expert's up/down rows for any piece longer than a few tokens (~1.8 s at --vram 24), while the sparse
path (direct misses: resident rows from the pool, absent experts' gate and kept rows read from pinned host memory)
costs per token. This times prefilling n new tokens after a 1500-token history (the cache rewound to it each time)
with the experts' sparse-token limit at the engine's default and raised past n, to place the offloaded crossover.

Usage: PYTHONUNBUFFERED=1 python bench/offload_prefill.py [--vram 24] [--sizes 16,64,128,256,512]
"""

import argparse
import time

import torch

from localmoe.engine.engine import Engine

p = argparse.ArgumentParser()
p.add_argument("--vram", type=float, default=24)
p.add_argument("--sizes", default="16,64,128,256,512")
p.add_argument("--history", type=int, default=1500)
a = p.parse_args()
sizes = [int(x) for x in a.sizes.split(",")]

e = Engine.random("qwen3.5-35b", device=torch.device("cuda"), dtype=torch.bfloat16, vram_gib=a.vram, context=8192)
e.set_sparsity(0.85)
g = e._graph_decoder()
gen = torch.Generator().manual_seed(0)
vocab = int(e.loaded.config.vocab_size)
hist = torch.randint(100, vocab - 100, (a.history,), generator=gen).tolist()
default = e.loaded.experts[0].max_sparse_tokens
cache = e.loaded.cache


def t(ids):
    return torch.tensor([ids], device="cuda")


rows = []
with torch.inference_mode():
    g.prefill(t(hist + [101]), a.history)  # the history, kept (the turn before)
    for n in sizes:
        new = torch.randint(100, vocab - 100, (n,), generator=gen).tolist()
        for limit in (default,) if n <= default else (default, max(sizes)):
            for m in e.loaded.experts:
                m.max_sparse_tokens = limit
            best, moved = float("inf"), 0.0
            for _ in range(2):
                h0 = cache.figures()[1] if cache is not None else 0
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                logits = g.prefill(t(hist + new), a.history)
                int(logits.argmax())
                dt = time.perf_counter() - t0
                assert g.reused == a.history
                best = min(best, dt)
                moved = ((cache.figures()[1] - h0) / 1e9) if cache is not None else 0.0
            path = "sparse" if n <= limit else "dense"
            rows.append((n, limit, path, best, moved))
            print(f"n={n} limit={limit} {path}: {best:.3f} s", flush=True)
for m in e.loaded.experts:
    m.max_sparse_tokens = default
print(
    f"\nprefill of n new tokens after a {a.history}-token history (rewound), qwen3.5-35b shapes, --vram {a.vram:g}, "
    f"85%, default sparse-token limit {default}"
)
print("| new tokens | path | time (s) | tok/s | host->GPU GB (figures) |")
print("|---:|---|---:|---:|---:|")
for n, limit, path, best, moved in rows:
    print(f"| {n} | {path} | {best:.3f} | {n / best:.1f} | {moved:.1f} |")
