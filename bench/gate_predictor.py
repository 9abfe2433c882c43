"""How well a department-shared low-rank gate predictor finds the kept neurons (issue: department loading for
pretrained MoEs). CPU, a trained model (localmoe-tiny by default); no GPU, no speed: recall and bytes only.

Per MoE layer, from the routed inputs of the calibration text (localmoe/data/calibration.txt, --calib tokens):
  * tau: the layer's threshold at --sparsity (quantile of |silu(x W_gate_e^T)| over routed (token, expert) pairs);
  * departments and fit: localmoe/experts/predictor.py's `fit_layer` (what `--departments N` loads):
    the E experts in N balanced groups, greedy by routing co-activation ("coact") or by the overlap of
    the experts' whitened gate row spaces ("rows");
    closed form: S = whitened inputs of the department (Sigma^1/2 from its routed inputs); the top-r right
    singular vectors V_r of the stacked [W_e Sigma^1/2] give the shared basis B_d = V_r^T Sigma^-1/2 [r, H]; each
    expert's C_e [I, r] is then refit by least squares on its own routed inputs (C_e = G Z^T (Z Z^T + lambda I)^-1,
    G = W_e X^T, Z = B_d X^T).
On the held-out text (localmoe/data/heldout.txt, --test tokens): the predicted |silu(C_e B_d x)| picks a candidate
fraction f of each expert's neurons (the layer's quantile); mass recall = share of the exact kept neurons' |act|
mass inside the candidates. Gate-side bytes per (token, expert), relative to reading the whole gate: B_d once per
department a token touches (shared by its experts there) + C_e (both int8 rows with an fp32 scale a row, as the
engine stores them) + the candidates' exact gate rows, the weights at --weight-bytes bytes an element (2: bf16).
Routed bytes relative to today's sparse path: (gate side + 2 (1 - sparsity)) / (1 + 2 (1 - sparsity)).

    python bench/gate_predictor.py [--model localmoe-tiny] [--ranks 8,16,32,64] [--departments 1,2,4,8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from localmoe.engine.engine import Engine  # noqa: E402
from localmoe.experts.local_experts import LocalExperts  # noqa: E402
from localmoe.experts.predictor import exact_and_predicted, fit_layer  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "localmoe" / "data"


def routed_inputs(engine, text: str, tokens: int):
    """{layer: (x [T, H] float64, top_k_index [T, k])} of each MoE layer's experts over `tokens` tokens of text."""
    ids = engine.encode_raw(text)[:tokens]
    mods = [m for m in engine.model.modules() if isinstance(m, LocalExperts)]
    got = {m.layer_idx: ([], []) for m in mods}

    def record(mod, args):  # returns None: the call's arguments are left as they are
        got[mod.layer_idx][0].append(args[0])
        got[mod.layer_idx][1].append(args[1])

    hooks = [m.register_forward_pre_hook(record) for m in mods]
    try:
        with torch.no_grad():
            for s in range(0, len(ids), 512):
                engine.model(input_ids=torch.tensor([ids[s : s + 512]]))
    finally:
        for h in hooks:
            h.remove()
    return {i: (torch.cat(x).double(), torch.cat(k)) for i, (x, k) in got.items()}, mods


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="localmoe-tiny")
    ap.add_argument("--sparsity", type=float, default=0.85)
    ap.add_argument("--ranks", default="8,16,32,64")
    ap.add_argument("--departments", default="1,2,4,8")
    ap.add_argument("--fractions", default="0.2,0.3,0.4")
    ap.add_argument("--calib", type=int, default=8192)
    ap.add_argument("--test", type=int, default=8192)
    ap.add_argument("--weight-bytes", type=int, default=2)
    a = ap.parse_args()
    engine = Engine.load(a.model, device="cpu", dtype="float32", sparsity=0.0)
    calib, mods = routed_inputs(engine, (DATA / "calibration.txt").read_text(), a.calib)
    test, _ = routed_inputs(engine, (DATA / "heldout.txt").read_text(), a.test)
    keep = 1.0 - a.sparsity
    ranks = [int(r) for r in a.ranks.split(",")]
    fractions = [float(f) for f in a.fractions.split(",")]
    rows = {}  # (grouping, N, r, f) -> [recall per layer], gate-side bytes per layer
    for m in mods:
        L = m.layer_idx
        wg = m.weights.w_gate.double()  # [E, I, H]
        E, I, H = wg.shape
        x, idx = calib[L]
        xt, idt = test[L]
        acts = torch.cat([torch.nn.functional.silu(x[(idx == e).any(1)] @ wg[e].T).abs().reshape(-1) for e in range(E)])
        tau = torch.quantile(acts[: 1 << 24].float(), a.sparsity).item()
        for kind in ("coact", "rows"):
            for N in (int(v) for v in a.departments.split(",")):
                if E % N:
                    continue
                for r in ranks:
                    if r > H:
                        continue
                    B, C, dept_of = fit_layer(wg, x, idx, N, r, kind)  # localmoe/experts/predictor.py
                    ex, pr, _ = exact_and_predicted(wg, xt, idt, B, C, dept_of, torch.nn.functional.silu)
                    kept = ex >= tau
                    mass = (ex * kept).sum()
                    # departments a token touches per routed expert (B_d is read once per department per token)
                    per_tok = torch.tensor([len(set(dept_of[row].tolist())) for row in idt]).double().mean()
                    share_b = float(per_tok) / idt.shape[1]
                    for f in fractions:
                        cut = torch.quantile(pr.reshape(-1)[: 1 << 24].float(), 1.0 - f).item()
                        recall = float((ex * kept * (pr >= cut)).sum() / mass)
                        maps = share_b * (r * H + 4 * r) + I * r + 6 * I  # int8 rows, fp32 scales, fp16 thresholds
                        gate_side = maps / (I * H * a.weight_bytes) + f
                        key = (kind, N, r, f)
                        rows.setdefault(key, []).append((recall, gate_side))
    print(f"{a.model}: sparsity {a.sparsity:.0%}, calibration {a.calib} tokens, held-out {a.test} tokens")
    print("grouping  N   rank  cand.  mass recall (min layer)  gate-side bytes  routed bytes vs today")
    for (kind, N, r, f), vals in sorted(rows.items()):
        rec = sum(v[0] for v in vals) / len(vals)
        low = min(v[0] for v in vals)
        gate = sum(v[1] for v in vals) / len(vals)
        routed = (gate + 2 * keep) / (1 + 2 * keep)
        print(f"{kind:<8} {N:>2} {r:>6} {f:>6.0%} {rec:>12.1%} ({low:.1%}) {gate:>15.2f} {routed:>15.2f}")


if __name__ == "__main__":
    main()
