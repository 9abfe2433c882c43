"""Shared inputs for the sparse-expert kernel tests: random routed-expert problems, the sparsities swept, the relative
error used to compare kernels with their torch references, the gate activations and per-expert thresholds of a
routed problem, the accumulate-mode check, and the offload layouts (pools and master copies poisoned where a
read must not go), plain and int4.

Shape legend: T = tokens, k = experts per token, E = experts, I = expert width, H = hidden.
"""

from __future__ import annotations

import torch

from localmoe.experts.int4 import Int4Tensor, quantize

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


def gate_abs(x, w_gate, ids):
    return torch.nn.functional.silu(torch.einsum("th,tkih->tki", x.float(), w_gate[ids.long()].float())).abs()


def tau_for(g_abs, ids, sparsity, E):
    """Per-expert thresholds: for each routed expert the midpoint between two adjacent |g| values at the given
    quantile of its own gate values (so rounding cannot flip a neuron); unrouted experts get 0."""
    if sparsity == "all":
        return torch.full((E,), float("inf"), device=DEV)
    tau = torch.zeros(E)
    if sparsity == 0.0:
        return tau.to(DEV)
    for e in ids.unique().tolist():
        a = torch.sort(g_abs[ids == e].flatten().cpu()).values
        m = max(1, int(sparsity * a.numel()))
        tau[e] = float(a[m - 1] + a[m]) / 2
    return tau.to(DEV)


def accumulates_twice(launch, y_ref, c_ref):
    """accumulate=True: `launch(out, count)` twice into a pre-filled fp32 out and int32 count adds y_ref and c_ref
    twice (the caller owns and pre-fills both)."""
    T, H = y_ref.shape
    base = torch.randn(T, H, device=DEV)
    out = base.clone()
    cnt = torch.full(tuple(c_ref.shape), 5, dtype=torch.int32, device=DEV)
    for _ in range(2):
        launch(out, cnt)
    assert rel_err(out, base + 2 * y_ref) < 1e-5
    assert torch.equal(cnt, 5 + 2 * c_ref)


def offload_layout(wg, wu, wd, table, S):
    """Pools [S,I,H] holding the resident experts at their slots (other slots NaN), and master copies whose
    resident experts are NaN: any read from the wrong side poisons the result."""
    E = wg.shape[0]
    pools, masters = [], []
    for w in (wg, wu, wd):
        p = torch.full((S,) + tuple(w.shape[1:]), float("nan"), dtype=w.dtype, device=DEV)
        m = w.clone()
        for e in range(E):
            s = int(table[e])
            if s >= 0:
                p[s] = w[e]
                m[e] = float("nan")
        pools.append(p)
        masters.append(m if DEV == "cpu" else m.cpu().pin_memory())
    return pools, masters


def int4_inputs(T, H, I, E, k, G, dtype, seed):
    """(x [T,H] in dtype, int4 w_gate, w_up, w_down_t (Int4Tensor [E,I,H], group G), ids [T,k], weights [T,k])."""
    x, wg, wu, wd, ids, rw = expert_inputs(T, H, I, E, k, dtype, seed=seed)
    return (x, *(quantize(w, group=G) for w in (wg, wu, wd)), ids, rw)


def int4_parts(w):
    return (w.packed, w.scale, w.minimum)


def int4_offload_layout(qs, table, S, pad=0):
    """Int4Tensor pools [S,I,H] holding the resident experts' packed bytes, scales and minimums at their slots (other
    slots: bytes 0xFF, scales and minimums NaN), and master copies whose resident experts are poisoned the same way: a
    read from the wrong side puts NaN in y. Each pool part is cut from a buffer with its own number of spare rows per
    slot (pad + 1..9), so every pool tensor has an expert stride of its own, none the masters'."""
    pools, masters = [], []
    for j, w in enumerate(qs):
        E, I, _ = w.packed.shape
        pp, mp = [], []
        for i, t in enumerate(int4_parts(w)):
            bad = 255 if t.dtype == torch.uint8 else float("nan")
            buf = torch.empty((S, I + pad + 1 + 3 * j + i, t.shape[-1]), dtype=t.dtype, device=DEV)
            p = buf[:, :I]
            p.fill_(bad)
            m = t.clone()
            for e in range(E):
                if int(table[e]) >= 0:
                    p[int(table[e])].copy_(t[e])
                    m[e] = bad
            pp.append(p)
            mp.append(m if DEV == "cpu" else m.cpu().pin_memory())
        pools.append(Int4Tensor(*pp, w.dtype))
        masters.append(Int4Tensor(*mp, w.dtype))
    return pools, masters
