"""The per-token tail of the fused sparse expert launches (kernels/sparse_fused.py, kernels/mxfp4_sparse.py).

Owns what those launches share after their experts' programs: the self-cleaning int32 workspace (`fused_workspace`;
`tail_buffers` splits it into fp32 sums [T*H], kept counts [T*k] and per-token tickets [T]), the device functions
that finish a token (`last_of_token`: the acq_rel ticket; `publish_token`: y[t] (+ residual) from the sums row,
the counts, and the row, counts and ticket zeroed for the next launch; `publish_totals`: the running stats), the
decoder layer's handles (`SharedExpert`, a dense expert run by extra programs; `Tail`, what a decoder layer hands
its experts for one decode step) with the shared expert's torch term (`shared_expert_term`), and the checks of
`shared=` / `residual=` (`check_tail`).

May import torch, triton and the kernels' helpers (rounding, workspace); no kernel file.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localmoe.kernels.workspace import zeroed_int32

try:  # Triton is optional at import time; the launchers need it.
    import triton
    import triton.language as tl

    from localmoe.kernels.rounding import round_to
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None


@dataclass(frozen=True)
class SharedExpert:
    """A dense expert every token goes through, run by extra programs of the same launch. w_gate, w_up, w_down_t
    [I_s, H] in x's dtype with rows contiguous (w_down_t: W_down transposed); weight [T] any float (Qwen3.5: the
    sigmoid gate), applied after down like a routing weight."""

    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down_t: torch.Tensor
    weight: torch.Tensor


@dataclass(frozen=True)
class Tail:
    """What a decoder layer hands its experts for one decode step: `sparse_fused(..., shared=, residual=,
    workspace=)`. A `workspace` whose sums row already holds the shared expert (kernels/moe_front.py
    `shared_expert=`, the launch just before) comes with shared=None."""

    shared: SharedExpert | None
    residual: torch.Tensor | None
    workspace: torch.Tensor | None = None


def shared_expert_term(x, shared: SharedExpert) -> torch.Tensor:
    """fp32 [T, H]: weight[t] * silu(x . W_gate_s) * (x . W_up_s) @ W_down_t_s (what `shared=` adds)."""
    xf = x.float()
    a = torch.nn.functional.silu(xf @ shared.w_gate.float().T) * (xf @ shared.w_up.float().T)
    return shared.weight.float().reshape(-1, 1) * (a @ shared.w_down_t.float())


if triton is not None:

    @triton.jit
    def last_of_token(tick_ptr, t, n_programs):
        """Whether this program is the last of token t's n_programs to finish (acq_rel ticket: everything the others
        wrote before their ticket is visible to it). `publish_token` re-zeroes the ticket for the next launch. (A
        two-level ticket, per neuron block then per token, measured no faster in the decode step: sessions 5-6.)"""
        return tl.atomic_add(tick_ptr + t, 1, sem="acq_rel", scope="gpu") == n_programs - 1

    @triton.jit
    def publish_token(
        acc_ptr,
        y_ptr,
        res_ptr,
        cnt_ptr,
        cws_ptr,
        tick_ptr,
        t,
        K,
        cols,
        cmask,
        H: tl.constexpr,
        H_P2: tl.constexpr,
        K_P2: tl.constexpr,
        HAS_RES: tl.constexpr,
        PACKED: tl.constexpr = False,
    ):
        """The last program of token t: y[t] (+ residual) from the fp32 workspace row, the k kept counts, and the
        workspace row, counts and ticket zeroed for the next launch. Returns the counts [K_P2] (0 past K). PACKED:
        each count word holds kept + (candidate rows << 16) (sparse_fused's predictor with row stats); the kept part
        is stored, the whole words returned."""
        arow = acc_ptr + t.to(tl.int64) * H + cols
        a = tl.load(arow, mask=cmask, other=0.0, cache_modifier=".cg")  # other programs' sums: via L2
        YT = y_ptr.dtype.element_ty
        if HAS_RES:  # y = residual + the block's output, each rounded as transformers' adds round
            rv = tl.load(res_ptr + t.to(tl.int64) * H + cols, mask=cmask, other=0.0).to(tl.float32)
            a = round_to(rv + round_to(a, YT), YT)
        tl.store(y_ptr + t.to(tl.int64) * H + cols, a.to(YT), mask=cmask)
        tl.store(arow, tl.zeros([H_P2], dtype=tl.float32), mask=cmask)
        kk = tl.arange(0, K_P2)
        km = kk < K
        crow = t.to(tl.int64) * K + kk
        c = tl.load(cws_ptr + crow, mask=km, other=0, cache_modifier=".cg")
        if PACKED:
            tl.store(cnt_ptr + crow, c & 0xFFFF, mask=km)
        else:
            tl.store(cnt_ptr + crow, c, mask=km)
        tl.store(cws_ptr + crow, tl.zeros([K_P2], dtype=tl.int32), mask=km)
        tl.store(tick_ptr + t, 0)  # ready for the next launch / graph replay
        return c

    @triton.jit
    def publish_totals(
        c,
        t,
        K,
        I,
        eid_ptr,
        slot_ptr,
        gslot_ptr,
        kept_ptr,
        host_ptr,
        rows_ptr,
        K_P2: tl.constexpr,
        KEPT_TOTAL: tl.constexpr,
        HOST_ROWS: tl.constexpr,
        GATE_TABLE: tl.constexpr,
        READ_ROWS: tl.constexpr,
    ):
        """The last program of token t adds its k kept counts `c` [K_P2] to the running totals the stats read (one
        atomic each, no extra launch): kept neurons; rows read from host memory (an absent expert's gate rows and its
        kept up and down rows); rows read wherever they live (I gate rows + 2 per kept neuron). `I`: the gate rows
        each routed expert read, the width I, or [K_P2] counts (sparse_fused's predictor: its candidates)."""
        kk = tl.arange(0, K_P2)
        km = kk < K
        crow = t.to(tl.int64) * K + kk
        if KEPT_TOTAL:
            tl.atomic_add(kept_ptr, tl.sum(c.to(tl.int64), axis=0), sem="relaxed")
        if HOST_ROWS:
            ee = tl.load(eid_ptr + crow, mask=km, other=0).to(tl.int64)
            absent = km & (tl.load(slot_ptr + ee, mask=km, other=0) < 0)
            if GATE_TABLE:
                g_absent = km & (tl.load(gslot_ptr + ee, mask=km, other=0) < 0)
                hr = tl.where(g_absent, I, 0).to(tl.int64) + tl.where(absent, 2 * c, 0).to(tl.int64)
            else:
                hr = tl.where(absent, I + 2 * c, 0).to(tl.int64)
            tl.atomic_add(host_ptr, tl.sum(hr, axis=0), sem="relaxed")
        if READ_ROWS:
            tl.atomic_add(rows_ptr, tl.sum(tl.where(km, I + 2 * c, 0).to(tl.int64), axis=0), sem="relaxed")


def fused_workspace(device, numel: int = 0) -> torch.Tensor:
    """Zeroed int32 workspace with >= numel elements, one per (device, stream); kernels leave it zeroed.

    A launch with T tokens, k experts, hidden H uses T*H + T*k + T elements (fp32 sums, counts, tickets).
    Allocate it before CUDA-graph capture (or pass your own zeroed int32 buffer as `workspace=`): a first
    allocation during capture lands in the graph's private pool."""
    return zeroed_int32("sparse_fused", device, numel, minimum=1 << 14)


def tail_buffers(out, count, workspace, accumulate: bool, dev, T: int, H: int, k: int):
    """(fp32 sums [T*H], counts [T*k], tickets [T]) a launch with the self-cleaning tail adds into: views of the
    (checked, or the shared) workspace; with `accumulate`, the caller's `out` and `count` (no tickets)."""
    need = T * H + T * k + T
    if accumulate:
        return out, count, count  # no workspace: the tickets are never read
    if workspace is None:
        workspace = fused_workspace(dev, need)
    elif (
        workspace.dtype != torch.int32
        or workspace.dim() != 1
        or workspace.numel() < need
        or not workspace.is_contiguous()
        or workspace.device != dev
    ):
        raise ValueError(f"workspace must be a zeroed contiguous int32 1-D tensor of >= {need} elements on {dev}")
    acc = workspace[: T * H].view(torch.float32)  # int32 zeros are fp32 zeros
    return acc, workspace[T * H : T * H + T * k], workspace[T * H + T * k : need]


def check_tail(shared: SharedExpert | None, residual, accumulate: bool, T: int, H: int, x, out) -> int:
    """Checks `shared` and `residual`; returns the shared expert's width (0 without one)."""
    if (shared is not None or residual is not None) and accumulate:
        raise ValueError("shared= and residual= belong to the finalising tail: not with accumulate=True")
    if residual is not None:
        dt = out.dtype if out is not None else torch.float32
        if (
            tuple(residual.shape) != (T, H)
            or residual.dtype != dt
            or not residual.is_contiguous()
            or residual.device != x.device
        ):
            raise ValueError(
                f"residual must be a contiguous {dt} [T, H] = {(T, H)} tensor on {x.device} (the output's dtype)"
            )
    if shared is None:
        return 0
    I_s = shared.w_gate.shape[0] if shared.w_gate.dim() == 2 else -1
    for name in ("w_gate", "w_up", "w_down_t"):
        w = getattr(shared, name)
        if w.dim() != 2 or tuple(w.shape) != (I_s, H) or w.stride(1) != 1 or w.stride(0) != H:
            raise ValueError(
                f"shared.{name} must be a contiguous [I_s, H] = [{I_s}, {H}] tensor, got "
                f"{tuple(w.shape)} strides {w.stride()}"
            )
        if w.dtype != x.dtype or w.device != x.device:
            raise ValueError(f"shared.{name} must be {x.dtype} on {x.device}, got {w.dtype} on {w.device}")
    wt = shared.weight
    if wt.numel() != T or not wt.dtype.is_floating_point or wt.device != x.device or not wt.is_contiguous():
        raise ValueError(f"shared.weight must be a contiguous float tensor of T = {T} values on {x.device}")
    return I_s
