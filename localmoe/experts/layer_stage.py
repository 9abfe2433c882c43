"""Offloaded prefill's layer stage (issue #29): a layer's absent int4 / NF4 experts staged packed, a layer ahead.

Span by span (experts/staging.py `Staging.stream`), a long prompt piece's int4 layer is dequantized on the side
stream, host and resident experts together, into two plain buffers, and PCIe only runs ahead by the two spans filled
during the next layer's attention. With the layer stage (`Staging.stage_layers`: int4 / NF4 experts whose master
copies the device reads in place, a call that routes every expert in a piece of at least `Staging.stage_rows` slots
an expert) only the absent experts' packed bytes cross on the side stream into one of two stage slots, issued as soon
as the layer before starts its experts: PCIe then runs under that layer's GEMMs and this layer's attention. From
pinned host memory the copy engines move them (experts/host_copies.py, `by_copy_engines`: the SMs stay with the
GEMMs): host master copies and slots are both laid expert-major (kernels/int4.py `expert_major`), so a run of
absent experts is one piece of a projection (~170 pieces a layer at Qwen3.5-35B-A3B's shapes, ~0.5 ms of host time,
where part by part took ~510 and ~1.6 ms). Else one gather_experts launch a projection (master copies on the device,
or `by_copy_engines` off). The compute stream dequantizes each span of the layer from the pool (resident) or the
stage (absent: kernels/gather_dequant.py `host_rows`, device memory only) into one plain buffer right before its
GEMMs.

The stage lays its own span buffer and its slots in the memory of the span path's two plain buffers (one
allocation; the prefill budget, experts/prefill_budget.py, is unchanged). A layer's slot takes the other end of the
room (the memory after the span buffer) from the one the layer before is still read from, as large as its absent
experts need (gates and up/down pairs; a gate tier leaves the up/down pairs all of it), so two stages fit whenever
their sum does. At each prompt piece (`lay`) the span buffer is as large as the span path's where the room still
holds the two largest stages in a row with the cache as it is, else fewer experts a span (`span_beside`): decoding
leaves the deep layers with the most experts absent (Qwen3.5-35B-A3B int4 at 16 GiB after 128 tokens: 10-46 of 256
in layers 0-14, 187-216 in layers 19-39; two fixed halves held 180), and spans of 43 instead of 64 then let every
stage be issued a layer ahead. A stage that still does not fit beside the one before is issued when its layer
starts; a layer whose absent experts do not fit the room is staged span by span. Shapes: E experts a layer, I
expert width, H hidden.

Imports: torch, experts/expert_weights, experts/host_copies and experts/int4, kernels/int4 and the two gather
kernels.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from localmoe.experts.expert_weights import ExpertWeights
from localmoe.experts.host_copies import copy_rows, upload
from localmoe.experts.int4 import PROJECTIONS, Nf4Tensor, parts
from localmoe.kernels.gather_dequant import gather_dequant_projections
from localmoe.kernels.gather_experts import gather_experts
from localmoe.kernels.int4 import expert_major
from localmoe.kernels.nf4 import nf4_code

ALIGN = 256  # bytes: each slot and each part of it starts at a multiple


@dataclass
class Staged:
    """One layer's absent experts in a slot: their ids (gate, up/down: the gate tier may differ), each expert's row
    in the slot ([E] int32 on the device, -1 resident), the slot's stacks as laid for them, the event that marks
    the copies done (None on the CPU), and where the slot lies in the stage's memory (bytes from, bytes)."""

    layer: int
    absent: tuple[tuple[int, ...], tuple[int, ...]]
    rows: tuple[torch.Tensor, torch.Tensor]
    slot: ExpertWeights
    event: torch.cuda.Event | None
    at: int = 0
    size: int = 0


