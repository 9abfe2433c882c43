"""GPT-OSS's MXFP4 sparse decode kernel (`kernels/mxfp4_sparse.py`) at gpt-oss-20b / -120b expert shapes (GPU, not a
test): time, real bytes read and GB/s against the byte floor, over a few launch parameters.

Shapes: H 2880, I 2880, k 4; E 32 (20b) and 128 (120b). Random MXFP4 experts (uniform codes, scales 2**-7..2**-5 so
gate / up pre-activations are O(1)), bf16 biases, one bf16 token, per-expert thresholds at the 0 / 50 / 70 / 85 %
quantile of the token's own |act(gate)| (midway between two neighbours: the kept fraction is exact). Each launch is
first checked against `sparse_mxfp4_ref`, then timed as a CUDA graph of calls whose routed experts rotate over all E
(the expert bytes, >= 400 MB, never sit in L2; `graph_timing.graph_us`, median µs per call).

Bytes (what one call must read from memory): the gate codes + scales of its k experts, the kept up rows (codes,
scales, bias), the kept down rows' codes, the down scale rows of the 32-neuron groups holding a kept neuron (H bytes
each), the gate and down biases and x. GB/s = bytes / time; `floor` = bytes / the device's measured copy bandwidth
(a large D2D copy), `eff` = floor / time.

Launch parameters: BLOCK_I x num_warps, the pairs that compile without spills for sm_90 at these shapes (`--quick`,
~2 minutes on an H200; the full sweep adds three more). The table prints every candidate at 20b, the best 4 again at
120b; also the prefill's dequantizer (`dequant_mxfp4`, 8 experts) in GB/s. Figures: kernels/mxfp4_sparse.py's launch
note.

Usage: PYTHONUNBUFFERED=1 python bench/mxfp4_kernel.py [--quick] [--pairs BLOCK_I/WARPS[/FLAT],...] [--only-20b]
"""

from __future__ import annotations

import sys

import torch
from graph_timing import graph_us

from localmoe.kernels.mxfp4 import Mxfp4Tensor
from localmoe.kernels.mxfp4_dequant import dequant_mxfp4, dequant_mxfp4_ref
from localmoe.kernels.mxfp4_sparse import ALPHA, LIMIT, sparse_mxfp4, sparse_mxfp4_ref

DEV, DT = torch.device("cuda"), torch.bfloat16
H = I = 2880
K = 4
SPARSITIES = (0.0, 0.5, 0.7, 0.85, 1.0)  # 1.0: nothing kept (tau = inf): the gate pass alone
QUICK = "--quick" in sys.argv
PAIRS = [(4, 4), (8, 4), (8, 8), (16, 8)]  # BLOCK_I, num_warps: spill-free on sm_90
if not QUICK:
    PAIRS += [(4, 2), (16, 16), (32, 16), (32, 8), (8, 16)]
if "--pairs" in sys.argv:  # e.g. --pairs 4/4,2/1: these launches only
    PAIRS = [p for p in sys.argv[sys.argv.index("--pairs") + 1].split(",")]
ONLY_20B = "--only-20b" in sys.argv  # no 120b rows, no dequantizer


