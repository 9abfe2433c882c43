"""Batch-1 GEMV on the GPU: cuBLAS (F.linear) against localmoe's `kernels/gemv.py` over its launch space, at the
projection shapes of a Qwen3.5-35B-A3B decode step (GPU, not a test).

Shapes (N x K, bf16): lm_head 248320 x 2048, DeltaNet in_proj (4 projections in one buffer, the layer's input
RMSNorm inside as the engine calls it) 12352 x 2048, DeltaNet out_proj 2048 x 4096 (also the attention o_proj's
shape), attention q|k|v (gated q, one buffer, input norm inside) 9216 x 2048. Every launch is
checked against F.linear, then timed as a CUDA graph over rotating weight copies (>= 3 GB in all, so L2 never
holds them; `triton.testing.do_bench` median, µs per call). Prints µs and GB/s per shape, and writes the best
launch per shape to `$OUT/gemv_params.json` ({"decode_params": {"gemv": {"N{N}_K{K}": kwargs}}}).

`--shape ALIAS` (another registry model; default Qwen3.5-35B-A3B as above): lm_head, the attention's q|k|v (one
buffer, input norm inside; DeepSeek-V2: its MLA's q|kv_a GEMV) and o_proj at that model's widths.

Usage: PYTHONUNBUFFERED=1 python bench/gemv_sweep.py [--shape ALIAS] [--skip lm_head]
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import torch
from graph_timing import graph_us

from localmoe.kernels.gemv import gemv
from localmoe.models.shapes import shape_config

DEV, DT = torch.device("cuda"), torch.bfloat16
SHAPES = {
    "lm_head": (248320, 2048, False),
    "deltanet in_proj": (12352, 2048, True),
    "deltanet out_proj": (2048, 4096, False),
    "attn q|k|v": (9216, 2048, True),
}  # name: (N, K, input norm)
if "--shape" in sys.argv and sys.argv[sys.argv.index("--shape") + 1] != "qwen3.5-35b":
    c = shape_config(sys.argv[sys.argv.index("--shape") + 1])
    c = getattr(c, "text_config", None) or c
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    SHAPES = {
        "lm_head": (c.vocab_size, c.hidden_size, False),
        "attn q|k|v": ((c.num_attention_heads + 2 * kv) * hd, c.hidden_size, True),
        "attn o_proj": (c.hidden_size, c.num_attention_heads * hd, False),
    }
    if getattr(c, "kv_lora_rank", None):  # DeepSeek-V2's MLA: q (or q_a) | kv_a in one GEMV, o_proj from Hq·Dv
        rope = c.qk_rope_head_dim
        q_in = c.q_lora_rank or c.num_attention_heads * (c.qk_nope_head_dim + rope)
        del SHAPES["attn q|k|v"]
        SHAPES["mla q|kv_a"] = (q_in + c.kv_lora_rank + rope, c.hidden_size, True)
        SHAPES["attn o_proj"] = (c.hidden_size, c.num_attention_heads * c.v_head_dim, False)
SPACE = dict(BLOCK_N=[1, 2, 4, 8, 16], BLOCK_K=[None, 512], num_warps=[2, 4, 8])
SKIP = sys.argv[sys.argv.index("--skip") + 1].split(",") if "--skip" in sys.argv else []


best_params, rows = {}, []
for name, (N, K, with_norm) in SHAPES.items():
    if name in SKIP:
        continue
    nbytes = N * K * 2
    copies = max(2, min(24, (3 << 30) // nbytes))
    ws = [torch.randn(N, K, device=DEV, dtype=DT) * K**-0.5 for _ in range(copies)]
    x = torch.randn(1, K, device=DEV, dtype=DT)
    outs = [torch.empty(1, N, device=DEV, dtype=DT) for _ in ws]
    nw = (torch.randn(K, device=DEV) * 0.1).to(DT) if with_norm else None
    norm = {"norm_weight": nw, "eps": 1e-6} if with_norm else {}
    want = gemv(x, ws[0], **norm, BLOCK_N=2)
    lin = graph_us([lambda w=w, o=o: torch.matmul(x, w.T, out=o) for w, o in zip(ws, outs)], warmup=10, rep=60)
    best = (float("inf"), None)
    for combo in itertools.product(*SPACE.values()):
        kw = dict(zip(SPACE, combo))
        if kw["BLOCK_K"] is not None and (kw["BLOCK_K"] >= K or with_norm):
            continue
        try:
            got = gemv(x, ws[0], **norm, **kw)
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            if err > 2e-2:
                print(f"  {name} {kw}: WRONG (rel err {err:.1e})", flush=True)
                continue
            us = graph_us(
                [lambda w=w, o=o, kw=kw: gemv(x, w, o, **norm, **kw) for w, o in zip(ws, outs)], warmup=10, rep=60
            )
        except Exception as e:  # noqa: BLE001 - a launch that does not compile is skipped
            print(f"  {name} {kw}: failed {type(e).__name__}: {str(e)[:80]}", flush=True)
            continue
        if us < best[0]:
            best = (us, kw)
    rows.append((name, N, K, lin, nbytes / lin / 1e3, best[0], nbytes / best[0] / 1e3, best[1]))
    best_params[f"N{N}_K{K}"] = {k: v for k, v in best[1].items() if v is not None}
    print(f"  {name}: F.linear {lin:.1f} us, gemv {best[0]:.1f} us {best[1]}", flush=True)
    del ws, outs
    torch.cuda.empty_cache()

print("| shape | N x K | F.linear µs | GB/s | gemv µs | GB/s | best launch |")
print("|---|---|---:|---:|---:|---:|---|")
for name, N, K, lin, lbw, us, bw, kw in rows:
    print(f"| {name} | {N} x {K} | {lin:.1f} | {lbw:.0f} | {us:.1f} | {bw:.0f} | {kw} |")
if os.environ.get("OUT"):
    Path(os.environ["OUT"], "gemv_params.json").write_text(
        json.dumps({"decode_params": {"gemv": best_params}}, indent=1)
    )
