"""GPU check of `--experts nf4` (not a test; run on the H200, bitsandbytes installed: bench/README.md says how).

1. Correctness, compiled: sparse_fused's NF4 mode against sparse_fused_ref at Qwen3.5-35B-A3B shapes (H 2048, I 512,
   E 256, k 8; T 1 and 4; thresholds 0 and the 85% quantile), and dequant_int4's NF4 mode against dequant_nf4_ref and
   bitsandbytes' dequantize_4bit, with their times on one layer's span (which prefill should use).
2. Speed, one process: `bench --shape qwen3.5-35b --experts int4` and `--experts nf4`, resident and at `--vram 16`, at
   sparsity 0 and 0.85: decode tok/s, prefill tok/s, peak VRAM, a short table at the end.
3. `--load`: what a bnb-4bit checkpoint costs to load against a bf16 one with `--experts int4`: a 4-layer Qwen3-30B-A3B
   (qwen3_moe, per-expert tensors, as the hub's bnb-4bit MoE checkpoints are) saved in bf16 and in bitsandbytes'
   serialized 4-bit format (double-quantized statistics), each loaded in a fresh process: time, peak host RSS, peak
   VRAM, expert GiB.
4. `--linear4bit`: a bnb-4bit checkpoint's non-expert Linears kept as bitsandbytes `Linear4bit` (NF4, bf16 compute;
   what transformers loads) against dequantized once to bf16 and read by localmoe's GEMV (what the fused decode path
   does): one decode step's non-expert projections at Qwen3.5-35B-A3B's shapes (every Linear of the model that is not
   a routed expert, with its count), µs per step each way and the bytes each keeps in VRAM.
Usage: PYTHONUNBUFFERED=1 python bench/nf4_check.py [--skip-kernels] [--skip-bench] [--load] [--linear4bit]
"""

import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

root = Path(tempfile.mkdtemp())
os.environ.update(HF_HUB_CACHE=str(root / "hub"), HF_HUB_OFFLINE="1", XDG_CACHE_HOME=str(root / "xdg"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402

OUT = os.environ.get("OUT")


def timed(fn, n=20) -> float:
    """Mean µs of fn() over n CUDA-synchronised calls after one warm-up."""
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def kernels() -> None:
    import bitsandbytes.functional as bnb_f

    from localmoe.kernels.dequant_int4 import dequant_int4, dequant_nf4_ref
    from localmoe.kernels.int4 import quantize
    from localmoe.kernels.nf4 import nf4_code, quantize_nf4
    from localmoe.kernels.sparse_fused import sparse_fused, sparse_fused_ref

    dev, E, I, H, k = "cuda", 256, 512, 2048, 8
    gen = torch.Generator(device=dev).manual_seed(0)
    w = [torch.randn(E, I, H, device=dev, generator=gen, dtype=torch.bfloat16) * 0.02 for _ in range(3)]
    nf, i4 = [quantize_nf4(t) for t in w], [quantize(t) for t in w]
    print("kernel            T  tau     max rel err vs ref   kept    µs (int4 µs)")
    for T in (1, 4):
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(E, device=dev, generator=gen)[:k] for _ in range(T)])
        rw = torch.softmax(torch.randn(T, k, device=dev), -1)
        zero = torch.zeros(E, device=dev)
        g = torch.nn.functional.silu(torch.einsum("th,eih->tei", x.float(), nf[0].dequantize(torch.float32)))
        q85 = torch.full((E,), float(g.abs().flatten().kthvalue(int(0.85 * g.numel())).values), device=dev)
        for name, tau in (("0", zero), ("q85", q85)):
            want, wc = sparse_fused_ref(x, *nf, ids, rw, tau)
            got, gc_ = sparse_fused(x, *nf, ids, rw, tau)
            err = float((got - want).norm() / want.norm())
            us = timed(lambda: sparse_fused(x, *nf, ids, rw, tau))
            us4 = timed(lambda: sparse_fused(x, *i4, ids, rw, tau))
            same = "==" if torch.equal(gc_, wc) else "!="
            print(f"sparse_fused nf4  {T}  {name:<6}  {err:.2e}             {same}ref   {us:7.1f} ({us4:.1f})")
    span = quantize_nf4(w[0][:64])  # one prefill span: 64 experts' gates
    code = nf4_code(dev)
    mine = dequant_int4(span.packed, span.scale, None, torch.bfloat16, code=code)
    ref = dequant_nf4_ref(span.packed, span.scale, code, torch.bfloat16)
    flat_q, st = bnb_f.quantize_4bit(w[0][:64].contiguous(), blocksize=64, quant_type="nf4")
    bnb_same = torch.equal(bnb_f.dequantize_4bit(flat_q, st).view_as(ref), ref)
    print(
        f"dequant nf4 (64 experts): kernel==ref {torch.equal(mine, ref)}, bnb==ref {bnb_same}; "
        f"kernel {timed(lambda: dequant_int4(span.packed, span.scale, None, torch.bfloat16, code=code)):.0f} µs, "
        f"bitsandbytes {timed(lambda: bnb_f.dequantize_4bit(flat_q, st)):.0f} µs, int4 kernel "
        f"{timed(lambda: i4[0][:64]):.0f} µs",
        flush=True,
    )