class LayerStage:
    """A span buffer and two stage slots of packed 4-bit experts laid in the plain buffers' memory (module doc)."""

    # Host master copies staged by the copy engines (experts/host_copies.py; one driver call a layer where the
    # driver has the batch call); False: one gather_experts launch a projection (SMs read the pinned rows).
    by_copy_engines = True

    def __init__(self, memory: torch.Tensor, like, row: torch.Tensor, experts: int, span: int, gates: bool):
        """`memory`: the bytes (uint8) of both plain staging buffers, one allocation; `like(p)`: a one-expert stack of
        projection p in the cache's 4-bit format; `row`: one plain [I, H] row (the dtype and shape spans are
        dequantized to); `experts` a layer; `span`: the span path's experts a buffer (the most a span holds here);
        `gates`: whether absent gates are staged (no gate tier). Laid at first for a whole layer's experts absent
        (`lay`)."""
        self.like = {p: like(p) for p in PROJECTIONS}
        self.whole, self.row, self.experts, self.most = memory, row, experts, span
        self._bytes: dict[tuple[str, int], int] = {}  # (projection, experts) -> _packed_bytes
        self.span = 0
        self.ahead: Staged | None = None
        self._none: dict[tuple, torch.Tensor] = {}  # (device, E) -> [E] of -1: gather_experts reads the host copy
        self._every: dict[torch.device, torch.Tensor] = {}  # device -> [E] int32 of 0..E-1 (`every`)
        # layers taken: "ahead" (staged a layer ahead), "at start" (staged as the layer starts), "spans" (too large)
        self.counts: Counter[str] = Counter()
        self.lay(sum(self.sizes(((tuple(range(experts)) if gates else ()), tuple(range(experts))))))

    def lay(self, need: int) -> None:
        """The span buffer at the head of the memory and the slots' room after it, for `need` bytes of slots: as
        many experts a span as the span path's where the room still holds them, else fewer (`span_beside`). No
        stage may be in flight (`settle` first)."""
        plain = self.row.numel() * self.row.element_size()
        span = span_beside(self.experts, self.most, 3 * plain, need, self.whole.numel())
        if span == self.span:
            return
        self.span, head = span, 3 * span * plain
        stacks = self.whole[:head].view(self.row.dtype).view(3 * span, *self.row.shape).split(span)
        self.buf = ExpertWeights(*stacks)  # where each span is dequantized
        at = -(-head // ALIGN) * ALIGN
        self.room = (self.whole.numel() - at) // ALIGN * ALIGN
        self.memory = self.whole[at:]

    def need(self, cache, layers: list[int]) -> int:
        """Bytes of slots `layers` (in order, each staged a layer ahead of the next) need with the cache as it is:
        the most any two in a row take together (decoding leaves the deep layers with the most absent)."""
        size = [sum(self.sizes(_absent(cache, layer))) for layer in layers]
        pairs = [a + b for a, b, x, y in zip(size, size[1:], layers, layers[1:]) if y == x + 1]
        return max(size + pairs, default=0)

    def sizes(self, absent: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[int, int, int]:
        """Bytes the three projections' stacks of these absent experts (gate, up/down) take in a slot."""
        out = []
        for p, k in zip(PROJECTIONS, (len(absent[0]), len(absent[1]), len(absent[1]))):
            n = self._bytes.get((p, k))
            if n is None:
                n = self._bytes[(p, k)] = _packed_bytes(self.like[p], k)
            out.append(n)
        return tuple(out)

    def every(self, device: torch.device) -> torch.Tensor:
        """Every expert's id, [E] int32 on `device`, made once: a span's ids are a slice (read only)."""
        ids = self._every.get(device)
        if ids is None:
            ids = self._every[device] = torch.arange(self.experts, dtype=torch.int32, device=device)
        return ids

    def fits(self, absent) -> bool:
        return sum(self.sizes(absent)) <= self.room

    def take(self, cache, layer: int, side, device: torch.device) -> Staged | None:
        """This layer's stage: the one issued ahead when it still matches the cache, else issued now (anywhere in
        the room: what the compute stream reads of the layer before was queued first); None when its absent experts
        do not fit the room."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead.layer == layer and ahead.absent == _absent(cache, layer):
            self.counts["ahead"] += 1
            return ahead
        staged = self.issue(cache, layer, side, device)
        self.counts["at start" if staged is not None else "spans"] += 1
        return staged

    def issue(self, cache, layer: int, side, device: torch.device, beside: Staged | None = None) -> Staged | None:
        """Copy `layer`'s absent experts into a slot of the room: on `side` after the compute stream's work so far;
        on the CPU now. `beside`: the stage the compute stream still reads (the layer before's), which the slot must
        not overlap: at the room's other end. None (nothing copied) when they do not fit."""
        absent = _absent(cache, layer)
        sizes = self.sizes(absent)
        need = sum(sizes)
        start = 0 if beside is None else _beside(beside.at, beside.at + beside.size, need, self.room)
        if start is None or need > self.room:
            return None
        E = cache.num_experts
        rows, ids = _tables(absent, E, device)
        raw, at, stacks = self.memory[start:], 0, []
        for p, size, k in zip(PROJECTIONS, sizes, (0, 1, 1)):
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
            return Staged(layer, absent, rows, slot, None, start, need)
        side.wait_stream(torch.cuda.current_stream(device))
        rows[0].record_stream(side)  # the layer's one upload (rows and ids): made on the compute stream, read on both
        with torch.cuda.stream(side):
            copy()
            event = torch.cuda.Event()
            event.record(side)
        return Staged(layer, absent, rows, slot, event, start, need)

    def dequantize(self, cache, staged: Staged, buf: ExpertWeights, ids: torch.Tensor) -> None:
        """buf[i] = expert ids[i] of the staged layer dequantized, from its pool slot or its stage row (device
        memory only), on the current stream (`dequantize_span`)."""
        rows = (staged.rows[0], staged.rows[1], staged.rows[1])
        dequantize_span(cache, staged.layer, buf, staged.slot, ids, rows)

    def settle(self, device: torch.device) -> None:
        """The compute stream waits for a stage issued ahead (its memory may go), and it is dropped."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead.event is not None:
            torch.cuda.current_stream(device).wait_event(ahead.event)


def dequantize_span(cache, layer: int, buf: ExpertWeights, src: ExpertWeights, ids: torch.Tensor, rows=None) -> None:
    """buf[i] = expert ids[i] of `layer` dequantized, its three projections each from the pool slot the cache's
    tables give (gates by the gate tier's) or else from `src` (host master copies, or with `rows` (gate, up, down)
    a stage of the absent experts): kernels/gather_dequant.py `gather_dequant_projections`."""
    table = cache.tables[layer]
    gate_table = cache.gate_tables[layer] if cache.gate_slots else table
    code = nf4_code(ids.device) if isinstance(src.w_gate, Nf4Tensor) else None
    gather_dequant_projections(
        [getattr(buf, p) for p in PROJECTIONS], [getattr(cache.pool, p) for p in PROJECTIONS],
        [getattr(src, p) for p in PROJECTIONS], (gate_table, table, table), ids, code=code, host_rows=rows,
    )  # fmt: skip


def span_beside(experts: int, span: int, expert: int, need: int, total: int) -> int:
    """Experts a span of the layer stage holds: the largest of `experts` split in equal spans, at most `span`, that
    leaves room for `need` bytes of slots beside a buffer of `expert` bytes an expert in `total` bytes; at least a
    quarter of `span` (the slots then take the rest: most layers still fit)."""
    floor = max(1, span // 4)
    for k in range(-(-experts // span), experts + 1):
        s = -(-experts // k)
        if s < floor:
            break
        if s * expert + need + 2 * ALIGN <= total:
            return s
    return floor


def _beside(lo: int, hi: int, need: int, room: int) -> int | None:
    """Where `need` bytes go in `room` beside the bytes lo..hi in use, at the other end of the room (two stages fit
    whenever their sum does): at its end when lo..hi is at its start, else at its start."""
    if lo == 0:
        return room - need if room - need >= hi else None
    return 0 if need <= lo else None


def _absent(cache, layer: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The experts of `layer` not resident: (gate, up/down), from the cache's host view (no device read)."""
    gates, slots = cache.sources(layer)
    return tuple(e for e, s in enumerate(gates) if s < 0), tuple(e for e, s in enumerate(slots) if s < 0)


def _tables(absent: tuple[tuple[int, ...], tuple[int, ...]], E: int, device: torch.device):
    """((gate rows, up/down rows): [E] int32 each, every absent expert's row in the slot in `absent`'s order and -1
    for the others; (gate ids, up/down ids): the absent experts' ids, None where there are none), all views of one
    upload (experts/host_copies.py: one pinned copy a layer, not four), each starting 16 bytes aligned as separate
    tensors would (the kernels' launches keep their compiled variants)."""
    values = []
    for a in absent:
        rows = [-1] * E
        for r, e in enumerate(a):
            rows[e] = r
        values += rows + [-1] * (-E % 4)
    starts = []
    for a in absent:
        starts.append(len(values))
        values += list(a) + [-1] * (-len(a) % 4)
    table = upload(values, device)
    step = E + -E % 4
    rows = (table[:E], table[step : step + E])
    ids = tuple(table[s : s + len(a)] if a else None for s, a in zip(starts, absent))
    return rows, ids


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
