"""GPU check of the Engine (not a test; run on the H200): correctness of the CUDA decode paths, then `bench`.

1. Tiny random checkpoints of each family (float32 on CUDA): localmoe greedy tokens at sparsity 0 with the CUDA
   graph equal transformers `generate`; after set_sparsity(0.5) the graph is captured again and used (column
   graph@0.5: False when the engine fell back to eager, whose notice shows under notes) and its tokens equal eager
   tokens; realised sparsity on the Triton path within 3 points of the target. Column fused: the decode modules
   installed (localmoe/decode/replacements.py), "+text" when the whole text model is fused (Qwen3.5, Qwen3-MoE,
   OLMoE, Mixtral, GraniteMoE).
2. `localmoe bench --shape S --baseline transformers` (random bf16 weights at the real shapes) for each `--shape`
   (default qwen3.5-35b; qwen3-30b for Qwen3-30B-A3B).
Usage: PYTHONUNBUFFERED=1 python bench/gpu_engine_check.py [--skip-bench] [--shape qwen3.5-35b --shape qwen3-30b]
"""

import os
import sys
import tempfile
from pathlib import Path

root = Path(tempfile.mkdtemp())
os.environ.update(HF_HUB_CACHE=str(root / "hub"), HF_HUB_OFFLINE="1", XDG_CACHE_HOME=str(root / "xdg"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import tiny_models  # noqa: E402
import torch  # noqa: E402

from localmoe.decode import replacements  # noqa: E402
from localmoe.decode.text_model import FusedTextModel  # noqa: E402
from localmoe.engine.engine import Engine  # noqa: E402
from localmoe.events import GenerationSettings  # noqa: E402

shapes = [sys.argv[i + 1] for i, a in enumerate(sys.argv[:-1]) if a == "--shape"] or ["qwen3.5-35b"]

rows = []
for fam in tiny_models.SUPPORTED:
    repo = f"{tiny_models.ORG}/tiny-{fam}"
    try:
        folder = tiny_models.save_checkpoint(fam, root / "src" / fam)
        snap = tiny_models.place_in_hf_cache(folder, root / "hub", repo)
        e = Engine.load(repo, device="cuda", dtype="float32", sparsity=0.0)
        notes = []
        e.on_notice = notes.append
        ids = e.encode_raw("Sparse experts skip most neurons.")
        s = GenerationSettings(max_new_tokens=24)
        graph0 = [ev.token_id for ev in e.generate(ids, s)]
        used_graph = e._graph is not None
        text = any(isinstance(m, FusedTextModel) for m in e.model.modules())
        fused = f"{replacements.installed(e.model)}{'+text' if text else ''}"
        from transformers import AutoModelForCausalLM

        kw = {}
        if fam == "gpt_oss":  # transformers' MXFP4 kernels (a hub download) are not here: its dequantized experts
            from transformers import Mxfp4Config

            kw["quantization_config"] = Mxfp4Config(dequantize=True)
        ref_model = AutoModelForCausalLM.from_pretrained(snap, dtype=torch.float32, **kw).cuda()
        for t in (*ref_model.parameters(), *ref_model.buffers()):  # CUDA: its MXFP4 experts dequantize to bf16
            if t.is_floating_point():
                t.data = t.data.float()
        x = torch.tensor([ids], device="cuda")
        out = ref_model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=24)[
            0, len(ids) :
        ].tolist()
        ref = out[: out.index(3)] if 3 in out else out
        del ref_model
        e.set_sparsity(0.5)
        g5 = [ev.token_id for ev in e.generate(ids, s)]
        graph5 = e.use_graphs and e._graph is not None and e._graph.graph is not None  # recaptured, not eager
        real_g = e.stats.sparsity_realized
        e.use_graphs = False
        e._drop_graph()
        eager5 = [ev.token_id for ev in e.generate(ids, s)]
        real_e = e.stats.sparsity_realized
        real = f"{real_g:.3f}/{real_e:.3f}"
        rows.append((fam, used_graph, graph0 == ref, graph5, g5 == eager5, real, fused, "; ".join(notes)[:80]))
    except Exception as ex:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        rows.append((fam, "-", "ERROR", "-", "-", "-", "-", f"{type(ex).__name__}: {ex}"[:120]))
print("\nfamily        graph  s0==transformers  graph@0.5  graph==eager@0.5  realised(graph/eager)  fused    notes")
for r in rows:
    print(f"{r[0]:<13} {str(r[1]):<6} {str(r[2]):<17} {str(r[3]):<10} {str(r[4]):<17} {r[5]:<22} {r[6]:<8} {r[7]}")
sys.stdout.flush()

if "--skip-bench" not in sys.argv:
    from localmoe.measure.benchmark import bench, table

    for shape in shapes:
        res = bench(
            None,
            shape=shape,
            sparsities=[0.0, 0.85],
            device="cuda",
            dtype="bfloat16",
            baseline="transformers",
            progress=lambda st, d, t: print(f"  {st} {d}/{t}", flush=True) if st.startswith("note") else None,
        )
        print(table(res))
        out = os.environ.get("OUT")
        if out:
            import json

            name = "bench_qwen35.json" if shape == "qwen3.5-35b" else f"bench_{shape}.json"
            Path(out, name).write_text(json.dumps(res, indent=1))
