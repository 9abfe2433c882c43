"""Expert-cache replacement policies replayed on real routing (CPU; not a test).

Runs the bundled localmoe-tiny (trained Qwen3-MoE, 8 layers x 8 experts, top-2) over the held-out text shipped
with localmoe, records which experts every layer routed each token to, and replays that trace through one cache
of (layer, expert) slots shared by all layers, as localmoe's ExpertCache is, at several sizes. Policies: LRU
(localmoe's), FIFO, LFU (all-time counts), random, static (the most-used experts of the first half pinned, measured
on the second half), hybrid (half the slots pinned that way, half LRU), and Belady's MIN (evict the expert used furthest in the future: the upper bound). Every miss
is admitted, the cache never evicts an expert the current layer needs. Prints hit rates per policy and size.

Usage: python bench/cache_policies.py [--tokens 8192] [--fractions 0.25,0.31,0.5,0.75]
"""

from __future__ import annotations

import argparse
import random
from collections import OrderedDict, defaultdict
from pathlib import Path

import torch

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=8192)
ap.add_argument("--fractions", default="0.25,0.31,0.5,0.75")
args = ap.parse_args()

from localmoe.engine import Engine  # noqa: E402

engine = Engine.load("localmoe-tiny", device="cpu", sparsity=0.0)
text = (Path(__file__).resolve().parents[1] / "localmoe" / "data" / "heldout.txt").read_text()
ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"][: args.tokens]
trace: list[list[tuple[int, ...]]] = []  # per token: per layer, the routed experts
hooks, per_layer = [], {}
for m in engine.loaded.experts:
    def rec(mod, inp, out, layer=m.layer_idx):
        per_layer[layer] = inp[1]  # top_k_index [T, k]
    hooks.append(m.register_forward_hook(rec))
with torch.inference_mode():
    for start in range(0, len(ids), 512):
        per_layer.clear()
        engine.model(input_ids=torch.tensor([ids[start:start + 512]]))
        layers = sorted(per_layer)
        for t in range(per_layer[layers[0]].shape[0]):
            trace.append([tuple(per_layer[layer][t].tolist()) for layer in layers])
L, E = len(trace[0]), engine.loaded.experts[0].num_experts
requests = [[(layer, e) for layer, routed in enumerate(tok) for e in routed] for tok in trace]  # per token
print(f"trace: {len(trace)} tokens, {L} layers x {E} experts, top-{len(trace[0][0])}")


def replay(policy: str, slots: int, start: int = 0) -> float:
    cache: OrderedDict = OrderedDict()
    freq: dict = defaultdict(int)
    rng = random.Random(0)
    hits = total = 0
    pinned: set = set()
    if policy in ("static", "hybrid"):  # the most used pairs of the first half pinned, measured on the second
        counts: dict = defaultdict(int)
        for tok in requests[: len(requests) // 2]:
            for key in tok:
                counts[key] += 1
        n_pin = slots if policy == "static" else slots // 2  # hybrid: half pinned, half LRU
        pinned = set(sorted(counts, key=counts.get, reverse=True)[:n_pin])
        start = len(requests) // 2
    future: dict = defaultdict(list)  # MIN: positions of each key's uses, ascending
    flat = [(i, key) for i, tok in enumerate(requests) for key in tok]
    if policy == "min":
        for pos, (_, key) in enumerate(flat):
            future[key].append(pos)
        nxt = {key: 0 for key in future}
    pos = -1
    for i, tok in enumerate(requests):
        for layer in range(L):
            need = [key for key in tok if key[0] == layer]
            for key in need:
                pos += 1
                if policy == "min":
                    nxt[key] += 1
                if i < start:
                    continue
                total += 1
                if policy == "static" or key in pinned:
                    hits += key in pinned
                    continue
                freq[key] += 1
                if key in cache:
                    hits += 1
                    if policy in ("lru", "hybrid"):
                        cache.move_to_end(key)
                    continue
                if len(cache) >= slots - len(pinned):
                    cands = [k for k in cache if k not in need]
                    if policy in ("lru", "fifo", "hybrid"):
                        victim = cands[0]
                    elif policy == "lfu":
                        victim = min(cands, key=lambda k: freq[k])
                    elif policy == "random":
                        victim = rng.choice(cands)
                    else:  # min: the one used furthest in the future (or never again)
                        def next_use(k):
                            f = future[k]
                            j = nxt[k]
                            return f[j] if j < len(f) else float("inf")
                        victim = max(cands, key=next_use)
                    del cache[victim]
                cache[key] = True
    return hits / max(1, total)


policies = ["lru", "fifo", "lfu", "random", "static", "hybrid", "min"]
fractions = [float(f) for f in args.fractions.split(",")]
print("\n| cache (share of all experts) | " + " | ".join(policies) + " |")
print("|---|" + "---:|" * len(policies))
for f in fractions:
    slots = max(len(trace[0][0]), round(f * L * E))
    rates = [replay(p, slots) for p in policies]
    print(f"| {f:.0%} ({slots} slots) | " + " | ".join(f"{r:.1%}" for r in rates) + " |")
