"""Expert offloading on the GPU under a VRAM budget: miss strategies, admission, routing spread, and accelerate's
offload as the baseline, in one run (H200, not a test).

Builds the Qwen3.5-35B-A3B-shaped random engine once (bf16, `--vram` GiB, fused decode modules), then decodes each
case on it: `mode:sparsity[:admit[:bg]]` with mode direct (fused kernel reads misses' gate rows + kept rows from pinned
host memory inside the CUDA graph, the cache's VRAM holding gates first: `placement.gate_tier_split`; up to `admit`
missed experts' up/down copied into slots after each step, on a side stream with `bg`), whole (direct misses with
whole-expert slots, the layout before the gate tier), copy
(copy-then-compute, eager) or cpu (misses computed on the CPU, eager); `skewed` rescales the routers in place
(`random_weights.skew_routers`: a few hot experts per layer) for the cases after it. The accelerate baseline (stock
transformers, `device_map` from `max_memory`) runs first in a child process so its host copy is freed before ours.
Prints a table row per case as it finishes and writes $OUT/offload_modes.json.

Usage: PYTHONUNBUFFERED=1 python bench/offload_modes.py [--vram 24] [--cases ...] [--baseline-tokens 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ap = argparse.ArgumentParser()
ap.add_argument("--vram", type=float, default=24.0)
ap.add_argument("--shape", default="qwen3.5-35b")
ap.add_argument("--prompt", type=int, default=128)
ap.add_argument("--decode", type=int, default=48)
ap.add_argument("--cases", default="direct:0,direct:0.85,whole:0.85,copy:0.85,cpu:0.85,skewed,direct:0.85,whole:0.85")
ap.add_argument("--baseline-tokens", type=int, default=3, help="0: no accelerate baseline")
ap.add_argument("--baseline-only", action="store_true", help=argparse.SUPPRESS)  # the child process
args = ap.parse_args()
DEV = torch.device("cuda")
OUT = os.environ.get("OUT")
rows = []


def prompt_ids(vocab):
    return torch.randint(0, vocab, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()


def emit(row: dict) -> None:
    rows.append(row)
    hit = "–" if row.get("cache_hit_rate") is None else f"{row['cache_hit_rate']:.0%}"
    mb = "–" if row.get("h2d_mb_per_token") is None else f"{row['h2d_mb_per_token']:.0f}"
    print(
        f"| {row['case']} | {row['sparsity']:.0%} | {row['decode_tok_s']:.2f} | {hit} | {mb} | "
        f"{row.get('sparsity_realized', 0):.1%} | {row.get('graph', False)} | {row['peak_gpu_mem_gb']:.1f} |",
        flush=True,
    )
    if OUT:
        Path(OUT, "offload_modes.json").write_text(json.dumps(rows, indent=1))


if args.baseline_only:
    from localmoe.measure.baselines import accelerate_baseline
    from localmoe.models.shapes import shape_config

    config = shape_config(args.shape)
    r = accelerate_baseline(config, DEV, torch.bfloat16, prompt_ids(config.vocab_size), args.baseline_tokens, args.vram)
    print("BASELINE " + json.dumps(r.__dict__), flush=True)
    sys.exit(0)

print("| case | sparsity | decode tok/s | cache hits | H2D MB/token | realised | graph | peak GB |")
print("|---|---:|---:|---:|---:|---:|---|---:|", flush=True)
if args.baseline_tokens:
    t0 = time.time()
    child = subprocess.run(
        [
            sys.executable,
            __file__,
            "--baseline-only",
            "--vram",
            str(args.vram),
            "--shape",
            args.shape,
            "--prompt",
            str(args.prompt),
            "--baseline-tokens",
            str(args.baseline_tokens),
        ],
        capture_output=True,
        text=True,
    )
    line = next((x for x in child.stdout.splitlines() if x.startswith("BASELINE ")), None)
    if line is None:
        print(f"accelerate baseline failed: {child.stderr[-800:]}", flush=True)
    else:
        b = json.loads(line[9:])
        emit(
            dict(
                case=b["name"],
                sparsity=0.0,
                decode_tok_s=b["decode_tok_s"],
                peak_gpu_mem_gb=b["peak_gpu_mem_gb"],
                seconds=time.time() - t0,
            )
        )

from localmoe.engine.engine import Engine  # noqa: E402
from localmoe.experts.local_experts import LocalExperts  # noqa: E402
from localmoe.measure.benchmark import _run, copy_bandwidth  # noqa: E402
from localmoe.models.loaded import attach_cache  # noqa: E402
from localmoe.models.random_weights import skew_routers  # noqa: E402

t0 = time.time()
engine = Engine.random(
    args.shape,
    device=DEV,
    dtype=torch.bfloat16,
    vram_gib=args.vram,
    context=args.prompt + args.decode + 64,
    on_notice=lambda s: print(f"note: {s}", flush=True),
    fused=True,
    offload_miss="direct",
)
print(f"engine built in {time.time() - t0:.0f} s", flush=True)
prompt = prompt_ids(engine.loaded.config.vocab_size)
bw = copy_bandwidth(DEV)
routing = "uniform"
for case in args.cases.split(","):
    if case == "skewed":
        experts = {n: m for n, m in engine.model.named_modules() if isinstance(m, LocalExperts)}
        skew_routers(engine.model, experts, seed=0)
        routing = "skewed"
        continue
    mode, sp, *rest = case.split(":")
    miss, tier = ("direct", mode == "direct") if mode in ("direct", "whole") else (mode, False)
    cache = engine.loaded.cache
    if (cache.mode, bool(cache.gate_slots)) != (miss, tier):
        engine._graph = cache = None
        torch.cuda.empty_cache()
        attach_cache(engine.loaded, torch.bfloat16, DEV, engine.loaded.host_pinned, miss, gate_tier=tier)
        cache = engine.loaded.cache
    cache.admit_per_step = int(rest[0]) if rest else 16
    cache.background = "bg" in rest[1:]  # admissions copied on a side stream (ExpertCache.background)
    engine.use_graphs = miss == "direct"  # copy / cpu decode eagerly (their misses need the host in the loop)
    engine._drop_graph()
    t0 = time.time()
    try:
        r = _run(engine, float(sp), prompt, args.decode, "localmoe", bw, None)
    except Exception as e:  # noqa: BLE001 - report and go on to the next case
        print(f"{case}: failed: {type(e).__name__}: {e}", flush=True)
        continue
    emit(
        dict(
            case=(
                f"localmoe {mode}{' gates ' + str(cache.gate_slots) if cache.gate_slots else ''}"
                f" admit {cache.admit_per_step}{' bg' if cache.background else ''} ({routing})"
            ),
            seconds=time.time() - t0,
            **{k: v for k, v in r.__dict__.items() if k != "name"},
        )
    )
cache = engine.loaded.cache
print(
    f"gate slots {cache.gate_slots}, up/down slots: {cache.slots} of "
    f"{cache.num_experts * len(engine.loaded.experts)} experts; "
    f"{engine.loaded.offload.summary()}"
)
