"""Greedy token choice on the device in one launch, with the next step's input written in place: the CUDA-graph
decode step ends with it, so a greedy step needs no copy, fill or argmax kernel between replays.

Owns `argmax_next(logits, ids=, pos=, ring=, host=, count=, seen=, penalty=)`, its torch reference
`argmax_next_ref`, and the Triton kernel `_argmax_kernel`. Grid: cdiv(V, BLOCK) programs; each reduces BLOCK logits
to (max, first index of the max) in a workspace row; the last program (an acq_rel ticket, self-cleaning) reduces
those partials and writes the token: to `ids` (the next step's input, int64), to `ring[count % R]` on the device
and `host[count % R]` (a pinned host ring the GPU writes through unified addressing, so the host reads the token
after the step's event without a copy on the stream), then count += 1 and pos += 1. Every output is optional.

Repetition penalty (optional, `seen` and `penalty` together): before the reduction each logit whose token is set in
the `seen` mask is divided by the penalty when positive and multiplied when not (transformers'
RepetitionPenaltyLogitsProcessor; IEEE division), and the last program marks the chosen token in `seen`. The penalty
is read at run time: 1.0 reads no mask and marks nothing, so a captured graph serves both.

Ties go to the first index, as `torch.argmax` does. NaN counts as +inf (torch returns the first NaN; here a +inf
before it would win): a model that emits NaN logits is broken either way.

Shape legend: V vocabulary, R ring slots. logits [V] (bf16/fp16/fp32, contiguous) · ids, pos, ring, host [.] int64
· count [1] int32 · seen [V] uint8 · penalty [1] float32.
"""

from __future__ import annotations

import torch

from localmoe.kernels.workspace import zeroed_int32

try:  # Triton is optional at import time; the launcher needs it.
    import triton
    import triton.language as tl

    from localmoe.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_kw
except ImportError:  # pragma: no cover
    triton = None
    tl = None

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------------------------
# torch reference
# ----------------------------------------------------------------------------------------------------------
def argmax_next_ref(
    logits, *, ids=None, pos=None, ring=None, host=None, count=None, seen=None, penalty=None
) -> torch.Tensor:
    """What `argmax_next` does, in torch: returns the token (0-d int64) and updates the given outputs."""
    x = logits.float()
    penalised = seen is not None and float(penalty.view(-1)[0]) != 1.0
    if penalised:
        p = penalty.view(-1)[0].float()
        x = torch.where(seen.bool(), torch.where(x < 0, x * p, x / p), x)
    x = torch.where(torch.isnan(x), torch.full_like(x, float("inf")), x)
    token = torch.argmax(x)
    if ids is not None:
        ids.view(-1)[0] = token
    if pos is not None:
        pos.view(-1)[0] += 1
    if count is not None:
        slot = int(count.view(-1)[0])
        if ring is not None:
            ring[slot % ring.numel()] = token
        if host is not None:
            host[slot % host.numel()] = token
        count.view(-1)[0] += 1
    if penalised:
        seen[token] = 1
    return token


# ----------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _argmax_kernel(
        x_ptr,  # logits [V] contiguous
        pm_ptr,  # fp32 [P] workspace: each program's max (rewritten every launch)
        pi_ptr,  # int32 [P] workspace: the first index of that max
        tk_ptr,  # int32 [1] ticket (zero between launches)
        ids_ptr,
        pos_ptr,
        ring_ptr,
        host_ptr,
        cnt_ptr,  # optional outputs (see the flags)
        seen_ptr,
        pen_ptr,  # repetition penalty: uint8 [V] mask, float32 [1] penalty (HAS_PENALTY)
        V,
        P,
        R,
        BLOCK: tl.constexpr,
        P_P2: tl.constexpr,
        HAS_IDS: tl.constexpr,
        HAS_POS: tl.constexpr,
        HAS_RING: tl.constexpr,
        HAS_HOST: tl.constexpr,
        HAS_PENALTY: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pid = tl.program_id(0)
        if PDL:  # kernels/pdl.py: the logits are the kernel before's output
            gdc_wait()
            gdc_launch_dependents()
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        m = offs < V
        x = tl.load(x_ptr + offs, mask=m, other=float("-inf")).to(tl.float32)
        if HAS_PENALTY:
            pen = tl.load(pen_ptr)
            if pen != 1.0:  # seen tokens: divided when positive, multiplied when not
                s = tl.load(seen_ptr + offs, mask=m, other=0)
                xp = tl.where(x < 0, x * pen, tl.math.div_rn(x, pen))
                x = tl.where(s != 0, xp, x)
        x = tl.where(x != x, float("inf"), x)  # NaN counts as the largest
        mx = tl.max(x, axis=0)
        first = tl.min(tl.where((x == mx) & m, offs, V), axis=0)
        tl.store(pm_ptr + pid, mx)
        tl.store(pi_ptr + pid, first)
        done = tl.atomic_add(tk_ptr, 1, sem="acq_rel", scope="gpu")
        if done == P - 1:  # the last program: every partial is visible
            j = tl.arange(0, P_P2)
            jm = j < P
            pm = tl.load(pm_ptr + j, mask=jm, other=float("-inf"), cache_modifier=".cg")
            pi = tl.load(pi_ptr + j, mask=jm, other=V, cache_modifier=".cg")
            best = tl.max(pm, axis=0)
            tok = tl.min(tl.where((pm == best) & jm, pi, V), axis=0).to(tl.int64)
            if HAS_IDS:
                tl.store(ids_ptr, tok)
            if HAS_POS:
                tl.store(pos_ptr, tl.load(pos_ptr) + 1)
            if HAS_RING or HAS_HOST:
                c = tl.load(cnt_ptr)
                if HAS_RING:
                    tl.store(ring_ptr + c % R, tok)
                if HAS_HOST:
                    tl.store(host_ptr + c % R, tok)
                tl.store(cnt_ptr, c + 1)
            if HAS_PENALTY:
                if tl.load(pen_ptr) != 1.0:
                    tl.store(seen_ptr + tok, tl.full((), 1, tl.uint8))
            tl.store(tk_ptr, 0)


