"""H200 benchmark of one MoE block at batch 1: localmoe sparse kernels vs dense paths.

Owns the measurement behind `bench/RESULTS.md` and the tuned data in `kernels/tuned/`:
  * device-copy bandwidth (the byte-floor ceiling), measured in the same run;
  * correctness of every path vs the fp32 torch references (max rel err printed before any timing);
  * launch-parameter sweep of localmoe's two expert kernels per shape (H, I, k): `dense_experts`, `sparse_fused`;
  * whole block (router + shared expert where the family has one + experts) and experts-only times for
    transformers `batched_mm`, `grouped_mm`, localmoe dense (`dense_experts`) and localmoe fused (`sparse_fused`,
    what the engine's decode runs) at 0/50/70/85/90 % sparsity;
  * at 85 %: fused variants (bf16 out; caller-zeroed accumulate with one memset node) and offload rows: the
    fused kernel with a slot table where half of each token's routed experts are absent from the device pool
    and read in place from pinned host memory, the same with all routed experts resident through the table,
    and copy-then-compute (H2D copy of the absent experts, then the resident kernel) for comparison;
  * dense/sparse crossover token count (T = 1..128) per shape.
Timing: CUDA graphs of several blocks over rotating weight sets and inputs (L2 = 60 MB must not hold the
working set), `triton.testing.do_bench` median of graph replays. The blocks, the paths and the timer are in
bench/moe_block_paths.py; this script runs a family's checks, sweep, table and crossover and writes the JSON.

    PYTHONUNBUFFERED=1 python bench/bench_moe_block.py --out $OUT          # on the GPU
    TRITON_INTERPRET=1 python bench/bench_moe_block.py --smoke             # CPU plumbing check, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from moe_block_paths import Paths, Timer, calibrate, copy_bandwidth, rel, route  # noqa: E402

from localmoe.kernels.dense_experts import dense_experts, dense_experts_ref  # noqa: E402
from localmoe.kernels.sparse_fused import sparse_fused, sparse_fused_ref  # noqa: E402

# name, H, I, E, k, shared I (0 = none), transformers family
FAMILIES = [
    ("Qwen3.5-35B-A3B", 2048, 512, 256, 8, 512, "qwen3_5_moe"),
    ("Qwen3.5-122B-A10B", 3072, 1024, 256, 8, 1024, "qwen3_5_moe"),
    ("Qwen3-30B-A3B", 2048, 768, 128, 8, 0, "qwen3_moe"),
]
SMOKE_FAMILIES = [("smoke-shared", 64, 32, 8, 2, 32, "qwen3_5_moe"), ("smoke-noshared", 64, 48, 8, 2, 0, "qwen3_moe")]
SPARSITIES = [0.0, 0.5, 0.7, 0.85, 0.9]
CROSS_T = [1, 2, 4, 8, 16, 32, 64, 128]
DENSE_SWEEP = [dict(BLOCK_N=bn, num_warps=w) for bn in (2, 4, 8, 16) for w in (4, 8)]
# fused: the whole BLOCK_I x H_P2 tile lives in registers; sm_90 builds (ptxas, bf16, H_P2 2048/4096) spill or
# drop to <= 2 blocks/SM above 64 tile elements per thread, so only configs with 16..64 elements per thread run
FUSED_CANDIDATES = [dict(BLOCK_I=bi, num_warps=w) for bi in (1, 2, 4, 8, 16) for w in (2, 4, 8, 16)]
FUSED_SWEEP = None  # None: FUSED_CANDIDATES filtered per shape by fused_sweep(H)


def fused_sweep(H):
    if FUSED_SWEEP is not None:
        return FUSED_SWEEP
    hp2 = 1 << (H - 1).bit_length()
    return [c for c in FUSED_CANDIDATES if 16 <= c["BLOCK_I"] * hp2 // (32 * c["num_warps"]) <= 64]


OFFLOAD_ABSENT = 0.5  # fraction of each token's routed experts missing from the device pool in the offload rows


def check(paths: Paths, tau_t: dict) -> dict:
    """Max relative error of every path against the fp32 torch references, on one fresh input of 3 tokens."""
    blk, lw = paths.blocks[0][1], paths.blocks[0][2]
    w = [lw["w_gate"], lw["w_up"], lw["w_down_t"]]
    x = torch.randn(3, paths.H, device=paths.dev, dtype=torch.bfloat16)
    ids, rw = route(blk, x)
    yref = dense_experts_ref(x, *w, ids, rw)
    errs = {}
    for impl in ("batched_mm", "grouped_mm"):
        paths.set_impl(impl)
        errs[impl] = rel(blk.experts(x, ids, rw), yref)
    errs["localmoe_dense"] = rel(dense_experts(x, *w, ids, rw), yref)
    yf, _ = sparse_fused(x, *w, ids, rw, tau_t[0.0], workspace=paths.ws)
    errs["fused_0"] = rel(yf, yref)
    yfr, cfr = sparse_fused_ref(x, *w, ids, rw, tau_t[0.85])
    for _ in range(2):  # twice: the workspace must have been cleaned by the first launch
        yf, cf = sparse_fused(x, *w, ids, rw, tau_t[0.85], workspace=paths.ws)
    errs["fused_85"] = rel(yf, yfr)
    errs["fused_85_count_mismatch"] = float((cf != cfr).sum())
    return errs


def tune(paths: Paths, timer, tau) -> dict:
    """The launch parameters of localmoe's two expert kernels at this shape (experts only, at `tau`)."""
    P = {"dense": dict(BLOCK_N=4, num_warps=8), "fused": dict(BLOCK_I=8, num_warps=8)}
    t0 = time.time()
    best = None
    for pd in DENSE_SWEEP:
        us, _ = timer(paths.dense_experts(pd), paths.nin)
        if best is None or us < best[0]:
            best = (us, pd)
    P["dense"] = best[1]
    print(f"  tuned dense {best[1]}: {best[0]:.2f} us  (sweep {time.time() - t0:.1f} s)")
    best = None
    for pf in fused_sweep(paths.H):
        us, _ = timer(paths.fused_experts(tau, pf), paths.nin)
        print(f"    fused {pf}: {us:.2f} us")
        if best is None or us < best[0]:
            best = (us, pf)
    P["fused"] = best[1]
    print(f"  tuned fused {best[1]}: {best[0]:.2f} us  (sweep {time.time() - t0:.1f} s)")
    return P


