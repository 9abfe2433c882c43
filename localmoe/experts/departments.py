"""DeaMoE's routed experts: departments of experts sharing gate/up/down projections, each expert a private [h, h].

One layer: D departments x n experts, hidden H, department width h. Department d owns W_gate_d, W_up_d [h, H] and
W_down_d [H, h] (stored transposed, `down_t` [D, h, H]: row i is neuron i's output vector); expert e = d * n + j owns
P_e [h, h], stored input-major (`private` [D, n, h_in, h_out]: row i is what input neuron i adds, z = u @ P_e). For a
token x with routing weights g_e over its k chosen experts:

    u_d = silu(x W_gate_d^T) * (x W_up_d^T)                  once per touched department            [h]
    z_d = sum_{e in d, chosen} g_e (u_d @ P_e)                each chosen expert's private part      [h]
    y   = sum_d z_d @ down_t_d                                the shared down projection once per d  [H]

(the down projection is linear, so it runs once over the department's weighted sum). Threshold sparsity lives on u's h
neurons: with a = silu(x W_gate_d^T), neuron i is skipped when |a_i| < tau[d]; a skipped neuron drops row i of W_up_d
and row i of every chosen P_e. z is dense, so W_down_d is read in full, unless a second threshold `tau_z` [D] is set:
then z entries with |z_i| < tau_z[d] are dropped and the rows of W_down_d no token keeps are not read
(bench/deamoe_twin.py sets it to measure the bytes; calibration does not yet, so it is None in every engine). tau is [D]
float32 (one threshold per department; a per-layer tau broadcast), and the gate recorder (`GateRecorder`, calibration)
gets |a| keyed by department.

Paths (same call as LocalExperts: `experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`,
routing weights final, indices are flat expert numbers e = d * n + j):
- dense (prefill, training, calibration): (token, department) pairs sorted by department, three grouped GEMMs
  (gate, up, down) over departments and one over experts (private), no per-token Python loop; where torch's grouped
  GEMM cannot run (CPU autograd, CUDA fp32, unaligned strides) a loop over the D departments and D * n experts;
- decode (T <= `max_sparse_tokens`): the step's departments in a fixed number of slots (`step_slots`, no host sync,
  graph capturable), each touched department's weights read once for all T tokens; on CUDA (or `kernel_on_cpu`) the
  Triton kernel `localmoe.kernels.department_experts`, elsewhere its torch reference; with `tail=` (a fused decoder
  layer's step: kernels/moe_front.py did the residual add, norm, group-limited routing and the shared expert into
  the workspace row) the kernel adds into that row, and its last program writes residual + row in x's dtype and
  zeroes the row: the block is moe_front, the slotting and the two department kernels (was 9 launches: norm,
  router, slotting, 3, cast, the shared expert's 2);
- offloaded (`cache`: experts/department_cache.py, the parameters are host master copies): decode looks the step's
  departments and chosen experts up on the host, copies misses into the cache's pools and runs the same kernel on
  them (department slot ids in place of department numbers, `private_slots` mapping (slot, expert) into the private
  pool, tau following its department); a step needing more units than a pool holds, prefill, calibration and
  training run `dense_cached` (experts/department_dense.py: groups of departments staged by the cache, then the
  grouped GEMMs). The resident paths are unchanged.

Shapes: T tokens, k experts per token, D departments, n experts per department, h department width, H hidden,
S = slots (departments one step may touch: min(D, T * min(k, topk_group))).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from localmoe.experts.department_dense import dense_cached, grouped_dense
from localmoe.kernels.department_experts import department_experts, department_experts_ref
from localmoe.kernels.department_slots import MAX_PAIRS as SLOT_PAIRS
from localmoe.kernels.department_slots import department_slots, department_slots_ref
from localmoe.kernels.token_tail import Tail, shared_expert_term
from localmoe.kernels.tuning import tuned


def group_limited_topk(probs: torch.Tensor, n: int, k: int, group: int, score: str = "max"):
    """Two-stage routing: probs [T, D * n] -> (top_k_index [T, k] flat expert ids, top_k_probs [T, k]).

    Departments are ranked by their best expert's probability ("max") or the sum of their two best ("top2_sum"); the
    `group` best departments stay allowed, the k most probable experts among them are chosen (a department may get
    several, or none of them: on average fewer than `group` departments are touched, the paper's soft limit)."""
    T, E = probs.shape
    D = E // n
    if group < D:
        per = probs.view(T, D, n)
        ds = per.max(-1).values if score == "max" else per.topk(2, dim=-1).values.sum(-1)  # [T, D]
        allowed = torch.zeros(T, D, dtype=torch.bool, device=probs.device)
        allowed.scatter_(1, ds.topk(group, dim=-1).indices, True)
        probs = probs.masked_fill(~allowed.repeat_interleave(n, dim=1), 0.0)
    top, idx = probs.topk(k, dim=-1)
    return idx, top


def launch_keywords(x: torch.Tensor, h: int, n: int) -> dict:
    """department_experts' tuned launch keywords for this device and shape (kernels/tuned/*.json, key
    "H{H}_h{h}_n{n}_T{T}"); {} (the launcher's defaults) off CUDA or when unmeasured."""
    T, H = x.shape
    return tuned(x, "department_experts", f"H{H}_h{h}_n{n}_T{T}")


def step_slots(
    top_k_index: torch.Tensor, top_k_weights: torch.Tensor, n: int, slots: int, kernel: bool | None = None, maps=None
):
    """The departments of a decode step in `slots` fixed slots, without host sync (graph capturable).

    -> (dept [S] int32, -1 for an unused slot; weights [S, T, n] float32: g of token t for expert j of the slot's
    department, 0 where not chosen). Departments fill the slots in ascending order; `slots` must be at least the
    number of distinct departments the step touches (min(D, T * min(k, topk_group)) always is). One Triton launch
    (`localmoe.kernels.department_slots`) on CUDA or with `kernel`, else its torch reference. `maps`: direct
    offloading's (dept_map, private_map, counts), whose hits and misses are counted there."""
    use = top_k_index.is_cuda if kernel is None else kernel
    if use and top_k_index.numel() <= SLOT_PAIRS:
        return department_slots(top_k_index, top_k_weights, n, slots, maps=maps)
    return department_slots_ref(top_k_index, top_k_weights, n, slots, maps=maps)


@dataclass
class DepartmentWeights:
    """A DeaMoE layer's expert tensors as the rest of localmoe reads an experts module's `weights` (full precision:
    `int4` False; `nbytes` for the plan and the engine's figures). Views of the module's parameters."""

    w_gate: torch.Tensor  # [D, h, H]
    w_up: torch.Tensor  # [D, h, H]
    w_down_t: torch.Tensor  # [D, h, H]
    private: torch.Tensor  # [D, n, h, h]
    int4 = False

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.w_gate, self.w_up, self.w_down_t, self.private))


