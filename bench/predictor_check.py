"""The department-shared gate predictor (`--departments`, issue #23) on a GPU: correctness first, then speed.

1. tokens: localmoe-tiny in float32 at 85% with `--departments 4 --rank 16` (fitted on the CPU, cached, then read by
   the CUDA engines): the CPU engine's greedy tokens (the torch reference of the predicted path) against the CUDA
   engine's (department_basis + sparse_fused with its predictor, CUDA graph) and an offloaded CUDA engine's (direct
   misses, a gate tier smaller than the gates, B and C in place of some of them). Prints one line each; exit 1 on a
   difference.
2. kernel: the routed-expert launch at real shapes (Qwen3.5-35B-A3B: H 2048, I 512, E 256, k 8; Qwen3-30B-A3B:
   H 2048, I 768, E 128, k 8), bf16, random weights, 85% sparsity: `sparse_fused` alone against
   `sparse_fused(predictor=)` with a synthetic predictor (N 8, r 64; τ′ at the candidate share of --candidates) and
   its stage 1 z computed before (the engine's decoder layers: in moe_front's launch); the same with z from its own
   `department_basis` launch; and the pair the engine runs, `moe_front` (router, no shared expert) + `sparse_fused`,
   against `moe_front(basis=)` + `sparse_fused(predictor=)`. µs per call (CUDA graph of 40 layers' weights in
   rotation, median of replays), at each BLOCK_I / num_warps pair of --launches (default 8 / 8).
3. engine (unless --skip-engine): `localmoe bench --shape S --sparsity 0.85 --departments 0,8` for each shape,
   resident, and qwen3.5-35b at `--vram 16` (bf16 experts offloaded): today's sparse path and the predictor's rows
   from one engine (`--basis-ab`: each row also with the predictor's stage 1 in its own `department_basis` launch
   instead of moe_front's, `FusedSparseMoeBlock.basis_in_front` off).
Random weights cannot show recall (synthetic predictors, speed only).

    PYTHONUNBUFFERED=1 python bench/predictor_check.py [--skip-engine] [--candidates 0.3] [--launches 8/8,4/8]
        [--basis-ab]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

root = Path(tempfile.mkdtemp())
os.environ.setdefault("XDG_CACHE_HOME", str(root / "xdg"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402

from localmoe.decode.moe_layer import FusedSparseMoeBlock  # noqa: E402
from localmoe.engine.engine import Engine  # noqa: E402
from localmoe.events import GenerationSettings  # noqa: E402
from localmoe.kernels.gate_predictor import (  # noqa: E402
    GatePredictor,
    department_basis,
    dequantize_rows,
    quantize_rows,
)
from localmoe.kernels.moe_front import moe_front  # noqa: E402
from localmoe.kernels.router_topk import router_tickets  # noqa: E402
from localmoe.kernels.sparse_fused import sparse_fused  # noqa: E402
from localmoe.measure.benchmark import bench, table  # noqa: E402

SHAPES = [("qwen3.5-35b", 2048, 512, 256), ("qwen3-30b", 2048, 768, 128)]
K, N, R, LAYERS = 8, 8, 64, 40


def tokens(engine, n: int = 12) -> list[int]:
    ids = engine.encode_raw("The requests library sends HTTP requests")
    return [e.token_id for e in engine.generate(ids, GenerationSettings(max_new_tokens=n, temperature=0.0))]


def check_tokens() -> bool:
    kw = dict(sparsity=0.85, dtype="float32", departments=4, rank=16)
    want = tokens(Engine.load("localmoe-tiny", device="cpu", **kw))
    p = Engine.load("localmoe-tiny", device="cuda", sparsity=0.0, dtype="float32", vram_gib=64.0).loaded.offload
    fixed = p.non_expert_bytes + p.state_bytes + p.workspace_bytes
    half = (fixed + 16.5 * p.expert_bytes) / (1 << 30)  # 16 experts' bytes: 48 of the 64 gates, no up/down rows
    ok = True
    for name, extra in (("cuda graph", {}), ("cuda offloaded (direct)", {"vram_gib": half})):
        engine = Engine.load("localmoe-tiny", device="cuda", offload_miss="direct", **kw, **extra)
        for m in engine.loaded.experts:  # direct misses send short prompt pieces down the sparse path on CUDA
            m.max_sparse_tokens = 1  # (thresholds.sparse_token_limit); the CPU engine's prefill is dense
        got = tokens(engine)
        cache = engine.loaded.cache
        where = f", {cache.gate_slots} gate slots, {cache.slots} up/down slots" if cache else ""
        graph = engine._graph is not None
        print(f"tokens {name}: equal {got == want}, graph {graph}{where}", flush=True)
        ok &= got == want and graph
    return ok


def synthetic(E: int, I: int, H: int, share: float, gen):
    """B [N, r, H] orthonormal rows, C = W_gate B^T, both int8 rows with scales (as the engine stores them), τ′ at
    the `share` quantile over random x: (w, B, B_scale, C, C_scale, dept_of, τ′ fp16 [E, I], one value)."""
    w = [torch.randn(E, I, H, device="cuda", generator=gen, dtype=torch.bfloat16) * H**-0.5 for _ in range(3)]
    B = torch.linalg.qr(torch.randn(N, H, R, device="cuda", generator=gen))[0].transpose(1, 2).contiguous()
    dept = torch.arange(E, device="cuda") * N // E
    (qb, sb), (qc, sc) = quantize_rows(B), quantize_rows(w[0].float() @ B[dept].transpose(1, 2))
    Bf, Cf = dequantize_rows(qb, sb), dequantize_rows(qc, sc)
    x = torch.randn(64, H, device="cuda", generator=gen)
    p = torch.nn.functional.silu(torch.einsum("nh,erh,eir->nei", x, Bf[dept], Cf)).abs()
    tp = float(torch.quantile(p.reshape(-1)[: 1 << 24], 1 - share))
    return w, qb, sb, qc, sc, dept.to(torch.int32), torch.full((E, I), tp, dtype=torch.float16, device="cuda")


def kernel_rows(share: float, launches: list[tuple[int, int]]) -> list[str]:
    rows = []
    for (name, H, I, E), (bi, nw) in ((s, lp) for s in SHAPES for lp in launches):
        gen = torch.Generator(device="cuda").manual_seed(0)
        sets = [synthetic(E, I, H, share, gen) for _ in range(4)]  # rotated: L2 must not hold the working set
        routers = [torch.randn(E, H, device="cuda", generator=gen, dtype=torch.bfloat16) * H**-0.5 for _ in sets]
        x = torch.randn(1, H, device="cuda", generator=gen, dtype=torch.bfloat16)
        res = torch.randn(1, H, device="cuda", generator=gen, dtype=torch.bfloat16)
        norm_w = torch.randn(H, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.1
        ids = torch.randperm(E, device="cuda", generator=gen)[:K].view(1, K)
        wts = torch.rand(1, K, device="cuda", generator=gen)
        g = (x.float() @ sets[0][0][0][ids[0, 0]].float().T).flatten()
        tau = torch.full((E,), float(torch.quantile(torch.nn.functional.silu(g).abs(), 0.85)), device="cuda")
        out = torch.empty(1, H, device="cuda", dtype=torch.bfloat16)
        z = torch.empty(1, N, R, device="cuda", dtype=torch.float32)
        tickets = router_tickets("cuda", 1)
        kw = dict(BLOCK_I=bi, num_warps=nw)

        def routed(s, h=x, i=ids, w=wts, predict=False):
            p = {"predictor": GatePredictor(z, s[3], s[4], s[5], s[6])} if predict else {}
            sparse_fused(h, *s[0], i, w, tau, out, **p, **kw)

        def front(i, basis=False):
            s = sets[i]
            b = {"basis": (s[1], s[2], z)} if basis else {}
            _, h, _, tw, ti, _ = moe_front(
                x, res, norm_w, 1e-6, "zero_centred", routers[i], K, True, tickets=tickets, **b
            )
            routed(s, h.view(1, H), ti, tw, predict=basis)

        def two(i):  # z from its own launch
            department_basis(x, sets[i][1], sets[i][2], sets[i][5], ids, out=z)
            routed(sets[i], predict=True)

        fns = {
            "today": lambda i: routed(sets[i]),
            "predictor": lambda i: routed(sets[i], predict=True),  # z from the launch before (moe_front's basis)
            "basis launch": two,
            "front today": front,
            "front predictor": lambda i: front(i, basis=True),
        }
        t = {}
        for label, fn in fns.items():
            for i in range(len(sets)):
                fn(i)  # compile
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for i in range(LAYERS):
                    fn(i % len(sets))
            t[label] = triton.testing.do_bench(graph.replay, warmup=25, rep=200) * 1e3 / LAYERS
        rows.append(
            f"| {name} | {bi} / {nw} | {t['today']:.1f} | {t['predictor']:.1f} | {t['today'] / t['predictor']:.2f}x "
            f"| {t['basis launch']:.1f} | {t['front today']:.1f} | {t['front predictor']:.1f} "
            f"| {t['front today'] / t['front predictor']:.2f}x |"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument(
        "--basis-ab", action="store_true", help="engine rows with the predictor's stage 1 in moe_front and not"
    )
    ap.add_argument("--candidates", type=float, default=0.3, help="synthetic predictor's candidate share")
    ap.add_argument("--launches", default="8/8", help="BLOCK_I/num_warps pairs of both launches, e.g. 8/8,4/8,4/4")
    a = ap.parse_args()
    launches = [tuple(int(v) for v in p.split("/")) for p in a.launches.split(",")]
    ok = check_tokens()
    print(f"\nrouted-expert launch, bf16, 85%, synthetic predictor N {N} r {R}, {a.candidates:.0%} candidates")
    print(
        "| shape | BLOCK_I / warps | today µs | predictor µs | speed-up | with department_basis µs "
        "| front + today µs | front with basis + predictor µs | speed-up |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    print("\n".join(kernel_rows(a.candidates, launches)), flush=True)
    if not a.skip_engine:
        for shape, vram in (("qwen3.5-35b", None), ("qwen3-30b", None), ("qwen3.5-35b", 16.0)):
            for front in [True, False] if a.basis_ab else [True]:
                FusedSparseMoeBlock.basis_in_front = front
                print(f"\n{shape}, the predictor's stage 1 in moe_front: {front}")
                result = bench(
                    None, shape=shape, sparsities=[0.85], device="cuda", dtype="bfloat16", prompt_tokens=256,
                    decode_tokens=128, vram_gib=vram, departments=[0, 8],
                )  # fmt: skip
                print(table(result), flush=True)
        FusedSparseMoeBlock.basis_in_front = True
    print("PREDICTOR CHECK:", "passed" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