class Rows(list):
    """The table's rows: a path's whole-block and experts-only time, bytes and timing mode."""

    def __init__(self, other_bytes: float):
        super().__init__()
        self.other = other_bytes  # router + shared expert + its gate

    def add(self, path, whole_us, exp_us, exp_bytes, mode, host_bytes=0.0):
        self.append(dict(path=path, whole_us=whole_us, experts_us=exp_us, experts_MB=exp_bytes / 1e6,
                         whole_MB=(exp_bytes + self.other) / 1e6, mode=mode, host_MB=host_bytes / 1e6))  # fmt: skip


def main_table(paths: Paths, timer, P: dict, tau_t: dict, rows: Rows) -> dict:
    """transformers', localmoe dense and localmoe fused at every sparsity, then the fused variants at 85%; the
    kept fraction per sparsity (measured on this run's inputs)."""
    k, I, nin = paths.k, paths.I, paths.nin
    ebytes = 2 * paths.H * I  # bytes of one neuron-matrix of one expert (bf16)
    dense_bytes = k * 3 * ebytes
    for impl in ("batched_mm", "grouped_mm"):
        w_us, m1 = timer(paths.whole(impl, P), nin)
        e_us, m2 = timer(paths.hf_experts(impl), nin)
        rows.add(f"transformers {impl}", w_us, e_us, dense_bytes, m1 if m1 == m2 else f"{m1}/{m2}")
    w_us, m1 = timer(paths.whole("dense", P), nin)
    e_us, _ = timer(paths.dense_experts(P["dense"]), nin)
    rows.add("localmoe dense", w_us, e_us, dense_bytes, m1)
    kept_frac = {}
    for s in SPARSITIES:
        kept = []
        for i in range(nin):
            lw = paths.weights(i)
            w = [lw["w_gate"], lw["w_up"], lw["w_down_t"]]
            _, c = sparse_fused(paths.xs[i], *w, *paths.routes[i], tau_t[s], workspace=paths.ws)
            kept.append(c.float().mean() / I)
        kf = kept_frac[s] = float(torch.stack(kept).mean())
        w_us, m1 = timer(paths.whole("fused", P, tau_t[s]), nin)
        e_us, _ = timer(paths.fused_experts(tau_t[s], P["fused"]), nin)
        rows.add(f"localmoe fused {int(round(s * 100))}% (kept {kf:.3f})", w_us, e_us, k * ebytes * (1 + 2 * kf), m1)
    fb = k * ebytes * (1 + 2 * kept_frac[0.85])
    e_us, m1 = timer(paths.fused_experts(tau_t[0.85], P["fused"], out_dtype=torch.bfloat16), nin)
    rows.add("localmoe fused 85%, bf16 out", float("nan"), e_us, fb, m1)
    e_us, m1 = timer(paths.fused_experts(tau_t[0.85], P["fused"], accumulate=True), nin)
    rows.add("localmoe fused 85%, accumulate + 1 memset node", float("nan"), e_us, fb, m1)
    return kept_frac