def experts(E: int, gen):
    def mx(along):
        b = torch.randint(0, 256, (E, I, H // 2), dtype=torch.uint8, device=DEV, generator=gen)
        shape = (E, I, H // 32) if along else (E, I // 32, H)
        s = torch.randint(120, 123, shape, dtype=torch.uint8, device=DEV, generator=gen)
        return Mxfp4Tensor(b, s, DT, along)

    w = (mx(True), mx(True), mx(False))
    b = [(torch.randn(E, n, device=DEV, generator=gen) * 0.3).to(DT) for n in (I, I, H)]
    return w, b


def act_abs(x, w_gate, b_gate) -> torch.Tensor:
    """|act(gate)| [E, I] of token x for every expert (fp32)."""
    rows = []
    for e in range(w_gate.shape[0]):
        z = dequant_mxfp4_ref(w_gate.blocks[e], w_gate.scales[e], True, torch.float32) @ x[0].float()
        g = (z + b_gate[e].float()).clamp(max=LIMIT)
        rows.append((g * torch.sigmoid(ALPHA * g)).abs())
    return torch.stack(rows)


def call_bytes(keep: torch.Tensor) -> int:
    """Bytes one call reads for its routed experts' keep masks [k, I]."""
    kept = int(keep.sum())
    groups = int(keep.view(keep.shape[0], I // 32, 32).any(-1).sum())  # down scale rows touched
    gate = keep.shape[0] * I * (H // 2 + H // 32 + 2)  # codes, scales, bias
    up = kept * (H // 2 + H // 32 + 2)
    down = kept * (H // 2) + groups * H + keep.shape[0] * H * 2  # codes, group scale rows, bias
    return gate + up + down + H * 2


def copy_gbs() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    us = graph_us([lambda: b.copy_(a)], warmup=5, rep=30)
    return 2 * a.numel() / us / 1e3


def run(E: int, space: list[dict], peak: float) -> list:
    gen = torch.Generator(device=DEV).manual_seed(E)
    (wg, wu, wd), (bg, bu, bd) = experts(E, gen)
    x = torch.randn(1, H, device=DEV, generator=gen).to(DT)
    a = act_abs(x, wg, bg)
    perm = torch.randperm(E, device=DEV, generator=gen)
    ids = [perm[i : i + K].view(1, K).to(torch.int32) for i in range(0, E, K)]  # every expert, K per call
    rw = torch.softmax(torch.randn(1, K, device=DEV, generator=gen), -1).to(DT)
    outs = [torch.empty(1, H, device=DEV, dtype=DT) for _ in ids]
    rows = []
    for s in SPARSITIES:
        v = a.sort(dim=1).values  # tau between two neighbours: rounding cannot flip a neuron
        m = max(1, int(s * I))
        edge = torch.full((E,), 0.0 if s == 0 else float("inf"), device=DEV)  # keep all / nothing
        tau = (v[:, m - 1] + v[:, m]) / 2 if 0 < s < 1 else edge
        nbytes = sum(call_bytes(a[i[0].long()] >= tau[i[0].long()].unsqueeze(-1)) for i in ids) / len(ids)
        y_ref, c_ref = sparse_mxfp4_ref(x, wg, wu, wd, bg, bu, bd, ids[0], rw, tau)
        for kw in space:
            try:
                y, c = sparse_mxfp4(x, wg, wu, wd, bg, bu, bd, ids[0], rw, tau, **kw)
                err = float((y.float() - y_ref).norm() / y_ref.norm())
                if err > 1e-4 or not torch.equal(c, c_ref):
                    print(f"  E{E} s{s} {kw}: WRONG (rel err {err:.1e}, counts {c.tolist()} vs {c_ref.tolist()})")
                    continue
                calls = [
                    lambda i=i, o=o, kw=kw: sparse_mxfp4(x, wg, wu, wd, bg, bu, bd, i, rw, tau, o, **kw)
                    for i, o in zip(ids, outs)
                ]
                us = graph_us(calls, warmup=10, rep=50)
            except Exception as exc:  # noqa: BLE001 - a launch that does not compile is reported and skipped
                print(f"  E{E} s{s} {kw}: failed {type(exc).__name__}: {str(exc)[:100]}")
                continue
            gbs = nbytes / us / 1e3
            rows.append((E, s, kw, us, nbytes, gbs, nbytes / peak / 1e3 / us))
            print(f"  E{E:<4d} sparsity {s:.2f} {str(kw):55s} {us:7.1f} µs {nbytes / 1e6:6.2f} MB {gbs:6.0f} GB/s "
                  f"eff {rows[-1][-1]:.2f}")  # fmt: skip
    return rows


def launch(pair) -> dict:
    """sparse_mxfp4's launch keywords of a (BLOCK_I, num_warps) pair or a "B/W" / "B/W/F" string (F: `flat`)."""
    if isinstance(pair, tuple):
        return dict(BLOCK_I=pair[0], num_warps=pair[1])
    b, w, *f = pair.split("/")
    return dict(BLOCK_I=int(b), num_warps=int(w)) | ({"flat": int(f[0])} if f else {})


def best(rows, n=4) -> list[dict]:
    """The n launches with the least total time over the sparsities."""
    tot = {}
    for _, _, kw, us, *_ in rows:
        tot[str(kw)] = (tot.get(str(kw), (0.0, kw))[0] + us, kw)
    return [kw for _, kw in sorted(tot.values(), key=lambda v: v[0])[:n]]


def main():
    peak = copy_gbs()
    print(f"device copy bandwidth: {peak:.0f} GB/s (the byte floor's ceiling)")
    space = [launch(p) for p in PAIRS]
    rows20 = run(32, space, peak)
    top = best(rows20)
    rows120 = [] if ONLY_20B else run(128, top, peak)
    print("\nbest launches at 20b (sum of µs over the sparsities):", top)
    print(f"{'model':6s} {'sparsity':>8s} {'launch':55s} {'µs':>7s} {'MB':>6s} {'GB/s':>6s} {'eff':>5s}")
    for E, s, kw, us, nb, gbs, eff in [r for r in rows20 if r[2] in top] + rows120:
        print(
            f"{'20b' if E == 32 else '120b':6s} {s:8.2f} {str(kw):55s} {us:7.1f} {nb / 1e6:6.2f} {gbs:6.0f} {eff:5.2f}"
        )
    if ONLY_20B:
        return
    # the prefill's dequantizer: 8 experts of gate (along rows) and down_t (across) into bf16
    gen = torch.Generator(device=DEV).manual_seed(1)
    (wg, _, wd), _ = experts(8, gen)
    for w in (wg, wd):
        out = torch.empty(8, I, H, device=DEV, dtype=DT)
        assert torch.equal(dequant_mxfp4(w.blocks, w.scales, w.along_rows, DT, out=out),
                           dequant_mxfp4_ref(w.blocks, w.scales, w.along_rows, DT))  # fmt: skip
        for br in (2, 4, 8):
            us = graph_us([lambda br=br: dequant_mxfp4(w.blocks, w.scales, w.along_rows, DT, out=out, BLOCK_R=br)])
            nb = w.nbytes() + out.numel() * 2
            print(f"dequant_mxfp4 along_rows={w.along_rows} BLOCK_R {br}: {us:7.1f} µs {nb / us / 1e3:6.0f} GB/s")


if __name__ == "__main__":
    main()
