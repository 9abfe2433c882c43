"""DeaMoE's department-grouped sparse decode (a step of T <= 8 tokens, T = 1 the usual case).

Owns `department_experts` (launcher), its torch reference `department_experts_ref`, and three kernels
(`_dept_up_private_kernel`, `_dept_down_kernel`, `_dept_one_kernel`) running two programs: the up/private stage's
`up_private_program` (kernels/department_up.py) and the down stage's `down_program` (kernels/department_down.py).
The step's departments sit in S fixed slots (`dept` [S], -1 = unused: the grid never depends on the routing, so the
step can be captured in a CUDA graph); `weights` [S, T, n] holds token t's routing weight for expert j of the slot's
department (0 = not chosen). For a slot s with department d, token t, a = silu(x_t W_gate_d^T), kept neurons
K = {i : |a_i| >= tau[d]} (only tokens with a chosen expert in d):

    u[s,t,i] = a_i (x_t . W_up_d[i])                            i in K, else 0             `_dept_up_private_kernel`
    z[s,t,:] = sum_j weights[s,t,j] sum_{i in K} u[s,t,i] P_{d,j}[i, :]                    (the same launch)
    y[t, :] += sum_i z[s,t,i] W_down_t_d[i, :]                                             `_dept_down_kernel`

(with `tau_z` [D], z entries with |z| < tau_z[d] are dropped first, and a W_down_t row no token keeps is not read).

Grids: up/private (S, h / BLOCK_N): a program reads a block of gate rows once for all T tokens, up rows only where
kept, and adds its neurons' share of z, reading the kept rows of each chosen expert's P once for all T tokens
(kernels/department_up.py); down (H / BLOCK_O, S, row splits) reads the department's W_down_t once (z is dense unless
tau_z) and adds into y atomically (kernels/department_down.py). z and the down kernel's tickets live in a zeroed
workspace (kernels/workspace.py): the last down program of each slot re-zeroes the slot's z, and the first kernel
zeroes y (unless accumulating): no memset launch. With `residual` the last slot to finish publishes residual + y and
zeroes y (a fused decoder layer's tail). Both kernels use programmatic dependent launch (kernels/pdl.py). The kept
count (tokens x kept neurons) is added into `kept_total`. One launch (`_dept_one_kernel`, the default for one token
read from VRAM: 1.3-2.4% faster decode steps of the Qwen3.5-35B twin on an H100): the same programs in one grid,
roles taken by ticket in the order programs start (up/private first), each down program loading its W_down rows
before it waits on a counter of finished up programs.

Shape legend: T tokens, D departments, n experts per department, h department width, H hidden, S slots.
Weight layout: w_gate, w_up, w_down_t [D, h, H] and private [D, n, h, h] (row i = input neuron i), rows contiguous.
"""

from __future__ import annotations

import torch

from localmoe.kernels.checks import FLOAT_DTYPES, expert_weights
from localmoe.kernels.workspace import zeroed_int32

try:
    import triton
    import triton.language as tl

    from localmoe.kernels.department_down import down_program
    from localmoe.kernels.department_up import up_private_program
    from localmoe.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_kw
    from localmoe.kernels.residual_publish import residual_publish
except ImportError:  # pragma: no cover
    triton = None
    tl = None

MAX_TOKENS = 8


def _unpack_pools(pools) -> tuple:
    """`pools` (gate, up, down, private pools, dept_map, private_map[, up_slots[, down_slots]]) -> the same with
    up_slots and down_slots (the department slots whose up / down projection is in its pool: slots [0, up_slots) and
    [0, down_slots); defaults: the up and down pools' sizes). A slot >= 0 always has its gate in the gate pool."""
    gp, upp, dp, pp, dmap, pmap, *rest = pools
    up_slots = int(rest[0]) if rest else upp.shape[0]
    return gp, upp, dp, pp, dmap, pmap, up_slots, int(rest[1]) if len(rest) > 1 else dp.shape[0]


