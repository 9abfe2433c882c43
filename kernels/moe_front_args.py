"""The argument checks of a `moe_front` launch (kernels/moe_front.py) for the work its launch can take beside the
router: the shared expert (`shared_expert=`, `acc=`), the gate predictor's stage 1 (`basis=`) and DeaMoE's department
slots (`slots=`). Each raises ValueError naming the argument and what it must be, and returns the launch's sizes for
it; the launcher stays the dispatcher.

Shape legend: H hidden, I_s shared expert width, N departments, r predictor rank, S slots, n experts per department.
"""

from __future__ import annotations

import torch


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def check_shared(shared_expert, w_sg, acc, shared_block: int, x: torch.Tensor, H: int) -> int:
    """`shared_expert` = (w_gate, w_up, w_down_t) [I_s, H] contiguous in x's dtype, with w_sg and the fp32 row `acc`
    -> I_s (0 without it)."""
    if shared_expert is None:
        if acc is not None:
            raise ValueError("acc= is what shared_expert= adds into: give both or neither")
        return 0
    if w_sg is None or acc is None:
        raise ValueError("shared_expert= needs w_sg (its sigmoid gate) and acc= (the fp32 [H] row it adds into)")
    if acc.dtype != torch.float32 or acc.numel() != H or not acc.is_contiguous() or acc.device != x.device:
        raise ValueError(f"acc must be a contiguous fp32 tensor of H = {H} values on {x.device}")
    I_s = shared_expert[0].shape[0] if shared_expert[0].dim() == 2 else -1
    for name, sw in zip(("w_gate", "w_up", "w_down_t"), shared_expert):
        if sw.dim() != 2 or tuple(sw.shape) != (I_s, H) or not sw.is_contiguous():
            raise ValueError(
                f"shared_expert {name} must be a contiguous [I_s, H] = [{I_s}, {H}] tensor, got {tuple(sw.shape)}"
            )
        if sw.dtype != x.dtype or sw.device != x.device:
            raise ValueError(f"shared_expert {name} must be {x.dtype} on {x.device}, got {sw.dtype} on {sw.device}")
    if shared_block < 1 or shared_block & (shared_block - 1):
        raise ValueError(f"shared_block must be a power of two, got {shared_block}")
    return I_s


def check_basis(basis, basis_block: int | None, x: torch.Tensor, H: int, num_warps: int) -> tuple[int, int]:
    """`basis` = (B int8 [N, r, H], B_scale fp32 [N, r], z fp32 of N·r values), all contiguous on x's device ->
    (N·r rows, rows a program: `basis_block`, default a tile of 32 elements a thread); (0, 1) without it."""
    if basis is None:
        return 0, 1
    B, B_scale, z = basis
    if B.dim() != 3 or B.shape[2] != H or B.dtype != torch.int8 or not B.is_contiguous():
        raise ValueError(f"basis B must be a contiguous int8 [N, r, {H}] tensor, got {B.dtype} {tuple(B.shape)}")
    nb = B.shape[0] * B.shape[1]
    if tuple(B_scale.shape) != tuple(B.shape[:2]) or B_scale.dtype != torch.float32 or not B_scale.is_contiguous():
        raise ValueError(f"basis B_scale must be a contiguous fp32 {tuple(B.shape[:2])} tensor")
    if z.numel() != nb or z.dtype != torch.float32 or not z.is_contiguous():
        raise ValueError(f"basis z must be a contiguous fp32 tensor of N·r = {nb} values")
    if any(t.device != x.device for t in (B, B_scale, z)):
        raise ValueError("basis tensors must be on x's device")
    bb = basis_block if basis_block is not None else max(1, 32 * 32 * num_warps // _pow2(H))
    if bb < 1 or bb & (bb - 1):
        raise ValueError(f"basis_block must be a power of two, got {bb}")
    return nb, min(bb, _pow2(nb))


def check_slots(slots, group_n: int, x: torch.Tensor) -> tuple[int, int]:
    """`slots` = (n, dept int32 [S], weights fp32 [S, 1, n]), contiguous on x's device, with the group-limited top-k
    of departments of n = group_n experts -> (n, S); (0, 0) without it."""
    if slots is None:
        return 0, 0
    sn, dept, sw = slots
    ss = dept.numel()
    if not group_n or sn != group_n:
        raise ValueError(f"slots= is DeaMoE's: n must be the group-limited top-k's group_size, got {sn}")
    if dept.dtype != torch.int32 or not dept.is_contiguous() or ss < 1:
        raise ValueError("slots dept must be a contiguous int32 tensor of S >= 1 values")
    if tuple(sw.shape) != (ss, 1, sn) or sw.dtype != torch.float32 or not sw.is_contiguous():
        raise ValueError(f"slots weights must be a contiguous fp32 [S, 1, n] = {(ss, 1, sn)} tensor")
    if dept.device != x.device or sw.device != x.device:
        raise ValueError("slots tensors must be on x's device")
    return sn, ss
