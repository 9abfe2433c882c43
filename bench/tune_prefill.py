"""Launch-parameter sweep of the prefill's grouped GEMMs at a registry model's shapes (GPU, not a test; default
Qwen3.5-35B-A3B), bf16 experts and int4 experts read in place.

One prompt piece's MoE layer as the dense path runs it (`DensePath._grouped_device`): --tokens tokens (2048) routed
uniformly at random to k of E experts, every expert in one span, `grouped_gate_up` (gate, up and the SwiGLU, each
slot's token row read in place) then `grouped_gemm` (the down projection), over the weights as stored: bf16 [E, I, H]
stacks, and `Int4Tensor` stacks read in place (kernels/grouped_gemm.py's module doc). Each launch is checked against
the default launch (relative error) and timed as a CUDA graph (`graph_timing.graph_us`, µs per call); the int4 rows
also time what reading in place replaces: `dequant_int4` of the three stacks (what a resident int4 layer's span
costs first). Prints the best launch per kernel and format and the layer's totals, and writes
`$OUT/prefill_params.json` ({"decode_params": {"grouped_gate_up" | "grouped_gemm": {shape: kwargs}}}: the keys the
dense path looks up, `K{K}_N{N}` with `_int4` for int4) to merge into kernels/tuned/<device>.json. A launch that does
not beat the default gets no entry.

Usage: PYTHONUNBUFFERED=1 python bench/tune_prefill.py [--shape ALIAS] [--tokens 2048] [--quick]
`--quick` sweeps 12 launches a kernel instead of 24 (4 warps only).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path

import torch
from graph_timing import graph_us

from localmoe.kernels.dequant_int4 import dequant_int4
from localmoe.kernels.grouped_gate_up import grouped_gate_up
from localmoe.kernels.grouped_gemm import grouped_gemm
from localmoe.kernels.int4 import Int4Tensor, quantize
from localmoe.kernels.slot_sort import slot_sort
from localmoe.models.shapes import shape_config

DEV, DT = torch.device("cuda"), torch.bfloat16
# int4 in place loads BLOCK_K / 2 bytes of each gate / up row a step: 64 fill a 32-byte sector, 32 half of one
SPACE = {"BLOCK_M": (64, 128), "BLOCK_N": (64, 128), "BLOCK_K": (32, 64, 128), "num_warps": (4, 8), "num_stages": (3,)}
QUICK = {"BLOCK_M": (64, 128), "BLOCK_N": (64, 128), "BLOCK_K": (32, 64, 128), "num_warps": (4,), "num_stages": (3,)}


def layer(shape: str, tokens: int):
    """(E, k, H, I, x [T, H], the sorted slots' tokens, group ends, bf16 stacks, int4 stacks) of one random layer."""
    cfg = shape_config(shape)
    cfg = getattr(cfg, "text_config", None) or cfg
    E = next(getattr(cfg, a) for a in ("num_experts", "num_local_experts", "n_routed_experts") if getattr(cfg, a, None))
    k, H = cfg.num_experts_per_tok, cfg.hidden_size
    I = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    g = torch.Generator(device=DEV).manual_seed(0)
    idx = torch.rand(tokens, E, device=DEV, generator=g).topk(k, -1).indices
    _, tok, _, ends = slot_sort(idx, E)
    x = torch.randn(tokens, H, device=DEV, generator=g).to(DT)
    plain = [(torch.randn(E, I, H, device=DEV, generator=g) / H**0.5).to(DT) for _ in range(3)]
    int4 = [Int4Tensor(*quantize(w).parts(), DT) for w in plain]
    return E, k, H, I, x, tok, ends, plain, int4


def sweep(name, key, call, check, space):
    """(default µs, [(µs, kwargs, relative error)] fastest first) of `call(kw)` over `space`."""
    default_us = graph_us([lambda: call({})])
    want = check({})
    rows = []
    for combo in itertools.product(*space.values()):
        kw = dict(zip(space, combo))
        try:
            err = float((check(kw).float() - want.float()).norm() / want.float().norm())
            us = graph_us([lambda kw=kw: call(kw)])
        except Exception as e:  # noqa: BLE001 - a launch that does not compile or fit is skipped
            print(f"  {name} {key} {kw}: failed ({type(e).__name__}: {str(e)[:80]})", flush=True)
            continue
        rows.append((us, kw, err))
        print(f"  {name} {key} {kw}: {us:.1f} µs (err {err:.1e})", flush=True)
    rows.sort(key=lambda r: r[0])
    return default_us, rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3.5-35b")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    space = QUICK if a.quick else SPACE
    E, k, H, I, x, tok, ends, plain, int4 = layer(a.shape, a.tokens)
    M = a.tokens * k
    h = torch.empty(M, I, device=DEV, dtype=DT)
    y = torch.empty(M, H, device=DEV, dtype=DT)
    print(f"{a.shape}: a {a.tokens}-token layer, E {E}, k {k}, H {H}, I {I}, {torch.cuda.get_device_name()}")
    results = []
    for fmt, (wg, wu, wd) in (("bf16", plain), ("int4", int4)):
        w4 = "_int4" if fmt == "int4" else ""
        down = wd if w4 else wd.transpose(1, 2)

        def gate_up(kw, wg=wg, wu=wu):
            return grouped_gate_up(x, wg, wu, ends, 0, h, x_rows=tok, **kw)

        def down_proj(kw, down=down):  # on h as the gate_up sweep left it (unchanged during this sweep)
            return grouped_gemm(h, down, ends, 0, y, **kw)

        for name, key, call in (
            ("grouped_gate_up", f"K{H}_N{I}{w4}", gate_up),
            ("grouped_gemm", f"K{I}_N{H}{w4}", down_proj),
        ):
            ok_space = {**space}
            if w4:  # int4 in place: two dots of >= 16 along the packed dim
                side = "BLOCK_K" if name == "grouped_gate_up" else "BLOCK_N"
                ok_space[side] = tuple(v for v in space[side] if v >= 32)
            default_us, rows = sweep(name, key, call, lambda kw, call=call: call(kw).clone(), ok_space)
            results.append((name, key, default_us, rows))
    bufs = [torch.empty(E, I, H, device=DEV, dtype=DT) for _ in range(3)]

    def dequantize():
        for w, b in zip(int4, bufs):
            dequant_int4(w.packed.view(-1, H // 2), w.scale.view(-1, w.scale.shape[-1]),
                         w.minimum.view(-1, w.minimum.shape[-1]), DT, out=b.view(-1, H))  # fmt: skip

    dq_us = graph_us([dequantize])
    print("\n| kernel | shape | default µs | best µs | best launch | rel diff vs default |")
    print("|---|---|---:|---:|---|---:|")
    out, best = {}, {}
    for name, key, default_us, rows in results:
        ok = [r for r in rows if r[2] < 1e-2]
        best[key] = min([default_us] + [r[0] for r in ok])
        if not ok or ok[0][0] >= default_us:
            print(f"| {name} | {key} | {default_us:.1f} | {ok[0][0] if ok else float('nan'):.1f} | default kept | |")
            continue
        us, kw, err = ok[0]
        print(f"| {name} | {key} | {default_us:.1f} | {us:.1f} | {kw} | {err:.1e} |")
        out.setdefault(name, {})[key] = kw
    plain_us = best[f"K{H}_N{I}"] + best[f"K{I}_N{H}"]
    int4_us = best[f"K{H}_N{I}_int4"] + best[f"K{I}_N{H}_int4"]
    first = dq_us + plain_us
    print(f"\nthe layer, best launches: bf16 {plain_us:.1f} µs; int4 dequantized first {dq_us:.1f} + {plain_us:.1f} = "
          f"{first:.1f} µs; int4 read in place {int4_us:.1f} µs ({first / int4_us:.2f}x)")  # fmt: skip
    o = os.environ.get("OUT")
    if o:
        Path(o, "prefill_params.json").write_text(json.dumps({"decode_params": out}, indent=1))


if __name__ == "__main__":
    main()
