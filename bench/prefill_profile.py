"""Where an offloaded prompt piece spends its time: one profiled prefill, its GPU time split by what overlaps what,
and the host syncs by call site (not a test; run on the H200).

Random weights at --shape, experts offloaded at --vram (0: resident), sparsity 0.85. After two warm-up prompts, time
to first token of --reps random prompts of --prompt-tokens (median), then one under torch.profiler:
- the GPU span split into staging only (`gather_*` kernels: the side stream's copies), compute only, both, idle;
- kernel time by kind (staging, GEMM, dequantize, DeltaNet, other) with the largest kernels of each;
- the GPU's idle stretches charged to the host code that launched the kernel after each (the profiler's Python
  stacks): where a launch-bound prefill's host is slow;
- the host syncs of one more prefill by call site (torch.cuda.set_sync_debug_mode): each drains the GPU's queue, and
  a prefill that is launch bound between them idles while Python issues the next launches.
The profiler slows the host side, so its span is longer than the timed TTFT; compare splits, not totals.

Usage: PYTHONUNBUFFERED=1 python bench/prefill_profile.py [--shape qwen3.5-35b] [--experts int4] [--vram 16]
       [--prompt-tokens 2048] [--reps 3] [--host-spans] [--cpu-share F]
`--host-spans` profiles the dense path with torch's grouped_mm and a host read of the routing each layer (the default
before session 35) instead of `DensePath.device_spans`. `--cpu-share F` sets `Staging.cpu_share` (bf16 experts: a
share F of each layer's absent experts computed on the CPU; 0 none; the default: the engine's automatic share).
"""

import argparse
import bisect
import collections
import json
import os
import statistics
import tempfile
import traceback
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from localmoe.devices import host_bandwidth
from localmoe.engine.engine import Engine
from localmoe.events import GenerationSettings
from localmoe.experts.staging import Staging

p = argparse.ArgumentParser()
p.add_argument("--shape", default="qwen3.5-35b")
p.add_argument("--experts", default="int4")
p.add_argument("--vram", type=float, default=16)
p.add_argument("--prompt-tokens", type=int, default=2048)
p.add_argument("--reps", type=int, default=3)
p.add_argument("--host-spans", action="store_true", help="the layer with a host read (DensePath.device_spans off)")
p.add_argument("--cpu-share", type=float, default=None, help="Staging.cpu_share (default: the automatic share)")
a = p.parse_args()
Staging.cpu_share = a.cpu_share
n = a.prompt_tokens
e = Engine.random(
    a.shape,
    device=torch.device("cuda"),
    dtype=torch.bfloat16,
    vram_gib=a.vram or None,
    context=n + 64,
    experts=a.experts,
)
e.set_sparsity(0.85)
for m in e.loaded.experts:
    m.device_spans = not a.host_spans
cache = e.loaded.cache
gen = torch.Generator().manual_seed(1)
vocab = e.loaded.config.vocab_size


def prefill() -> float:
    prompt = torch.randint(0, vocab, (n,), generator=gen).tolist()
    for _ in e.generate(prompt, GenerationSettings(max_new_tokens=1)):
        pass
    return e.stats.ttft_s


for _ in range(2):
    prefill()
