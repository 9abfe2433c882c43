"""Would a second threshold, on z (what a DeaMoE department's down projection reads), cost accuracy? CPU, a trained
DeaMoE model (localmoe-tiny-deamoe by default); no GPU, no speed.

Today the decode path keeps neuron i of a department when |a_i| >= tau_u (a = silu(x W_gate_d^T)), and the down
projection reads W_down_d whole because z = sum_e g_e (u @ P_e) is dense. Here z's entries with |z_i| < tau_z are
dropped too (rows of W_down not read). Per layer, tau_u is the sparsity-s quantile of |a| and tau_z the q quantile
of |z| (computed with u's mask on) over the calibration text's (token, department) pairs; held-out perplexity is
scored teacher-forced with both masks on every position (a forward hook on each layer's experts computes the
layer's output with the masks: the same formulas as localmoe/experts/departments.py).

    python bench/deamoe_zthreshold.py [--model localmoe-tiny-deamoe] [--u 0.4,0.7,0.85] [--z 0,0.5,0.7,0.85]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from localmoe.engine.engine import Engine  # noqa: E402
from localmoe.experts.departments import DepartmentExperts  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "localmoe" / "data"


def layer_out(m: DepartmentExperts, x, idx, w, tau_u: float, tau_z: float, record=None):
    """The layer's output with both masks (tau 0: off); `record` collects (|a|, |z|) of every pair."""
    n, y = m.per_department, torch.zeros_like(x)
    dep = idx // n
    for d in dep.unique().tolist():
        rows = (dep == d).any(1)
        xs = x[rows].float()
        a = F.silu(xs @ m.gate_proj[d].float().T)
        a = a * (a.abs() >= tau_u)
        u = a * (xs @ m.up_proj[d].float().T)
        z = torch.zeros_like(u)
        for j in range(n):
            g = (w * (idx == d * n + j)).sum(1)[rows].float()
            if bool((g != 0).any()):
                z += g[:, None] * (u @ m.private[d, j].float())
        if record is not None:
            record.append((a.abs().reshape(-1), z.abs().reshape(-1)))
        z = z * (z.abs() >= tau_z)
        y[rows] += (z @ m.down_t[d].float()).to(x.dtype)
    return y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="localmoe-tiny-deamoe")
    ap.add_argument("--u", default="0.4,0.7,0.85")
    ap.add_argument("--z", default="0,0.5,0.7,0.85")
    ap.add_argument("--calib", type=int, default=2048)
    ap.add_argument("--test", type=int, default=8192)
    ap.add_argument("--window", type=int, default=256)
    a = ap.parse_args()
    engine = Engine.load(a.model, device="cpu", dtype="float32", sparsity=0.0)
    model = engine.model
    mods = [m for m in model.modules() if isinstance(m, DepartmentExperts)]
    state = {"tau": {}, "record": None}

    def hook(mod, args, out):
        x, idx, w = args
        tu, tz = state["tau"].get(mod.layer_idx, (0.0, 0.0))
        rec = state["record"][mod.layer_idx] if state["record"] is not None else None
        return layer_out(mod, x, idx, w, tu, tz, rec)

    handles = [m.register_forward_hook(hook) for m in mods]
    calib = engine.encode_raw((DATA / "calibration.txt").read_text())[: a.calib]
    test = engine.encode_raw((DATA / "heldout.txt").read_text())[: a.test]

    def run(ids, score: bool) -> float:
        nll, count = 0.0, 0
        with torch.no_grad():
            for s in range(0, len(ids) - 1, a.window):
                piece = torch.tensor([ids[s : s + a.window + 1]])
                logits = model(input_ids=piece[:, :-1]).logits[0].float()
                if score:
                    nll += float(F.cross_entropy(logits, piece[0, 1:], reduction="sum"))
                    count += piece.shape[1] - 1
        return math.exp(nll / count) if score else 0.0

    dense = run(test, True)
    print(f"{a.model}: held-out {a.test} tokens, dense perplexity {dense:.2f}")
    print("u sparsity  z sparsity  perplexity  ratio to dense  (down rows read)")
    for su in (float(v) for v in a.u.split(",")):
        # tau_u from the calibration pass without masks; then |z| with u's mask on, for tau_z
        state["tau"], state["record"] = {}, {m.layer_idx: [] for m in mods}
        run(calib, False)
        tau_u = {
            L: torch.quantile(torch.cat([r[0] for r in recs])[: 1 << 24], su).item()
            for L, recs in state["record"].items()
        }
        state["tau"], state["record"] = {L: (t, 0.0) for L, t in tau_u.items()}, {m.layer_idx: [] for m in mods}
        run(calib, False)
        zs = {L: torch.cat([r[1] for r in recs])[: 1 << 24] for L, recs in state["record"].items()}
        state["record"] = None
        for sz in (float(v) for v in a.z.split(",")):
            state["tau"] = {L: (tau_u[L], torch.quantile(zs[L], sz).item() if sz else 0.0) for L in tau_u}
            ppl = run(test, True)
            print(f"{su:>10.0%} {sz:>11.0%} {ppl:>11.2f} {ppl / dense:>15.3f}   {1 - sz:.0%}")
    for h in handles:
        h.remove()


if __name__ == "__main__":
    main()
