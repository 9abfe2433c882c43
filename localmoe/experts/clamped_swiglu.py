"""GPT-OSS's expert arithmetic beyond a plain gated MLP: the clamped SwiGLU (`ClampedSwiGLU`) and the experts' biases
(`ExpertBiases`), as `LocalExperts` applies them on every path (dense loop, grouped GEMMs, the sparse reference).

Per routed expert e of a token x (transformers' GptOssExperts, `swiglu_alpha` and `swiglu_limit` from the config):
  z_n = x·Wg[n] + bg[n]                 the gate's pre-activation
  a_n = min(z_n, limit) * sigmoid(alpha * min(z_n, limit))      act(gate): what the sparse path thresholds, |a_n| >= τ
  u_n = clamp(x·Wu[n] + bu[n], -limit, limit) + 1               `ClampedSwiGLU.up`
  y_e = sum_n a_n * u_n * Wd[:, n] + bd                          the down bias always added (skipping a neuron is exact
                                                                 for that neuron's term only)
and the block's output is sum_k w_k * y_{e_k} (the routing weight multiplies the bias too).

The biases live on the device the experts compute on, indexed by expert id (not by cache slot): a layer's are
E * (2I + H) values, small beside its weights, so offloading never moves them.

Shapes: E experts, I expert width, H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CLAMPED_SWIGLU = "clamped_swiglu"  # the activation's name (FamilySpec.activation, LocalExperts.hidden_act)


@dataclass(frozen=True)
class ClampedSwiGLU:
    """act(gate) = min(z, limit) * sigmoid(alpha * min(z, limit)) (called like transformers' ACT2FN functions), and
    `up`, the up projection's clamp and + 1. The same operations in the same order as transformers' GptOssExperts."""

    alpha: float
    limit: float

    def __call__(self, gate: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(min=None, max=self.limit)
        return gate * torch.sigmoid(gate * self.alpha)

    def up(self, up: torch.Tensor) -> torch.Tensor:
        return up.clamp(min=-self.limit, max=self.limit) + 1


@dataclass
class ExpertBiases:
    """One MoE layer's expert biases in the model's dtype: gate [E, I], up [E, I], down [E, H]."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.gate.device

    def to(self, device) -> ExpertBiases:
        return ExpertBiases(*(t.to(device) for t in (self.gate, self.up, self.down)))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.gate, self.up, self.down))

    @classmethod
    def empty(cls, experts: int, width: int, hidden: int, dtype: torch.dtype, device) -> ExpertBiases:
        return cls(
            torch.empty(experts, width, dtype=dtype, device=device),
            torch.empty(experts, width, dtype=dtype, device=device),
            torch.empty(experts, hidden, dtype=dtype, device=device),
        )


def gate_pre(z: torch.Tensor, biases: ExpertBiases | None, experts) -> torch.Tensor:
    """z + the gate bias of `experts` (an expert id, or ids [n] for rows z [n, I]); z unchanged without biases."""
    return z if biases is None else z + biases.gate[experts]


def up_value(u: torch.Tensor, biases: ExpertBiases | None, experts, up_fn) -> torch.Tensor:
    """The up projection's value as the gate multiplies it: + bias, then `up_fn` (ClampedSwiGLU.up) when given."""
    if biases is not None:
        u = u + biases.up[experts]
    return u if up_fn is None else up_fn(u)


def down_out(y: torch.Tensor, biases: ExpertBiases | None, experts) -> torch.Tensor:
    """y + the down bias of `experts`; y unchanged without biases."""
    return y if biases is None else y + biases.down[experts]
