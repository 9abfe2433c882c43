"""Every family's decode at its real shapes, dense and at its registry default sparsity, in one table (run on the GPU,
not a test): the closing table of "every family fast".

For each registry alias (default: every supported model that fits the GPU in bf16), `localmoe bench --shape ALIAS
--sparsity 0,DEFAULT --decode-tokens N` in this process (random weights, real config, CUDA graph, fused decode),
then one row per sparsity: decode tok/s, the step's bytes, the fraction of the byte floor, and default / dense.
Each model is built, measured and freed before the next.

    python bench/family_table.py [--models qwen3-30b,olmoe] [--decode-tokens 128]
"""

from __future__ import annotations

import argparse
import gc

import torch

from localmoe.measure.benchmark import bench
from localmoe.models.registry import load_registry

DEFAULT = "qwen3.5-35b,qwen3-30b,olmoe,granite-moe-3b,granite-moe-1b,deepseek-v2-lite,mixtral-8x7b"

ap = argparse.ArgumentParser(description="every family's decode at its real shapes")
ap.add_argument("--models", default=DEFAULT, help=f"comma-separated registry aliases (default {DEFAULT})")
ap.add_argument("--decode-tokens", type=int, default=128)
opts = ap.parse_args()
registry = load_registry()
rows = []
for alias in opts.models.split(","):
    spec = registry.get(alias)
    default = float(spec.sparsity)
    try:
        result = bench(
            None, shape=alias, sparsities=[0.0, default], device="cuda", dtype="bfloat16",
            prompt_tokens=128, decode_tokens=opts.decode_tokens,
        )  # fmt: skip
    except Exception as e:  # noqa: BLE001 - one model's failure is a row, not the end of the table
        rows.append((alias, spec.family, "error", str(e).splitlines()[0][:80]))
        print(f"{alias}: {type(e).__name__}: {e}", flush=True)
        continue
    got = {r["sparsity"]: r for r in result["rows"] if r["name"] == "localmoe"}
    dense = got.get(0.0)
    for s, r in sorted(got.items()):
        ratio = f"{r['decode_tok_s'] / dense['decode_tok_s']:.2f}x" if dense and s > 0 else ""
        rows.append(
            (alias, spec.family, f"{s:.0%}", f"{r['decode_tok_s']:.1f}", f"{r['step_mb']:.0f}",
             f"{r['fraction_of_floor']:.1%}", ratio, f"{r['peak_gpu_mem_gb']:.1f}")
        )  # fmt: skip
        print(" ".join(rows[-1]), flush=True)
    gc.collect()
    torch.cuda.empty_cache()

gpu = torch.cuda.get_device_name()
print(f"\nbf16, random weights, uniform routing, prompt 128, decode {opts.decode_tokens}, on {gpu}")
print("| model | family | sparsity | decode tok/s | step MB | of floor | vs dense | peak GB |")
print("|---|---|---:|---:|---:|---:|---:|---:|")
for row in rows:
    print("| " + " | ".join(row) + " |")
