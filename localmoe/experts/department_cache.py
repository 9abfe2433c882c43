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

Figures since `reset_stats`: department and private hits/misses, host→device bytes copied; the overall hit rate is
byte-weighted (the share of looked-up expert bytes that were already resident).

Shapes: D departments, n experts per department, h department width, H hidden.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


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

    def _evict(self, keep: set) -> int:
        for key in self.lru:
            if key not in keep:
                return self.lru.pop(key)
        raise RuntimeError("every slot holds a unit the current call needs")  # excluded by lookup's check


class DepartmentCache:
    """The department pool and the private pool of a DeaMoE model's offloaded experts (module doc)."""

    mode = "copy"  # misses copied in before the compute (the engine decodes eagerly)
    admits = False  # nothing to observe after a step: lookups happen inside the layer call
    gate_slots = 0

    def __init__(self, department_slots: int, private_slots: int, shape, dtype: torch.dtype, device):
        D, n, h, H = shape
        self.num_departments, self.per_department, self.width, self.hidden = D, n, h, H
        self.num_experts = D * n
        self.device = torch.device(device)
        el = torch.finfo(dtype).bits // 8

        def make(*s):
            return torch.empty(s, dtype=dtype, device=self.device)

        ds, ps = max(department_slots, 1), max(private_slots, 1)  # a kernel needs a pool to point at
        self.gate, self.up, self.down_t = make(ds, h, H), make(ds, h, H), make(ds, h, H)
        self.private = make(ps, h, h)
        self.masters: dict[int, object] = {}  # layer -> DepartmentWeights (host master copies)
        self.departments = Pool(department_slots, 3 * h * H * el, self._copy_department)
        self.privates = Pool(private_slots, h * h * el, self._copy_private)
        self.slots = private_slots  # as ExpertCache.slots (the notices' and plan's "experts cached")
        self.copied_bytes = 0

    def add_layer(self, layer: int, master) -> None:
        self.masters[layer] = master

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

    def department(self, layer: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate, up, down_t) [h, H] of department d of `layer` on the device (the dense path, one at a time)."""
        (s,) = self.department_slots(layer, [d])
        return self.gate[s], self.up[s], self.down_t[s]

    def private_of(self, layer: int, d: int, j: int) -> torch.Tensor:
        """Expert j of department d's private [h, h] on the device (the dense path, one at a time)."""
        (s,) = self.private_slots(layer, [(d, j)])
        return self.private[s]

    def fits(self, departments: int, experts: int) -> bool:
        """Whether one call's units fit the pools at once (else the layer takes the one-at-a-time dense path)."""
        return departments <= self.departments.slots and experts <= self.privates.slots

    # -- figures ---------------------------------------------------------------------------------------------------
    def reset_stats(self) -> None:
        for p in (self.departments, self.privates):
            p.hits = p.misses = 0
        self.copied_bytes = 0

    @staticmethod
    def _rate(pool: Pool) -> float | None:
        n = pool.hits + pool.misses
        return pool.hits / n if n else None

    def figures(self) -> tuple[float, int]:
        """(hit rate, host→device bytes) since reset_stats: the share of looked-up expert bytes found resident
        (a department weighs 3·h·H, a private part h²), and the bytes copied in."""
        d, p = self.departments, self.privates
        hit = d.hits * d.unit_bytes + p.hits * p.unit_bytes
        seen = hit + d.misses * d.unit_bytes + p.misses * p.unit_bytes
        return (hit / seen if seen else 0.0), self.copied_bytes

    def department_figures(self) -> dict:
        """Hits and misses of each pool since reset_stats, their hit rates (None before any lookup)."""
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