class DepartmentExperts(nn.Module):
    """The routed experts of one DeaMoE layer (parameters: gate_proj, up_proj, down_t, private; see module doc)."""

    def __init__(self, departments: int, per_department: int, hidden: int, width: int, layer_idx: int = 0):
        super().__init__()
        D, n, H, h = departments, per_department, hidden, width
        self.num_departments, self.per_department, self.hidden_size, self.width = D, n, H, h
        self.layer_idx = layer_idx
        self.gate_proj = nn.Parameter(torch.empty(D, h, H))
        self.up_proj = nn.Parameter(torch.empty(D, h, H))
        self.down_t = nn.Parameter(torch.empty(D, h, H))
        self.private = nn.Parameter(torch.empty(D, n, h, h))
        self.slots = D  # decode slots per step (the model sets min(D, T * departments per token))
        self.tau: torch.Tensor | None = None  # [D] float32 per-department threshold (per-layer tau broadcast)
        self.tau_z: torch.Tensor | None = None  # [D] float32 threshold on z (module doc), applied with tau
        self.sparse_enabled = False
        self.max_sparse_tokens = 1
        self.mask_all_tokens = False  # evaluation: the sparse mask on the dense path too (same function)
        self.recorder = None  # localmoe.experts.gate_recorder.GateRecorder during calibration (keyed by department)
        self.z_recorder = None  # the same for |z| (tau_z's calibration: the dense path with tau's mask on)
        self.kernel_on_cpu = False  # tests: the Triton path on CPU tensors (TRITON_INTERPRET=1)
        self.kept = torch.zeros((), dtype=torch.int64)  # kept neurons (sparse paths), updated in place
        self.seen = torch.zeros((), dtype=torch.int64)  # neurons considered there (a device counter: no host sync)
        self._no_tau: torch.Tensor | None = None  # tau of zeros for the dense-equivalent decode (kept, not remade)
        self.last_departments: torch.Tensor | None = None  # decode: the step's slot table (for a department cache)
        self.cache = None  # offloaded: the DepartmentCache (experts/department_cache.py) the paths read through
        self.launch: dict | None = None  # department_experts' launch keywords (a bench's sweep); None: tuned table

    # -- what the rest of localmoe reads of an experts module (LocalExperts has the same names) ---------------------
    @property
    def num_experts(self) -> int:
        """Routed experts (D * n), as the router numbers them."""
        return self.num_departments * self.per_department

    @property
    def tau_groups(self) -> int:
        """Entries of `tau` (and of calibration's samples and routing counts): one per department."""
        return self.num_departments

    @property
    def weights(self) -> DepartmentWeights:
        return DepartmentWeights(self.gate_proj, self.up_proj, self.down_t, self.private)

    def extra_repr(self) -> str:
        return (
            f"D={self.num_departments}, n={self.per_department}, H={self.hidden_size}, h={self.width}, "
            f"sparse={self.sparse_enabled}"
        )

    def reset_counters(self) -> None:
        self.kept.zero_()
        self.seen.zero_()

    def _counters_on(self, device) -> None:
        """The kept / seen counters on `device` (moved once; then updated in place, also by graph replays)."""
        if self.kept.device != torch.device(device):
            self.kept = self.kept.to(device)
        if self.seen.device != torch.device(device):
            self.seen = self.seen.to(device)

    def _count(self, kept: torch.Tensor, neurons) -> None:
        self._counters_on(kept.device)
        self.kept.add_(kept)  # in place: a captured CUDA graph keeps counting on replay
        self.seen.add_(neurons)

    def takes_tail(self, hidden_states: torch.Tensor) -> bool:
        """Whether a call on these tokens can take `tail=` (a fused decoder layer's step: module doc): resident,
        decode-sized, on the Triton path."""
        T = hidden_states.shape[0]
        few = T <= self.max_sparse_tokens and self.recorder is None and not self.mask_all_tokens and not self.training
        return few and self.cache is None and (hidden_states.is_cuda or self.kernel_on_cpu)

    def front_slots(self, hidden_states: torch.Tensor) -> tuple[int, int] | None:
        """(n, S) when a one-token call with `tail=` runs the department kernel (`takes_tail`), so the caller's router
        launch may write the step's department slots (kernels/moe_front.py `slots=`: S slots of n experts) and pass
        them as `forward(slots=)`; else None."""
        H = hidden_states.shape[-1]
        if hidden_states.numel() != H or not self.takes_tail(hidden_states.reshape(1, H)):
            return None
        return self.per_department, min(self.num_departments, self.slots)

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        tail: Tail = None,
        slots: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        """`tail`: a fused decoder layer's step (`takes_tail`); `slots` (with `tail`, where `front_slots` said so):
        the step's (dept [S], weights [S, 1, n]) as kernels/department_slots.py writes them, from the router's
        launch."""
        T = hidden_states.shape[0]
        if tail is not None:
            return self._decode_tail(hidden_states, top_k_index, top_k_weights, tail, slots)
        few = T <= self.max_sparse_tokens and self.recorder is None and not self.mask_all_tokens and not self.training
        if self.cache is not None:
            return self._through_cache(hidden_states, top_k_index, top_k_weights, few)
        if few:
            return self._decode(hidden_states, top_k_index, top_k_weights)
        return self._dense(hidden_states, top_k_index, top_k_weights)

    # -- dense: (token, department) pairs grouped by department ---------------------------------------------------
    def _dense(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        masked = self.mask_all_tokens and self.sparse_enabled and self.tau is not None and self.recorder is None
        parts = (self.gate_proj, self.up_proj, self.down_t, self.private)
        return grouped_dense(self, x, top_k_index, top_k_weights, parts, None, masked)

    # -- decode: the step's departments in fixed slots -------------------------------------------------------------
    def _tau(self, device) -> tuple[bool, torch.Tensor]:
        sparse = self.sparse_enabled and self.tau is not None
        if sparse:
            return True, self.tau.to(device=device, dtype=torch.float32)
        if self._no_tau is None or self._no_tau.device != torch.device(device):  # made once, not per decode step
            self._no_tau = torch.zeros(self.num_departments, dtype=torch.float32, device=device)
        return False, self._no_tau

    def _tau_z(self, device) -> torch.Tensor | None:
        """tau_z on `device` (moved once), or None."""
        if self.tau_z is not None and self.tau_z.device != torch.device(device):
            self.tau_z = self.tau_z.to(device=device, dtype=torch.float32)
        return self.tau_z

    def _decode(
        self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, slots=None, **out
    ) -> torch.Tensor:
        """`out`: out= and accumulate=True, the kernel adding into that fp32 row (`_decode_tail`); `slots`: the
        step's (dept, weights) already written (`forward`)."""
        T = x.shape[0]
        if slots is not None:
            dept, w = slots
        else:
            S = min(self.num_departments, T * self.slots)
            dept, w = step_slots(top_k_index, top_k_weights, self.per_department, S, x.is_cuda or self.kernel_on_cpu)
        self.last_departments = dept
        sparse, tau = self._tau(x.device)
        args = (x, self.gate_proj, self.up_proj, self.down_t, self.private, dept, w, tau)
        return self._run_kernel(x, args, w, sparse, self._tau_z(x.device), **out)

    def _decode_tail(self, x: torch.Tensor, top_k_index, top_k_weights, tail: Tail, slots=None) -> torch.Tensor:
        """`_decode` adding into the workspace row (the shared expert's output when moe_front put it there), and
        publishing residual + row in x's dtype in the same launch, the row zeroed (`takes_tail` holds; module doc)
        -> [T, H]."""
        T, H = x.shape
        if tail.workspace is not None:
            acc = tail.workspace[: T * H].view(torch.float32).view(T, H)
        else:
            acc = torch.zeros((T, H), dtype=torch.float32, device=x.device)
        if tail.shared is not None:  # the shared expert not in moe_front's launch
            acc += shared_expert_term(x, tail.shared)
        residual = tail.residual.view(T, H)
        return self._decode(x, top_k_index, top_k_weights, slots, out=acc, accumulate=True, residual=residual)

    def _run_kernel(self, x, args, w, sparse: bool, tau_z=None, **where) -> torch.Tensor:
        """`where`: private_slots= (copied-in pools) or pools= and host_elems= (direct offloading), or out= with
        accumulate=True (the kernel only; the fp32 row is returned as it is; with residual= the published [T, H]
        residual + row); `tau_z` [D or department slots] applies with the sparse path only. -> [T, H] in x's dtype."""
        if sparse and tau_z is not None:
            where["tau_z"] = tau_z
        if x.is_cuda or self.kernel_on_cpu:  # the kernel adds into the module's counters (no launch of their own)
            counters = {}
            if sparse:
                self._counters_on(x.device)
                counters = {"kept_total": self.kept, "seen_total": self.seen}
            kw = self.launch if self.launch is not None else launch_keywords(x, self.width, self.per_department)
            y = department_experts(*args, **where, **counters, **kw)
        else:
            y, kept = department_experts_ref(*args, **where)
            if sparse:
                self._count(kept, (w.abs().sum(-1) > 0).sum() * self.width)  # (token, department) pairs x h
        return y if where.get("accumulate") and "residual" not in where else y.to(x.dtype)

    # -- offloaded: the same paths reading the department cache's pools (experts/department_cache.py) -------------
    def _through_cache(self, x: torch.Tensor, top_k_index, top_k_weights, few: bool) -> torch.Tensor:
        """Decode: the step's departments and chosen experts looked up on the host (one readback), misses copied in,
        the kernel run on the pools (department slot ids for departments, a [S, n] map into the private pool). When
        the step needs more units than a pool holds, or for prefill, calibration and training: groups of departments
        staged by the cache (`dense_cached`)."""
        if not few:
            return dense_cached(self, x, top_k_index, top_k_weights, self.mask_all_tokens)
        if self.cache.mode == "direct":
            return self._direct(x, top_k_index, top_k_weights)
        T, n, cache = x.shape[0], self.per_department, self.cache
        dept, w = step_slots(top_k_index, top_k_weights, n, min(self.num_departments, T * self.slots))
        self.last_departments = dept
        chosen = w.abs().sum(1) > 0  # [S, n]
        depts = dept.tolist()
        pairs = [(d, j) for s, d in enumerate(depts) if d >= 0 for j, c in enumerate(chosen[s].tolist()) if c]
        used = [d for d in depts if d >= 0]
        if not cache.fits(len(used), len(pairs)):  # the decode path's function: thresholds applied
            return dense_cached(self, x, top_k_index, top_k_weights, True)
        d_slots = cache.department_slots(self.layer_idx, used)
        p_slots = cache.private_slots(self.layer_idx, pairs)
        at = dict(zip(used, d_slots))
        pmap = [[0] * n for _ in depts]
        for (d, j), ps in zip(pairs, p_slots):
            pmap[depts.index(d)][j] = ps
        dev = x.device
        slot_dept = torch.tensor([at.get(d, -1) for d in depts], dtype=torch.int32, device=dev)
        private_slots = torch.tensor(pmap, dtype=torch.int32, device=dev).reshape(len(depts), n)
        sparse, tau = self._tau(dev)
        tau_slots = torch.zeros(
            cache.gate.shape[0], dtype=torch.float32, device=dev
        )  # each department's tau follows it
        tz, tz_slots = self._tau_z(dev), None
        if used:
            tau_slots[torch.tensor(d_slots, device=dev)] = tau[torch.tensor(used, device=dev)]
            if tz is not None:
                tz_slots = torch.zeros_like(tau_slots)
                tz_slots[torch.tensor(d_slots, device=dev)] = tz[torch.tensor(used, device=dev)]
        args = (x, cache.gate, cache.up, cache.down_t, cache.private, slot_dept, w, tau_slots)
        return self._run_kernel(x, args, w, sparse, tz_slots, private_slots=private_slots)

    def _direct(self, x: torch.Tensor, top_k_index, top_k_weights) -> torch.Tensor:
        """Direct offloading (experts/department_cache.py): the kernels read resident units from the pools and the
        others from the host master copies (this module's parameters); no host sync, graph capturable."""
        T, cache, layer = x.shape[0], self.cache, self.layer_idx
        slots = min(self.num_departments, T * self.slots)
        maps = (cache.dept_map[layer], cache.priv_map[layer], cache.counts)
        kernel = x.is_cuda or self.kernel_on_cpu
        dept, w = step_slots(top_k_index, top_k_weights, self.per_department, slots, kernel, maps=maps)
        self.last_departments = dept
        sparse, tau = self._tau(x.device)
        args = (x, self.gate_proj, self.up_proj, self.down_t, self.private, dept, w, tau)
        pools = cache.direct_pools(layer)
        return self._run_kernel(x, args, w, sparse, self._tau_z(x.device), pools=pools, host_elems=cache.host_elems)