def offload_rows(paths: Paths, timer, P: dict, taus: dict, tau_t: dict, kf: float, rows: Rows) -> dict:
    """At 85%, half of each token's routed experts absent from the device pool: the fused kernel reading them from
    pinned memory through a slot table, the same with all resident, and copy-then-compute; returns the check of
    the offload addressing against the resident computation."""
    k, nin = paths.k, paths.nin
    ebytes = 2 * paths.H * paths.I
    fb = k * ebytes * (1 + 2 * kf)
    off = paths.offload_inputs(taus[0.85], OFFLOAD_ABSENT)
    o, lw = off[0], paths.weights(0)
    w = [lw["w_gate"], lw["w_up"], lw["w_down_t"]]
    y_res, c_res = sparse_fused(paths.xs[0], *w, *paths.routes[0], tau_t[0.85], workspace=paths.ws)
    y_off, c_off = sparse_fused(paths.xs[0], *o["masters"], o["ids"], o["rw"], o["tau"], slot_table=o["tabs"]["mixed"],
                                pool_gate=w[0], pool_up=w[1], pool_down_t=w[2], workspace=paths.ws)  # fmt: skip
    errs = dict(offload_vs_resident=rel(y_off, y_res), offload_count_mismatch=float((c_off != c_res).sum()))
    print("  offload check:", {a: f"{b:.2e}" for a, b in errs.items()})
    n_abs = int(round(OFFLOAD_ABSENT * k))
    e_us, m1 = timer(paths.fused_offload(off, "resident", P["fused"]), nin)
    rows.add("localmoe fused 85%, slot table, all routed resident", float("nan"), e_us, fb, m1)
    e_us, m1 = timer(paths.fused_offload(off, "mixed", P["fused"]), nin)
    rows.add(f"localmoe fused 85%, slot table, {n_abs}/{k} routed absent: host reads", float("nan"), e_us, fb, m1,
             host_bytes=n_abs * ebytes * (1 + 2 * kf))  # fmt: skip
    e_us, m1 = timer(paths.copy_then_compute(off, tau_t[0.85], P["fused"]), nin)
    rows.add(f"copy-then-compute: H2D copy of {n_abs}/{k} experts + fused 85% resident", float("nan"), e_us,
             fb + n_abs * 3 * ebytes, m1, host_bytes=n_abs * 3 * ebytes)  # fmt: skip
    return errs