def _int64_slot(name: str, t, device) -> None:
    if t is None:
        return
    if t.dtype != torch.int64 or t.numel() < 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous int64 tensor, got {t.dtype} {tuple(t.shape)}")
    if t.device != device and not (
        name == "host" and t.device.type == "cpu" and (device.type != "cuda" or t.is_pinned())
    ):
        raise ValueError(f"{name} is on {t.device}, the logits on {device} (host must be pinned host memory)")


def argmax_next(
    logits: torch.Tensor,
    *,
    ids=None,
    pos=None,
    ring=None,
    host=None,
    count=None,
    seen=None,
    penalty=None,
    block: int = 4096,
    num_warps: int = 4,
) -> None:
    """Greedy token of logits [V] into the given outputs (see the module docstring); returns nothing: the token is
    where the caller asked for it. ring / host need count, and the same number of slots; seen and penalty go
    together (the repetition penalty)."""
    if triton is None:
        raise RuntimeError("argmax_next needs Triton")
    if logits.dim() != 1 or logits.stride(0) != 1:
        raise ValueError(f"logits must be a contiguous [V] vector, got shape {tuple(logits.shape)}")
    if logits.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"logits must be bf16/fp16/fp32, got {logits.dtype}")
    dev = logits.device
    for name, t in (("ids", ids), ("pos", pos), ("ring", ring), ("host", host)):
        _int64_slot(name, t, dev)
    if (ring is not None or host is not None) != (count is not None):
        raise ValueError("ring / host and count go together")
    if count is not None and (count.dtype != torch.int32 or count.device != dev):
        raise ValueError(f"count must be int32 on {dev}, got {count.dtype} on {count.device}")
    if ring is not None and host is not None and ring.numel() != host.numel():
        raise ValueError(f"ring and host need the same slots, got {ring.numel()} and {host.numel()}")
    if (seen is None) != (penalty is None):
        raise ValueError("seen and penalty go together")
    if seen is not None:
        if (
            seen.dtype != torch.uint8
            or seen.device != dev
            or not seen.is_contiguous()
            or seen.numel() != logits.numel()
        ):
            raise ValueError(
                f"seen must be a contiguous uint8 [{logits.numel()}] tensor on {dev}, got {seen.dtype} "
                f"{tuple(seen.shape)} on {seen.device}"
            )
        if penalty.dtype != torch.float32 or penalty.device != dev or penalty.numel() != 1:
            raise ValueError(
                f"penalty must be one float32 on {dev}, got {penalty.dtype} {tuple(penalty.shape)} on {penalty.device}"
            )
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    V = logits.numel()
    P = triton.cdiv(V, block)
    R = (ring if ring is not None else host).numel() if count is not None else 1
    ws = zeroed_int32("argmax_partials", dev, 2 * P + 1)  # the ticket first: it stays zero whatever V was before
    tk, pm, pi = ws[:1], ws[1 : P + 1].view(torch.float32), ws[P + 1 : 2 * P + 1]
    dummy = pi  # never read or written where its flag is off
    _argmax_kernel[(P,)](
        logits,
        pm,
        pi,
        tk,
        ids if ids is not None else dummy,
        pos if pos is not None else dummy,
        ring if ring is not None else dummy,
        host if host is not None else dummy,
        count if count is not None else dummy,
        seen if seen is not None else dummy,
        penalty if penalty is not None else dummy,
        V,
        P,
        R,
        BLOCK=block,
        P_P2=triton.next_power_of_2(P),
        HAS_IDS=ids is not None,
        HAS_POS=pos is not None,
        HAS_RING=ring is not None,
        HAS_HOST=host is not None,
        HAS_PENALTY=seen is not None,
        num_warps=num_warps,
        **pdl_kw(logits),
    )
