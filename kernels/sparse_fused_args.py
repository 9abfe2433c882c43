"""The argument checks of a `sparse_fused` launch (kernels/sparse_fused.py), top to bottom in the order the launcher
calls them: the expert weights (plain or 4-bit, resident or host master copies), the offload pools and slot tables,
the output buffers, the row and kept-neuron counters.

Each check raises ValueError naming the argument, the shape / dtype / device it must have and what it got; the
launcher stays the dispatcher. The shared expert and residual tail's checks are kernels/token_tail.py's
`check_tail`, the gate predictor's kernels/gate_predictor.py's `check_predictor`, the routing's and the shared
weight-stack checks kernels/checks.py's.
"""

from __future__ import annotations

import torch

from localmoe.kernels.checks import expert_weights, int4_expert_weights
from localmoe.kernels.int4 import Int4Tensor

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INT_DTYPES = (torch.int32, torch.int64)


def check_weights(masters, pools, quant: bool, offload: bool, shared: bool, E: int, I: int, H: int, dev) -> None:
    """The three projections (`masters`: (name, weights) pairs), plain [E, I, H] or 4-bit of one group size, on x's
    device or (offload) host master copies; the pools given with the slot table or not at all."""
    if offload != all(p is not None for p in pools) or (not offload and any(p is not None for p in pools)):
        raise ValueError(
            "slot_table, pool_gate, pool_up and pool_down_t must be given together (offload) or not at all"
        )
    if not quant:
        for name, w in masters:
            expert_weights(name, w, E, I, H, dev, allow_host=offload)
        return
    if shared:
        raise ValueError(
            "int4 experts (Int4Tensor weights): not with shared= (run the shared expert in "
            "moe_front, its sums go into the workspace)"
        )
    for name, w in masters:
        int4_expert_weights(name, w, E, I, H, dev, allow_host=offload)
    if len({w.group for _, w in masters}) != 1:
        raise ValueError(f"w_gate, w_up and w_down_t must share one group size, got {[w.group for _, w in masters]}")


def out_buffers(out, count, accumulate: bool, T: int, H: int, k: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """The caller's out [T, H] and count [T, k] checked, or new ones (accumulate=True needs the caller's, zeroed)."""
    if accumulate:
        if out is None or count is None:
            raise ValueError("accumulate=True needs out= (fp32 [T,H]) and count= (int32 [T,k]) buffers")
        if out.dtype != torch.float32:
            raise ValueError(f"accumulate=True needs an fp32 out, got {out.dtype}")
    if out is None:
        out = torch.empty(T, H, dtype=torch.float32, device=dev)
    elif tuple(out.shape) != (T, H) or out.dtype not in _FLOAT_DTYPES or not out.is_contiguous() or out.device != dev:
        raise ValueError(
            f"out must be a contiguous bf16/fp16/fp32 [T, H] = {(T, H)} tensor on {dev}, got "
            f"{out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if count is None:
        count = torch.empty(T, k, dtype=torch.int32, device=dev)
    elif tuple(count.shape) != (T, k) or count.dtype != torch.int32 or not count.is_contiguous() or count.device != dev:
        raise ValueError(f"count must be a contiguous int32 [T, k] = {(T, k)} tensor on {dev}")
    return out, count


def check_stats(kept_total, host_rows, read_rows, gate_table, accumulate: bool, offload: bool, dev) -> None:
    """The one-element int64 counters the kernel's tail adds to (not with accumulate=True), and the offload-only
    arguments given without a slot table."""
    for name, tot in (("kept_total", kept_total), ("host_rows", host_rows)):
        if tot is None:
            continue
        if accumulate:
            raise ValueError(f"{name} is counted in the finalising tail: not with accumulate=True")
        if tot.dtype != torch.int64 or tot.numel() != 1 or tot.device != dev:
            raise ValueError(f"{name} must be a one-element int64 tensor on {dev}")
    if host_rows is not None and not offload:
        raise ValueError("host_rows counts host reads of offloaded experts: it needs slot_table")
    if gate_table is not None and not offload:
        raise ValueError("gate_table addresses the gate pool of offloaded experts: it needs slot_table")
    if read_rows is not None:
        if accumulate:
            raise ValueError("read_rows is counted in the finalising tail: not with accumulate=True")
        if read_rows.dtype != torch.int64 or read_rows.numel() != 1 or read_rows.device != dev:
            raise ValueError(f"read_rows must be a one-element int64 tensor on {dev}")


def check_offload(masters, pools, slot_table, gate_table, quant: bool, E: int, I: int, H: int, dev) -> list:
    """Checks the offload arguments (slot tables; pools in the masters' format, plain or int4, on x's device) and
    returns the pools' base tensors (int4: the packed bytes)."""
    if slot_table.dim() != 1 or slot_table.shape[0] != E or slot_table.dtype not in _INT_DTYPES:
        raise ValueError(
            f"slot_table must be int32/int64 [E] = [{E}], got {slot_table.dtype} {tuple(slot_table.shape)}"
        )
    if slot_table.device != dev:
        raise ValueError(f"slot_table is on {slot_table.device}, x is on {dev}")
    pool_names = ("pool_gate", "pool_up", "pool_down_t")
    for pname, p in zip(pool_names, pools):
        if isinstance(p, Int4Tensor) != quant:
            raise ValueError(
                f"{pname} is {'an Int4Tensor' if not quant else 'a plain tensor'} but the master "
                f"copies are {'Int4Tensors' if quant else 'plain tensors'}: pools and masters "
                f"must share one format (int4 or not)"
            )
        if quant and type(p) is not type(masters[0][1]):
            raise ValueError(f"{pname} is an {type(p).__name__}, the master copies {type(masters[0][1]).__name__}s")
    pt = [p.packed if quant else p for p in pools]  # int4: the packed bytes carry the [S, I, H/2] shape
    if pt[0].dim() != 3:
        raise ValueError(f"pool_gate must be [S, I, H], got shape {tuple(pt[0].shape)}")
    S = pt[1].shape[0] if pt[1].dim() == 3 else 0
    Sg = pt[0].shape[0] if gate_table is not None else S
    if S < 1 or Sg < 1:
        raise ValueError("the pools need at least one slot")
    if gate_table is not None and (
        gate_table.dim() != 1
        or gate_table.shape[0] != E
        or gate_table.dtype not in _INT_DTYPES
        or gate_table.device != dev
    ):
        raise ValueError(
            f"gate_table must be int32/int64 [E] = [{E}] on {dev}, got {gate_table.dtype} "
            f"{tuple(gate_table.shape)} on {gate_table.device}"
        )
    for (name, w), pname, p, n in zip(masters, pool_names, pools, (Sg, S, S)):
        if not quant:
            expert_weights(pname, p, n, I, H, dev)
            if p.dtype != w.dtype:
                raise ValueError(f"{pname} ({p.dtype}) and its master copy {name} ({w.dtype}) must share a dtype")
            continue
        int4_expert_weights(pname, p, n, I, H, dev)  # the pools live on x's device
        if p.group != w.group:
            raise ValueError(f"{pname} has group size {p.group}, its master copy {name} {w.group}: they must share one")
        for part in ("scale", "minimum"):  # the kernel picks pool or master per program: one element type
            if getattr(w, part) is None:  # NF4: no minimum
                continue
            pdt, mdt = getattr(p, part).dtype, getattr(w, part).dtype
            if pdt != mdt:
                raise ValueError(f"{pname}.{part} ({pdt}) and its master copy {name}.{part} ({mdt}) must share a dtype")
    return pt
