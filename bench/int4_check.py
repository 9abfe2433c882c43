"""GPU check of `--experts int4` (not a test; run on the H200): tokens first, then speed at the real shapes.

1. Tiny random checkpoints of each family, float32 on CUDA: the int4 engine's CUDA-graph greedy tokens equal those of
   the same model with the dequantized experts (its graph) at sparsity 0 and 0.5, and equal its own eager tokens at
   0.5; realised sparsity on both.
2. `--bench resident`: `localmoe bench --shape qwen3.5-35b --experts int4` at 0 and 85% (all experts in VRAM; the
   full-precision figures are `gpu_engine_check.py`'s).
   `--bench vram24`: both formats at 85% under `--vram 24` (a 24 GB card): int4 keeps every expert in VRAM, full
   offloads them behind the expert cache. `--bench vram16` (a 16 GB card): both offload.
   The tiny check also runs the int4 engine offloaded (a third of the experts in VRAM, direct misses).
Usage: PYTHONUNBUFFERED=1 python bench/int4_check.py [--skip-tiny] [--bench resident|vram24]
"""

import gc
import json
import os
import sys
import tempfile
from pathlib import Path

root = Path(tempfile.mkdtemp())
os.environ.update(HF_HUB_CACHE=str(root / "hub"), HF_HUB_OFFLINE="1", XDG_CACHE_HOME=str(root / "xdg"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import tiny_models  # noqa: E402
import torch  # noqa: E402

from localmoe.engine.engine import Engine  # noqa: E402
from localmoe.events import GenerationSettings  # noqa: E402
from localmoe.experts.expert_weights import ExpertWeights  # noqa: E402


def tokens(e, ids, s):
    return [ev.token_id for ev in e.generate(ids, s)]


def tiny() -> None:
    rows = []
    for fam in tiny_models.SUPPORTED:
        repo = f"{tiny_models.ORG}/tiny-{fam}"
        try:
            folder = tiny_models.save_checkpoint(fam, root / "src" / fam)
            tiny_models.place_in_hf_cache(folder, root / "hub", repo)
            e4 = Engine.load(repo, device="cuda", dtype="float32", sparsity=0.0, experts="int4")
            ref = Engine.load(repo, device="cuda", dtype="float32", sparsity=0.0)
            for a, b in zip(e4.loaded.experts, ref.loaded.experts):
                w = a.weights
                b.weights = ExpertWeights(*(t.dequantize(torch.float32) for t in (w.w_gate, w.w_up, w.w_down_t)))
            ids = e4.encode_raw("Sparse experts skip most neurons.")
            s = GenerationSettings(max_new_tokens=24)
            same0 = tokens(e4, ids, s) == tokens(ref, ids, s)
            graph = e4._graph is not None
            e4.set_sparsity(0.5)
            ref.set_sparsity(0.5)
            g5 = tokens(e4, ids, s)
            real = e4.stats.sparsity_realized
            same5 = g5 == tokens(ref, ids, s)
            e4.use_graphs, e4._graph = False, None
            eager5 = tokens(e4, ids, s)
            ratio = ref.loaded.expert_bytes() / e4.loaded.expert_bytes()
            # int4 offloaded behind the expert cache (direct misses: the kernel reads absent int4 rows from pinned
            # host memory inside the graph), a budget with room for ~1/3 of the experts
            plan = Engine.load(
                repo, device="cuda", dtype="float32", sparsity=0.0, experts="int4", vram_gib=64.0
            ).loaded.offload
            fixed = plan.non_expert_bytes + plan.state_bytes + (1 << 29)
            vram = (fixed + (plan.total_experts // 3) * plan.expert_bytes) / 2**30
            off = Engine.load(repo, device="cuda", dtype="float32", sparsity=0.5, experts="int4", vram_gib=vram)
            e4.use_graphs = True
            same_off = tokens(off, ids, s) == tokens(e4, ids, s)
            cache = off.loaded.cache
            offload = f"{same_off} ({cache.mode}, {off.stats.cache_hit_rate:.0%} hits, graph {off._graph is not None})"
            rows.append(
                (
                    fam,
                    graph,
                    same0,
                    same5,
                    g5 == eager5,
                    f"{real:.3f}/{e4.stats.sparsity_realized:.3f}",
                    f"{ratio:.2f}x",
                    offload,
                )
            )
        except Exception as ex:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            rows.append((fam, "-", "ERROR", "-", "-", "-", f"{type(ex).__name__}: {ex}"[:100], "-"))
    print(
        "\nfamily        graph  int4==dequant@0  int4==dequant@0.5  graph==eager@0.5  realised(g/e)  smaller  "
        "offloaded==resident@0.5"
    )
    for r in rows:
        print(f"{r[0]:<13} {str(r[1]):<6} {str(r[2]):<16} {str(r[3]):<18} {str(r[4]):<17} {r[5]:<14} {r[6]:<8} {r[7]}")
    sys.stdout.flush()


def bench_formats(formats, sparsities, vram) -> None:
    from localmoe.measure.benchmark import bench, table

    def note(st, d, t):
        if st.startswith("note"):
            print(f"  {st}", flush=True)

    for fmt in formats:
        res = bench(
            None,
            shape="qwen3.5-35b",
            sparsities=sparsities,
            device="cuda",
            dtype="bfloat16",
            vram_gib=vram,
            experts=fmt,
            progress=note,
        )
        print(table(res), flush=True)
        out = os.environ.get("OUT")
        if out:
            Path(out, f"bench_{fmt}_{vram or 'resident'}.json").write_text(json.dumps(res, indent=1))
        gc.collect()
        torch.cuda.empty_cache()


if "--skip-tiny" not in sys.argv:
    tiny()
if "--bench" in sys.argv:
    mode = sys.argv[sys.argv.index("--bench") + 1]
    if mode == "resident":
        bench_formats(["int4"], [0.0, 0.85], None)
    elif mode == "vram16":
        bench_formats(["int4", "full"], [0.85], 16.0)
    else:
        bench_formats(["int4", "full"], [0.85], 24.0)
