"""`GateRecorder`: the |act(gate)| samples of routed experts that calibration (experts/thresholds.py) sets the
sparsity thresholds from; `LocalExperts` and DeaMoE's `DepartmentExperts` feed it while a recorder is attached."""

from __future__ import annotations

import torch


class GateRecorder:
    """Collects |g| samples of routed experts during calibration (bounded random subsample per layer),
    with the expert each sample came from, so thresholds can be per layer or per expert."""

    def __init__(self, max_samples: int = 1 << 21, seed: int = 0):
        self.max_samples = max_samples
        self.values: list[torch.Tensor] = []
        self.experts: list[torch.Tensor] = []
        self.count = 0
        self.routed: dict[int, int] = {}  # expert -> calibration tokens routed to it (gate-tier placement)
        self.gen = torch.Generator().manual_seed(seed)

    def add(self, g_abs: torch.Tensor, expert: int = 0) -> None:
        """g_abs [n, I]: |gate activations| of the n tokens routed to `expert`."""
        self.routed[expert] = self.routed.get(expert, 0) + (g_abs.shape[0] if g_abs.dim() > 1 else 1)
        v = g_abs.detach().flatten().float().cpu()
        self.values.append(v)
        self.experts.append(torch.full((v.numel(),), expert, dtype=torch.int32))
        self.count += v.numel()
        self._bound()

    def add_rows(self, g_abs: torch.Tensor, experts: torch.Tensor) -> None:
        """g_abs [n, I] with its rows' experts [n] in ascending order: the same record as `add` per expert in that
        order (one host copy instead of one per expert)."""
        e = experts.to(torch.int64)
        for ex, c in zip(*(t.tolist() for t in torch.unique_consecutive(e, return_counts=True))):
            self.routed[ex] = self.routed.get(ex, 0) + c
        v = g_abs.detach().flatten().float().cpu()
        self.values.append(v)
        self.experts.append(e.repeat_interleave(g_abs.shape[1]).to(torch.int32).cpu())
        self.count += v.numel()
        self._bound()

    def _bound(self) -> None:
        if sum(c.numel() for c in self.values) > 2 * self.max_samples:
            allv, alle = torch.cat(self.values), torch.cat(self.experts)
            keep = torch.randperm(allv.numel(), generator=self.gen)[: self.max_samples]
            self.values, self.experts = [allv[keep]], [alle[keep]]

    @staticmethod
    def _q(v: torch.Tensor, q: float) -> float:
        if q <= 0.0 or v.numel() == 0:
            return 0.0
        kth = max(1, min(v.numel(), int(round(q * v.numel()))))
        return float(torch.kthvalue(v, kth).values)

    def quantile(self, q: float) -> float:
        return self._q(torch.cat(self.values) if self.values else torch.zeros(0), q)

    def expert_quantiles(self, q: float, num_experts: int, min_samples: int = 256) -> list[float]:
        """Per-expert S-quantiles; experts seen too rarely fall back to the layer's."""
        allv = torch.cat(self.values) if self.values else torch.zeros(0)
        alle = torch.cat(self.experts) if self.experts else torch.zeros(0, dtype=torch.int32)
        layer = self._q(allv, q)
        out = []
        for e in range(num_experts):
            v = allv[alle == e]
            out.append(self._q(v, q) if v.numel() >= min_samples else layer)
        return out
