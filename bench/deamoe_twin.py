"""DeaMoE against the vanilla MoE of equal parameters and FLOPs, on the GPU (not a test).

Two parts, each printing a table and writing JSON under --out:

  layer   one MoE layer's routed experts alone, CUDA-graph timed: Qwen3.5-35B-A3B's (256 experts of width 512,
          top-8) against its DeaMoE twin's (48 departments x 20 experts of width 768, top-8 within 4
          departments), for steps of 1 and 4 tokens (a 4-token step is a prompt piece, or several decode tokens at
          once: department weights are read once for all its tokens) at sparsity 0 and 85%. Bytes: what the step
          must read given its routing (the union of experts or departments the tokens touch), averaged over the
          replayed steps. 6 layers of distinct weights per graph so L2 holds none of them.
  engine  `localmoe bench --shape` rows for a pair of shapes in one process: qwen3.5-35b and qwen3.5-35b-deamoe
          (or deamoe-7b-vanilla and deamoe-7b with --pair 7b) at --vram (resident when absent).

    PYTHONUNBUFFERED=1 python bench/deamoe_twin.py layer --out $OUT [--z 0,0.5] [--launch two,one]
                                                                 # --z: tau_z rows at 85%; --launch: kernel modes
    PYTHONUNBUFFERED=1 python bench/deamoe_twin.py tune --out $OUT    # department_experts' launch keywords
    PYTHONUNBUFFERED=1 python bench/deamoe_twin.py engine --vram 12 --sparsity 0.85 --out $OUT [--engine-z 0,0.5]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from localmoe.experts.departments import (  # noqa: E402
    DepartmentExperts,
    group_limited_topk,
    launch_keywords,
    step_slots,
)
from localmoe.experts.expert_weights import ExpertWeights  # noqa: E402
from localmoe.experts.local_experts import LocalExperts  # noqa: E402
from localmoe.measure.benchmark import bench, table  # noqa: E402

H, LAYERS = 2048, 6
VANILLA = dict(E=256, I=512, k=8)
TWIN = dict(D=48, n=20, h=768, k=8, g=4)
PAIRS = {"35b": ("qwen3.5-35b", "qwen3.5-35b-deamoe"), "7b": ("deamoe-7b-vanilla", "deamoe-7b")}


def _randn(*shape, gen):
    return torch.empty(shape, dtype=torch.bfloat16, device="cuda").normal_(0.0, 0.02, generator=gen)


def vanilla_layers(gen):
    mods = []
    for i in range(LAYERS):
        m = LocalExperts(VANILLA["E"], H, VANILLA["I"], "silu", i)
        shape = (VANILLA["E"], VANILLA["I"], H)
        m.weights = ExpertWeights(_randn(*shape, gen=gen), _randn(*shape, gen=gen), _randn(*shape, gen=gen))
        mods.append(m)
    return mods


def twin_layers(gen):
    mods = []
    for i in range(LAYERS):
        D, n, h = TWIN["D"], TWIN["n"], TWIN["h"]
        m = DepartmentExperts(D, n, H, h, i).to(device="cuda", dtype=torch.bfloat16).eval()  # eval: decode path
        with torch.no_grad():
            for p in (m.gate_proj, m.up_proj, m.down_t, m.private):
                p.copy_(_randn(*p.shape, gen=gen))
        m.slots = min(TWIN["k"], TWIN["g"], D)
        mods.append(m)
    return mods


def routing(kind: str, T: int, steps: int, gen):
    """(index [steps, T, k], weights [steps, T, k]) from random router probabilities."""
    E = VANILLA["E"] if kind == "vanilla" else TWIN["D"] * TWIN["n"]
    k = VANILLA["k"] if kind == "vanilla" else TWIN["k"]
    probs = torch.softmax(torch.randn(steps * T, E, device="cuda", generator=gen), -1)
    if kind == "vanilla":
        w, idx = probs.topk(k, -1)
    else:
        idx, w = group_limited_topk(probs, TWIN["n"], k, TWIN["g"])
    w = (w / w.sum(-1, keepdim=True)).to(torch.bfloat16)
    return idx.view(steps, T, k), w.view(steps, T, k)


def step_bytes(kind: str, idx: torch.Tensor, sparsity: float, z_sparsity: float = 0.0) -> float:
    """Bytes a step must read, averaged over steps: the union of experts (vanilla: gate whole, up/down rows kept)
    or departments (gate whole, up rows kept, down rows of kept z entries) plus chosen private parts (rows kept)
    the step's tokens touch."""
    keep = 1.0 - sparsity
    out = []
    for s in range(idx.shape[0]):
        chosen = idx[s].reshape(-1).unique()
        if kind == "vanilla":
            out.append(len(chosen) * VANILLA["I"] * H * 2 * (1 + 2 * keep))
        else:
            depts = (chosen // TWIN["n"]).unique()
            h = TWIN["h"]
            down = 1.0 - z_sparsity
            out.append(len(depts) * h * H * 2 * (1 + down + keep) + len(chosen) * h * h * 2 * keep)
    return sum(out) / len(out)


def set_tau(mods, sparsity: float, x: torch.Tensor) -> None:
    """A per-layer threshold at the `sparsity` quantile of |silu(x W_gate^T)| over all experts / departments."""
    for m in mods:
        if sparsity == 0:
            m.sparse_enabled, m.tau = False, None
            continue
        w = m.weights.w_gate if isinstance(m, LocalExperts) else m.gate_proj
        a = torch.nn.functional.silu(torch.einsum("th,eih->tei", x.float(), w[:16].float())).abs()
        tau = torch.quantile(a.reshape(-1)[: 1 << 24], sparsity).item()
        m.tau = torch.full((m.tau_groups,), tau, dtype=torch.float32, device="cuda")
        m.sparse_enabled = True


def set_tau_z(mods, z_sparsity: float, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> None:
    """DeaMoE: a per-layer tau_z at the `z_sparsity` quantile of |z| (the private parts' weighted sum, the down
    projection's input) over one step's departments, after tau (the kernels' reference computes z)."""
    for m in mods:
        m.tau_z = None
        if z_sparsity == 0:
            continue
        dept, ws = step_slots(idx, w, m.per_department, min(m.num_departments, idx.shape[0] * m.slots))
        zs = []
        for s, d in enumerate(dept.tolist()):
            for t in range(idx.shape[0]) if d >= 0 else ():
                a = torch.nn.functional.silu(m.gate_proj[d].float() @ x[t].float())
                if m.sparse_enabled:
                    a = a * (a.abs() >= m.tau[d])
                u = a * (m.up_proj[d].float() @ x[t].float())
                z = sum(ws[s, t, j] * (u @ m.private[d, j].float()) for j in range(m.per_department) if ws[s, t, j])
                if isinstance(z, torch.Tensor):
                    zs.append(z.abs())
        tz = torch.quantile(torch.cat(zs), z_sparsity).item()
        m.tau_z = torch.full((m.tau_groups,), tz, dtype=torch.float32, device="cuda")


def time_layers(mods, kind: str, T: int, sparsity: float, gen, steps: int = 24, z_sparsity: float = 0.0):
    for m in mods:
        m.max_sparse_tokens = max(T, 1)
    xs = torch.randn(steps, T, H, device="cuda", generator=gen, dtype=torch.bfloat16)
    set_tau(mods, sparsity, xs[0])
    idx, w = routing(kind, T, steps, gen)
    if kind == "deamoe":
        set_tau_z(mods, z_sparsity, xs[0], idx[0], w[0].float())
    x_in, i_in, w_in = xs[0].clone(), idx[0].clone(), w[0].clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            for m in mods:
                m(x_in, i_in, w_in)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for m in mods:
            m(x_in, i_in, w_in)
    times = []
    for s in range(steps):
        x_in.copy_(xs[s])
        i_in.copy_(idx[s])
        w_in.copy_(w[s])
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / len(mods))
    times.sort()
    return times[len(times) // 2], step_bytes(kind, idx, sparsity, z_sparsity)


def layer_part(out: Path, z_sparsities: list[float], launches: list[str]) -> None:
    """`launches`: the DeaMoE kernel's launch modes to time ("two": up/private then down, "one": ONE_LAUNCH)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for kind, make in (("vanilla", vanilla_layers), ("deamoe", twin_layers)):
        mods = make(gen)
        for T in (1, 4):
            for sp in (0.0, 0.85):
                for zs, mode in [
                    (zs, mode)
                    for zs in (z_sparsities if kind == "deamoe" and sp > 0 else (0.0,))
                    for mode in (launches if kind == "deamoe" else ("two",))
                ]:
                    for m in mods if kind == "deamoe" else ():
                        x1 = torch.empty(T, H, device="cuda")
                        m.launch = {**launch_keywords(x1, m.width, m.per_department), "ONE_LAUNCH": mode == "one"}
                    us, nbytes = time_layers(mods, kind, T, sp, gen, z_sparsity=zs)
                    name = (kind if zs == 0 else f"{kind} z{zs:.0%}") + (" 1L" if mode == "one" else "")
                    rows.append(dict(layer=name, tokens=T, sparsity=sp, us=us, mb=nbytes / 1e6, gb_s=nbytes / us / 1e3))
                    r = rows[-1]
                    print(
                        f"{name:<12} T={T} sparsity {sp:>4.0%}  {us:8.1f} µs/layer  {r['mb']:7.1f} MB  "
                        f"{r['gb_s']:6.0f} GB/s"
                    )
        del mods
        gc.collect()
        torch.cuda.empty_cache()
    print("\nlayer        tokens  sparsity  µs/layer  MB/step  GB/s   (deamoe / vanilla time)")
    for r in rows:
        base = next(
            v["us"]
            for v in rows
            if v["layer"] == "vanilla" and v["tokens"] == r["tokens"] and v["sparsity"] == r["sparsity"]
        )
        print(
            f"{r['layer']:<12} {r['tokens']:>6} {r['sparsity']:>9.0%} {r['us']:>9.1f} {r['mb']:>8.1f} {r['gb_s']:>5.0f}"
            f"   {r['us'] / base:.2f}x"
        )
    (out / "deamoe_layer.json").write_text(json.dumps(rows, indent=1))


TUNE = (
    ("BLOCK_N", (4, 16)),
    ("BLOCK_Z", (256, 512)),
    ("BLOCK_O", (64, 256)),
    ("SPLIT_ROWS", (48, 192)),
    ("BLOCK_I", (32,)),
    ("ONE_ROWS", (64, 256)),  # one token: the one launch's W_down rows a down program (default 128)
    ("num_warps", (8,)),
)


def tune_part(out: Path) -> None:
    """Coordinate descent over department_experts' launch keywords at the twin's shape (T = 1 and 4, 85%), from the
    launcher's defaults: a value is kept when it is 2% faster. Writes the winners to $OUT/department_tuned.json (keys
    "H{H}_h{h}_n{n}_T{T}" of decode_params' "department_experts", read by experts/departments.launch_keywords: merge
    them into the device's kernels/tuned/ table)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    mods = twin_layers(gen)
    found = {}
    for T in (1, 4):

        def measure(cfg):
            for m in mods:
                m.launch = cfg
            return time_layers(mods, "deamoe", T, 0.85, gen)[0]

        cfg, best = {}, measure({})
        print(f"T={T} defaults {best:.1f} µs/layer")
        for name, values in TUNE:
            for v in values:
                us = measure({**cfg, name: v})
                print(f"T={T} {name}={v} {us:.1f} µs/layer")
                if us < 0.98 * best:
                    cfg, best = {**cfg, name: v}, us
        found[f"H{H}_h{TWIN['h']}_n{TWIN['n']}_T{T}"] = cfg
        print(f"T={T} chosen {cfg} {best:.1f} µs/layer")
    for m in mods:
        m.launch = None
    (out / "department_tuned.json").write_text(json.dumps(found, indent=1))


def engine_part(
    out: Path, pair: str, vram: float | None, sparsities: list[float], prompt: int, decode: int, zs: list[float]
) -> None:
    """The vanilla shape, then the DeaMoE one at each z sparsity in `zs` (a fresh engine each)."""
    results = []
    for shape, z in [(PAIRS[pair][0], 0.0)] + [(PAIRS[pair][1], z) for z in zs]:
        res = bench(
            None,
            shape=shape,
            sparsities=sparsities,
            device="cuda",
            dtype="bfloat16",
            prompt_tokens=prompt,
            decode_tokens=decode,
            vram_gib=vram,
            z_sparsity=z,
        )
        print(table(res), flush=True)
        results.append(res)
        gc.collect()
        torch.cuda.empty_cache()
    base = {r["sparsity"]: r for r in results[0]["rows"]}
    print(f"\n{PAIRS[pair][1]} / {PAIRS[pair][0]} decode tok/s at --vram {vram or 'resident'}:")
    for z, res in zip(zs, results[1:]):
        twin = {r["sparsity"]: r for r in res["rows"]}
        for s in sparsities:
            if s in base and s in twin:
                zt = f", z sparsity {z:.0%}" if z and s else ""
                print(f"  sparsity {s:.0%}{zt}: {twin[s]['decode_tok_s'] / base[s]['decode_tok_s']:.2f}x")
    name = f"deamoe_engine_{pair}_{'resident' if vram is None else f'vram{vram:g}'}.json"
    (out / name).write_text(json.dumps(results, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=["layer", "tune", "engine"])
    ap.add_argument("--pair", choices=sorted(PAIRS), default="35b")
    ap.add_argument("--vram", type=float, default=None)
    ap.add_argument("--sparsity", default="0,0.85")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=Path("/tmp"))
    ap.add_argument("--z", default="0", help="layer: z sparsities (tau_z quantiles) for the DeaMoE rows at 85%%")
    ap.add_argument("--launch", default="two", help="layer: the DeaMoE kernel's launch modes, two,one (ONE_LAUNCH)")
    ap.add_argument("--engine-z", default="0", help="engine: the DeaMoE engine's z sparsities (one engine each)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.part == "layer":
        layer_part(a.out, [float(z) for z in a.z.split(",")], a.launch.split(","))
    elif a.part == "tune":
        tune_part(a.out)
    else:
        sp = [float(s) for s in a.sparsity.split(",")]
        zs = [float(z) for z in a.engine_z.split(",")]
        engine_part(a.out, a.pair, a.vram, sp, a.prompt_tokens, a.decode_tokens, zs)


if __name__ == "__main__":
    main()
