"""The GPU expert cache in front of the experts' host master copies (the plan it fills: `localmoe.experts.placement`).

The cache is shared by all layers. Each layer has slot tables on the device (expert → slot, -1 when absent), so
the compute kernels read the pool through them inside a CUDA graph. Up/down (or whole-expert) slots are
least-recently-used first out, never evicting an expert the current layer call needs. With direct misses the
gates have a tier of their own (`gate_slots`), filled once (`place_gates`: by calibration routing counts when
known); the up/down slots are filled at load the same way (`place_experts`), then follow decode's admissions.
Three ways to serve a miss (MISS_MODES; the loader's "auto" picks direct on CUDA with pinned memory, the fastest on
the H200: gates first 103.8 tok/s, whole-expert slots 35.7, accelerate 0.13 at 24 GiB, 85%, Qwen3.5-35B shapes; copy
8.5 and cpu 5.2 against direct's 29.7 in session 2):
- "copy": copy-then-compute — the expert's three matrices are copied into a slot, then computed from it;
- "direct": the fused sparse kernel reads the gate rows and only the kept up/down rows of an absent
  expert straight from pinned host memory, inside the CUDA graph; after each step the routing it saw is observed
  and up to `admit_per_step` missed experts are copied into slots for later hits;
- "cpu": absent experts are computed on the CPU from the host copies (only x and y cross PCIe) while hits run on
  the GPU; misses are admitted after each step as in "direct".
Every way the outputs equal the all-resident model (up to float rounding where the CPU computes).
int4 experts (`--experts int4`, or nf4): slots and master copies are Int4Tensors (Nf4Tensors; localmoe/experts/int4.py),
copied part by part; a gpt-oss checkpoint's MXFP4 experts likewise Mxfp4Tensors (`empty_stack` per projection);
a row's bytes (`row_bytes`) include its scales.

Shapes: E = experts per layer, I = expert width, H = hidden, S = cache slots.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from localmoe.errors import UsageError
from localmoe.experts.expert_weights import ExpertWeights
from localmoe.experts.int4 import QUANTIZED, copy_expert, empty_stack, expert_bytes
from localmoe.experts.staging import Staging

MISS_MODES = ("copy", "direct", "cpu")
ADMIT_PER_STEP = 16  # direct mode: experts copied into slots after a step (bounds the copy time per token)


class ExpertCache:
    """S GPU slots shared by all MoE layers; LRU over (layer, expert); per-layer slot tables on the device."""

    def __init__(
        self,
        slots: int,
        shape: tuple[int, int, int],
        dtype: torch.dtype,
        device: torch.device,
        mode: str = "copy",
        admit_per_step: int = ADMIT_PER_STEP,
        background: bool = False,
        gate_slots: int = 0,
        int4: bool | str = False,
    ):
        E, I, H = shape
        if mode not in MISS_MODES:
            raise UsageError(f"offload miss mode must be one of {', '.join(MISS_MODES)}, got {mode!r}")
        if gate_slots and mode != "direct":
            raise ValueError(
                "a separate gate tier needs direct misses (the fused kernel reads gates and up/down "
                "from different places)"
            )
        self.mode, self.admit_per_step = mode, admit_per_step
        fmt = int4 if isinstance(int4, str) else "int4" if int4 else "full"  # int4: True (int4) or a format name
        quantized = fmt != "full"
        self.row_bytes = expert_bytes(1, H, fmt) // 3 if quantized else H * (torch.finfo(dtype).bits // 8)  # a row
        self.width = I
        self.slots, self.num_experts = slots, E
        # gate tier (direct mode): `gate_slots` gates live in their own pool, placed once (`place_gates`), and the
        # S slots hold up/down only. A gate is read whole for every routed expert while up/down rows are read only
        # where kept, so at sparsity s a byte of gate saves 1/(1-s) times the host reads of a byte of up/down
        self.gate_slots = gate_slots
        self.planned_gate_slots = gate_slots  # what the plan gave the tier (resize_gates may lend some to others)
        parts = 2 if gate_slots else 3
        n = max(slots, 1)  # the fused kernel needs a pool to point at even when every up/down row is on the host

        def make(m: int, projection: str):  # m slots of `projection` in the experts' format
            return empty_stack(fmt, (m, I, H), dtype, device, projection)

        self._make_gates = lambda m: make(m, "w_gate")  # resize_gates makes the gate pool again
        self.pool = ExpertWeights(make(gate_slots if gate_slots else n, "w_gate"), make(n, "w_up"), make(n, "w_down_t"))
        # the dense path's routed experts stream through two staging buffers (experts/staging.py)
        plain = (lambda m: torch.empty((m, I, H), dtype=dtype, device=device)) if fmt in ("int4", "nf4") else None
        self.staging = Staging(
            make, 3 * I * self.row_bytes, 3 * I * H * (torch.finfo(dtype).bits // 8), quantized, E, plain=plain
        )
        self.expert_bytes = parts * I * self.row_bytes  # one admission
        self.device = device
        self.lru: OrderedDict[tuple[int, int], int] = OrderedDict()  # (layer, expert) -> slot, oldest first
        self.free = list(range(slots - 1, -1, -1))
        self.masters: dict[int, ExpertWeights] = {}
        self.tables: dict[int, torch.Tensor] = {}  # layer -> [E] int64 slot or -1 (device)
        self.gate_tables: dict[int, torch.Tensor] = {}  # layer -> [E] int64 gate slot or -1 (gate tier only)
        self.gate_rows: dict[int, list[int]] = {}  # the same on the host (read without a device sync)
        self.hits = self.misses = self.copied_bytes = 0
        # direct mode: weight rows the kernels read from host memory (gate rows + kept up/down rows of absent
        # experts) and in all, counted on the device inside the step (a CUDA graph replay adds its own)
        self.host_rows = torch.zeros((), dtype=torch.int64, device=device)
        self.read_rows = torch.zeros((), dtype=torch.int64, device=device)
        self._admitted = 0
        self._where: dict[int, list[int]] | None = None  # `sources`' per-layer slot lists (None: to rebuild)
        self.placed = False  # `place_experts` filled the slots and no decode step has looked up or admitted since
        # direct/cpu admissions in the background (experimental, off until measured on a GPU): the copy runs on a
        # side stream and the slot table flips to the new slot at the first step boundary after it completed, so
        # the next step is not held up by it; until then the expert is read from host memory (and counts a miss)
        self.background = background
        self.pending: dict[tuple[int, int], object] = {}  # key -> its copy's CUDA event (None off CUDA)
        self._copy_stream = None

    @property
    def admits(self) -> bool:
        """Whether decode steps must be observed (routing read back) to admit misses into free or LRU slots."""
        return self.mode in ("direct", "cpu") and self.slots > 0

    def _parts(self) -> tuple[str, ...]:
        return ("w_up", "w_down_t") if self.gate_slots else ("w_gate", "w_up", "w_down_t")

    def place_gates(self, order: list[tuple[int, int]] | None = None) -> None:
        """Fill the gate tier with the gates of `order` [(layer, expert), most wanted first]; by default every
        layer's experts in id order, layer by layer interleaved (the same share of each layer resident). Gates
        already resident keep their slots (only the newcomers are copied); the tables are rewritten in place."""
        if not self.gate_slots:
            return
        if order is None:
            order = [(layer, e) for e in range(self.num_experts) for layer in sorted(self.masters)]
        self._gate_order = order
        want = order[: self.gate_slots]
        now = {(layer, e): s for layer, row in self.gate_rows.items() for e, s in enumerate(row) if s >= 0}
        rows = {layer: [-1] * self.num_experts for layer in self.gate_tables}
        kept = {k: now[k] for k in want if k in now}
        free = sorted(set(range(self.gate_slots)) - set(kept.values()), reverse=True)
        for layer, e in want:
            slot = kept.get((layer, e))
            if slot is None:
                slot = free.pop()
                copy_expert(self.pool.w_gate, slot, self.masters[layer].w_gate, e, non_blocking=True)
                self.copied_bytes += self.row_bytes * self.width
            rows[layer][e] = slot
        for layer, t in self.gate_tables.items():  # same tensors: a captured CUDA graph keeps reading them
            t.copy_(torch.tensor(rows[layer], dtype=t.dtype))
        self.gate_rows = rows

    def place_experts(self, order: list[tuple[int, int]] | None = None) -> None:
        """Fill the up/down slots (whole-expert slots without a gate tier) with the first `slots` experts of `order`
        [(layer, expert), most wanted first; default: `place_gates`' interleaved id order], so the first prompt and the
        first decode steps find them resident instead of an empty cache that admissions fill 16 experts a step.
        Experts of `order` already resident keep their slots (nothing copied); others are evicted for them; the most
        wanted end up most recently used. At load, and again when calibration's routing counts are known, while no
        decode step has looked up or admitted an expert (`placed`; calibration's own passes may have): a decode's
        working set is never thrown away for them."""
        if not self.slots or not self.masters:
            return
        self.staging.settle(self.device)  # a prefill's fill ahead may still read the pools
        if order is None:
            order = [(layer, e) for e in range(self.num_experts) for layer in sorted(self.masters)]
        want = order[: self.slots]
        wanted = set(want)
        for key in [k for k in self.lru if k not in wanted and k not in self.pending]:
            self.free.append(self.lru.pop(key))
        for layer, e in reversed(want):  # least wanted first: the first out when decode admits others
            key = (layer, e)
            if key in self.lru:
                self.lru.move_to_end(key)
                continue
            if not self.free:
                break
            slot = self.free.pop()
            src = self.masters[layer]
            for name in self._parts():
                copy_expert(getattr(self.pool, name), slot, getattr(src, name), e, non_blocking=True)
            self.copied_bytes += self.expert_bytes
            self.lru[key] = slot
        self._where = None
        rows = {layer: self.sources(layer)[1] for layer in self.tables}
        for layer, t in self.tables.items():  # one write a layer, queued after the copies; the same tensors
            t.copy_(torch.tensor(rows[layer], dtype=t.dtype))
        self.placed = True

    def resize_gates(self, gate_slots: int) -> None:
        """The gate tier reallocated with `gate_slots` slots (at least one: the fused kernel needs a pool to point at)
        and filled again in the last `place_gates` order: the department predictor (--departments) takes the VRAM of
        the gates it frees, and gives it back when turned off. The old pool is freed before the new one is made, so
        the budget holds; the tables are rewritten in place (a CUDA graph captured before must be captured again)."""
        gate_slots = max(1, gate_slots)
        if not self.gate_slots or gate_slots == self.gate_slots:
            return
        self.staging.settle(self.device)  # a prefill's fill ahead may still read the old gate pool
        template = self.pool.w_gate
        self.pool.w_gate = None
        del template
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.pool.w_gate = self._make_gates(gate_slots)
        self.gate_slots = gate_slots
        self.gate_rows = {layer: [-1] * self.num_experts for layer in self.gate_rows}  # the new pool holds none
        self.place_gates(getattr(self, "_gate_order", None))

    def expert(self, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate, up, down_t) [I,H] of expert e of `layer` on the device, for the dense grouped path (prefill):
        whole-expert caches fetch it into a slot; with a gate tier, each part comes from its pool when resident,
        else is copied for this use only (no slot is taken)."""
        if not self.gate_slots:
            self.fetch(layer, [e])
            slot = self.lru[(layer, e)]
            return self.pool.w_gate[slot], self.pool.w_up[slot], self.pool.w_down_t[slot]
        m = self.masters[layer]

        def part(pool, master, slot):
            if slot >= 0:
                return pool[slot]
            self.copied_bytes += self.row_bytes * self.width
            if isinstance(master, QUANTIZED):
                return master.expert_on(e, self.device)
            return master[e].to(self.device, non_blocking=True)

        key = (layer, e)
        s = self.lru[key] if key in self.lru and key not in self.pending else -1
        if s >= 0:
            self.hits += 1
        else:
            self.misses += 1
        return (
            part(self.pool.w_gate, m.w_gate, self.gate_rows[layer][e]),
            part(self.pool.w_up, m.w_up, s),
            part(self.pool.w_down_t, m.w_down_t, s),
        )

    def sources(self, layer: int) -> tuple[list[int], list[int]]:
        """Where each expert of `layer` is resident, on the host: (gate slot, up/down slot) per expert, -1 for
        absent (a copy in flight counts as absent); no device read."""
        if self._where is None:  # rebuilt after the LRU changed, all layers in one pass (a prefill asks every layer)
            self._where = {lay: [-1] * self.num_experts for lay in self.masters}
            for key, slot in self.lru.items():
                if key not in self.pending:
                    self._where[key[0]][key[1]] = slot
        slots = list(self._where[layer])
        gates = self.gate_rows[layer] if self.gate_slots else slots
        return gates, slots

    def absent_bytes(self) -> int:
        """Bytes a pass over every expert of every layer copies from host memory (each part not in VRAM once): what
        one prefill piece long enough to route to every expert moves."""
        part = self.row_bytes * self.width
        total = 0
        for layer in self.masters:
            gates, slots = self.sources(layer)
            total += part * sum((g < 0) + 2 * (s < 0) for g, s in zip(gates, slots))
        return total

    def stream(self, layer: int, experts: list[int], packed: bool = False, cpu: list[int] = (), slots: int = 0):
        """The dense path's routed `experts` of `layer` (ascending) staged a span at a time: `Staging.stream`."""
        return self.staging.stream(self, layer, experts, packed, cpu, slots)

    def add_layer(self, layer: int, master: ExpertWeights) -> None:
        self.masters[layer] = master
        self._where = None
        self.tables[layer] = torch.full((self.num_experts,), -1, dtype=torch.long, device=self.device)
        if self.gate_slots:
            self.gate_tables[layer] = torch.full((self.num_experts,), -1, dtype=torch.long, device=self.device)
            self.gate_rows[layer] = [-1] * self.num_experts

    def reset_stats(self) -> None:
        self.hits = self.misses = self.copied_bytes = 0
        self.host_rows.zero_()
        self.read_rows.zero_()

    def _rows(self) -> tuple[int, int]:
        """(rows read from host memory, rows read in all) by the fused kernels since reset_stats (one readback)."""
        host, rows = torch.stack([self.host_rows, self.read_rows]).tolist()
        return host, rows

    def sparse_piece_tokens(self, k: int, sparsity: float) -> int:
        """Direct misses: the longest prefill piece for which the sparse path moves fewer host bytes than the dense
        one. Sparse, per token: every routed expert's gate (where absent) and kept up/down rows (where absent) read
        from host memory. Dense, per piece: nearly every absent expert's up/down rows copied in once (a piece of a few
        hundred tokens routes to most of them). Both are PCIe bound on a desktop card. Qwen3.5-35B shapes at 24 GiB,
        85%: 0.23 GB per token against 41 GB per piece, ~178 tokens; the H200's times cross near 470
        (bench/offload_prefill.py, `s10c`: its zero-copy reads run faster than the piece's copies)."""
        layers, E = len(self.masters), self.num_experts
        total = max(layers * E, 1)
        gates = self.gate_slots if self.gate_slots else self.slots
        gate_absent = 1.0 - min(gates, total) / total
        absent = max(total - self.slots, 0)
        matrix = self.width * self.row_bytes
        per_token = layers * k * matrix * (gate_absent + 2.0 * (1.0 - sparsity) * absent / total)
        per_piece = absent * matrix * (2 if self.gate_slots else 3)
        return int(per_piece / per_token) if per_token > 0 else 1 << 30

    def figures(self) -> tuple[float, int]:
        """(hit rate, host→GPU bytes) since reset_stats, from one readback of the kernels' counters.

        Hit rate: the share of expert weight rows read from VRAM where the fused kernels counted them (direct
        misses), else the share of expert lookups that found the expert resident. Bytes: admissions' copies plus
        the rows kernels read in place from host memory."""
        host, rows = self._rows()
        if rows:
            rate = 1.0 - host / rows
        else:
            n = self.hits + self.misses
            rate = self.hits / n if n else 0.0
        return rate, self.copied_bytes + host * self.row_bytes

    @property
    def h2d_bytes(self) -> int:
        return self.figures()[1]

    @property
    def hit_rate(self) -> float:
        return self.figures()[0]

    def fetch(self, layer: int, experts: list[int], keep: set | None = None, background: bool = False) -> None:
        """Make `experts` of `layer` resident (len(experts) <= slots), never evicting `keep` or `experts`; with
        `background`, copied on a side stream and live from a later step boundary (`observe_step`)."""
        self.staging.settle(self.pool.w_up.device)  # a prefill's fill ahead may still read the pools
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
                for name in self._parts():
                    copy_expert(getattr(dst, name), slot, getattr(src, name), e, non_blocking=True)
                self.tables[layer][e] = slot
            self.copied_bytes += self.expert_bytes
            self.lru[key] = slot
            self._where = None

    def _copy_in_background(self, layer: int, e: int, slot: int):
        """Copy expert e of `layer` into `slot` on a side stream (after everything queued so far); its event."""
        src, dst = self.masters[layer], self.pool
        pairs = [(getattr(dst, name), getattr(src, name)) for name in self._parts()]
        if self.pool.w_gate.device.type != "cuda":  # no streams: copy now, the table still flips a step later
            for a, b in pairs:
                copy_expert(a, slot, b, e)
            return None
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.pool.w_gate.device)
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.pool.w_gate.device))
        with torch.cuda.stream(self._copy_stream):
            for a, b in pairs:
                copy_expert(a, slot, b, e, non_blocking=True)
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
        self._where = None
        self.tables[key[0]][key[1]] = self.lru[key]
        return True

    def _evict(self, keep: set) -> int:
        for key in self.lru:
            if key not in keep:
                if key in self.pending:  # its copy may still be writing the slot: later work waits for it
                    self._settle(key, wait=True)
                slot = self.lru.pop(key)
                self._where = None
                self.tables[key[0]][key[1]] = -1
                return slot
        raise RuntimeError("expert cache: every slot holds an expert the current call needs")

    def observe(self, layer: int, routed: list[int]) -> None:
        """After a step (direct/cpu misses): count hits/misses of what `layer` routed to, admit some misses."""
        self.placed = False
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
            hits, misses = self.hits, self.misses
            try:
                self.fetch(layer, [e], keep={(layer, x) for x in seen}, background=self.background)
            except RuntimeError:  # every slot holds something this step needs: try again next step
                break
            self.hits, self.misses = hits, misses  # admission is not a lookup

    def observe_step(self, experts) -> None:
        """After a decode step: what every layer routed to, read back in one transfer, then `observe` per layer."""
        self._admitted = 0
        mods = [m for m in experts if m.last_routing is not None]
        if not mods:
            return
        routed = torch.cat([m.last_routing.reshape(-1) for m in mods]).tolist()
        at = 0
        for m in mods:
            n = m.last_routing.numel()
            self.observe(m.layer_idx, routed[at : at + n])
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
        self.placed = False  # a decode step (copy misses) decides what stays from here on
        self.fetch(layer, sorted(set(top_k_index.reshape(-1).tolist())))
        return self.tables[layer][top_k_index]