def report(rows: Rows, copy_bw: float) -> None:
    """Each row's bandwidth, speed-up over the best dense path and ratio to the byte floor, printed as a table."""
    best_dense_w = min(r["whole_us"] for r in rows[:3])
    best_dense_e = min(r["experts_us"] for r in rows[:3])
    for r in rows:
        r["GBps_experts"] = r["experts_MB"] * 1e6 / (r["experts_us"] * 1e-6) / 1e9
        r["GBps_whole"] = r["whole_MB"] * 1e6 / (r["whole_us"] * 1e-6) / 1e9
        r["speedup_whole"] = best_dense_w / r["whole_us"]
        r["speedup_experts"] = best_dense_e / r["experts_us"]
        r["floor_ratio_experts"] = r["experts_us"] / (r["experts_MB"] * 1e6 / (copy_bw * 1e9) * 1e6)
        r["floor_ratio_whole"] = r["whole_us"] / (r["whole_MB"] * 1e6 / (copy_bw * 1e9) * 1e6)
        r["host_GBps"] = r["host_MB"] * 1e6 / (r["experts_us"] * 1e-6) / 1e9 if r["host_MB"] else 0.0
    print(
        "  | path | whole µs | experts µs | experts GB/s | speed-up whole / experts | x byte floor whole / experts "
        "| host MB (GB/s) | mode |"
    )
    for r in rows:
        host = f"{r['host_MB']:.1f} ({r['host_GBps']:.1f})" if r["host_MB"] else "–"
        print(
            f"  | {r['path']} | {r['whole_us']:.1f} | {r['experts_us']:.1f} | {r['GBps_experts']:.0f} | "
            f"{r['speedup_whole']:.2f} / {r['speedup_experts']:.2f} | {r['floor_ratio_whole']:.2f} / "
            f"{r['floor_ratio_experts']:.2f} | {host} | {r['mode']} |"
        )
    f85 = next(r for r in rows if r["path"].startswith("localmoe fused 85% (kept"))
    print(
        f"  fused 85% experts: {f85['experts_us']:.2f} us, {f85['speedup_experts']:.2f}x best dense "
        f"(target <= 10 us and >= 2.5x)"
    )


def crossover(paths: Paths, timer, P: dict, tau) -> tuple[dict, int]:
    """Experts-only times at 85% for T = CROSS_T tokens; the largest T up to which sparse_fused won at every T."""
    cross, last_win = {}, 0
    for T in CROSS_T:
        n = 2 * paths.nsets if T <= 32 else paths.nsets
        xT = [torch.randn(T, paths.H, device=paths.dev, dtype=torch.bfloat16) for _ in range(n)]
        ti = (xT, [route(paths.block(i), xT[i]) for i in range(n)])
        fu, _ = timer(paths.fused_experts(tau, P["fused"], ti), n)
        de, _ = timer(paths.dense_experts(P["dense"], ti), n)
        bm, _ = timer(paths.hf_experts("batched_mm", ti), n)
        gm, _ = timer(paths.hf_experts("grouped_mm", ti), n)
        cross[T] = dict(fused85=fu, localmoe_dense=de, batched_mm=bm, grouped_mm=gm)
        print(f"  T={T:2d}: fused85 {fu:7.1f}  dense {de:7.1f}  batched_mm {bm:7.1f}  grouped_mm {gm:7.1f} us")
        if fu < min(de, bm, gm) and last_win == (CROSS_T[CROSS_T.index(T) - 1] if T != CROSS_T[0] else 0):
            last_win = T
    return cross, max(last_win, 1)


