"""Loading int4 experts from a checkpoint at Qwen3.5-35B-A3B shapes (not a test; run on the H200).

A 4-layer text checkpoint with random bf16 weights at the real widths is saved to a local folder, then
`Engine.load(folder, experts=int4|full)`: load time, expert GiB, VRAM after the load and its peak during the load
(int4 quantizes expert by expert as it reads, so the peak stays near what it keeps), and a few greedy tokens.
`--tiny` runs the same at tiny widths on the CPU.
Usage: PYTHONUNBUFFERED=1 python bench/int4_load.py [--tiny]
"""

import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

import tiny_models  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from localmoe.engine.engine import Engine  # noqa: E402
from localmoe.events import GenerationSettings  # noqa: E402
from localmoe.models.shapes import shape_config  # noqa: E402

small = "--tiny" in sys.argv
cfg = shape_config("qwen3.5-35b")
if small:
    cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.num_experts = 64, 32, 32, 16
cfg.vocab_size = tiny_models.VOCAB  # the test suite's character tokenizer
cfg.num_hidden_layers = 4
cfg.layer_types = cfg.layer_types[:4]
dev = "cpu" if small else "cuda"
folder = pathlib.Path(tempfile.mkdtemp()) / "q35-4layers"
with torch.device(dev):
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
model.save_pretrained(folder)
tiny_models.char_tokenizer().save_pretrained(folder)
del model
print(f"saved {sum(f.stat().st_size for f in folder.iterdir()) / 1e9:.2f} GB", flush=True)
for fmt in ("int4", "full"):
    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    e = Engine.load(str(folder), device=dev, dtype="bfloat16", sparsity=0.0, experts=fmt)
    load_s = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else 0.0
    now = torch.cuda.memory_allocated() / 2**30 if dev == "cuda" else 0.0
    toks = [ev.token_id for ev in e.generate(e.encode_raw("hello there"), GenerationSettings(max_new_tokens=8))]
    print(
        f"{fmt}: load {load_s:.1f} s, experts {e.loaded.expert_bytes() / 2**30:.2f} GiB, VRAM after load "
        f"{now:.2f} GiB, peak during load {peak:.2f} GiB, tokens {toks}",
        flush=True,
    )
    del e
