"""The department-shared gate predictor's kernels (issue #23): stage 1, and what `sparse_fused` needs for stages 2-3.

Owns `GatePredictor` (the argument `kernels/sparse_fused.py`'s `predictor=` takes) with its launch check
`check_predictor`, `department_basis` (Triton launcher) with its torch reference `department_basis_ref`, the stage
1 + 2 reference `candidates_ref`, and one kernel `_department_basis_kernel`. The math (localmoe/experts/predicted.py):
a layer's experts are grouped into N departments, department d has a shared basis B_d [r, H], expert e a private map
C_e [I, r], both stored as int8 rows with an fp32 scale a row (`quantize_rows`: B_d = sB_d * qB_d, C_e = sC_e * qC_e;
half the bytes of bf16 maps, a quarter of fp32's, with the calibration recall unchanged on localmoe-tiny); for a
token x routed to experts e of departments d(e):

    stage 1  z_d = sB_d * (qB_d . x)        once per department the token's experts touch (this file)
    stage 2  cand = |silu(sC_e * (qC_e . z_d(e)))| >= tau'_e         (sparse_fused, PRED mode)
    stage 3  the candidates' exact gate rows only, keep |g| >= tau   (sparse_fused, as without a predictor)

`_department_basis_kernel`, grid (T*k, ceil(r / BLOCK_R)): program (tj, b) takes slot j of token t (tj = t*k + j),
expert e = experts[t, j], department d = dept_of[e]. If an earlier slot j' < j of token t has the same department it
returns at once (each touched B_d is read once per token); else it writes z[t, d, b*BLOCK_R : (b+1)*BLOCK_R] =
B_d[rows] . x_t, accumulated in fp32, from one full-width [BLOCK_R, next_pow2(H)] tile (no serial loop over H unless
the tile would exceed 64 elements per thread: then BLOCK_H-wide chunks). Rows of z of departments no expert of token
t touches are not written (and sparse_fused never reads them). Fixed grid, no host sync: CUDA-graph capturable
(`out=` keeps z's address). Programmatic dependent launch (kernels/pdl.py): it waits first (the expert ids are the
router's output), then lets sparse_fused launch; sparse_fused's own wait covers its reads of z.

tau'_e [I] is a threshold a neuron (row of C_e), stored in fp16: the fit lowers each row's threshold by a multiple
of how far its predictions strayed on the calibration text (localmoe/experts/predictor.py), so neurons predicted
well need less margin.

Shape legend: T = tokens, k = experts per token, E = experts, N = departments, r = predictor rank, I = expert width,
H = hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:  # Triton is optional at import time; the launcher needs it.
    import triton
    import triton.language as tl

    from localmoe.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_kw
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INT_DTYPES = (torch.int32, torch.int64)
TILE_PER_THREAD = 64  # register tile elements per thread a program may hold (kernels/sparse_fused.py's launch notes)


@dataclass(frozen=True)
class GatePredictor:
    """What `sparse_fused(..., predictor=)` needs to run stages 2 + 3 for one launch."""

    z: torch.Tensor  # [T, N, r] fp32 contiguous: B_d x per (token, department), filled by department_basis this step
    C: torch.Tensor  # [E, I, r] int8 the experts' private maps (quantize_rows), rows contiguous
    C_scale: torch.Tensor  # [E, I] fp32 contiguous: each row's scale
    dept_of: torch.Tensor  # [E] int32/int64: each expert's department
    tau_rows: torch.Tensor  # [E, I] fp16 contiguous: neuron i of expert e is a candidate when |silu(C_e . z_d)|_i >= it
    experts: torch.Tensor | None = None  # [T, k] expert ids when sparse_fused's expert_ids hold cache slots (copy mode)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [..., n], scale fp32 [...]): symmetric per-row int8, w ~ scale * q with scale = max|row| / 127 (an
    all-zero row gets scale 0). The predictor's maps B and C are stored and read this way."""
    amax = w.detach().abs().amax(-1).to(torch.float64)
    scale = (amax / 127.0).to(torch.float32)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale)).to(torch.float64)
    q = torch.round(w.detach().to(torch.float64) / safe[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (q.to(torch.float64) * scale.to(torch.float64)[..., None]).to(dtype)


# ----------------------------------------------------------------------------------------------------------
# torch references
# ----------------------------------------------------------------------------------------------------------
def department_basis_ref(x, B, B_scale, dept_of, experts) -> torch.Tensor:
    """z [T, N, r] fp32: z[t, d] = sB_d * (qB_d . x_t) (fp32) for every department d an expert of token t belongs to;
    the rows of untouched departments are 0."""
    T, N = x.shape[0], B.shape[0]
    z = torch.einsum("nrh,th->tnr", B.float(), x.float()) * B_scale.float()[None]
    touched = torch.zeros(T, N, dtype=torch.bool, device=x.device)
    touched.scatter_(1, dept_of.long()[experts.long()], True)
    return z * touched[:, :, None]


def candidates_ref(x, B, B_scale, C, C_scale, dept_of, experts, tau_rows) -> torch.Tensor:
    """bool [T, k, I]: stages 1 + 2, the neurons of each routed expert experts[t, j] whose predicted gate
    |silu(sC_e * (qC_e . z_d(e)))| (fp32) reaches their threshold tau_rows[e] (fp16 [E, I])."""
    z = department_basis_ref(x, B, B_scale, dept_of, experts)  # [T, N, r]
    e = experts.long()
    d = dept_of.long()[e]  # [T, k]
    zt = z.gather(1, d[:, :, None].expand(-1, -1, z.shape[2]))  # [T, k, r]
    p = torch.einsum("tkir,tkr->tki", C[e].float(), zt) * C_scale.float()[e]
    return torch.nn.functional.silu(p).abs() >= tau_rows.float()[e]


# ----------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _department_basis_kernel(
        x_ptr,  # [T, H] any float, row stride stride_xt, last dim contiguous
        b_ptr,  # [N, r, H] int8, rows contiguous, department stride stride_bd
        bs_ptr,  # [N, r] fp32 contiguous: each row's scale
        dept_ptr,  # [E] int32/int64
        exp_ptr,  # [T*k] int32/int64 expert ids
        z_ptr,  # [T, N, r] fp32 contiguous
        R,  # rank r
        NDEPT,  # departments N
        K,  # experts per token
        stride_xt,
        stride_bd,
        H: tl.constexpr,
        BLOCK_R: tl.constexpr,
        BLOCK_H: tl.constexpr,  # next_pow2(H), or a smaller chunk when the whole row tile would not fit
        K_P2: tl.constexpr,  # next power of two >= K
        PDL: tl.constexpr,
    ):
        if PDL:  # the expert ids are the router's output: nothing of this step is read before the wait
            gdc_wait()
            gdc_launch_dependents()
        tj = tl.program_id(0)
        t = tj // K
        j = tj - t * K
        e = tl.load(exp_ptr + tj).to(tl.int64)
        d = tl.load(dept_ptr + e).to(tl.int64)
        # ---- an earlier slot of token t in the same department computes z[t, d]: this one does nothing ----
        kk = tl.arange(0, K_P2)
        prev = kk < j
        pe = tl.load(exp_ptr + t * K + kk, mask=prev, other=0).to(tl.int64)
        pd = tl.load(dept_ptr + pe, mask=prev, other=-1).to(tl.int64)
        dup = tl.sum((prev & (pd == d)).to(tl.int32), axis=0)
        if dup == 0:
            rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
            rmask = rows < R
            cols = tl.arange(0, BLOCK_H)
            brow = b_ptr + d * stride_bd + rows.to(tl.int64)[:, None] * H  # [BLOCK_R, 1]
            xrow = x_ptr + t.to(tl.int64) * stride_xt
            if BLOCK_H >= H:  # one full-width tile: every byte in flight at once
                cm = cols < H
                w = tl.load(brow + cols[None, :], mask=rmask[:, None] & cm[None, :], other=0.0)
                xv = tl.load(xrow + cols, mask=cm, other=0.0).to(tl.float32)
                acc = tl.sum(w.to(tl.float32) * xv[None, :], axis=1)
            else:  # very wide H: BLOCK_H-wide chunks
                acc = tl.zeros([BLOCK_R], dtype=tl.float32)
                for h0 in range(0, H, BLOCK_H):
                    hh = h0 + cols
                    cm = hh < H
                    w = tl.load(brow + hh[None, :], mask=rmask[:, None] & cm[None, :], other=0.0)
                    xv = tl.load(xrow + hh, mask=cm, other=0.0).to(tl.float32)
                    acc += tl.sum(w.to(tl.float32) * xv[None, :], axis=1)
            sc = tl.load(bs_ptr + d * R + rows, mask=rmask, other=0.0)
            tl.store(z_ptr + (t.to(tl.int64) * NDEPT + d) * R + rows, acc * sc, mask=rmask)


# ----------------------------------------------------------------------------------------------------------
# launcher
# ----------------------------------------------------------------------------------------------------------
def department_basis(x, B, B_scale, dept_of, experts, out=None, *, BLOCK_R: int | None = None, num_warps: int = 4):
    """Stage 1: z[t, d] = sB_d * (qB_d . x_t) (fp32 accumulate) for each department d an expert of token t touches,
    each B_d read once per token. Returns z [T, N, r] fp32 (into `out` when given: contiguous fp32 [T, N, r] on x's
    device); rows of untouched departments are left as they are.

    x [T, H] bf16/fp16/fp32 (last dim contiguous); B [N, r, H] int8 (`quantize_rows`), rows contiguous, any
    department stride; B_scale [N, r] fp32 contiguous; dept_of [E] int32/int64 (values in [0, N): not checked,
    that would sync); experts [T, k] int32/int64 expert ids (values in [0, E)). BLOCK_R (a power of two) defaults
    to a tile of 32 elements per thread (H 2048, 4 warps: 2). Fixed grid, no host sync: CUDA-graph capturable with
    `out=`."""
    if triton is None:
        raise RuntimeError("department_basis needs triton")
    if x.dim() != 2 or x.dtype not in _FLOAT_DTYPES or x.stride(1) != 1:
        raise ValueError(
            f"x must be a bf16/fp16/fp32 [T, H] tensor with a contiguous last dim, got {x.dtype} {tuple(x.shape)}"
        )
    T, H = x.shape
    dev = x.device
    if B.dim() != 3 or B.shape[2] != H or B.dtype != torch.int8:
        raise ValueError(f"B must be an int8 [N, r, H] tensor with H = {H}, got {B.dtype} {tuple(B.shape)}")
    N, r, _ = B.shape
    if tuple(B_scale.shape) != (N, r) or B_scale.dtype != torch.float32 or not B_scale.is_contiguous():
        raise ValueError(
            f"B_scale must be a contiguous fp32 [N, r] = {(N, r)} tensor, got {B_scale.dtype} {tuple(B_scale.shape)}"
        )
    if N < 1 or r < 1:
        raise ValueError(f"B needs at least one department and rank 1, got shape {tuple(B.shape)}")
    if B.stride(2) != 1 or (r > 1 and B.stride(1) != H):
        raise ValueError(f"B rows must be contiguous (stride(2) == 1, stride(1) == H), got strides {B.stride()}")
    if dept_of.dim() != 1 or dept_of.dtype not in _INT_DTYPES or dept_of.shape[0] < 1:
        raise ValueError(f"dept_of must be an int32/int64 [E] tensor, got {dept_of.dtype} {tuple(dept_of.shape)}")
    if experts.dim() != 2 or experts.shape[0] != T or experts.dtype not in _INT_DTYPES:
        raise ValueError(f"experts must be int32/int64 [T, k] with T = {T}, got {experts.dtype} {tuple(experts.shape)}")
    for name, tns in (("B", B), ("B_scale", B_scale), ("dept_of", dept_of), ("experts", experts)):
        if tns.device != dev:
            raise ValueError(f"{name} is on {tns.device}, x is on {dev}: all inputs must share a device")
    if out is None:
        out = torch.empty(T, N, r, dtype=torch.float32, device=dev)
    elif tuple(out.shape) != (T, N, r) or out.dtype != torch.float32 or not out.is_contiguous() or out.device != dev:
        raise ValueError(f"out must be a contiguous fp32 [T, N, r] = {(T, N, r)} tensor on {dev}")
    k = experts.shape[1]
    if T == 0 or k == 0:
        return out
    h_p2 = triton.next_power_of_2(H)
    budget = TILE_PER_THREAD * 32 * num_warps  # tile elements a program may hold
    if BLOCK_R is None:
        br = max(1, min(triton.next_power_of_2(r), budget // 2 // h_p2))
    else:
        br = max(1, min(triton.next_power_of_2(BLOCK_R), triton.next_power_of_2(r)))
    bh = min(h_p2, max(16, budget // br))
    _department_basis_kernel[(T * k, triton.cdiv(r, br))](
        x,
        B,
        B_scale,
        dept_of,
        experts.contiguous(),
        out,
        r,
        N,
        k,
        x.stride(0),
        B.stride(0),
        H=H,
        BLOCK_R=br,
        BLOCK_H=bh,
        K_P2=triton.next_power_of_2(k),
        num_warps=num_warps,
        **pdl_kw(x),
    )
    return out


def check_predictor(p: GatePredictor | None, x, T: int, k: int, E: int, I: int) -> dict:
    """Checks `predictor=` against the launch (x, T tokens, k experts each, E experts or cache slots, width I) and
    returns the kernel's arguments for it: pointers (z, C, C_scale, tau_rows, dept_of, the predictor's expert ids),
    scalars (r, N, C's expert stride) and R_P2; without a predictor, dummies that are never read."""
    if p is None:
        return {"tensors": (x, x, x, x, x, x), "scalars": (1, 1, 0), "R_P2": 1}
    dev = x.device
    z, C, dept = p.z, p.C, p.dept_of
    if z.dim() != 3 or z.shape[0] != T or z.dtype != torch.float32 or not z.is_contiguous() or z.device != dev:
        raise ValueError(
            f"predictor.z must be a contiguous fp32 [T, N, r] tensor with T = {T} on {dev}, got {z.dtype} "
            f"{tuple(z.shape)} on {z.device}"
        )
    _, N, r = z.shape
    if N < 1 or r < 1:
        raise ValueError(f"predictor.z needs N >= 1 departments and rank r >= 1, got shape {tuple(z.shape)}")
    if C.dim() != 3 or C.shape[1:] != (I, r) or C.dtype != torch.int8 or C.device != dev:
        raise ValueError(
            f"predictor.C must be an int8 [E, I, r] tensor with I = {I}, r = {r} on {dev}, got {C.dtype} "
            f"{tuple(C.shape)} on {C.device}"
        )
    if C.stride(2) != 1 or (I > 1 and C.stride(1) != r):
        raise ValueError(f"predictor.C rows must be contiguous (stride(2) == 1, stride(1) == r), got {C.stride()}")
    E_p = C.shape[0]
    cs = p.C_scale
    if tuple(cs.shape) != (E_p, I) or cs.dtype != torch.float32 or not cs.is_contiguous() or cs.device != dev:
        raise ValueError(
            f"predictor.C_scale must be a contiguous fp32 [E, I] = {(E_p, I)} tensor on {dev}, got {cs.dtype} "
            f"{tuple(cs.shape)} on {cs.device}"
        )
    if dept.dim() != 1 or dept.shape[0] != E_p or dept.dtype not in _INT_DTYPES or dept.device != dev:
        raise ValueError(
            f"predictor.dept_of must be an int32/int64 [E] = [{E_p}] tensor on {dev} (C's experts), got "
            f"{dept.dtype} {tuple(dept.shape)} on {dept.device}"
        )
    ids = p.experts
    if ids is None:
        if E_p != E:
            raise ValueError(
                f"predictor.C has {E_p} experts, the weights {E}: in copy mode (expert_ids hold cache slots) give "
                f"predictor.experts, the expert ids"
            )
    elif tuple(ids.shape) != (T, k) or ids.dtype not in _INT_DTYPES or ids.device != dev:
        raise ValueError(
            f"predictor.experts must be int32/int64 [T, k] = {(T, k)} on {dev}, got {ids.dtype} {tuple(ids.shape)}"
        )
    tr = p.tau_rows
    if tuple(tr.shape) != (E_p, I) or tr.dtype != torch.float16 or not tr.is_contiguous() or tr.device != dev:
        raise ValueError(
            f"predictor.tau_rows must be a contiguous fp16 [E, I] = {(E_p, I)} tensor on {dev}, got {tr.dtype} "
            f"{tuple(tr.shape)} on {tr.device}"
        )
    pexp = ids.contiguous() if ids is not None else dept
    return {"tensors": (z, C, cs, tr, dept, pexp), "scalars": (r, N, C.stride(0)), "R_P2": triton.next_power_of_2(r)}