def run_family(spec, args, timer, copy_bw, dev, results, tuned):
    name, H, I, E, k, SI, _ = spec
    print(f"\n=== {name}: H={H} I={I} E={E} k={k} shared={SI}")
    paths = Paths(spec, args.sets, args.reps, dev, max(CROSS_T + [8]))
    taus = {s: calibrate(paths.blocks[0][1], paths.blocks[0][2], H, s, args.calib, dev) for s in SPARSITIES}
    tau_t = {s: torch.full((E,), taus[s], device=dev, dtype=torch.float32) for s in SPARSITIES}
    print("  tau per sparsity:", {s: round(v, 4) for s, v in taus.items()})
    errs = results.setdefault("correctness", {})[name] = check(paths, tau_t)
    print("  max rel err vs fp32 reference:", {a: f"{b:.2e}" for a, b in errs.items()})
    P = {"dense": dict(BLOCK_N=4, num_warps=8), "fused": dict(BLOCK_I=8, num_warps=8)}
    if not args.no_tune:
        P = tune(paths, timer, tau_t[0.85])
    tuned["launch_params"][f"H{H}_I{I}_k{k}"] = P
    rows = Rows(E * H * 2 + ((3 * SI * H + H) * 2 if SI else 0))
    kept_frac = main_table(paths, timer, P, tau_t, rows)
    if not args.no_offload:
        try:
            errs.update(offload_rows(paths, timer, P, taus, tau_t, kept_frac[0.85], rows))
        except Exception as exc:  # keep the resident numbers
            traceback.print_exc()
            results.setdefault("errors", {})[name + " offload"] = repr(exc)
    report(rows, copy_bw)
    results.setdefault("tables", {})[name] = rows
    if not args.no_cross:
        cross, tokens = crossover(paths, timer, P, tau_t[0.85])
        tuned["crossover_tokens"][f"H{H}_I{I}_E{E}_k{k}"] = tokens
        results.setdefault("crossover", {})[name] = dict(times=cross, crossover_tokens=tokens)
        print(f"  crossover tokens (sparse_fused 85% vs the best dense path): {tokens}")
    del paths
    if dev == "cuda":
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--sets", type=int, default=6)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--calib", type=int, default=512)
    ap.add_argument("--no-tune", action="store_true")
    ap.add_argument("--no-cross", action="store_true")
    ap.add_argument("--no-offload", action="store_true")
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    dev = "cuda" if cuda else "cpu"
    if args.smoke:
        global DENSE_SWEEP, FUSED_SWEEP, CROSS_T
        DENSE_SWEEP, CROSS_T = DENSE_SWEEP[:2], [1, 2]
        FUSED_SWEEP = FUSED_CANDIDATES[5:7]
        args.sets, args.reps, args.calib = 2, 1, 64
    torch.manual_seed(0)
    devname = torch.cuda.get_device_name() if cuda else "cpu"
    import transformers
    import triton

    print(
        f"device {devname}; torch {torch.__version__}; triton {triton.__version__}; "
        f"transformers {transformers.__version__}"
    )
    bw = copy_bandwidth(cuda)
    print(f"device copy bandwidth (read+write): {bw:.0f} GB/s")
    tiny = [torch.empty(64, device=dev) for _ in range(12)]
    node_us, _ = Timer(cuda)(lambda: [b.zero_() for b in tiny], 12)
    print(f"one tiny kernel node in a CUDA graph: {node_us:.2f} us")
    results = dict(
        device=devname,
        copy_GBps=bw,
        graph_node_us=node_us,
        torch=torch.__version__,
        triton=triton.__version__,
        transformers=transformers.__version__,
    )
    tuned = dict(device=devname, launch_params={}, crossover_tokens={})
    timer = Timer(cuda)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fams = SMOKE_FAMILIES if args.smoke else FAMILIES
    if args.only:
        fams = [f for f in fams if args.only in f[0]]
    with torch.no_grad():
        for spec in fams:
            try:
                run_family(spec, args, timer, bw, dev, results, tuned)
            except Exception as exc:  # keep the other families' numbers
                traceback.print_exc()
                results.setdefault("errors", {})[spec[0]] = repr(exc)
            (out / "results.json").write_text(json.dumps(results, indent=1))
            slug = "".join(ch if ch.isalnum() else "_" for ch in devname.lower()).strip("_")
            (out / f"{slug}.json").write_text(json.dumps(tuned, indent=1))


if __name__ == "__main__":
    main()
