"""Shared inputs for the sparse-expert kernel tests: random routed-expert problems, the sparsities swept, and the
relative error used to compare kernels with their torch references.

Shape legend: T = tokens, k = experts per token, E = experts, I = expert width, H = hidden.
"""

from __future__ import annotations

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SPARSITIES = [0.0, 0.5, 0.9, "all"]


def shape_id(s) -> str:
    return "T{}_H{}_I{}_E{}_k{}".format(*s[:5])


def expert_inputs(T, H, I, E, k, dtype, seed, id_dtype=torch.int32):
    """(x [T,H], w_gate, w_up, w_down_t [E,I,H], expert ids [T,k] distinct per token, routing weights [T,k])."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype).to(DEV)
    w = [(torch.randn(E, I, H, generator=gen) * 2.0 / H**0.5).to(dtype).to(DEV) for _ in range(3)]
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).to(id_dtype).to(DEV)
    rw = torch.softmax(torch.randn(T, k, generator=gen), -1).to(dtype).to(DEV)
    return x, w[0], w[1], w[2], ids, rw


def rel_err(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
