"""The expert cache filled at load (`ExpertCache.place_experts`) against an empty one that decode fills 16 experts a
step (the behaviour before 315e174): one engine each, in one process (not a test; run on the H200).

For each mode, with random weights at --shape, `--experts int4 --vram 16` by default, sparsity 0.85: a 2048-token
prompt's time to first token right after load, then a 512-token prompt decoding 256 tokens (tok/s, hit rate, host
bytes a token), then three more 2048-token prompts (their TTFTs). Modes run in the order placed, empty, placed, so a
drift over the process shows.

Usage: PYTHONUNBUFFERED=1 python bench/cache_fill_ab.py [--shape qwen3.5-35b] [--experts int4] [--vram 16]
"""

import argparse
import statistics

import torch

from localmoe.engine.engine import Engine
from localmoe.events import GenerationSettings

p = argparse.ArgumentParser()
p.add_argument("--shape", default="qwen3.5-35b")
p.add_argument("--experts", default="int4")
p.add_argument("--vram", type=float, default=16)
a = p.parse_args()

for mode in ("placed", "empty", "placed"):
    e = Engine.random(
        a.shape, device=torch.device("cuda"), dtype=torch.bfloat16, vram_gib=a.vram, context=2113, experts=a.experts
    )
    e.set_sparsity(0.85)
    e.reuse_prompts = False
    cache = e.loaded.cache
    if mode == "empty":  # what the load left before place_experts: every up/down slot free
        cache.place_experts([])
    gen = torch.Generator().manual_seed(1)
    V = e.loaded.config.vocab_size

    def run(engine: Engine, n: int, new: int):
        prompt = torch.randint(0, V, (n,), generator=gen).tolist()
        for _ in engine.generate(prompt, GenerationSettings(max_new_tokens=new)):
            pass
        return engine.stats

    first = run(e, 2048, 1).ttft_s
    s = run(e, 512, 256)
    decode, hit, h2d = s.decode_tok_s, s.cache_hit_rate, s.h2d_bytes_per_token
    after = [run(e, 2048, 1).ttft_s for _ in range(3)]
    print(
        f"{mode:6s}: first 2048-token TTFT {first:.3f} s | decode {decode:.1f} tok/s, hits {hit:.0%}, "
        f"{h2d / 1e6:.0f} MB/token | then 2048-token TTFT median {statistics.median(after):.3f} s "
        f"{[round(x, 3) for x in after]}",
        flush=True,
    )
    del e, cache
    torch.cuda.empty_cache()