def bench_all() -> None:
    from localmoe.measure.benchmark import bench

    rows = []
    for vram in (None, 16.0):
        for fmt in ("int4", "nf4"):
            try:
                res = bench(
                    None,
                    shape="qwen3.5-35b",
                    sparsities=[0.0, 0.85],
                    device="cuda",
                    dtype="bfloat16",
                    vram_gib=vram,
                    experts=fmt,
                    progress=lambda st, d, t: print(f"  {st}", flush=True) if st.startswith("note") else None,
                )
            except Exception as ex:  # noqa: BLE001
                import traceback

                traceback.print_exc()
                rows.append(f"{fmt:<7} {vram or 'resident'}: ERROR {type(ex).__name__}: {ex}"[:160])
                continue
            if OUT:
                Path(OUT, f"bench_{fmt}_{vram or 'resident'}.json").write_text(json.dumps(res, indent=1, default=str))
            where = f"{vram:g} GiB" if vram else "resident"
            for r in res["rows"]:
                hits = r.get("cache_hit_rate")
                rows.append(
                    f"{fmt:<7} {where:<9} {r['sparsity']:<9g} {r['decode_tok_s']:<13.1f} {r['prefill_tok_s']:<14.0f} "
                    f"{r['peak_gpu_mem_gb']:<13.2f} {'-' if hits is None else f'{hits:.0%}'}"
                )
            gc.collect()
            torch.cuda.empty_cache()
    print("\nformat  vram      sparsity  decode tok/s  prefill tok/s  peak VRAM GB  cache hits")
    print("\n".join(rows), flush=True)


