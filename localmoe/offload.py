"""Expert offloading under a VRAM budget: placement, and the GPU expert cache.

Placement: the non-expert modules, the KV/recurrent state and a workspace reserve must fit in the budget (else a
one-line error with the numbers); what is left becomes slots of an expert cache. Every expert's master copy lives
in host memory (pinned when possible, pageable with a notice when pinning fails; a notice before the load when they
look larger than the RAM available). The cache is expert-granular
and shared by all layers, least-recently-used first out, never evicting an expert the current layer call needs.
Each layer has a slot table on the device (expert → slot, -1 when absent), so the compute kernels read the pool
through slot ids. Three ways to serve a miss (MISS_MODES; the loader's "auto" picks direct on CUDA with pinned
memory, the fastest on the H200: 29.7 tok/s against 8.5 copy and 5.2 cpu at 24 GiB, 85%, Qwen3.5-35B shapes):
- "copy": copy-then-compute — the expert's three matrices are copied into a slot, then computed from it;
- "direct": the fused sparse kernel reads the gate rows and only the kept up/down rows of an absent
  expert straight from pinned host memory, inside the CUDA graph; after each step the routing it saw is observed
  and up to `admit_per_step` missed experts are copied into slots for later hits;
- "cpu": absent experts are computed on the CPU from the host copies (only x and y cross PCIe) while hits run on
  the GPU; misses are admitted after each step as in "direct".
Every way the outputs equal the all-resident model (up to float rounding where the CPU computes).

Shapes: E = experts per layer, I = expert width, H = hidden, S = cache slots.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from localmoe.errors import UsageError
from localmoe.experts import ExpertWeights

GiB = 1 << 30
MISS_MODES = ("copy", "direct", "cpu")
ADMIT_PER_STEP = 16  # direct mode: experts copied into slots after a step (bounds the copy time per token)
WORKSPACE_RESERVE = 0.5 * GiB  # activations, kernels' workspaces, allocator slack


@dataclass(frozen=True)
class OffloadPlan:
    budget_bytes: int
    non_expert_bytes: int
    state_bytes: int
    expert_bytes: int  # one expert (gate + up + down)
    total_experts: int
    slots: int  # GPU cache slots (== total_experts: everything resident, no offloading)

    @property
    def offloading(self) -> bool:
        return self.slots < self.total_experts

    def summary(self) -> str:
        gib = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
        return (f"VRAM budget {gib(self.budget_bytes)}: non-expert weights {gib(self.non_expert_bytes)}, "
                f"KV/state {gib(self.state_bytes)}, {self.slots} of {self.total_experts} experts cached on the GPU "
                f"({gib(self.slots * self.expert_bytes)}); host RAM for expert master copies "
                f"{gib(self.total_experts * self.expert_bytes)}")


def state_bytes(config, context: int, dtype: torch.dtype) -> int:
    """KV cache of full-attention layers for `context` tokens, plus linear-attention states (batch 1)."""
    el = torch.finfo(dtype).bits // 8
    layers = int(config.num_hidden_layers)
    types = getattr(config, "layer_types", None) or ["full_attention"] * layers
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    full = sum(1 for t in types if t != "linear_attention")
    linear = layers - full
    kv = full * 2 * context * heads * head_dim * el
    lin_state = 0
    if linear:
        vh = int(getattr(config, "linear_num_value_heads", 0))
        kd, vd = int(getattr(config, "linear_key_head_dim", 0)), int(getattr(config, "linear_value_head_dim", 0))
        lin_state = linear * vh * kd * vd * 4 * 2  # recurrent state (fp32) + conv state, generous
    return kv + lin_state


def plan(*, budget_bytes: int, non_expert_bytes: int, state: int, expert_bytes: int, total_experts: int,
         top_k: int) -> OffloadPlan:
    fixed = non_expert_bytes + state + WORKSPACE_RESERVE
    if budget_bytes < fixed + top_k * expert_bytes:
        need = (fixed + top_k * expert_bytes) / GiB
        raise UsageError(
            f"--vram {budget_bytes / GiB:.2f} GiB cannot hold the non-expert weights ({non_expert_bytes / GiB:.2f} GiB), "
            f"KV/state ({state / GiB:.2f} GiB), workspace ({WORKSPACE_RESERVE / GiB:.2f} GiB) and one token's "
            f"{top_k} experts: give at least --vram {need:.2f}, a shorter --context, or --device cpu")
    slots = min(total_experts, int((budget_bytes - fixed) // expert_bytes))
    return OffloadPlan(budget_bytes, non_expert_bytes, state, expert_bytes, total_experts, slots)


def available_ram() -> int | None:
    """Bytes of host memory available to a new allocation (Linux MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def host_ram_notice(plan: OffloadPlan, available: int | None) -> str | None:
    """A one-line warning, before the load, when the expert master copies look larger than the host RAM available
    now (a warning, not a refusal: VMs whose memory grows on demand report too little up front)."""
    need = plan.total_experts * plan.expert_bytes
    if not plan.offloading or available is None or need <= available:
        return None
    return (f"the expert master copies need {need / GiB:.1f} GiB of host RAM and {available / GiB:.1f} GiB is "
            "available now: if loading fails, close other programs or run a smaller model")


def host_buffer(shape, dtype, pin: bool) -> tuple[torch.Tensor, bool]:
    """(tensor, pinned) — pinned host memory when asked and possible, else pageable."""
    if pin:
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True), True
        except RuntimeError:
            pass
    return torch.empty(shape, dtype=dtype), False


