"""Does torch.compile before CUDA-graph capture cut the step's kernel count? (GPU, not a test)"""
import time, torch
from localmoe.benchmark import bench, table
t = time.time()
res = bench(None, shape="qwen3.5-35b", sparsities=[0.0, 0.85], device="cuda", dtype="bfloat16", decode_tokens=128,
            compile=True, progress=lambda s, d, n: print(s, flush=True) if s.startswith("note") else None)
print(table(res)); print(f"total {time.time() - t:.0f} s")
