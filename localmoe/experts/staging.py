"""Offloaded prefill: a layer's routed experts streamed through two device staging buffers (issue #29's first step).

The dense path of an offloaded layer (a prompt piece, calibration, evaluation) needs nearly every expert of the layer
once. `Staging.stream(cache, layer, experts)` copies the routed experts, a span of `span` experts at a time, into one
of two staging buffers ([span, I, H] per projection: plain tensors in the model's dtype, int4 / NF4 experts
dequantized as they arrive (their packed bytes cross the bus), MXFP4 stacks as stored) and yields each span for the
grouped GEMMs (`LocalExperts._grouped`). On CUDA the copies run on a side stream: the next span's copies are issued
before the current span is computed, so PCIe and the GEMMs overlap, with no host synchronisation per expert (the side
stream waits for the compute stream before refilling a buffer; the compute stream waits for the span's copy event).
Each part comes from its cache pool when resident, else from the host master copy; nothing is admitted into the cache
(prefill does not evict the decode working set). When a layer routed every expert (a long prompt piece), the next
layer's first two spans of experts are filled ahead, on the side stream, as soon as this layer's last span is issued:
the next layer's attention then runs while PCIe works, not before it (used when the next layer's first spans are the
same experts; otherwise refilled). With pinned master copies one kernel launch per projection (int4 / NF4:
kernels/gather_dequant.py; otherwise kernels/gather_experts.py, all its parts) fills a span: the device slot tables
pick pool or host per expert, and the host rows are read through unified addressing; otherwise (memory-mapped or
pageable master copies, the CPU) a copy per expert and part (int4 / NF4: dequantized on the device).
`stream(packed=True)` (int4 experts whose grouped GEMMs read them in place, experts/dense_path.py `int4_staged_packed`)
stages spans as int4 stacks laid in the same buffers' memory, one gather_experts launch per projection (its three
parts): the packed bytes cross and nothing is dequantized. A packed span holds as many experts as that memory does
(`packed_fill`; ~3.8x `span` for bf16 models, evened out: a layer in two spans of 128 at Qwen3.5-35B-A3B's shapes):
fewer spans, fewer launches a layer, and the next layer's two spans filled ahead are all of it.

With `cpu_share` some absent plain experts of a layer are not staged at all: the CPU computes them meanwhile
(experts/cpu_share.py; `cpu_experts` picks them without the routing, so the layer ahead is filled without them).

A span holds as many experts as fit STAGE_BYTES of stored weights (int4 / NF4 staged dequantized: not counted),
and, for 4-bit experts, STAGE_DEQUANT_BYTES of dequantized ones, evened out so that a layer's spans are of one size
(experts/prefill_budget.span_for); the engine sets it from the VRAM budget at load (`resize`,
prefill_budget.fit: two buffers (MXFP4: and two dequantized spans) and the piece's activations inside what the plan
left for prefill).

Shapes: I expert width, H hidden; `span` experts per staging buffer.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from localmoe.experts.cpu_share import CpuRates, measure
from localmoe.experts.expert_weights import ExpertWeights
from localmoe.experts.host_copies import upload
from localmoe.experts.int4 import PROJECTIONS, Int4Tensor, copy_expert, parts
from localmoe.experts.layer_stage import LayerStage, dequantize_span
from localmoe.experts.prefill_budget import span_for
from localmoe.kernels.gather_experts import gather_experts


class Staging:
    """Two staging buffers of `span` experts for one cache (made on first use, kept for the next calls)."""

    # Packed int4 spans hold as many experts as the plain buffers' memory does (False: `span`, as staged dequantized).
    packed_fill = True
    # Plain (bf16 / fp32) experts: the share of an offloaded layer's absent experts a long piece computes on the CPU
    # while the GPU stages the rest (experts/cpu_share.py, `cpu_experts`). None: the share that balances the rates
    # measured on this machine at the piece's rows per expert, in pieces of at most cpu_share.MAX_ROWS rows an
    # expert (on CUDA; elsewhere with `rates` given), 0: off.
    cpu_share: float | None = None
    # int4 / NF4 layers that route every expert: the absent experts staged packed a layer ahead (by the copy engines
    # where the driver allows) and every span dequantized on the compute stream (experts/layer_stage.py). Off: span by
    # span, dequantized on the side stream. In-process A/Bs at 2048 tokens after decoding (H100, RESULTS.md): 0.188
    # against 0.258 s and 0.199 against 0.223 (session 47), 0.187-0.200 against 0.223 (session 46); fresh 0.165
    # against 0.214.
    stage_layers = True
    # Pieces the stage takes: at least this many (token, expert) slots an expert (Qwen3.5-35B-A3B, 8 of 256: 1024
    # tokens and up). A span costs one gather_dequant launch (kernels/gather_dequant.JOINED; 3 before, when the
    # stage was bound by the host's launches). In-process at 1024 tokens after decoding (H100, session 49): 0.177 /
    # 0.173 against 0.190 / 0.185 s span by span; at 512 it lost (0.200 against 0.180 s, session 46): shorter pieces
    # go span by span.
    stage_rows = 32

    def __init__(
        self, make, expert_bytes: int, dequantized_bytes: int, quantized: bool, experts: int = 1 << 30, plain=None
    ):
        """`make(n, projection)` -> an empty [n, I, H] stack of `projection` ("w_gate", "w_up", "w_down_t") in the
        cache's format on its device; bytes of one expert stored (all three projections) and dequantized; experts
        per layer (a span holds at most that many). `plain(n)`: int4 / NF4 experts are staged dequantized, in
        [n, I, H] stacks of the model's dtype that `plain` makes (filled by kernels/gather_dequant.py)."""
        self.make = make
        self.plain = plain
        self.span = span_for(expert_bytes, dequantized_bytes, quantized, experts, plain is not None)
        self.quantized = quantized
        self.experts = experts
        self.packed_span = 0  # experts per packed buffer (`_buffers(packed=True)` sets it)
        self.buffers: list[ExpertWeights] | None = None
        self.packed_buffers: list[ExpertWeights] | None = None  # int4 views of `buffers` (`stream(packed=True)`)
        self.stream_: torch.cuda.Stream | None = None
        self.gathers: dict[int, bool] = {}  # layer -> whether its spans fill by gather_experts (pinned masters)
        # what was filled ahead: (layer, first spans, events, packed)
        self.ahead: tuple[int, list[list[int]], list, bool] | None = None
        self.stage: LayerStage | None = None  # the layer stage: its span buffer and slots in the plain buffers' memory
        self.memory: torch.Tensor | None = None  # both plain buffers' bytes (uint8), their six stacks one allocation
        self.kernel_on_cpu = False  # tests: the gather kernel on CPU tensors too (TRITON_INTERPRET=1)
        self.rates: CpuRates | None = None  # the automatic CPU share's rates (`measure`d at the first long piece)
        self.rows = 0.0  # the last long piece's rows per expert (the layer ahead is filled for the same)
        self.cpu_seconds = [0.0, 0.0, 0.0]  # the CPU share's host syncs, worker and waits for it (CpuRows)

    def resize(self, span: int) -> None:
        """`span` experts per buffer from now on (the buffers are made again at the next use when it changed)."""
        span = max(1, int(span))
        if span != self.span:
            if self.buffers is not None:  # a fill ahead may still write them: the compute stream waits before they go
                self.settle(self.buffers[0].w_gate.device)
            self.buffers = self.stage = None
            self.span = span

    def _buffers(self, packed: bool = False) -> list[ExpertWeights]:
        """The two buffers; `packed`: int4 stacks of `span` experts laid in the plain buffers' memory (`_packed`)."""
        if self.buffers is None:
            if self.plain is not None:  # both buffers' stacks in one allocation: the layer stage lays its own in it
                whole = self.plain(6 * self.span)
                self.buffers = [ExpertWeights(*w.split(self.span)) for w in whole.split(3 * self.span)]
                self.memory = whole.view(-1).view(torch.uint8)
            else:
                self.buffers = [ExpertWeights(*(self.make(self.span, p) for p in PROJECTIONS)) for _ in "ab"]
            self.packed_buffers = self.stage = None
        if not packed:
            return self.buffers
        if self.packed_buffers is None:
            n = self.span
            if self.packed_fill:  # as many packed experts as a plain buffer's bytes hold, spans of equal size
                plain = self.buffers[0].w_gate
                one = sum(t.numel() * t.element_size() for t in parts(self.make(1, "w_gate")))
                most = min(self.experts, plain.numel() * plain.element_size() // one)
                n = max(self.span, -(-self.experts // -(-self.experts // most)))  # 256 experts, 225 fit: 128
            self.packed_span = n
            self.packed_buffers = [ExpertWeights(*(_packed(getattr(b, p), self.make, n) for p in PROJECTIONS))
                                   for b in self.buffers]  # fmt: skip
        return self.packed_buffers

    def _span(self, packed: bool) -> int:
        """Experts a span holds staged this way (the packed buffers made first)."""
        if not packed:
            return self.span
        self._buffers(True)
        return self.packed_span

    def cpu_experts(self, cache, layer: int, slots: int | None = None) -> list[int]:
        """The absent experts of `layer` a long piece of `slots` (token, expert) slots computes on the CPU (`cpu_share`,
        or `share`; plain experts only; None: the last piece's): the last share of them by id, a choice that needs no
        routing (the layer ahead is filled without them)."""
        if self.quantized or layer not in cache.masters:
            return []
        if slots is not None:
            self.rows = slots / cache.num_experts
        share = self.cpu_share if self.cpu_share is not None else self.share(cache, layer)
        if not share:
            return []
        gates, sources = cache.sources(layer)
        absent = [e for e in range(cache.num_experts) if sources[e] < 0 and gates[e] < 0]
        n = int(len(absent) * share)
        return absent[len(absent) - n :] if n else []

    def share(self, cache, layer: int) -> float:
        """The automatic share at the last piece's rows per expert (experts/cpu_share.py): on CUDA from rates measured
        once, at the first long piece; elsewhere only with `rates` set (0 otherwise)."""
        if self.rates is None:
            device = torch.device(cache.device)
            if device.type != "cuda":
                return 0.0
            try:
                self.rates = measure(cache.masters[layer], 3 * cache.row_bytes * cache.width, device)
            except RuntimeError:  # no pinned memory to time the bus with (a container's limit): no share
                self.rates = CpuRates(0.0, 0.0, 0.0)
        return self.rates.share(self.rows)

    def stream(
        self, cache, layer: int, experts: list[int], packed: bool = False, cpu: list[int] = (), slots: int = 0
    ) -> Iterator[tuple[int, int, ExpertWeights, torch.Tensor]]:
        """(index in `experts` of the span's first expert, experts in the span n, the staging buffer holding them in
        its first n rows, their ids [n] int32 on the device) for each span of `experts` (ascending expert ids of
        `layer`), in order (module doc). The buffer is valid until the generator is resumed twice. No host sync: the
        ids cross once, from pinned memory. `packed` (int4 experts staged dequantized otherwise): the spans stay
        int4, in the same memory (the grouped GEMMs read them in place). `cpu`: the routed experts the CPU computes
        (`cpu_experts`), not in `experts`."""
        packed = packed and self.plain is not None
        staged = None if cpu else self._layer_stage(cache, layer, experts, packed, slots)
        if staged is not None:
            yield from self._stream_staged(cache, staged)
            return
        size = self._span(packed)
        spans = [experts[i : i + size] for i in range(0, len(experts), size)]
        ahead = self._take_ahead(layer, spans, packed)
        if not spans:
            return
        bufs = self._buffers(packed)
        device = bufs[0].w_gate.device
        cuda = device.type == "cuda"
        if cuda and self.stream_ is None:
            self.stream_ = torch.cuda.Stream(device)
        sources = cache.sources(layer)
        gather = (cuda or self.kernel_on_cpu) and self._gathers(cache, layer, device)
        ids = upload(experts, device)

        def issue(i: int):
            if i in ahead:  # filled ahead, at the end of the layer before
                return ahead[i]
            return self._issue(cache, layer, spans[i], bufs[i % 2], ids[i * size :] if gather else None, cuda, packed)

        n = len(spans)
        fill_next = len(experts) + len(cpu) == cache.num_experts and layer + 1 in cache.masters
        ready = issue(0)
        for i, span in enumerate(spans):
            following = issue(i + 1) if i + 1 < n else None
            if ready is not None:
                torch.cuda.current_stream(device).wait_event(ready)
            _count(cache, span, sources)
            first = i * size
            yield first, len(span), bufs[i % 2], ids[first : first + len(span)]
            ready = following
        if fill_next:
            nxt, fill = self._ahead(cache, layer + 1, device, cuda, packed)
            self.ahead = (layer + 1, nxt, [fill(j) for j in range(len(nxt))], packed)

    def _layer_stage(self, cache, layer: int, experts: list[int], packed: bool, slots: int):
        """`layer`'s stage (experts/layer_stage.py) when it takes the layer: int4 / NF4 experts staged dequantized,
        every expert routed in a piece of at least `stage_rows` slots an expert, master copies the device reads
        (pinned or on the device; on the CPU, the gather kernels under the interpreter with `kernel_on_cpu`) and its
        absent experts fitting a slot; else None (span by span)."""
        E = cache.num_experts
        if not self.stage_layers or self.plain is None or packed or len(experts) != E or slots < self.stage_rows * E:
            return None
        bufs = self._buffers()
        device = bufs[0].w_gate.device
        cuda = device.type == "cuda"
        if not (cuda or self.kernel_on_cpu) or not self._gathers(cache, layer, device):
            return None
        if self.stage is None:
            gates = not cache.gate_slots  # no gate tier: an absent expert's gate is staged with it
            self.stage = LayerStage(self.memory, lambda p: self.make(1, p), bufs[0].w_gate[0], E, self.span, gates)
        self._settle_spans(device)  # spans filled ahead write both buffers: done before the stage reuses them
        if layer == min(cache.masters):  # a prompt piece starts: the room for this cache's two largest in a row
            self.stage.settle(device)
            self.stage.lay(
                self.stage.need(cache, [n for n in sorted(cache.masters) if self._gathers(cache, n, device)])
            )
        if cuda and self.stream_ is None:
            self.stream_ = torch.cuda.Stream(device)
        side = self.stream_ if cuda else None
        staged = self.stage.take(cache, layer, side, device)
        if staged is None:
            return None
        if cuda:  # this layer's copies, not the next one's
            torch.cuda.current_stream(device).wait_event(staged.event)
        if layer + 1 in cache.masters and self._gathers(cache, layer + 1, device):
            self.stage.ahead = self.stage.issue(cache, layer + 1, side, device, beside=staged)
        return staged

    def _stream_staged(self, cache, staged) -> Iterator[tuple[int, int, ExpertWeights, torch.Tensor]]:
        """`stream` of a whole layer through its stage: each span dequantized into the first buffer on the compute
        stream (valid until the generator is resumed)."""
        buf, size, E = self.stage.buf, self.stage.span, cache.num_experts
        ids = self.stage.every(buf.w_gate.device)
        sources = cache.sources(staged.layer)
        for first in range(0, E, size):
            n = min(size, E - first)
            self.stage.dequantize(cache, staged, buf, ids[first : first + n])
            _count(cache, list(range(first, first + n)), sources)
            yield first, n, buf, ids[first : first + n]

    def _issue(self, cache, layer: int, span: list[int], buf: ExpertWeights, ids, cuda: bool, packed: bool = False):
        """Fill `buf` with `span`'s experts: on the side stream after the compute stream's work so far (the buffer's
        previous span is computed), returning the event that marks it done; on the CPU now (None). `ids`: the span's
        expert ids on the device (from their first) for the gather kernel, None for a copy per expert."""

        def fill() -> None:
            if ids is None:
                self._fill(cache, layer, span, buf, packed)
            else:
                self._gather(cache, layer, buf, ids[: len(span)], packed)

        if not cuda:
            fill()
            return None
        self.stream_.wait_stream(torch.cuda.current_stream(buf.w_gate.device))
        if ids is not None:  # made on the compute stream, read on the side one: not reused before that read
            ids.record_stream(self.stream_)
        with torch.cuda.stream(self.stream_):
            fill()
            done = torch.cuda.Event()
            done.record(self.stream_)
        return done

    def _ahead(
        self, cache, layer: int, device: torch.device, cuda: bool, packed: bool
    ) -> tuple[list[list[int]], object]:
        """`layer`'s first two spans of experts (all experts routed, as a long piece routes them; staged `packed` or
        not) to fill ahead, span j into buffer j, for `stream` to take if they are that layer's first spans: (the
        spans, a function issuing span j's fill and returning its event)."""
        bufs, size = self._buffers(packed), self._span(packed)
        skip = set(self.cpu_experts(cache, layer))
        experts = [e for e in range(cache.num_experts) if e not in skip]
        spans = [experts[a : a + size] for a in range(0, min(len(experts), 2 * size), size)]
        gather = (cuda or self.kernel_on_cpu) and self._gathers(cache, layer, device)
        ids = upload(experts, device) if gather else None

        def fill(j: int):
            src = ids[j * size :] if gather else None
            return self._issue(cache, layer, spans[j], bufs[j], src, cuda, packed)

        return spans, fill

    def _take_ahead(self, layer: int, spans: list[list[int]], packed: bool = False) -> dict:
        """{span index: its fill event (None on the CPU)} for the leading spans of `layer` filled ahead with the
        same experts, staged the same way; clears what was filled ahead either way."""
        ahead, self.ahead = self.ahead, None
        if ahead is None or ahead[0] != layer or ahead[3] != packed:
            return {}
        taken = {}
        for i, (span, event) in enumerate(zip(ahead[1], ahead[2])):
            if i >= len(spans) or spans[i] != span:
                break
            taken[i] = event
        return taken

    def settle(self, device: torch.device) -> None:
        """Before the cache writes its pools (decode admits experts): the compute stream waits for any fill ahead
        still reading them, and it is dropped (a layer staged ahead too)."""
        self._settle_spans(device)
        if self.stage is not None:
            self.stage.settle(device)

    def _settle_spans(self, device: torch.device) -> None:
        """The compute stream waits for the spans filled ahead, and they are dropped."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and device.type == "cuda":
            for event in ahead[2]:
                torch.cuda.current_stream(device).wait_event(event)

    def _gathers(self, cache, layer: int, device: torch.device) -> bool:
        """Whether `layer`'s master copies are on `device` or pinned: the gather kernel can read them in place."""
        if layer not in self.gathers:
            master = cache.masters[layer]
            self.gathers[layer] = all(
                t.device == device or t.is_pinned()
                for w in (master.w_gate, master.w_up, master.w_down_t)
                for t in parts(w)
            )
        return self.gathers[layer]

    def _gather(self, cache, layer: int, buf: ExpertWeights, ids: torch.Tensor, packed: bool = False) -> None:
        """buf[i] = expert ids[i] of `layer` (on the device), pool slot or host master per expert as the device slot
        tables say: the three projections dequantized into plain buffers (layer_stage.dequantize_span), else (and
        `packed`) one gather_experts launch per projection for all its parts."""
        if self.plain is not None and not packed:
            dequantize_span(cache, layer, buf, cache.masters[layer], ids)
            return
        master, table = cache.masters[layer], cache.tables[layer]
        gate_table = cache.gate_tables[layer] if cache.gate_slots else table
        for name, t in (("w_gate", gate_table), ("w_up", table), ("w_down_t", table)):
            gather_experts(
                parts(getattr(buf, name)), parts(getattr(cache.pool, name)), parts(getattr(master, name)), t, ids
            )

    def _fill(self, cache, layer: int, span: list[int], buf: ExpertWeights, packed: bool = False) -> None:
        """buf[i] = expert span[i] of `layer`, each projection from its pool slot when resident, else from the host
        master copy (dequantized on the device into plain buffers unless `packed`)."""
        master = cache.masters[layer]
        gate_slots, slots = cache.sources(layer)
        for i, e in enumerate(span):
            for name, slot in (("w_gate", gate_slots[e]), ("w_up", slots[e]), ("w_down_t", slots[e])):
                if self.plain is not None and not packed:
                    dst = getattr(buf, name)[i]
                    src = (
                        getattr(cache.pool, name)[slot] if slot >= 0 else getattr(master, name).expert_on(e, dst.device)
                    )
                    dst.copy_(src)
                elif slot >= 0:
                    copy_expert(getattr(buf, name), i, getattr(cache.pool, name), slot, non_blocking=True)
                else:
                    copy_expert(getattr(buf, name), i, getattr(master, name), e, non_blocking=True)


def _packed(plain: torch.Tensor, make, n: int) -> Int4Tensor:
    """An int4 stack of `n` experts [n, I, H] laid in plain's own memory ([span, I, H] in the model's dtype: packed
    bytes, then the scales, then the minimums, each part contiguous; the caller keeps n within plain's bytes), the
    dtype and group `make` gives the format (a one-expert stack made to read them)."""
    like = make(1, "w_gate")
    if not isinstance(like, Int4Tensor) or like.minimum is None:
        raise ValueError("only int4 experts are staged packed for the grouped GEMMs to read in place")
    raw = plain.view(-1).view(torch.uint8)
    out, at = [], 0
    for t in like.parts():
        size = n * t[0].numel() * t.element_size()
        out.append(raw[at : at + size].view(t.dtype).view(n, *t.shape[1:]))
        at += size
    return Int4Tensor(*out, like.dtype)


def _count(cache, span: list[int], sources) -> None:
    """The cache's figures for staging `span` (counted when it is used: a span filled ahead and not taken is not):
    a hit or a miss per expert (its up/down), and the bytes of each part read from host memory."""
    gate_slots, slots = sources
    part = cache.row_bytes * cache.width
    for e in span:
        cache.hits += slots[e] >= 0
        cache.misses += slots[e] < 0
        cache.copied_bytes += part * ((gate_slots[e] < 0) + 2 * (slots[e] < 0))
