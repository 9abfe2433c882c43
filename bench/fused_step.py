"""Decode tok/s and kernels per step with and without `localmoe.fused` (run on the H200, not a test).

Random bf16 weights at Qwen3.5-35B-A3B shapes (`Engine.random("qwen3.5-35b")`), CUDA-graph decode on. For each
sparsity and each mode (same process, same weights): "stock" (transformers modules), "fused-no-moe"
(`fused.install(model, exclude=MoE blocks)`: RMSNorms + Gated DeltaNet step only), "fused" (the whole table, the
engine's default on CUDA: also the MoE block's router and shared expert), any of them with "-compile", and
"only:<class>" (one table entry alone, to bisect); every mode starts from `fused.uninstall(model)`.
Per mode it reports graph decode tok/s (Engine.generate, greedy, prompt 128),
kernels per eager step (torch.profiler, CUDA kernel events / step), and checks the fused step against the stock one:
greedy tokens from the graph decode (common prefix length) and the max logit difference over teacher-forced eager
steps. Writes fused_step.json under $OUT when set. On random 35B weights those two checks are not a correctness
test: stock against itself drifts as much (the random network amplifies the summation order of GPU atomics);
correctness comes from tests/test_fused.py and bench/gpu_engine_check.py on the tiny families.

Usage: PYTHONUNBUFFERED=1 python bench/fused_step.py [--sparsity 0,0.85] [--decode 128] [--prompt 128]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from localmoe import fused
from localmoe.engine import Engine, _cache_of
from localmoe.events import GenerationSettings

ap = argparse.ArgumentParser()
ap.add_argument("--sparsity", default="0,0.85")
ap.add_argument("--decode", type=int, default=128)
ap.add_argument("--prompt", type=int, default=128)
ap.add_argument("--profile-steps", type=int, default=5)
ap.add_argument("--shape", default="qwen3.5-35b")
ap.add_argument("--device", default="cuda")  # cpu + --force: a smoke run of this script (Triton interpreter)
ap.add_argument("--force", action="store_true", help="install the fused modules off CUDA too")
ap.add_argument("--modes", default="stock,fused-no-moe,fused",
                help="of stock, fused-no-moe, fused, each optionally with -compile (torch.compile before capture)")
args = ap.parse_args()
DEV = torch.device(args.device)

t_start = time.time()
engine = Engine.random(args.shape, device=DEV, dtype=torch.bfloat16)
engine.set_context(args.prompt + args.decode + 16)
engine.eos_ids = set()
model = engine.model
print(f"engine ready in {time.time() - t_start:.0f} s", flush=True)
kw = engine._cache_kw
V = engine.loaded.config.vocab_size
prompt = torch.randint(0, V, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()


def _sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def eager_steps(n: int, forced: list[int]):
    """Prefill + n eager decode steps feeding `forced` tokens (or greedy when forced is empty): (logits [n+1, V], toks)."""
    ids = torch.tensor([prompt], device=DEV)
    out = model(input_ids=ids, use_cache=True)
    cache = _cache_of(out)
    logits = [out.logits[0, -1].float()]
    toks = []
    for i in range(n):
        tok = forced[i] if forced else int(logits[-1].argmax())
        toks.append(tok)
        out = model(input_ids=torch.tensor([[tok]], device=DEV), use_cache=True, **{kw: cache})
        logits.append(out.logits[0, -1].float())
    return torch.stack(logits), toks


@torch.inference_mode()
def kernels_per_step(steps: int) -> tuple[float, float]:
    """(CUDA kernels per eager decode step, device µs per step) from torch.profiler."""
    ids = torch.tensor([prompt], device=DEV)
    out = model(input_ids=ids, use_cache=True)
    cache = _cache_of(out)
    tok = out.logits[0, -1].argmax().view(1, 1)
    for _ in range(2):
        out = model(input_ids=tok, use_cache=True, **{kw: cache})
    _sync()
    with profile(activities=[ProfilerActivity.CUDA if DEV.type == "cuda" else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            out = model(input_ids=tok, use_cache=True, **{kw: cache})
        _sync()
    evs = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    n = sum(e.count for e in evs) / steps
    us = sum(e.self_device_time_total for e in evs) / steps
    return n, us


def graph_decode(compile: bool = False):
    engine.compile = compile
    engine.set_context(engine.context)  # drop any captured graph: capture again with the current modules
    s = GenerationSettings(max_new_tokens=args.decode)
    list(engine.generate(prompt, GenerationSettings(max_new_tokens=4)))  # capture + warm
    toks = [ev.token_id for ev in engine.generate(prompt, s)]
    return engine.stats.decode_tok_s, toks, engine._graph is not None


MOE_BLOCKS = tuple(k for k in fused.REPLACEMENTS if k.endswith("SparseMoeBlock"))
MODES = args.modes.split(",")
assert MODES[0] == "stock", "the first mode is the reference"

rows = []
for sp in [float(x) for x in args.sparsity.split(",")]:
    engine.set_sparsity(sp)
    res = {}
    for mode in MODES:
        fused.uninstall(model)
        if mode.startswith("only:"):  # bisect: one replaced class alone
            done = fused.install(model, force=args.force, exclude=tuple(k for k in fused.REPLACEMENTS if k != mode[5:]))
            print(f"{mode} installed: {done}", flush=True)
        elif mode not in ("stock", "stock-compile"):
            done = fused.install(model, force=args.force, exclude=MOE_BLOCKS if mode.startswith("fused-no-moe") else ())
            print(f"{mode} installed: {done}", flush=True)
        ref_forced = res.get("stock", {}).get("eager_toks", [])
        logits, eager_toks = eager_steps(8, ref_forced)
        n_k, dev_us = kernels_per_step(args.profile_steps)
        tok_s, toks, used_graph = graph_decode(compile=mode.endswith("-compile"))
        res[mode] = dict(tok_s=tok_s, toks=toks, graph=used_graph, kernels=n_k, device_us=dev_us,
                         logits=logits, eager_toks=eager_toks)
        print(f"sparsity {sp:.0%} {mode}: {tok_s:.1f} tok/s (graph {used_graph}), {n_k:.0f} kernels/eager step, "
              f"{dev_us:.0f} us device/eager step", flush=True)
    fused.uninstall(model)
    a = res["stock"]
    for mode in MODES:
        r = res[mode]
        same = dl = None
        if mode != "stock":
            same = next((i for i, (x, y) in enumerate(zip(a["toks"], r["toks"])) if x != y),
                        min(len(a["toks"]), len(r["toks"])))
            dl = (a["logits"] - r["logits"]).abs().max().item() / a["logits"].abs().max().item()
            per_step = ((a["logits"] - r["logits"]).abs().amax(-1) / a["logits"].abs().amax(-1)).tolist()
            print(f"sparsity {sp:.0%} {mode}: rel Δlogits per step (0 = prefill) "
                  + " ".join(f"{v:.1e}" for v in per_step), flush=True)
        rows.append(dict(sparsity=sp, mode=mode, tok_s=r["tok_s"], us_step=1e6 / max(r["tok_s"], 1e-9),
                         kernels=r["kernels"], device_us=r["device_us"], graph=r["graph"],
                         same_prefix=same, n=len(r["toks"]), rel_logit_diff=dl))

print("\n| sparsity | mode | decode tok/s | µs/step (graph) | kernels/step (eager) | device µs/step (eager) |"
      " greedy tokens equal | max rel Δlogits (8 forced steps) |")
print("|---:|---|---:|---:|---:|---:|---|---:|")
for r in rows:
    eq = "–" if r["same_prefix"] is None else f"{r['same_prefix']}/{r['n']}"
    dl = "–" if r["rel_logit_diff"] is None else f"{r['rel_logit_diff']:.2e}"
    print(f"| {r['sparsity']:.0%} | {r['mode']}{'' if r['graph'] else ' (eager!)'} | {r['tok_s']:.1f} | "
          f"{r['us_step']:.0f} | {r['kernels']:.0f} | {r['device_us']:.0f} | {eq} | {dl} |")
print(f"total {time.time() - t_start:.0f} s")
out = os.environ.get("OUT")
if out:
    Path(out, "fused_step.json").write_text(json.dumps(rows, indent=1))
