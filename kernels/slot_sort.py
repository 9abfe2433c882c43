"""A prompt piece's (token, expert) slots sorted by expert in one Triton launch: the dense path's routing order with
no host sync and no torch sort (was ~10 launches a layer: argsort, the counts, their cumsum and casts, the tokens and
the inverse permutation).

Owns `slot_sort` (checked launcher), its torch reference `slot_sort_ref`, and `_slot_sort_kernel`. For a routing
top_k_index [T, k] (slot s = t·k + j holds token t's j-th expert) it writes

    order [M] int64   the slots sorted by expert, stably (torch.argsort(flat, stable=True))
    tok   [M] int64   the token of each sorted slot, order // k
    pos   [M] int64   where each slot landed: pos[order[i]] = i (the inverse permutation)
    ends  [E] int32   each expert's group end in the sorted order, cumsum(bincount(flat, minlength=E))

M = T·k. Grid cdiv(M, BLOCK): program b takes slots [b·BLOCK, (b+1)·BLOCK). Each program reads every slot's expert
CHUNK at a time and histograms them (tl.histogram): the totals give every expert's group start (their exclusive
cumsum), the slots before its block how many of each expert earlier blocks place first. A slot's place is
its expert's start + the earlier blocks' count of that expert + the number of earlier slots of its own block with
the same expert (a [BLOCK, BLOCK] comparison): the stable order, with no atomics, so it is deterministic. Program 0
writes `ends`. Every program reads all M ids (T·k = 16384 at a 2048-token Qwen3.5 piece: 128 KB of int64 from L2
per program, 16 histograms of 1024), so the work grows as M² / BLOCK: cheap next to the ~10 launches it replaces at
a piece's sizes (pieces are at most a few thousand tokens). Fixed grid, no host sync: capturable.

Shape legend: T tokens, k experts per token, M = T·k slots, E experts.
"""

from __future__ import annotations

import torch

try:  # Triton is optional at import time; the launcher needs it.
    import triton
    import triton.language as tl

    from localmoe.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_kw
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None

__all__ = ["slot_sort", "slot_sort_ref"]

MAX_EXPERTS = 4096  # the histogram's bins live in registers


def slot_sort_ref(top_k_index: torch.Tensor, num_experts: int):
    """(order, tok, pos, ends) in torch (module docstring)."""
    flat = top_k_index.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, order // top_k_index.shape[-1], pos, torch.cumsum(counts, 0).to(torch.int32)


if triton is not None:

    @triton.jit
    def _slot_sort_kernel(
        ids_ptr,  # [M] expert of each slot (int32 or int64), contiguous
        order_ptr,  # [M] int64 out
        tok_ptr,  # [M] int64 out
        pos_ptr,  # [M] int64 out
        ends_ptr,  # [E] int32 out
        M,
        E,
        K,  # experts per token
        BLOCK: tl.constexpr,
        CHUNK: tl.constexpr,  # slots histogrammed at a time (a multiple of BLOCK)
        E_P2: tl.constexpr,
        PDL: tl.constexpr,
    ):
        b = tl.program_id(0)
        if PDL:  # kernels/pdl.py: the routing is the kernel before's output
            gdc_wait()
            gdc_launch_dependents()
        offs = tl.arange(0, BLOCK)
        coffs = tl.arange(0, CHUNK)
        total = tl.zeros([E_P2], dtype=tl.int32)
        before = tl.zeros([E_P2], dtype=tl.int32)
        bins = tl.arange(0, E_P2)
        first = b * BLOCK  # this block's first slot
        for c0 in range(0, M, CHUNK):
            s = c0 + coffs
            sm = s < M
            e = tl.load(ids_ptr + s, mask=sm, other=0).to(tl.int32)
            # slots past M were read as expert 0: taken back out of bin 0
            h = tl.histogram(e, E_P2) - tl.where(bins == 0, CHUNK - tl.sum(sm.to(tl.int32), 0), 0)
            total += h
            if c0 + CHUNK <= first:  # the whole chunk precedes this block
                before += h
            elif c0 < first:  # the chunk this block starts in: its slots before the block
                bm = s < first
                eb = tl.where(bm, e, 0)
                before += tl.histogram(eb, E_P2) - tl.where(bins == 0, CHUNK - tl.sum(bm.to(tl.int32), 0), 0)
        start = tl.cumsum(total, 0) - total  # each expert's first sorted slot
        if b == 0:
            tl.store(ends_ptr + bins, start + total, mask=bins < E)
        s = b * BLOCK + offs
        sm = s < M
        e = tl.load(ids_ptr + s, mask=sm, other=0).to(tl.int32)
        same = (e[:, None] == e[None, :]) & (offs[None, :] < offs[:, None])  # earlier slots of the block, its expert
        rank = tl.sum(same.to(tl.int32), 1)
        p = (tl.gather(start + before, e, 0) + rank).to(tl.int64)
        tl.store(order_ptr + p, s.to(tl.int64), mask=sm)
        tl.store(tok_ptr + p, (s // K).to(tl.int64), mask=sm)
        tl.store(pos_ptr + s, p, mask=sm)


def slot_sort(top_k_index: torch.Tensor, num_experts: int, *, block: int = 128, chunk: int = 1024, num_warps: int = 4):
    """(order [M] int64, tok [M] int64, pos [M] int64, ends [E] int32) of a routing top_k_index [T, k] (int32 or
    int64 expert ids in [0, E)), one launch (module docstring). Ids outside [0, E) are not checked (no host read)."""
    if triton is None:
        raise RuntimeError("slot_sort needs triton")
    if top_k_index.dim() != 2 or top_k_index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"top_k_index must be an int32/int64 [T, k] tensor, got {top_k_index.dtype} "
                         f"{tuple(top_k_index.shape)}")  # fmt: skip
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts {num_experts} out of range [1, {MAX_EXPERTS}]")
    if block < 16 or block & (block - 1) or chunk < block or chunk & (chunk - 1):
        raise ValueError("block and chunk must be powers of two, 16 <= block <= chunk")
    ids = top_k_index.contiguous().view(-1)
    M, dev = ids.numel(), ids.device
    order = torch.empty(M, dtype=torch.int64, device=dev)
    tok = torch.empty(M, dtype=torch.int64, device=dev)
    pos = torch.empty(M, dtype=torch.int64, device=dev)
    ends = torch.empty(num_experts, dtype=torch.int32, device=dev)
    if M == 0:
        ends.zero_()
        return order, tok, pos, ends
    _slot_sort_kernel[(triton.cdiv(M, block),)](
        ids,
        order,
        tok,
        pos,
        ends,
        M,
        num_experts,
        top_k_index.shape[1],
        BLOCK=block,
        CHUNK=chunk,
        E_P2=triton.next_power_of_2(num_experts),
        num_warps=num_warps,
        **pdl_kw(ids),
    )
    return order, tok, pos, ends
