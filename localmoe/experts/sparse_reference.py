"""`sparse_reference`: the torch reference of the sparse decode path (the Triton kernels' definition), used where no
kernel runs (the CPU, offloaded CPU misses): the gate whole, then only the kept rows of W_up and W_down_t.

Shapes: T = tokens, k = experts per token, E = experts, I = expert width, H = hidden.
"""

from __future__ import annotations

import torch

from localmoe.experts.clamped_swiglu import down_out, gate_pre


def sparse_reference(x, w, top_k_index, top_k_weights, tau, act_fn, *, biases=None, experts=None, up_fn=None):
    """Torch reference of the sparse path; reads only the kept rows of W_up and W_down_t.

    x [T,H], top_k_index/top_k_weights [T,k], tau [E] -> (y [T,H] fp32, kept neuron count as a 0-d tensor).
    GPT-OSS: `biases` (ExpertBiases, indexed by `experts` [T,k], default top_k_index) and `up_fn` (the up
    projection's clamp and + 1); the down bias is added whatever is kept. A 4-bit stack's expert is dequantized whole
    (`w.w_up[e]`), then its kept rows taken: the same values the kernels read row by row."""
    T, k = top_k_index.shape
    y = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    kept_total = torch.zeros((), dtype=torch.int64, device=x.device)
    experts = top_k_index if experts is None else experts
    for t in range(T):
        xt = x[t]
        for j in range(k):
            e, be = int(top_k_index[t, j]), int(experts[t, j])
            g = act_fn(gate_pre(w.w_gate[e] @ xt, biases, be))  # [I]
            keep = (g.abs() >= tau[e]).nonzero().squeeze(1)  # kept neuron ids, ascending
            kept_total += keep.numel()
            if keep.numel() == 0 and biases is None:
                continue
            u = w.w_up[e].index_select(0, keep) @ xt  # [n_kept]
            if biases is not None:
                u = u + biases.up[be].index_select(0, keep)
            h = g[keep] * (u if up_fn is None else up_fn(u))
            out = down_out(h @ w.w_down_t[e].index_select(0, keep), biases, be)  # [H]
            y[t] += (top_k_weights[t, j].float() * out).float()
    return y, kept_total
