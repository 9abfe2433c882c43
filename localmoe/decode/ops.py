"""Small decode-time building blocks of localmoe's fused modules: the one-row GEMV
(`linear_1`, `FusedLinear`), one weight buffer for projections sharing an input (`concat_rows`) and the one-launch
RMSNorm (`FusedRMSNorm`). `localmoe.decode.replacements` holds the replacement table; `deltanet`, `attention` and
`moe_layer` build on these.

Shape legend: K input features, N output features, R rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from localmoe.kernels.gemv import gemv
from localmoe.kernels.rmsnorm import rmsnorm
from localmoe.kernels.tuning import tuned


def one_row(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether x @ weight.T is a decode GEMV localmoe's kernel takes: one row, same dtype and device, row contiguous."""
    return (
        x.numel() == x.shape[-1]
        and x.dtype == weight.dtype
        and x.device == weight.device
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
        and weight.dim() == 2
    )


@torch.compiler.disable
def linear_1(x: torch.Tensor, weight: torch.Tensor, norm: FusedRMSNorm | None = None) -> torch.Tensor:
    """x [..., K] with one row -> x @ weight.T [..., N] through kernels/gemv.py (launch tuned per shape); with
    `norm` (see `takes_norm`), norm(x) @ weight.T, the norm computed inside the GEMV (one launch fewer)."""
    N, K = weight.shape
    kw = tuned(x, "gemv", f"N{N}_K{K}")
    if norm is not None:
        kw = dict(kw, norm_weight=norm.weight, eps=norm.eps, norm_kind=norm.kind)
    return gemv(x.reshape(1, K), weight, **kw).view(*x.shape[:-1], N)


def takes_norm(norm, x: torch.Tensor) -> bool:
    """Whether `linear_1(x, w, norm)` can fold this norm module into its GEMV (a FusedRMSNorm of x's width, K up to
    one 4096-wide tile)."""
    return (
        isinstance(norm, FusedRMSNorm)
        and norm.kind in ("standard", "zero_centred")
        and norm.weight.numel() == x.shape[-1] <= 4096
        and norm.weight.device == x.device
    )


class FusedLinear(nn.Module):
    """nn.Linear whose one-row calls (decode: lm_head, attention and DeltaNet projections) run localmoe's GEMV; every
    other call (prefill, a bias) runs F.linear. cuBLAS's GEMV read Qwen3.5's lm_head at 2.1 TB/s in the engine."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        object.__setattr__(self, "_hf", hf)
        self.weight = hf.weight  # the same Parameter (tied embeddings stay tied)
        self.bias = hf.bias
        self.in_features, self.out_features = hf.in_features, hf.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None and one_row(x, self.weight):
            return linear_1(x, self.weight)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def concat_rows(linears: list[nn.Module]) -> tuple[torch.Tensor | None, list[int]]:
    """Bias-free Linears sharing an input: one [ΣN, H] matrix whose row blocks become the Linears' weights (each
    Parameter object stays, its data now a view: no extra memory, same values), so one GEMV does all of them.
    (None, []) when they cannot share one (bias, other dtype/device/width, not plain Linears)."""
    ws = [getattr(lin, "weight", None) for lin in linears]
    if (
        not all(isinstance(lin, (nn.Linear, FusedLinear)) and lin.bias is None for lin in linears)
        or len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1
        or ws[0].device.type == "meta"
    ):
        return None, []
    with torch.no_grad():
        cat = torch.cat([w.detach() for w in ws], dim=0)  # [ΣN, H]
        sizes, at = [w.shape[0] for w in ws], 0
        for w, n in zip(ws, sizes):
            w.data = cat[at : at + n]
            at += n
    return cat, sizes


class FusedRMSNorm(nn.Module):
    """transformers' RMSNorm (`kind` standard or zero_centred) in one Triton launch, any number of rows."""

    def __init__(self, hf: nn.Module, kind: str):
        super().__init__()
        object.__setattr__(self, "_hf", hf)  # the original, unregistered (uninstall puts it back)
        self.weight = hf.weight  # the same Parameter
        self.eps = float(getattr(hf, "variance_epsilon", getattr(hf, "eps", 1e-6)))
        self.variance_epsilon = self.eps
        self.kind = kind

    @torch.compiler.disable  # Triton launches stay opaque to dynamo (the CUDA graph still holds them)
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., N]
        return rmsnorm(x, self.weight, self.eps, self.kind)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, kind={self.kind}"


def norm_eps(norm: nn.Module) -> float | None:
    """An RMSNorm module's epsilon (localmoe's FusedRMSNorm `eps`, transformers' `variance_epsilon` / `eps`)."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return None if eps is None else float(eps)


def static_layer(cache, layer_idx: int, heads: int, k_dim: int, v_dim: int, h: torch.Tensor):
    """The cache's layer when it is a plain, initialised transformers StaticLayer of this shape on h's device (one
    sequence, keys [1, heads, L, k_dim] and values [1, heads, L, v_dim] of h's dtype, rows contiguous, an integer
    position tensor): then localmoe writes the token's keys and values itself, as StaticLayer.update would
    (transformers 5.17 and 5.2x). Else None: call cache.update. (Full attention: heads Hkv, k_dim = v_dim = D;
    DeepSeek-V2's MLA: one "head" of latents, k_dim C and v_dim R.)"""
    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx >= len(layers) or type(layers[layer_idx]).__name__ != "StaticLayer":
        return None
    layer = layers[layer_idx]
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    pos = getattr(layer, "cumulative_length", None)
    if not (getattr(layer, "is_initialized", False) and all(isinstance(t, torch.Tensor) for t in (keys, values, pos))):
        return None
    ok = all(
        t.dim() == 4
        and t.shape[0] == 1
        and t.shape[1] == heads
        and t.shape[3] == width
        and t.stride(3) == 1
        and t.dtype == h.dtype
        and t.device == h.device
        for t, width in ((keys, k_dim), (values, v_dim))
    )
    return layer if ok and pos.numel() == 1 and pos.device == h.device and not pos.is_floating_point() else None
