"""Where a trained DeaMoE model's activation sparsity lives: per layer and department, the distribution of the
gate activations |a| = |silu(x W_gate_d^T)| that the threshold acts on, and of z = sum_e g_e (u @ P_e) after the
private matrices (what the shared down projection reads in full today), on the calibration text.

For each (token, department) pair the step touches: quantiles of |a| (and the share of the pair's u energy the
smallest 30 % / 50 % of its neurons hold), and the same for |z| - if z's smallest entries hold as little energy as
u's, a second threshold on z (skipping rows of W_down) is worth writing. Runs on the CPU in float32; no GPU needed.

    python bench/deamoe_sparsity.py [--model localmoe-tiny-deamoe] [--tokens 1024]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from localmoe.engine.engine import Engine
from localmoe.experts.departments import DepartmentExperts
from localmoe.experts.thresholds import DEFAULT_TEXT


def pair_tensors(m: DepartmentExperts, x, idx, w):
    """(department of each pair [P], a [P, h], u [P, h], z [P, h]) for the (token, department) pairs of a call."""
    n = m.per_department
    dep = idx // n
    pairs = torch.unique(dep * x.shape[0] + torch.arange(x.shape[0])[:, None])  # d * T + t, sorted by department
    pd, pt = pairs // x.shape[0], pairs % x.shape[0]
    xs = x[pt].float()
    a = F.silu(torch.einsum("ph,pih->pi", xs, m.gate_proj[pd].float()))
    u = a * torch.einsum("ph,pih->pi", xs, m.up_proj[pd].float())
    g = torch.zeros(len(pairs), n)
    for j in range(idx.shape[1]):
        hit = (pd[:, None] == dep[pt, j][:, None]).squeeze(1)
        g[hit, (idx[pt, j] % n)[hit]] += w[pt, j][hit].float()
    z = torch.einsum("pi,pj,pjik->pk", u, g, m.private[pd].float())
    return pd, a, u, z


def low_energy(v: torch.Tensor, q: float) -> float:
    """Share of the rows' squared norm held by each row's smallest q fraction of entries (by |v|), averaged."""
    s = v.abs().sort(dim=1).values.square()
    k = int(round(q * v.shape[1]))
    return float((s[:, :k].sum(1) / s.sum(1).clamp_min(1e-30)).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="localmoe-tiny-deamoe")
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args()
    engine = Engine.load(args.model, device="cpu", dtype="float32", sparsity=0.0)
    calls: dict[int, list] = {}
    for m in engine.loaded.experts:
        m.register_forward_pre_hook(lambda mod, inp: calls.setdefault(mod.layer_idx, []).append(inp))
    ids = engine.tokenizer(DEFAULT_TEXT.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    ids = ids[: args.tokens]
    with torch.inference_mode():
        for i in range(0, len(ids), 512):
            engine.model(input_ids=torch.tensor([ids[i : i + 512]]), use_cache=False)
        qs = torch.tensor([0.1, 0.3, 0.5, 0.9])
        print(f"{args.model}: {len(ids)} calibration tokens; per layer: |a| quantiles (10/30/50/90 %), the energy of u")
        print("and z in each pair's smallest 30 % / 50 % of entries; |a| p30 per department (the 30 % threshold)")
        print("layer  |a| p10   p30    p50    p90  | u low30 low50 | z low30 low50 | |z|/max p30 | p30 per department")
        for m in engine.loaded.experts:
            parts = [pair_tensors(m, *inp) for inp in calls[m.layer_idx]]
            pd = torch.cat([p[0] for p in parts])
            a, u, z = (torch.cat([p[i] for p in parts]) for i in (1, 2, 3))
            qa = torch.quantile(a.abs().flatten()[:1_000_000], qs).tolist()
            zrel = (z.abs() / z.abs().amax(1, keepdim=True)).flatten()[:1_000_000]
            per_dep = [
                f"{torch.quantile(a[pd == d].abs().flatten(), 0.3):.3f}" if (pd == d).any() else "-"
                for d in range(m.num_departments)
            ]
            print(
                f"{m.layer_idx:>5}  " + " ".join(f"{v:.3f}" for v in qa) + f" | {low_energy(u, 0.3):.3f} "
                f"{low_energy(u, 0.5):.3f} | {low_energy(z, 0.3):.3f} {low_energy(z, 0.5):.3f} | "
                f"{torch.quantile(zrel, 0.3):.3f}       | {' '.join(per_dep)}"
            )


if __name__ == "__main__":
    main()