class ExpertCache:
    """S GPU slots shared by all MoE layers; LRU over (layer, expert); per-layer slot tables on the device."""

    def __init__(self, slots: int, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device,
                 mode: str = "copy", admit_per_step: int = ADMIT_PER_STEP, background: bool = False):
        E, I, H = shape
        if mode not in MISS_MODES:
            raise UsageError(f"offload miss mode must be one of {', '.join(MISS_MODES)}, got {mode!r}")
        self.mode, self.admit_per_step = mode, admit_per_step
        self.row_bytes = H * (torch.finfo(dtype).bits // 8)
        self.width = I
        self.slots, self.num_experts = slots, E
        self.pool = ExpertWeights(*(torch.empty((slots, I, H), dtype=dtype, device=device) for _ in range(3)))
        self.expert_bytes = 3 * I * H * (torch.finfo(dtype).bits // 8)
        self.device = device
        self.lru: OrderedDict[tuple[int, int], int] = OrderedDict()  # (layer, expert) -> slot, oldest first
        self.free = list(range(slots - 1, -1, -1))
        self.masters: dict[int, ExpertWeights] = {}
        self.tables: dict[int, torch.Tensor] = {}  # layer -> [E] int64 slot or -1 (device)
        self.hits = self.misses = self.h2d_bytes = 0
        # direct mode: weight rows the kernels read from host memory (gate rows + kept up/down rows of absent
        # experts), counted on the device inside the step (a CUDA graph replay adds its own), read once per step
        self.host_rows = torch.zeros((), dtype=torch.int64, device=device)
        self._host_rows_seen = 0
        self._admitted = 0
        # direct/cpu admissions in the background (experimental, off until measured on a GPU): the copy runs on a
        # side stream and the slot table flips to the new slot at the first step boundary after it completed, so
        # the next step is not held up by it; until then the expert is read from host memory (and counts a miss)
        self.background = background
        self.pending: dict[tuple[int, int], object] = {}  # key -> its copy's CUDA event (None off CUDA)
        self._copy_stream = None

    def add_layer(self, layer: int, master: ExpertWeights) -> None:
        self.masters[layer] = master
        self.tables[layer] = torch.full((self.num_experts,), -1, dtype=torch.long, device=self.device)

    def reset_stats(self) -> None:
        self.hits = self.misses = self.h2d_bytes = 0
        self.host_rows.zero_()
        self._host_rows_seen = 0

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0

    def fetch(self, layer: int, experts: list[int], keep: set | None = None, background: bool = False) -> None:
        """Make `experts` of `layer` resident (len(experts) <= slots), never evicting `keep` or `experts`; with
        `background`, copied on a side stream and live from a later step boundary (`observe_step`)."""
        needed = {(layer, e) for e in experts} | (keep or set())
        if len(needed) > self.slots:
            raise RuntimeError(f"{len(needed)} experts needed at once but the cache has {self.slots} slots")
        for e in experts:
            key = (layer, e)
            if key in self.lru:
                if key in self.pending:  # a background copy: this call needs it now
                    self._settle(key, wait=True)
                self.hits += 1
                self.lru.move_to_end(key)
                continue
            self.misses += 1
            slot = self.free.pop() if self.free else self._evict(needed)
            self.tables[layer][e] = -1  # (already) absent while its slot is written: stream order keeps this safe
            if background:
                self.pending[key] = self._copy_in_background(layer, e, slot)
            else:
                src, dst = self.masters[layer], self.pool
                for a, b in ((dst.w_gate, src.w_gate), (dst.w_up, src.w_up), (dst.w_down_t, src.w_down_t)):
                    a[slot].copy_(b[e], non_blocking=True)
                self.tables[layer][e] = slot
            self.h2d_bytes += self.expert_bytes
            self.lru[key] = slot

    def _copy_in_background(self, layer: int, e: int, slot: int):
        """Copy expert e of `layer` into `slot` on a side stream (after everything queued so far); its event."""
        src, dst = self.masters[layer], self.pool
        pairs = ((dst.w_gate, src.w_gate), (dst.w_up, src.w_up), (dst.w_down_t, src.w_down_t))
        if self.pool.w_gate.device.type != "cuda":  # no streams: copy now, the table still flips a step later
            for a, b in pairs:
                a[slot].copy_(b[e])
            return None
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.pool.w_gate.device)
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.pool.w_gate.device))
        with torch.cuda.stream(self._copy_stream):
            for a, b in pairs:
                a[slot].copy_(b[e], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
        return ev

    def _settle(self, key: tuple[int, int], wait: bool) -> bool:
        """Make a background-copied expert live (its slot in the table) if its copy is done, or after waiting for it
        on the current stream when `wait`. True when it went live."""
        ev = self.pending[key]
        if ev is not None:
            if wait:
                torch.cuda.current_stream(self.pool.w_gate.device).wait_event(ev)
            elif not ev.query():
                return False
        del self.pending[key]
        self.tables[key[0]][key[1]] = self.lru[key]
        return True

    def _evict(self, keep: set) -> int:
        for key in self.lru:
            if key not in keep:
                if key in self.pending:  # its copy may still be writing the slot: later work waits for it
                    self._settle(key, wait=True)
                slot = self.lru.pop(key)
                self.tables[key[0]][key[1]] = -1
                return slot
        raise RuntimeError("expert cache: every slot holds an expert the current call needs")

    def observe(self, layer: int, routed: list[int]) -> None:
        """After a step (direct/cpu misses): count hits/misses of what `layer` routed to, admit some misses."""
        seen: set[int] = set()
        admit: list[int] = []
        for e in routed:
            key = (layer, e)
            if key in self.lru:
                if key in self.pending:  # still copying in the background: the kernel read it from host memory
                    self.misses += 1
                else:
                    self.hits += 1
                self.lru.move_to_end(key)
            else:
                self.misses += 1
                if e not in seen:
                    admit.append(e)
            seen.add(e)
        for e in admit:
            if self._admitted >= self.admit_per_step:
                break
            if not self.free and not any(k[0] != layer or k[1] not in seen for k in self.lru):
                break
            self._admitted += 1
            hits, misses, moved = self.hits, self.misses, self.h2d_bytes
            try:
                self.fetch(layer, [e], keep={(layer, x) for x in seen}, background=self.background)
            except RuntimeError:  # every slot holds something this step needs: try again next step
                break
            self.hits, self.misses = hits, misses  # admission is not a lookup
            self.h2d_bytes = moved + self.expert_bytes

    def observe_step(self, experts) -> None:
        """After a decode step: what every layer routed to and the host rows the kernels read, read back in one
        transfer, then `observe` per layer."""
        self._admitted = 0
        mods = [m for m in experts if m.last_routing is not None]
        if not mods:
            return
        vals = torch.cat([m.last_routing.reshape(-1) for m in mods] + [self.host_rows.view(1)]).tolist()
        rows, routed = vals[-1], vals[:-1]
        self.h2d_bytes += (rows - self._host_rows_seen) * self.row_bytes
        self._host_rows_seen = rows
        at = 0
        for m in mods:
            n = m.last_routing.numel()
            self.observe(m.layer_idx, routed[at:at + n])
            at += n
        for key in list(self.pending):  # background copies that finished go live for the next step
            self._settle(key, wait=False)

    def slot_tau(self, slots: torch.Tensor, experts: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
        """Thresholds indexed by slot [S] for kernels that address the pool: each expert's τ follows it."""
        out = torch.zeros(self.slots, dtype=torch.float32, device=tau.device)
        out[slots.reshape(-1)] = tau[experts.reshape(-1)]
        return out

    def slot_ids(self, layer: int, top_k_index: torch.Tensor) -> torch.Tensor:
        """Fetch what `top_k_index` [T,k] routes to and return the same-shape slot ids (device)."""
        self.fetch(layer, sorted(set(top_k_index.reshape(-1).tolist())))
        return self.tables[layer][top_k_index]
