"""Gated DeltaNet prefill on a GPU: localmoe's chunked delta rule (kernels/delta_rule_chunk.py) against
transformers' torch fallback and, when importable, flash-linear-attention's `chunk_gated_delta_rule`.

First a check: the kernel against its torch reference (transformers' function op for op) on the GPU, T = 300 (a
partial last chunk), with an initial state, each dot precision, either prepare; max absolute error of the
output and the final state. Then the times (median ms, CUDA events around each call, warm) of one Qwen3.5-35B-A3B
Gated DeltaNet layer's delta rule (H_k 16, H_v 32, d_k = d_v 128, bf16 q/k/v, fp32 g) at T 512 / 2048 / 8192, for:
transformers' `torch_chunk_gated_delta_rule`, the kernel (fp32 dots and TF32; the intra-chunk phase in torch,
and in Triton: `_tprep`), fla's kernel; then the whole layer (`Qwen3_5MoeGatedDeltaNet` vs localmoe's
`FusedGatedDeltaNet`, hidden 2048, no cache); between them, with --sweep, a sweep of the scan launch (precision x
block_v x num_warps x num_stages) at T 2048. Prints the tables; with $OUT set writes `$OUT/deltanet_prefill.json`.

    python bench/deltanet_prefill.py [--T 512,2048,8192] [--reps 10] [--sweep]

Run from the repository root with localmoe importable (see README.md: `pip install -e .`, or PYTHONPATH with
kernels/ linked in as localmoe/kernels as gpu_release_check.sh does).
Shape legend: B batch (1), T tokens, H_k / H_v key / value heads, d head dim, H hidden.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q35

from localmoe.decode.deltanet import FusedGatedDeltaNet
from localmoe.kernels.delta_rule_chunk import chunk_gated_delta_rule, chunk_gated_delta_rule_ref
from localmoe.kernels.delta_rule_prepare import PRECISIONS

try:  # optional: the package transformers would use if it were installed
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
except Exception:  # noqa: BLE001 (any import failure: not there, or broken on this machine)
    fla_chunk = None

HK, HV, D, HIDDEN = 16, 32, 128, 2048
# transformers' torch function itself (its hub decorator would hand the call to fla when fla is installed)
torch_chunk = getattr(q35.torch_chunk_gated_delta_rule, "__wrapped__", q35.torch_chunk_gated_delta_rule)


def _inputs(T, dtype=torch.bfloat16, seed=0, state=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, T, HK, D, device="cuda", generator=gen).to(dtype)
    k = torch.randn(1, T, HK, D, device="cuda", generator=gen).to(dtype)
    v = torch.randn(1, T, HV, D, device="cuda", generator=gen).to(dtype)
    g = -torch.rand(1, T, HV, device="cuda", generator=gen) * 2 - 0.01  # fp32, as the model's
    beta = torch.rand(1, T, HV, device="cuda", generator=gen).to(dtype)
    s0 = torch.randn(1, HV, D, D, device="cuda", generator=gen) * 0.5 if state else None
    return q, k, v, g, beta, s0


def _rep(q, k):
    return q.repeat_interleave(HV // HK, dim=2), k.repeat_interleave(HV // HK, dim=2)


def _time(fn, reps):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def check() -> dict:
    q, k, v, g, beta, s0 = _inputs(300, seed=1, state=True)
    want, want_s = chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=s0)
    hf, hf_s = torch_chunk(
        *_rep(q, k), v, g=g, beta=beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    res = {"ref_vs_transformers": float((want.float() - hf.float()).abs().max())}
    for name, prec, prep in (
        ("ieee", "ieee", "torch"),
        ("tf32", "tf32", "torch"),
        ("split_ieee", "ieee", "split"),
        ("tprep_ieee", "ieee", "triton"),
        ("tprep_tf32", "tf32", "triton"),
    ):
        got, got_s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, precision=prec, prepare=prep)
        res[f"{name}_out"] = float((got.float() - want.float()).abs().max())
        res[f"{name}_state"] = float((got_s - want_s).abs().max())
    res["out_scale"] = float(want.float().abs().max())
    res["state_scale"] = float(want_s.abs().max())
    print("check (T 300, initial state, bf16 in): max |kernel - reference|")
    for key, val in res.items():
        print(f"  {key:20s} {val:.3e}")
    return res


def rule_times(Ts, reps) -> list[dict]:
    rows = []
    for T in Ts:
        q, k, v, g, beta, _ = _inputs(T)
        qr, kr = _rep(q, k)
        fns = {
            "transformers": lambda: torch_chunk(
                qr, kr, v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True
            ),
            "localmoe": lambda: chunk_gated_delta_rule(q, k, v, g, beta),
            "localmoe_tf32": lambda: chunk_gated_delta_rule(q, k, v, g, beta, precision="tf32"),
            "localmoe_split": lambda: chunk_gated_delta_rule(q, k, v, g, beta, prepare="split"),
            "localmoe_tprep": lambda: chunk_gated_delta_rule(q, k, v, g, beta, prepare="triton"),
            "localmoe_tprep_tf32": lambda: chunk_gated_delta_rule(q, k, v, g, beta, prepare="triton", precision="tf32"),
        }
        if fla_chunk is not None:
            fns["fla"] = lambda: fla_chunk(
                qr, kr, v, g=g, beta=beta, output_final_state=True, use_qk_l2norm_in_kernel=True
            )
        row = {"T": T}
        for name, fn in fns.items():
            try:
                row[name] = _time(fn, reps)
            except Exception as e:  # noqa: BLE001 (report and go on: one failing path must not hide the others)
                print(f"  {name} T={T} failed: {type(e).__name__}: {e}", file=sys.stderr)
                row[name] = None
        rows.append(row)
    return rows


def sweep(T, reps) -> list[dict]:
    """The scan kernel's launch keywords at one T (torch prepare): precision x block_v x num_warps x num_stages."""
    q, k, v, g, beta, _ = _inputs(T)
    rows = []
    for prec in PRECISIONS:
        for bv in (16, 32, 64):
            for nw in (4, 8):
                for ns in (1, 2):
                    kw = dict(precision=prec, block_v=bv, num_warps=nw, num_stages=ns)
                    try:
                        ms = _time(lambda: chunk_gated_delta_rule(q, k, v, g, beta, **kw), reps)  # noqa: B023
                    except Exception as e:  # noqa: BLE001 (a launch that does not fit: report, go on)
                        print(f"  {kw} failed: {type(e).__name__}", file=sys.stderr)
                        continue
                    rows.append({**kw, "ms": ms})
    print(f"scan launch sweep at T {T} (ms, median; the defaults: num_warps 8, _block_v, _scan_stages)")
    for r in sorted(rows, key=lambda r: (r["precision"], r["ms"])):
        print(
            f"  {r['precision']:6s} block_v {r['block_v']:3d} num_warps {r['num_warps']} "
            f"num_stages {r['num_stages']}  {r['ms']:.4g}"
        )
    return rows


