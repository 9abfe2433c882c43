"""DeaMoE's expert cache on the device (department-aware offloading; the plan it fills:
localmoe.experts.department_placement).

Two pools shared by all DeaMoE layers: department slots (a department's shared gate, up and down_t, [h, H] each) and
private slots (one expert's private [h, h]). Each pool is least-recently-used first out, over (layer, department)
and (layer, department, expert) keys, never evicting a unit the current call needs; the pools are separate, so a
department is never evicted to make room for a private part (the plan gave departments their VRAM first). Lookups
run on the host after routing (the step's slot table is read back; like vanilla copy-then-compute offloading, the
model decodes eagerly, no CUDA graph): a miss is copied in from the host master copy (pinned when the loader could
pin it: the copy is then asynchronous on the current stream) and the kernels read the pools through slot ids
(`DepartmentExperts`: department slot ids in place of department numbers, a [S, n] map into the private pool).

Direct mode (`direct=True`; on CUDA with pinned master copies, the default there): the pools are filled once (`place`:
round-robin over the layers so each layer holds an equal share; the gate projections of departments first, the down
projections of the first `down_slots` of them, the up projections of the first `up_slots`, then private parts:
department_placement.direct_split) and never change; device maps (layer -> [D] department slot, [D * n] private slot,
-1: in host memory) let the decode kernels read a resident unit from its pool slot and any other straight from pinned
host memory (kernels/department_experts.py `pools=`), with no lookup on the host: the decode step is captured in a CUDA
graph. The step's hits and misses and the elements read from host memory are counted on the device
(kernels/department_slots.py `maps=`). Prefill and calibration stage a group of departments at a time (`stage`).

Figures since `reset_stats`: department and private hits/misses, host→device bytes (copied, or read directly); the
overall hit rate is byte-weighted (the share of looked-up expert bytes that were already resident).

Shapes: D departments, n experts per department, h department width, H hidden.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from localmoe.kernels.department_experts import MAX_TOKENS


class Pool:
    """`slots` device slots of one kind of unit, LRU over keys; `copy_in(key, slot)` fills a slot on a miss."""

    def __init__(self, slots: int, unit_bytes: int, copy_in):
        self.slots, self.unit_bytes, self.copy_in = slots, unit_bytes, copy_in
        self.lru: OrderedDict[tuple, int] = OrderedDict()  # key -> slot, oldest first
        self.free = list(range(slots - 1, -1, -1))
        self.hits = self.misses = 0

    def lookup(self, keys: list[tuple]) -> list[int]:
        """The slots of `keys` (each made resident, missing ones copied in), never evicting one of `keys`."""
        needed = set(keys)
        if len(needed) > self.slots:
            raise RuntimeError(f"{len(needed)} units needed at once but the pool has {self.slots} slots")
        out = []
        for key in keys:
            slot = self.lru.get(key)
            if slot is not None:
                self.hits += 1
                self.lru.move_to_end(key)
            else:
                self.misses += 1
                slot = self.free.pop() if self.free else self._evict(needed)
                self.copy_in(key, slot)
                self.lru[key] = slot
            out.append(slot)
        return out

    def tally(self, slots: list[int]) -> None:
        """Count lookups that admit nothing (the dense path's staging): a slot >= 0 a hit, -1 a miss."""
        hit = sum(s >= 0 for s in slots)
        self.hits += hit
        self.misses += len(slots) - hit

    def _evict(self, keep: set) -> int:
        for key in self.lru:
            if key not in keep:
                return self.lru.pop(key)
        raise RuntimeError("every slot holds a unit the current call needs")  # excluded by lookup's check


class DepartmentCache:
    """The department pool and the private pool of a DeaMoE model's offloaded experts (module doc)."""

    admits = False  # nothing to observe after a step: lookups happen inside the layer call (or never: direct)
    gate_slots = 0

    def __init__(
        self,
        department_slots: int,
        private_slots: int,
        shape,
        dtype: torch.dtype,
        device,
        direct: bool = False,
        up_slots: int | None = None,
        down_slots: int | None = None,
    ):
        # "copy": misses copied in before the compute (the engine decodes eagerly); "direct": module doc
        self.mode = "direct" if direct else "copy"
        D, n, h, H = shape
        self.num_departments, self.per_department, self.width, self.hidden = D, n, h, H
        self.num_experts = D * n
        self.device = torch.device(device)
        el = torch.finfo(dtype).bits // 8

        def make(*s):
            return torch.empty(s, dtype=dtype, device=self.device)

        ds, ps = max(department_slots, 1), max(private_slots, 1)  # a kernel needs a pool to point at
        # direct mode: department slots [0, down_slots) hold their down projection too, [0, up_slots) their up
        # projection (copy mode: every slot all three)
        self.down_slots = department_slots if down_slots is None or not direct else min(down_slots, department_slots)
        self.up_slots = department_slots if up_slots is None or not direct else min(up_slots, department_slots)
        self.gate, self.up = make(ds, h, H), make(max(self.up_slots, 1), h, H)
        self.down_t = make(max(self.down_slots, 1), h, H)
        self.private = make(ps, h, h)
        self.masters: dict[int, object] = {}  # layer -> DepartmentWeights (host master copies)
        self.departments = Pool(department_slots, 3 * h * H * el, self._copy_department)
        self.privates = Pool(private_slots, h * h * el, self._copy_private)
        self.slots = private_slots  # as ExpertCache.slots (the notices' and plan's "experts cached")
        self.copied_bytes = 0
        self.element_bytes = el
        # direct mode: the pools' maps per layer, and device counters (department hits, misses, private hits,
        # misses; elements read from host memory)
        self.dept_map: dict[int, torch.Tensor] = {}
        self.priv_map: dict[int, torch.Tensor] = {}
        self._placed: dict[tuple, int] = {}  # the same placement on the host: (layer, d) / (layer, d, j) -> slot
        self.counts = torch.zeros(4, dtype=torch.int64, device=self.device)
        self.host_elems = torch.zeros((), dtype=torch.int64, device=self.device)
        self._stage_stream: torch.cuda.Stream | None = None  # the dense path's copies on CUDA (`stage_stream`)

    def add_layer(self, layer: int, master) -> None:
        self.masters[layer] = master
        if self.mode == "direct":
            D, n = self.num_departments, self.per_department
            self.dept_map[layer] = torch.full((D,), -1, dtype=torch.int32, device=self.device)
            self.priv_map[layer] = torch.full((D * n,), -1, dtype=torch.int32, device=self.device)

    def place(self) -> None:
        """Direct mode: fill the pools once, departments round-robin over the layers (department 0 of every layer,
        then 1, ...; the down / up projection only in slots below `down_slots` / `up_slots`), then private parts the
        same way, and write the maps (kept on the host too, in `_placed`); nothing is evicted afterwards."""
        layers = sorted(self.masters)
        D, n = self.num_departments, self.per_department
        host = {
            layer: (torch.full((D,), -1, dtype=torch.int32), torch.full((D * n,), -1, dtype=torch.int32))
            for layer in layers
        }
        units = [(layer, d) for d in range(D) for layer in layers][: self.departments.slots]
        for slot, (layer, d) in enumerate(units):
            m = self.masters[layer]
            self.gate[slot].copy_(m.w_gate[d])
            if slot < self.down_slots:
                self.down_t[slot].copy_(m.w_down_t[d])
            if slot < self.up_slots:
                self.up[slot].copy_(m.w_up[d])
            self._placed[(layer, d)] = host[layer][0][d] = slot
        experts = [(layer, d, j) for d in range(D) for j in range(n) for layer in layers][: self.privates.slots]
        for slot, (layer, d, j) in enumerate(experts):
            self.private[slot].copy_(self.masters[layer].private[d, j])
            self._placed[(layer, d, j)] = host[layer][1][d * n + j] = slot
        for layer, (dm, pm) in host.items():  # one copy per map
            self.dept_map[layer].copy_(dm)
            self.priv_map[layer].copy_(pm)

    def direct_pools(self, layer: int) -> tuple:
        """department_experts' `pools=` for `layer` (direct mode)."""
        maps = (self.dept_map[layer], self.priv_map[layer])
        return self.gate, self.up, self.down_t, self.private, *maps, self.up_slots, self.down_slots

    def _copy_department(self, key: tuple[int, int], slot: int) -> None:
        layer, d = key
        m = self.masters[layer]
        for dst, src in ((self.gate, m.w_gate), (self.up, m.w_up), (self.down_t, m.w_down_t)):
            dst[slot].copy_(src[d], non_blocking=True)
        self.copied_bytes += self.departments.unit_bytes

    def _copy_private(self, key: tuple[int, int, int], slot: int) -> None:
        layer, d, j = key
        self.private[slot].copy_(self.masters[layer].private[d, j], non_blocking=True)
        self.copied_bytes += self.privates.unit_bytes

    # -- lookups -------------------------------------------------------------------------------------------------
    def department_slots(self, layer: int, departments: list[int]) -> list[int]:
        return self.departments.lookup([(layer, d) for d in departments])

    def private_slots(self, layer: int, experts: list[tuple[int, int]]) -> list[int]:
        """Slots of (department, expert-in-department) pairs of `layer`."""
        return self.privates.lookup([(layer, d, j) for d, j in experts])

    def stage_stream(self, device: torch.device) -> torch.cuda.Stream | None:
        """The side stream `stage` copies run on during a dense pass on CUDA (made once); None elsewhere."""
        if device.type != "cuda":
            return None
        if self._stage_stream is None:
            self._stage_stream = torch.cuda.Stream(device)
        return self._stage_stream

    def department_stage_bytes(self) -> int:
        """Device bytes one department takes in a dense-path staging group: its shared projections and n privates."""
        return self.departments.unit_bytes + self.per_department * self.privates.unit_bytes

    def _resident(self, key: tuple) -> int:
        """The pool slot holding `key` ((layer, d) or (layer, d, j)), or -1; no LRU touch, no count."""
        if self.mode == "direct":
            return self._placed.get(key, -1)
        pool = self.departments if len(key) == 2 else self.privates
        return pool.lru.get(key, -1)

    def stage(self, layer: int, departments: list[int], chosen: torch.Tensor) -> tuple:
        """(gate, up, down_t [G, h, H], private [G, n, h, h]) of `departments` of `layer` on the device, for the dense
        path (prefill, calibration): each unit copied from its pool slot when resident, else from the host master
        copy (asynchronous from pinned memory; a department's privates in one copy when most are chosen and none is
        resident). Nothing is admitted to the pools, so a prompt does not evict what decode keeps (copy mode counts
        the lookups as hits and misses). `chosen` [G, n] bool (host): the
        experts some token chose; the others' private parts are left unset (never read)."""
        m = self.masters[layer]
        G, n, h, H = len(departments), self.per_department, self.width, self.hidden
        dt, dev = self.gate.dtype, self.device
        shared = [torch.empty(G, h, H, dtype=dt, device=dev) for _ in range(3)]
        private = torch.empty(G, n, h, h, dtype=dt, device=dev)
        pools = (self.gate, self.up, self.down_t)
        masters = (m.w_gate, m.w_up, m.w_down_t)
        below = (self.departments.slots, self.up_slots, self.down_slots)  # a pool slot holds the projection
        third, unit = self.departments.unit_bytes // 3, self.privates.unit_bytes
        count = self.mode == "copy"  # its pools' hits and misses count lookups (direct mode: the device counters)
        for i, d in enumerate(departments):
            slot = self._resident((layer, d))
            for dst, pool, master, limit in zip(shared, pools, masters, below):
                if 0 <= slot < limit:
                    dst[i].copy_(pool[slot])
                else:
                    dst[i].copy_(master[d], non_blocking=True)
                    self.copied_bytes += third
            js = chosen[i].nonzero().squeeze(1).tolist()
            slots = [self._resident((layer, d, j)) for j in js]
            if count:
                self.departments.tally([slot])
                self.privates.tally(slots)
            if max(slots, default=0) < 0 and 2 * len(js) > n:  # most chosen, none resident: one copy of them all
                private[i].copy_(m.private[d], non_blocking=True)
                self.copied_bytes += n * unit
                continue
            for j, ps in zip(js, slots):
                if ps >= 0:
                    private[i, j].copy_(self.private[ps])
                else:
                    private[i, j].copy_(m.private[d, j], non_blocking=True)
                    self.copied_bytes += unit
        return (*shared, private)

    def sparse_piece_tokens(self, k: int, sparsity: float) -> int:
        """Direct mode: the longest prefill piece the decode kernels take (they read a non-resident unit's gate and
        down projection once per piece, kept rows only of the rest; the dense path copies every touched department
        whole): the kernel's token limit, whatever k and the sparsity."""
        return MAX_TOKENS

    def fits(self, departments: int, experts: int) -> bool:
        """Whether one call's units fit the pools at once (else the layer takes the one-at-a-time dense path)."""
        return departments <= self.departments.slots and experts <= self.privates.slots

    # -- figures ---------------------------------------------------------------------------------------------------
    def reset_stats(self) -> None:
        for p in (self.departments, self.privates):
            p.hits = p.misses = 0
        self.copied_bytes = 0
        self.counts.zero_()
        self.host_elems.zero_()

    def _pull(self) -> None:
        """Direct mode: the device counters into the pools' figures (one device read)."""
        if self.mode == "direct":
            *c, elems = torch.cat([self.counts, self.host_elems.view(1)]).tolist()
            self.departments.hits, self.departments.misses, self.privates.hits, self.privates.misses = c
            self._direct_bytes = elems * self.element_bytes

    @staticmethod
    def _rate(pool: Pool) -> float | None:
        n = pool.hits + pool.misses
        return pool.hits / n if n else None

    def figures(self) -> tuple[float, int]:
        """(hit rate, host→device bytes) since reset_stats: the share of looked-up expert bytes found resident
        (a department weighs 3·h·H, a private part h²), and the bytes copied in."""
        self._pull()
        d, p = self.departments, self.privates
        hit = d.hits * d.unit_bytes + p.hits * p.unit_bytes
        seen = hit + d.misses * d.unit_bytes + p.misses * p.unit_bytes
        direct = self._direct_bytes if self.mode == "direct" else 0
        return (hit / seen if seen else 0.0), self.copied_bytes + direct

    def department_figures(self) -> dict:
        """Hits and misses of each pool since reset_stats, their hit rates (None before any lookup)."""
        self._pull()
        d, p = self.departments, self.privates
        return {
            "department_hits": d.hits,
            "department_misses": d.misses,
            "department_hit_rate": self._rate(d),
            "private_hits": p.hits,
            "private_misses": p.misses,
            "private_hit_rate": self._rate(p),
        }

    @property
    def hit_rate(self) -> float:
        return self.figures()[0]

    @property
    def h2d_bytes(self) -> int:
        return self.copied_bytes