times = [prefill() for _ in range(a.reps)]
ttft = statistics.median(times)
line = f"{a.shape} --experts {a.experts} --vram {a.vram:g}, {n} tokens: TTFT {ttft:.3f} s ({n / ttft:.0f} tok/s)"
if cache is not None:
    h2d = host_bandwidth(torch.device("cuda"))
    pcie = -(-n // e.prefill_chunk) * cache.absent_bytes() / h2d
    line += f", PCIe-bound {pcie:.3f} s at {h2d / 1e9:.1f} GB/s ({pcie / ttft:.1%} of the ceiling)"
    line += f"; pieces {e.prefill_chunk}, span {cache.staging.span}"
print(line, flush=True)


def kind(name: str) -> str:
    low = name.lower()
    if "gather_" in low:
        return "staging"
    if any(w in low for w in ("gemm", "grouped", "cutlass", "nvjet", "wgmma", "sm90")):
        return "gemm"
    if "dequant" in low:
        return "dequantize"
    if "delta" in low or "chunk_scan" in low:
        return "deltanet"
    return "other"


with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
    prefill()
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
ks = sorted(
    (x for x in events if x.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in x), key=lambda x: x["ts"]
)
lo, hi = ks[0]["ts"], max(x["ts"] + x["dur"] for x in ks)
edges = []
for x in ks:
    staging = x["cat"] == "kernel" and kind(x["name"]) == "staging"
    edges += [(x["ts"], 1, staging), (x["ts"] + x["dur"], -1, staging)]
edges.sort(key=lambda t: (t[0], t[1]))
split = dict.fromkeys(("staging only", "compute only", "both", "idle"), 0.0)
busy = {True: 0, False: 0}
last = lo
gaps = []  # (start, length) of each stretch with nothing running on the GPU
for t, d, staging in edges:
    if t > last:
        s, c = busy[True] > 0, busy[False] > 0
        split["both" if s and c else "staging only" if s else "compute only" if c else "idle"] += t - last
        if not (s or c):
            gaps.append((last, t - last))
    last = t
    busy[staging] += d
print(f"\nprofiled prefill: GPU span {(hi - lo) / 1e3:.1f} ms (TTFT {e.stats.ttft_s * 1e3:.1f} ms under the profiler)")
print("  " + ", ".join(f"{k} {v / 1e3:.1f} ms" for k, v in split.items()))
by_kind = collections.defaultdict(collections.Counter)
calls = collections.Counter()
for x in ks:
    k = kind(x["name"]) if x["cat"] == "kernel" else x["cat"]
    by_kind[k][x["name"][:70]] += x["dur"]
    calls[x["name"][:70]] += 1
for k, names in sorted(by_kind.items(), key=lambda kv: -sum(kv[1].values())):
    print(f"  {k:<11} {sum(names.values()) / 1e3:8.1f} ms")
    for name, us in names.most_common(3):
        print(f"      {us / 1e3:8.1f} ms {calls[name]:>6}x  {name}")


def idle_sites(events, kernels, gaps, depth=2):
    """{python site: (µs, gaps)} of the GPU's idle stretches, each charged to where the host launched the kernel that
    ended it: the innermost localmoe frames (`depth` of them) around that launch (the profiler's python_function
    events, same thread). A host that issues launches slower than the GPU runs them shows up here."""
    launch = {
        x["args"]["correlation"]: x
        for x in events
        if x.get("cat") == "cuda_runtime" and "Launch" in x.get("name", "") and "correlation" in x.get("args", {})
    }
    starts = sorted(k["ts"] for k in kernels)
    queries = []  # (host time of the launch, its thread, the gap's length)
    for g0, glen in gaps:
        i = bisect.bisect_left(starts, g0 + glen)
        nxt = [k for k in kernels[i : i + 4] if k["ts"] >= g0 + glen and k.get("cat") == "kernel"]
        rt = launch.get(nxt[0].get("args", {}).get("correlation")) if nxt else None
        if rt is not None:
            queries.append((rt["ts"], rt.get("tid"), glen))
    frames = sorted(
        (x for x in events if x.get("cat") == "python_function" and "dur" in x and "localmoe" in x.get("name", "")),
        key=lambda x: x["ts"],
    )
    out = collections.defaultdict(lambda: [0.0, 0])
    j, active = 0, []
    for t, tid, glen in sorted(queries, key=lambda q: q[0]):
        while j < len(frames) and frames[j]["ts"] <= t:
            active.append(frames[j])
            j += 1
        active = [f for f in active if f["ts"] + f["dur"] >= t]
        inner = sorted((f for f in active if f.get("tid") == tid), key=lambda f: f["ts"])[-depth:]
        site = " < ".join(f["name"].split("localmoe/")[-1] for f in inner[::-1]) or "(no localmoe frame)"
        out[site][0] += glen
        out[site][1] += 1
    return out


idle = idle_sites(events, ks, gaps)
total = sum(g for _, g in gaps) / 1e3
print(f"\nGPU idle stretches: {len(gaps)}, {total:.1f} ms; by where the host launched the kernel after each:")
for site, (us, count) in sorted(idle.items(), key=lambda kv: -kv[1][0])[:12]:
    print(f"  {us / 1e3:7.1f} ms {count:>6}x  {site}")

sites = collections.Counter()


def record(message, category, filename, lineno, file=None, line=None):
    frames = [f for f in traceback.extract_stack()[:-2] if "/localmoe/" in f.filename or "/kernels/" in f.filename]
    sites[" < ".join(f"{f.filename.split('/')[-1]}:{f.lineno}" for f in frames[-3:][::-1]) or "(outside)"] += 1


warnings.showwarning = record
warnings.simplefilter("always")
torch.cuda.set_sync_debug_mode("warn")
prefill()
torch.cuda.set_sync_debug_mode(0)
print(f"\nhost syncs in one prefill: {sum(sites.values())}")
for site, count in sites.most_common(10):
    print(f"  {count:>5}  {site}")