def layer_times(Ts, reps) -> list[dict]:
    cfg = q35.Qwen3_5MoeTextConfig(
        hidden_size=HIDDEN,
        linear_num_key_heads=HK,
        linear_num_value_heads=HV,
        linear_key_head_dim=D,
        linear_value_head_dim=D,
        linear_conv_kernel_dim=4,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    hf = q35.Qwen3_5MoeGatedDeltaNet(cfg, 0).to("cuda", torch.bfloat16).eval()
    fused = FusedGatedDeltaNet(hf)
    rows = []
    for T in Ts:
        x = torch.randn(1, T, HIDDEN, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            a, b = hf(x), fused(x)
            err = float((a.float() - b.float()).abs().max())
            rows.append(
                {
                    "T": T,
                    "transformers": _time(lambda: hf(x), reps),
                    "localmoe": _time(lambda: fused(x), reps),
                    "max_err": err,
                    "out_scale": float(a.float().abs().max()),
                }
            )
    return rows


def _table(title, rows, cols):
    print(title)
    width = {c: max(10, len(c)) for c in cols}
    print("  " + " | ".join([f"{'T':>6s}"] + [f"{c:>{width[c]}s}" for c in cols]))
    for r in rows:
        cells = [f"{r['T']:>6d}"]
        for c in cols:
            val = r.get(c)
            cells.append(f"{'-':>{width[c]}s}" if val is None else f"{val:>{width[c]}.4g}")
        print("  " + " | ".join(cells))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", default="512,2048,8192", help="comma-separated token counts")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--sweep", action="store_true", help="also sweep the scan's launch keywords at T 2048")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    Ts = [int(t) for t in args.T.split(",")]
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  fla {'yes' if fla_chunk else 'no'}")
    res = {"check": check()}
    res["rule"] = rule_times(Ts, args.reps)
    cols = ["transformers", "localmoe", "localmoe_tf32", "localmoe_split", "localmoe_tprep", "localmoe_tprep_tf32"]
    cols += ["fla"] if fla_chunk is not None else []
    _table("delta rule, one layer (ms, median)", res["rule"], cols)
    if args.sweep:
        res["sweep"] = sweep(2048, args.reps)
    res["layer"] = layer_times(Ts, args.reps)
    layer_title = "whole Gated DeltaNet layer, no cache (ms, median; transformers' module uses fla when it imports)"
    _table(layer_title, res["layer"], ["transformers", "localmoe", "max_err"])
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "deltanet_prefill.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
