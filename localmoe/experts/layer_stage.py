"""Offloaded prefill's layer stage (issue #29): a layer's absent int4 / NF4 experts staged packed, a layer ahead.

Span by span (experts/staging.py `Staging.stream`), a long prompt piece's int4 layer is dequantized on the side
stream, host and resident experts together, into two plain buffers, and PCIe only runs ahead by the two spans filled
during the next layer's attention. With the layer stage (`Staging.stage_layers`: int4 / NF4 experts whose master
copies the device reads in place, a call that routes every expert) only the absent experts' packed bytes cross on
the side stream into one of two stage slots, issued as soon as the layer before starts its experts: PCIe then runs
under that layer's GEMMs and this layer's attention. From pinned host memory the copy engines move them
(experts/host_copies.py, `by_copy_engines`: the SMs stay with the GEMMs): host master copies and slots are both
laid expert-major (kernels/int4.py `expert_major`), so a run of absent experts is one piece of a projection (~170
pieces a layer at Qwen3.5-35B-A3B's shapes, ~0.5 ms of host time, where part by part took ~510 and ~1.6 ms). Else
one gather_experts launch a projection (master copies on the device, or `by_copy_engines` off). The compute stream
dequantizes each span of the layer from the pool (resident) or the stage (absent: kernels/gather_dequant.py
`host_rows`, device memory only) into one plain buffer right before its GEMMs.

The two slots are laid in the other plain buffer's memory (a half each, packed: ~2x a plain span's experts over the
three projections, laid for each layer's absent gates and up/down pairs: a gate tier leaves the up/down pairs all of
it), so the prefill budget (experts/prefill_budget.py) is unchanged; a layer whose absent experts do not fit a slot
is staged span by span. Shapes: E experts a layer, I expert width, H hidden.

Imports: torch, experts/expert_weights, experts/host_copies and experts/int4, kernels/int4 and the two gather
kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localmoe.experts.expert_weights import ExpertWeights
from localmoe.experts.host_copies import copy_rows, upload
from localmoe.experts.int4 import PROJECTIONS, Nf4Tensor, parts
from localmoe.kernels.gather_dequant import gather_dequant
from localmoe.kernels.gather_experts import gather_experts
from localmoe.kernels.int4 import expert_major
from localmoe.kernels.nf4 import nf4_code

ALIGN = 256  # bytes: each slot and each part of it starts at a multiple


@dataclass
class Staged:
    """One layer's absent experts in a slot: their ids (gate, up/down: the gate tier may differ), each expert's row
    in the slot ([E] int32 on the device, -1 resident), the slot's stacks as laid for them, and the event that marks
    the copies done (None on the CPU)."""

    layer: int
    absent: tuple[tuple[int, ...], tuple[int, ...]]
    rows: tuple[torch.Tensor, torch.Tensor]
    slot: ExpertWeights
    event: torch.cuda.Event | None


class LayerStage:
    """Two stage slots of packed 4-bit experts laid in one plain buffer's memory (module doc)."""

    # Host master copies staged by the copy engines (experts/host_copies.py; one driver call a layer where the
    # driver has the batch call); False: one gather_experts launch a projection (SMs read the pinned rows).
    by_copy_engines = True

    def __init__(self, memory: torch.Tensor, like):
        """`memory`: the bytes (uint8) of a plain staging buffer, its three projections' stacks in one allocation
        (a half of it a slot, each laid for the layer it holds); `like(p)`: a one-expert stack of projection p in
        the cache's 4-bit format."""
        self.half = memory.numel() // 2 // ALIGN * ALIGN
        self.memory = memory
        self.like = {p: like(p) for p in PROJECTIONS}
        self.ahead: Staged | None = None
        self._none: dict[tuple, torch.Tensor] = {}  # (device, E) -> [E] of -1: gather_experts reads the host copy

    def sizes(self, absent: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[int, int, int]:
        """Bytes the three projections' stacks of these absent experts (gate, up/down) take in a slot."""
        n = (len(absent[0]), len(absent[1]), len(absent[1]))
        return tuple(_packed_bytes(self.like[p], k) for p, k in zip(PROJECTIONS, n))

    def fits(self, absent) -> bool:
        return sum(self.sizes(absent)) <= self.half

    def take(self, cache, layer: int, side, device: torch.device) -> Staged | None:
        """This layer's stage: the one issued ahead when it still matches the cache, else issued now; None when
        its absent experts do not fit a slot."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead.layer == layer and ahead.absent == _absent(cache, layer):
            return ahead
        return self.issue(cache, layer, side, device)

    def issue(self, cache, layer: int, side, device: torch.device) -> Staged | None:
        """Copy `layer`'s absent experts into slot layer % 2: on `side` after the compute stream's work so far (the
        slot's previous layer is computed); on the CPU now. None (nothing copied) when they do not fit."""
        absent = _absent(cache, layer)
        if not self.fits(absent):
            return None
        E = cache.num_experts
        rows = tuple(_rows(a, E, device) for a in absent)
        ids = tuple(upload(list(a), device) if a else None for a in absent)
        raw, at, stacks = self.memory[(layer % 2) * self.half :], 0, []
        for p, size, k in zip(PROJECTIONS, self.sizes(absent), (0, 1, 1)):
            stacks.append(_laid(raw[at : at + size], self.like[p], len(absent[k])))
            at += size
        slot, master = ExpertWeights(*stacks), cache.masters[layer]
        none = self._none.get((device, E))
        if none is None:
            none = self._none[(device, E)] = torch.full((E,), -1, dtype=torch.int32, device=device)

        def copy() -> None:
            if self.by_copy_engines and not any(t.is_cuda for p in PROJECTIONS for t in parts(getattr(master, p))):
                for name, k in (("w_gate", 0), ("w_up", 1), ("w_down_t", 1)):  # expert-major: a piece a run
                    dst, src = getattr(slot, name), getattr(master, name)
                    whole = src.block is not None and src.block.shape[1:] == dst.block.shape[1:]
                    copy_rows([(dst.block, src.block)] if whole else list(zip(parts(dst), parts(src))), absent[k])
                return
            for name, i in (("w_gate", ids[0]), ("w_up", ids[1]), ("w_down_t", ids[1])):
                if i is not None:
                    stage = getattr(slot, name)
                    gather_experts(
                        parts(stage), parts(getattr(cache.pool, name)), parts(getattr(master, name)), none, i
                    )

        if side is None:
            copy()
            return Staged(layer, absent, rows, slot, None)
        side.wait_stream(torch.cuda.current_stream(device))
        for t in ids:  # made on the compute stream, read on the side one
            if t is not None:
                t.record_stream(side)
        with torch.cuda.stream(side):
            copy()
            event = torch.cuda.Event()
            event.record(side)
        return Staged(layer, absent, rows, slot, event)

    def dequantize(self, cache, staged: Staged, buf: ExpertWeights, ids: torch.Tensor) -> None:
        """buf[i] = expert ids[i] of the staged layer dequantized, from its pool slot or its stage row (device
        memory only), one gather_dequant launch a projection on the current stream."""
        layer = staged.layer
        table = cache.tables[layer]
        gate_table = cache.gate_tables[layer] if cache.gate_slots else table
        slot = staged.slot
        for name, t, rows in (
            ("w_gate", gate_table, staged.rows[0]),
            ("w_up", table, staged.rows[1]),
            ("w_down_t", table, staged.rows[1]),
        ):
            stage = getattr(slot, name)
            code = nf4_code(ids.device) if isinstance(stage, Nf4Tensor) else None
            gather_dequant(getattr(buf, name), getattr(cache.pool, name), stage, t, ids, code=code, host_rows=rows)

    def settle(self, device: torch.device) -> None:
        """The compute stream waits for a stage issued ahead (its memory may go), and it is dropped."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead.event is not None:
            torch.cuda.current_stream(device).wait_event(ahead.event)


def _absent(cache, layer: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The experts of `layer` not resident: (gate, up/down), from the cache's host view (no device read)."""
    gates, slots = cache.sources(layer)
    return tuple(e for e, s in enumerate(gates) if s < 0), tuple(e for e, s in enumerate(slots) if s < 0)


def _rows(absent: tuple[int, ...], E: int, device: torch.device) -> torch.Tensor:
    """[E] int32 on `device`: each absent expert's row in the slot (in `absent`'s order), -1 for the others."""
    rows = [-1] * E
    for r, e in enumerate(absent):
        rows[e] = r
    return upload(rows, device)


def _specs(like) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape of one expert's part, dtype) of each part of `like`'s format."""
    return [(tuple(t.shape[1:]), t.dtype) for t in parts(like)]


def _packed_bytes(like, n: int) -> int:
    """Bytes `n` experts of `like`'s format take laid by `_laid` (expert-major, rounded up to ALIGN)."""
    block = expert_major(lambda shape, dt: torch.empty(shape, dtype=dt, device="meta"), n, _specs(like))[-1]
    return -(-block.numel() // ALIGN) * ALIGN


def _laid(raw: torch.Tensor, like, n: int):
    """A 4-bit stack of `n` experts like `like` (Int4Tensor / Nf4Tensor) laid expert-major in `raw` (uint8, at least
    `_packed_bytes(like, n)` bytes) as the host master copies are (kernels/int4.py `expert_major`): a run of absent
    experts crosses in one copy."""
    *out, block = expert_major(lambda shape, dt: raw[: shape[0] * shape[1]].view(shape), n, _specs(like))
    minimum = () if len(out) == 3 else (None,)
    return type(like)(*out, *minimum, like.dtype, block)