def department_experts_ref(
    x, w_gate, w_up, w_down_t, private, dept, weights, tau, private_slots=None, pools=None, host_elems=None, tau_z=None
):
    """Torch reference reading only kept rows of W_up and P: -> (y [T, H] fp32, kept count as a 0-d int64).
    With `private_slots` [S, n], private is a pool [P, h, h] and expert j of slot s is private[private_slots[s, j]].
    With `pools` (direct offloading, module doc), a department / expert the maps place in a pool is read there, any
    other from the host master copies (w_gate... / private); `host_elems` (0-d int64) gets the elements read from
    the host added (gate rows, kept up rows, down rows, kept private rows). `tau_z` [D]: z entries under it are
    dropped, and W_down rows no token keeps are not read."""
    ps = private_slots.tolist() if private_slots is not None else None
    if pools is not None:
        gp, upp, dp, pp, dmap, pmap, up_slots, down_slots = _unpack_pools(pools)
        dmap, pmap = dmap.tolist(), pmap.tolist()
    T, H = x.shape
    h = w_gate.shape[1]
    n = weights.shape[2]
    y = torch.zeros(T, H, dtype=torch.float32, device=x.device)
    kept = torch.zeros((), dtype=torch.int64, device=x.device)
    from_host = 0
    for s, d in enumerate(dept.tolist()):
        if d < 0:
            continue
        g_w, u_w, d_w = w_gate[d], w_up[d], w_down_t[d]
        on_host = pools is not None and dmap[d] < 0
        up_host = pools is not None and not 0 <= dmap[d] < up_slots
        down_host = pools is not None and not 0 <= dmap[d] < down_slots
        if pools is not None and not on_host:
            g_w = gp[dmap[d]]
            if not up_host:
                u_w = upp[dmap[d]]
            if not down_host:
                d_w = dp[dmap[d]]
        if on_host:
            from_host += h * H  # the gate, read once for the slot
        z_rows: set = set()  # W_down rows some token keeps (read once for the slot)
        live: dict[int, set] = {}  # expert j -> kept neurons of the tokens that chose it (its P rows read once)
        for t in range(T):
            w = weights[s, t].float()
            if not bool((w != 0).any()):
                continue
            xt = x[t].float()
            a = torch.nn.functional.silu(g_w.float() @ xt)  # [h]
            keep = (a.abs() >= tau[d].float()).nonzero().squeeze(1)
            kept += keep.numel()
            if up_host:
                from_host += keep.numel() * H  # kept up rows (for this token)
            u = a[keep] * (u_w.index_select(0, keep).float() @ xt)  # [kept]
            z = torch.zeros(h, dtype=torch.float32, device=x.device)
            for j in (w != 0).nonzero().squeeze(1).tolist():
                if ps is not None:
                    pj = private[ps[s][j]]
                elif pools is not None and pmap[d * n + j] >= 0:
                    pj = pp[pmap[d * n + j]]
                else:
                    pj = private[d, j]
                    if pools is not None:
                        live.setdefault(j, set()).update(keep[u != 0].tolist())
                z += w[j] * (u @ pj.index_select(0, keep).float())
            if tau_z is not None:
                z = torch.where(z.abs() >= tau_z[d].float(), z, torch.zeros_like(z))
                z_rows.update(z.nonzero().squeeze(1).tolist())
            else:
                z_rows.update(range(h))
            y[t] += z @ d_w.float()
        from_host += sum(len(rows) for rows in live.values()) * h
        if down_host:
            from_host += len(z_rows) * H
    if host_elems is not None:
        host_elems += from_host
    return y, kept


