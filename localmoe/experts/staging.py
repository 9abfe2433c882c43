"""Offloaded prefill: a layer's routed experts streamed through two device staging buffers (issue #29's first step).

The dense path of an offloaded layer (a prompt piece, calibration, evaluation) needs nearly every expert of the
layer once. `Staging.stream(cache, layer, experts)` copies the routed experts, a span of `span` experts at a time,
into one of two staging buffers ([span, I, H] per projection, in the cache's format: plain tensors, or int4 / nf4
stacks whose packed bytes cross the bus) and yields each span for the grouped GEMMs
(`LocalExperts._grouped`). On CUDA the copies run on a side stream: the next span's copies are issued before the
current span is computed, so PCIe and the GEMMs overlap, with no host synchronisation per expert (the side stream
waits for the compute stream before refilling a buffer; the compute stream waits for the span's copy event). Each
part comes from its cache pool when resident (a device copy), else from the pinned host master copy; nothing is
admitted into the cache (prefill does not evict the decode working set). On the CPU the copies run in order.

A span holds as many experts as fit STAGE_BYTES of stored weights, and, for 4-bit experts, whose span is
dequantized for the GEMMs, DEQUANT_BYTES of dequantized ones: two buffers plus one dequantized span stay inside the
plan's workspace reserve (experts/placement.WORKSPACE_RESERVE, 0.5 GiB).

Shapes: I expert width, H hidden; `span` experts per staging buffer.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from localmoe.experts.int4 import copy_expert
from localmoe.experts.local_experts import DEQUANT_BYTES, ExpertWeights

STAGE_BYTES = 96 << 20  # stored expert bytes per staging buffer (two buffers)


class Staging:
    """Two staging buffers of `span` experts for one cache (made on first use, kept for the next calls)."""

    def __init__(self, make, expert_bytes: int, dequantized_bytes: int, quantized: bool):
        """`make(n)` -> an empty [n, I, H] stack in the cache's format on its device; bytes of one expert stored
        (all three projections) and dequantized."""
        self.make = make
        per = STAGE_BYTES // max(expert_bytes, 1)
        if quantized:
            per = min(per, DEQUANT_BYTES // max(dequantized_bytes, 1))
        self.span = max(1, per)
        self.buffers: list[ExpertWeights] | None = None
        self.stream_: torch.cuda.Stream | None = None

    def _buffers(self) -> list[ExpertWeights]:
        if self.buffers is None:
            self.buffers = [
                ExpertWeights(self.make(self.span), self.make(self.span), self.make(self.span)) for _ in "ab"
            ]
        return self.buffers

    def stream(self, cache, layer: int, experts: list[int]) -> Iterator[tuple[int, int, ExpertWeights]]:
        """(index in `experts` of the span's first expert, experts in the span n, the staging buffer holding them in
        its first n rows) for each span of `experts` (ascending expert ids of `layer`), in order (module doc). The
        buffer is valid until the generator is resumed twice."""
        spans = [experts[i : i + self.span] for i in range(0, len(experts), self.span)]
        if not spans:
            return
        bufs = self._buffers()
        device = bufs[0].w_gate.device
        cuda = device.type == "cuda"
        if cuda and self.stream_ is None:
            self.stream_ = torch.cuda.Stream(device)
        sources = cache.sources(layer)

        def issue(i: int):
            if not cuda:
                self._fill(cache, layer, spans[i], bufs[i % 2], sources)
                return None
            self.stream_.wait_stream(torch.cuda.current_stream(device))  # the buffer's previous span is computed
            with torch.cuda.stream(self.stream_):
                self._fill(cache, layer, spans[i], bufs[i % 2], sources)
                done = torch.cuda.Event()
                done.record(self.stream_)
            return done

        ready = issue(0)
        for i, span in enumerate(spans):
            following = issue(i + 1) if i + 1 < len(spans) else None
            if ready is not None:
                torch.cuda.current_stream(device).wait_event(ready)
            yield i * self.span, len(span), bufs[i % 2]
            ready = following

    @staticmethod
    def _fill(cache, layer: int, span: list[int], buf: ExpertWeights, sources) -> None:
        """buf[i] = expert span[i] of `layer`, each projection from its pool slot when resident, else from the host
        master copy (counted in the cache's figures)."""
        master = cache.masters[layer]
        gate_slots, slots = sources
        for i, e in enumerate(span):
            resident = slots[e] >= 0
            cache.hits += resident
            cache.misses += not resident
            for name, slot in (("w_gate", gate_slots[e]), ("w_up", slots[e]), ("w_down_t", slots[e])):
                if slot >= 0:
                    copy_expert(getattr(buf, name), i, getattr(cache.pool, name), slot, non_blocking=True)
                else:
                    copy_expert(getattr(buf, name), i, getattr(master, name), e, non_blocking=True)
                    cache.copied_bytes += cache.row_bytes * cache.width