def peak_rss_kib() -> int:
    """This process's peak resident set (VmHWM). Not ru_maxrss: Linux carries that across the spawning parent's
    vfork + exec, so a child started by a 20 GiB parent would report 20 GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def load_one(folder: str, fmt: str) -> None:
    """In a fresh process: load `folder` with `--experts fmt`; one JSON line of its costs."""
    from localmoe.engine.engine import Engine
    from localmoe.events import GenerationSettings

    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    e = Engine.load(folder, device="cuda", dtype="bfloat16", sparsity=0.0, experts=fmt)
    load_s = time.perf_counter() - t
    toks = [ev.token_id for ev in e.generate(e.encode_raw("hello there"), GenerationSettings(max_new_tokens=8))]
    print(
        json.dumps(
            {
                "format": e.experts_format,
                "load_s": round(load_s, 2),
                "peak_rss_gib": round(peak_rss_kib() / 2**20, 2),
                "peak_vram_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                "expert_gib": round(e.loaded.expert_bytes() / 2**30, 2),
                "tokens": toks,
            }
        )
    )


def load() -> None:
    import shutil

    import tiny_models
    from test_bnb import bnb_quantize_folder
    from transformers import AutoModelForCausalLM

    from localmoe.models.shapes import shape_config

    cfg = shape_config("qwen3-30b")
    cfg.vocab_size = tiny_models.VOCAB  # the test suite's character tokenizer
    cfg.num_hidden_layers = 4
    bf16, nf4 = root / "q30-4layers-bf16", root / "q30-4layers-bnb-4bit"
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(bf16)
    tiny_models.char_tokenizer().save_pretrained(bf16)
    del model
    torch.cuda.empty_cache()
    shutil.copytree(bf16, nf4)
    bnb_quantize_folder(nf4, double_quant=True, device="cuda")
    size = {f: sum(p.stat().st_size for p in f.iterdir()) / 2**30 for f in (bf16, nf4)}
    print(f"checkpoints: bf16 {size[bf16]:.2f} GiB, bnb-4bit {size[nf4]:.2f} GiB", flush=True)
    print("checkpoint  --experts  load s  peak host RSS GiB  peak VRAM GiB  expert GiB")
    for folder, fmt in ((bf16, "int4"), (nf4, "nf4"), (bf16, "nf4")):
        run = subprocess.run(
            [sys.executable, __file__, "--load-one", str(folder), fmt], capture_output=True, text=True, check=False
        )
        line = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr.strip()[-300:]
        try:
            r = json.loads(line)
            print(
                f"{folder.name.split('-')[-1]:<11} {fmt:<10} {r['load_s']:<7} {r['peak_rss_gib']:<18} "
                f"{r['peak_vram_gib']:<14} {r['expert_gib']}",
                flush=True,
            )
        except ValueError:
            print(f"{folder.name} {fmt}: FAILED {line}", flush=True)


def linear4bit() -> None:
    from collections import Counter

    import bitsandbytes as bnb
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from localmoe.kernels.gemv import gemv
    from localmoe.models.shapes import shape_config

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(shape_config("qwen3.5-35b"), dtype=torch.bfloat16)
    shapes = Counter(
        (m.out_features, m.in_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and ".experts." not in name and not name.endswith("lm_head")
    )  # lm_head stays bf16 either way (bitsandbytes skips it)
    print("out x in           count  bf16 GEMV µs  Linear4bit µs  bf16 MB  nf4 MB", flush=True)
    tot = [0.0, 0.0, 0, 0]
    for (n, k), count in sorted(shapes.items()):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        lin = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
        lin.weight = bnb.nn.Params4bit(w.cpu(), requires_grad=False, quant_type="nf4")
        lin = lin.cuda()
        with torch.inference_mode():
            err = float((lin(x) - gemv(x, w)).float().norm() / gemv(x, w).float().norm())
            us_bf16, us_4 = timed(lambda: gemv(x, w)), timed(lambda: lin(x))
        mb_bf16, mb_4 = n * k * 2 / 1e6, n * k * (0.5 + 4 / 64) / 1e6
        tot = [tot[0] + us_bf16 * count, tot[1] + us_4 * count, tot[2] + mb_bf16 * count, tot[3] + mb_4 * count]
        print(
            f"{n:>6} x {k:<6}  {count:>5}  {us_bf16:>12.1f}  {us_4:>13.1f}  {mb_bf16:>7.1f}  {mb_4:>6.1f}  "
            f"(rel. diff {err:.3f})",
            flush=True,
        )
    print(f"per step          {tot[0]:>12.0f}  {tot[1]:>13.0f}  {tot[2]:>7.0f}  {tot[3]:>6.0f}  (µs, µs, MB, MB)")


if __name__ == "__main__":
    if "--load-one" in sys.argv:
        i = sys.argv.index("--load-one")
        load_one(sys.argv[i + 1], sys.argv[i + 2])
        sys.exit(0)
    if "--skip-kernels" not in sys.argv:
        kernels()
    if "--skip-bench" not in sys.argv:
        bench_all()
    if "--load" in sys.argv:
        load()
    if "--linear4bit" in sys.argv:
        linear4bit()