if triton is not None:

    @triton.jit
    def _dept_up_private_kernel(
        x_ptr, wg_ptr, wu_ptr, p_ptr, dept_ptr, w_ptr, tau_ptr, z_ptr, y_ptr, y_chunk, kept_ptr, seen_ptr,
        ps_ptr, gp_ptr, up_ptr, pp_ptr, dmap_ptr, pmap_ptr, hc_ptr,
        T, h, n, stride_xt, stride_gd, stride_ud, stride_pd, stride_pe, stride_pool, stride_pp, up_slots,
        H: tl.constexpr, H_P2: tl.constexpr, N_P2: tl.constexpr, T_P2: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_Z: tl.constexpr, COUNT: tl.constexpr, SEEN: tl.constexpr, DIRECT: tl.constexpr,
        INDEXED: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:  # the slot's department comes from the step's routing: nothing is read before the wait
            gdc_wait()
            gdc_launch_dependents()
        up_private_program(
            tl.program_id(0), tl.program_id(1), tl.num_programs(1), x_ptr, wg_ptr, wu_ptr, p_ptr, dept_ptr, w_ptr,
            tau_ptr, z_ptr, y_ptr, y_chunk, kept_ptr, seen_ptr, ps_ptr, gp_ptr, up_ptr, pp_ptr, dmap_ptr, pmap_ptr,
            hc_ptr, T, h, n, stride_xt, stride_gd, stride_ud, stride_pd, stride_pe, stride_pool, stride_pp, up_slots,
            H, H_P2, N_P2, T_P2, BLOCK_N, BLOCK_Z, COUNT, SEEN, DIRECT, INDEXED,
        )  # fmt: skip

    @triton.jit
    def _dept_down_kernel(
        wd_ptr, dept_ptr, z_ptr, y_ptr, dp_ptr, dmap_ptr, hc_ptr, tz_ptr, tick_ptr, res_ptr, out_ptr,
        T, h, S, stride_dd, stride_pool, stride_res, stride_out, down_slots,
        H: tl.constexpr, H_P2: tl.constexpr, T_P2: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_O: tl.constexpr,
        ROWS: tl.constexpr, DIRECT: tl.constexpr, ZMASK: tl.constexpr, TAIL: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        down_program(
            tl.program_id(0), tl.program_id(1), tl.program_id(2), tl.num_programs(0) * tl.num_programs(2), wd_ptr,
            dept_ptr, z_ptr, y_ptr, dp_ptr, dmap_ptr, hc_ptr, tz_ptr, tick_ptr, res_ptr, out_ptr, T, h, S, stride_dd,
            stride_pool, stride_res, stride_out, down_slots, 0.0, tick_ptr,
            H, H_P2, T_P2, BLOCK_I, BLOCK_O, ROWS, DIRECT, ZMASK, TAIL, False, False,
        )  # fmt: skip

    @triton.jit
    def _dept_one_kernel(
        x_ptr, wg_ptr, wu_ptr, p_ptr, dept_ptr, w_ptr, tau_ptr, z_ptr, y_ptr, y_chunk, kept_ptr, seen_ptr,
        ps_ptr, gp_ptr, up_ptr, pp_ptr, dmap_ptr, pmap_ptr, hc_ptr,
        wd_ptr, dp_ptr, tz_ptr, tick_ptr, res_ptr, out_ptr, role_ptr, done_ptr, NB, NCB, NSPLIT,
        T, h, n, S, stride_xt, stride_gd, stride_ud, stride_pd, stride_pe, stride_pool, stride_pp, up_slots,
        stride_dd, stride_res, stride_out, down_slots,
        H: tl.constexpr, H_P2: tl.constexpr, N_P2: tl.constexpr, T_P2: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_Z: tl.constexpr, BLOCK_O: tl.constexpr, ROWS: tl.constexpr, COUNT: tl.constexpr, SEEN: tl.constexpr,
        DIRECT: tl.constexpr, INDEXED: tl.constexpr, ZMASK: tl.constexpr, TAIL: tl.constexpr, PRE: tl.constexpr,
        PDL: tl.constexpr,
    ):  # fmt: skip
        # both phases in one launch: a program takes a ticket (the order programs start in) and is an up/private
        # program for tickets [0, S * NB), a down program after; a down program loads its W_down rows first, then
        # waits until every up program has added its share of z. A waiting program's ticket is higher than every up
        # program's, and those started before it (they took their tickets): the wait always ends. The program with
        # the last ticket re-zeroes the ticket counter (every program has read it), the down phase's last program
        # the done counter.
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        n_up = S * NB
        ticket = tl.atomic_add(role_ptr, 1, sem="relaxed")
        if ticket == n_up + NCB * S * NSPLIT - 1:
            tl.store(role_ptr, 0)
        if ticket < n_up:
            up_private_program(
                ticket // NB, ticket % NB, NB, x_ptr, wg_ptr, wu_ptr, p_ptr, dept_ptr, w_ptr, tau_ptr, z_ptr, y_ptr,
                y_chunk, kept_ptr, seen_ptr, ps_ptr, gp_ptr, up_ptr, pp_ptr, dmap_ptr, pmap_ptr, hc_ptr,
                T, h, n, stride_xt, stride_gd, stride_ud, stride_pd, stride_pe, stride_pool, stride_pp, up_slots,
                H, H_P2, N_P2, T_P2, BLOCK_N, BLOCK_Z, COUNT, SEEN, DIRECT, INDEXED,
            )  # fmt: skip
            tl.atomic_add(done_ptr, 1, sem="release", scope="gpu")  # after this program's z and y writes
        else:
            r = ticket - n_up
            cb = r % NCB
            s = (r // NCB) % S
            split = r // (NCB * S)
            wd = 0.0
            if PRE:  # (neither DIRECT nor ZMASK) the rows this program multiplies, loaded while the up programs run
                d = tl.load(dept_ptr + s)
                cols = cb * BLOCK_O + tl.arange(0, BLOCK_O)
                ii = split * ROWS + tl.arange(0, ROWS)
                dm = ((ii < h) & ((ii * 0 + d) >= 0))[:, None] & (cols < H)[None, :]  # masks are blocks
                doff = ii.to(tl.int64)[:, None] * H + cols[None, :]
                wd = tl.load(wd_ptr + tl.maximum(d, 0).to(tl.int64) * stride_dd + doff, mask=dm, other=0.0)
            done = tl.atomic_add(done_ptr, 0, sem="acquire", scope="gpu")
            while done < n_up:
                done = tl.atomic_add(done_ptr, 0, sem="acquire", scope="gpu")
            down_program(
                cb, s, split, NCB * NSPLIT, wd_ptr, dept_ptr, z_ptr, y_ptr, dp_ptr, dmap_ptr, hc_ptr, tz_ptr,
                tick_ptr, res_ptr, out_ptr, T, h, S, stride_dd, stride_pool, stride_res, stride_out, down_slots, wd,
                done_ptr, H, H_P2, T_P2, ROWS, BLOCK_O, ROWS, DIRECT, ZMASK, TAIL, PRE, True,
            )  # fmt: skip


def _split(rows: int, block: int, target: int) -> tuple[int, int]:
    """(rows per program, programs) splitting `rows` into chunks of about `target` rows, multiples of `block`."""
    per = max(block, (min(rows, target) + block - 1) // block * block)
    return per, (rows + per - 1) // per


def department_experts(
    x, w_gate, w_up, w_down_t, private, dept, weights, tau, out=None, *, accumulate=False, kept_total=None,
    seen_total=None, private_slots=None, pools=None, host_elems=None, tau_z=None, residual=None,
    BLOCK_N: int = 8, BLOCK_I: int = 0, BLOCK_Z: int = 1024, BLOCK_O: int = 128, SPLIT_ROWS: int = 96,
    ONE_LAUNCH: bool | None = None, ONE_ROWS: int = 0, num_warps: int = 4,
):  # fmt: skip
    """y [T, H] fp32 = the department-grouped DeaMoE experts of a step (module doc); `out` is zeroed and filled, or
    with `accumulate=True` added into (what it held stays: e.g. the shared expert's output from kernels/moe_front.py).

    x [T, H] (T <= MAX_TOKENS), w_gate/w_up/w_down_t [D, h, H], private [D, n, h, h] (bf16/fp16/fp32, rows
    contiguous), dept [S] int32 (-1 = unused slot), weights [S, T, n] fp32, tau [D] fp32; `kept_total` (0-d int64)
    gets the kept (token, neuron) count added, `seen_total` (0-d int64) the (token, neuron) count considered (the
    step's (token, department) pairs x h): a module's sparsity counters, added in place with no launch of their own.
    With `private_slots` [S, n] int32, private is a pool [P, h, h] and
    expert j of slot s reads private[private_slots[s, j]] (an expert cache's slots; entries of unchosen experts are
    never read).

    Direct offloading, `pools` = (gate_pool, up_pool, down_pool [P, h, H], private_pool [Q, h, h], dept_map [D] int32,
    private_map [D * n] int32[, up_slots[, down_slots]]): w_gate... and private are the host master copies (pinned when
    x is on CUDA: read through unified addressing), dept holds department numbers, and a department / expert whose map
    entry is a slot >= 0 is read from that pool slot (its up projection only when the slot is below up_slots, its down
    projection only below down_slots, defaults the up and down pools' sizes: those pools may be shorter), any other
    straight from host memory (no copy, no host sync: graph capturable).
    `host_elems` (0-d int64 on x's device) gets the elements read from host memory added.

    `residual` [T, H] (with out= a workspace row and accumulate=True: a fused decoder layer's tail): the launch
    returns residual + out in residual's dtype, rounded once, and leaves out zeroed (as kernels/residual_publish.py
    does, in the down kernel's last program: no launch of its own).

    `ONE_LAUNCH` (default: one token read from VRAM, not `pools`): both phases in one launch (`_dept_one_kernel`,
    module doc), each down program's W_down rows (`ONE_ROWS` a program, default 128 / T) loaded while the up programs
    run; else the up/private and down kernels."""
    if triton is None:
        raise RuntimeError("department_experts needs triton")
    if x.dim() != 2 or x.dtype not in FLOAT_DTYPES or x.stride(1) != 1:
        raise ValueError(f"x must be a float [T, H] tensor with a contiguous last dim, got {x.dtype} {tuple(x.shape)}")
    T, H = x.shape
    if not 0 < T <= MAX_TOKENS:
        raise ValueError(f"department_experts takes 1 to {MAX_TOKENS} tokens, got {T}")
    if w_gate.dim() != 3:
        raise ValueError(f"w_gate must be [D, h, H], got shape {tuple(w_gate.shape)}")
    D, h = w_gate.shape[0], w_gate.shape[1]
    direct = pools is not None
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down_t", w_down_t)):
        expert_weights(name, w, D, h, H, x.device, allow_host=direct)
    indexed = private_slots is not None
    if indexed and direct:
        raise ValueError("private_slots (copied-in pools) and pools (direct reads) exclude each other")
    if indexed:
        if private.dim() != 3 or tuple(private.shape[1:]) != (h, h):
            raise ValueError(
                f"with private_slots, private must be a pool [P, h, h] with h={h}, got {tuple(private.shape)}"
            )
        if private_slots.dim() != 2 or private_slots.dtype != torch.int32 or not private_slots.is_contiguous():
            raise ValueError("private_slots must be a contiguous int32 [S, n] tensor")
        if private_slots.device != x.device:
            raise ValueError(f"private_slots must be on {x.device}")
        n = private_slots.shape[1]
    elif private.dim() != 4 or private.shape[0] != D or tuple(private.shape[2:]) != (h, h):
        raise ValueError(f"private must be [D, n, h, h] with D={D}, h={h}, got {tuple(private.shape)}")
    else:
        n = private.shape[1]
    if private.dtype not in FLOAT_DTYPES or not private.is_contiguous():
        raise ValueError("private must be a contiguous bf16/fp16/fp32 tensor")
    if private.device != x.device and not (direct and private.device.type == "cpu"):
        raise ValueError(f"private must be on {x.device}")
    if private.device != x.device and x.is_cuda and not private.is_pinned():
        raise ValueError("a host copy of private must be pinned (the GPU reads it through unified addressing)")
    if direct:
        gp, upp, dp, pp, dmap, pmap, up_slots, down_slots = _unpack_pools(pools)
        if not 0 <= up_slots <= upp.shape[0]:
            raise ValueError(f"up_slots must be within the up pool's {upp.shape[0]} slots, got {up_slots}")
        if not 0 <= down_slots <= dp.shape[0]:
            raise ValueError(f"down_slots must be within the down pool's {dp.shape[0]} slots, got {down_slots}")
        for name, w in (("gate_pool", gp), ("up_pool", upp), ("down_pool", dp)):
            expert_weights(name, w, w.shape[0], h, H, x.device)
        if pp.dim() != 3 or tuple(pp.shape[1:]) != (h, h) or not pp.is_contiguous() or pp.device != x.device:
            raise ValueError(f"private_pool must be a contiguous [Q, {h}, {h}] tensor on {x.device}")
        if gp.stride() != upp.stride() or gp.stride() != dp.stride():
            raise ValueError("the gate, up and down pools must share one layout")
        for name, m, size in (("dept_map", dmap, D), ("private_map", pmap, D * n)):
            if tuple(m.shape) != (size,) or m.dtype != torch.int32 or not m.is_contiguous() or m.device != x.device:
                raise ValueError(f"{name} must be a contiguous int32 [{size}] tensor on {x.device}")
        if host_elems is None or host_elems.dtype != torch.int64 or host_elems.numel() != 1:
            raise ValueError("direct offloading needs host_elems, a one-element int64 tensor")
    if dept.dim() != 1 or dept.dtype != torch.int32 or not dept.is_contiguous() or dept.device != x.device:
        raise ValueError(
            f"dept must be a contiguous int32 [S] tensor on {x.device}, got {dept.dtype} {tuple(dept.shape)}"
        )
    S = dept.shape[0]
    if tuple(weights.shape) != (S, T, n) or weights.dtype != torch.float32 or not weights.is_contiguous():
        raise ValueError(
            f"weights must be a contiguous fp32 [S, T, n] = {(S, T, n)} tensor, got {tuple(weights.shape)}"
        )
    if tuple(tau.shape) != (D,) or tau.dtype != torch.float32 or tau.device != x.device:
        raise ValueError(f"tau must be an fp32 [D] = ({D},) tensor on {x.device}")
    if tau_z is not None and (tuple(tau_z.shape) != (D,) or tau_z.dtype != torch.float32 or tau_z.device != x.device):
        raise ValueError(f"tau_z must be an fp32 [D] = ({D},) tensor on {x.device}")
    if weights.device != x.device:
        raise ValueError("weights must be on x's device")
    for name, c in (("kept_total", kept_total), ("seen_total", seen_total)):
        if c is not None and (c.dtype != torch.int64 or c.numel() != 1 or c.device != x.device):
            raise ValueError(f"{name} must be a one-element int64 tensor on {x.device}")
    if out is not None and (
        tuple(out.shape) != (T, H) or out.dtype != torch.float32 or not out.is_contiguous() or out.device != x.device
    ):
        raise ValueError(f"out must be a contiguous fp32 [T, H] = {(T, H)} tensor on {x.device}")
    if accumulate and out is None:
        raise ValueError("accumulate=True adds into out=: give the fp32 [T, H] tensor")
    residual_out = _check_residual(residual, accumulate, T, H, x)
    if out is None:
        out = torch.empty(T, H, dtype=torch.float32, device=x.device)
    if S == 0:
        if residual_out is not None:
            return residual_publish(out, residual.view(T, H), out=residual_out)
        return out if accumulate else out.zero_()
    # z (S*T*h fp32, added into atomically), the down programs' tickets (one per slot, one for the last slot: the tail
    # and the one-launch reset) and the one launch's role and done counters: a zeroed workspace the launch leaves zeroed
    ws = zeroed_int32("department_experts", x.device, S * T * h + S + 3)
    z_ws, tick = ws[: S * T * h].view(torch.float32), ws[S * T * h : S * T * h + S + 1]
    role, done = ws[S * T * h + S + 1 :], ws[S * T * h + S + 2 :]
    t_p2 = triton.next_power_of_2(T)
    bn = max(1, min(triton.next_power_of_2(BLOCK_N), triton.next_power_of_2(h)))
    bz = min(triton.next_power_of_2(BLOCK_Z), triton.next_power_of_2(h))
    block_i = BLOCK_I or (64 if t_p2 == 1 else 32 if t_p2 == 2 else 16)  # the [T, BLOCK_I, BLOCK_O] product's size
    bi = min(triton.next_power_of_2(block_i), triton.next_power_of_2(h))
    bo = min(triton.next_power_of_2(BLOCK_O), triton.next_power_of_2(H))
    rows, splits = _split(h, bi, SPLIT_ROWS)
    count, see = kept_total is not None, seen_total is not None
    kept = kept_total if count else ws  # any pointer when not counting
    seen = seen_total if see else ws
    if direct:
        gp, upp, dp, pp, dmap, pmap, up_slots, down_slots = _unpack_pools(pools)
        hc, pool_stride, pp_stride = host_elems, gp.stride(0), pp.stride(0)
    else:  # any tensors of the right kind: never read
        gp = upp = dp = w_gate
        pp, dmap, pmap, hc, pool_stride, pp_stride, up_slots, down_slots = private, dept, dept, ws, 0, 0, 0, 0
    if indexed and tuple(private_slots.shape) != (S, n):
        raise ValueError(f"private_slots must be [S, n] = {(S, n)}, got {tuple(private_slots.shape)}")
    pstride_d, pstride_e = (0, private.stride(0)) if indexed else (private.stride(0), private.stride(1))
    nb = triton.cdiv(h, bn)
    y_chunk = 0 if accumulate else triton.cdiv(T * H, S * nb)
    tail = residual_out is not None
    res = residual.view(T, H) if tail else x
    ps = private_slots if indexed else dept
    consts = dict(H=H, H_P2=triton.next_power_of_2(H), T_P2=t_p2, DIRECT=direct, ZMASK=tau_z is not None, TAIL=tail)
    up_consts = dict(N_P2=triton.next_power_of_2(n), BLOCK_N=bn, BLOCK_Z=bz, COUNT=count, SEEN=see, INDEXED=indexed)
    if ONE_LAUNCH is None:  # measured faster for one token read from VRAM (bench/RESULTS.md, DeaMoE)
        ONE_LAUNCH = T == 1 and not direct
    if ONE_LAUNCH:
        one_rows = min(triton.next_power_of_2(ONE_ROWS or max(16, 128 // t_p2)), triton.next_power_of_2(h))
        ncb, nsplit = triton.cdiv(H, bo), triton.cdiv(h, one_rows)
        try:
            _dept_one_kernel[(S * nb + ncb * S * nsplit,)](
                x, w_gate, w_up, private, dept, weights, tau, z_ws, out, y_chunk, kept, seen, ps, gp, upp, pp, dmap,
                pmap, hc, w_down_t, dp, tau if tau_z is None else tau_z, tick, res, residual_out if tail else x, role,
                done, nb, ncb, nsplit, T, h, n, S, x.stride(0), w_gate.stride(0), w_up.stride(0), pstride_d,
                pstride_e, pool_stride, pp_stride, up_slots, w_down_t.stride(0), res.stride(0),
                residual_out.stride(0) if tail else 0, down_slots,
                BLOCK_O=bo, ROWS=one_rows, PRE=not direct and tau_z is None, **consts, **up_consts,
                num_warps=num_warps, **pdl_kw(x),
            )  # fmt: skip
        except Exception:  # a launch stopped part-way (the interpreter) must leave no ticket for the next to wait on
            ws.zero_()
            raise
        return residual_out if tail else out
    _dept_up_private_kernel[(S, nb)](
        x, w_gate, w_up, private, dept, weights, tau, z_ws, out, y_chunk, kept, seen, ps, gp, upp, pp, dmap, pmap, hc,
        T, h, n, x.stride(0), w_gate.stride(0), w_up.stride(0), pstride_d, pstride_e, pool_stride, pp_stride,
        up_slots, H=H, H_P2=consts["H_P2"], T_P2=t_p2, DIRECT=direct, **up_consts, num_warps=num_warps, **pdl_kw(x),
    )  # fmt: skip
    _dept_down_kernel[(triton.cdiv(H, bo), S, splits)](
        w_down_t, dept, z_ws, out, dp, dmap, hc, tau if tau_z is None else tau_z, tick, res,
        residual_out if tail else x, T, h, S, w_down_t.stride(0), pool_stride, res.stride(0),
        residual_out.stride(0) if tail else 0, down_slots,
        BLOCK_I=bi, BLOCK_O=bo, ROWS=rows, **consts, num_warps=num_warps, **pdl_kw(x),
    )  # fmt: skip
    return residual_out if tail else out


def _check_residual(residual, accumulate: bool, T: int, H: int, x) -> torch.Tensor | None:
    """With `residual` [T, H] (accumulate=True into a workspace row): the tensor the tail publishes into."""
    if residual is None:
        return None
    if not accumulate:
        raise ValueError("residual= publishes the row accumulate=True added into: give out= and accumulate=True")
    if residual.numel() != T * H or residual.stride(-1) != 1 or not residual.dtype.is_floating_point:
        raise ValueError(f"residual must be a float [T, H] = {(T, H)} tensor with a contiguous last dim")
    if residual.device != x.device:
        raise ValueError(f"residual must be on {x.device}")
    return torch.empty((T, H), dtype=residual.dtype, device=x.device)
