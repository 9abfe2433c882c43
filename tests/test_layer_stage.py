"""experts/layer_stage.py: a layer's absent int4 / NF4 experts staged packed a layer ahead, each span dequantized
from the pool or the stage. The spans equal those staged span by span (bit for bit: the same kernel arithmetic),
the next layer is staged ahead and taken, a stage that no longer matches the cache is made again, one that does not
fit a slot falls back to spans, and the cache counts the same hits, misses and bytes. The CPU under the
interpreter (the gather kernels; the stage filled by host copies or by the gather kernel); the offloaded engine's
logits through the stage: tests/test_offload_prefill.py."""

import os

import pytest
import torch

from localmoe.experts import cache as offload
from localmoe.experts import layer_stage
from localmoe.experts.expert_weights import ExpertWeights
from localmoe.experts.int4 import PROJECTIONS, quantize_as
from localmoe.experts.layer_stage import LayerStage, _beside, span_beside
from localmoe.experts.staging import Staging
from localmoe.kernels import gather_dequant

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the gather kernels on CPU tensors need the interpreter"
)
E, I, H = 6, 4, 64


@pytest.fixture(autouse=True)
def _stage_on(monkeypatch):
    """The layer stage (on by default for long pieces, bench/RESULTS.md): on here unless a test turns it off, for
    pieces of any length."""
    monkeypatch.setattr(Staging, "stage_layers", True)
    monkeypatch.setattr(Staging, "stage_rows", 0)


class _Counted:
    """A kernel whose launches are counted (each still runs)."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]


def _cache(fmt: str, layers: int = 3):
    cache = offload.ExpertCache(3, (E, I, H), torch.float32, torch.device("cpu"), int4=fmt)
    gen = torch.Generator().manual_seed(0)
    for layer in range(layers):
        w = {p: quantize_as(torch.randn(E, I, H, generator=gen), fmt, p) for p in PROJECTIONS}
        cache.add_layer(layer, ExpertWeights(**w))
    cache.staging.kernel_on_cpu, cache.staging.span = True, 3
    cache.fetch(0, [1, 4])  # resident: experts 1 and 4 of layer 0, 2 of layer 1
    cache.fetch(1, [2])
    return cache


def _spans(cache, layer: int) -> list[list[torch.Tensor]]:
    out = []
    for first, n, buf, ids in cache.stream(layer, list(range(E))):
        assert ids.tolist() == list(range(first, first + n))
        out.append([getattr(buf, p)[:n].clone() for p in PROJECTIONS])
    return out


@pytest.mark.parametrize("copies", [True, False])
@pytest.mark.parametrize("fmt", ["int4", "nf4"])
def test_the_stage_gives_the_spans_the_span_path_gives(fmt, copies, monkeypatch):
    monkeypatch.setattr(LayerStage, "by_copy_engines", copies)  # host copies or the gather kernel fill the stage
    cache = _cache(fmt)
    monkeypatch.setattr(Staging, "stage_layers", False)
    want, figures = [], []
    for layer in range(3):
        cache.reset_stats()
        want.append(_spans(cache, layer))
        figures.append((cache.hits, cache.misses, cache.copied_bytes))
    assert cache.staging.stage is None
    monkeypatch.setattr(Staging, "stage_layers", True)
    for layer in range(3):
        cache.reset_stats()
        got = _spans(cache, layer)
        for a, b in zip(got, want[layer]):
            for x, y in zip(a, b):
                assert torch.equal(x, y)
        assert (cache.hits, cache.misses, cache.copied_bytes) == figures[layer]
        stage = cache.staging.stage
        assert stage is not None and stage.fits((tuple(range(E)),) * 2)  # fp32 spans of 3: the room holds a layer
        if layer < 2:  # the next layer staged ahead, its absent experts listed
            assert stage.ahead.layer == layer + 1
            assert stage.ahead.absent[1] == tuple(e for e in range(E) if not (layer == 0 and e == 2))
        else:
            assert stage.ahead is None
    assert cache.staging.ahead is None  # no spans filled ahead on this path


def test_a_stale_or_oversized_stage_is_not_used(monkeypatch):
    cache = _cache("int4")
    want = [_spans(cache, layer) for layer in range(2)]
    _spans(cache, 0)
    stage = cache.staging.stage
    assert stage.ahead.layer == 1
    cache.fetch(1, [3])  # decode admits into the pools: the stage ahead is dropped
    assert stage.ahead is None
    got = _spans(cache, 1)  # staged now, with expert 3 resident
    assert [[torch.equal(x, y) for x, y in zip(a, b)] for a, b in zip(got, want[1])] == [[True] * 3] * 2
    stage.ahead = None
    _spans(cache, 0)
    cache.place_experts([])  # every slot freed: a stage ahead still held no longer matches the cache (`take`)
    assert stage.ahead is None or stage.ahead.absent[1] != tuple(range(E))
    got = _spans(cache, 1)
    assert [[torch.equal(x, y) for x, y in zip(a, b)] for a, b in zip(got, want[1])] == [[True] * 3] * 2
    monkeypatch.setattr(stage, "room", sum(stage.sizes(((0, 1), (0, 1)))))  # room for two experts: span by span
    cache.reset_stats()
    got = _spans(cache, 0)
    assert cache.staging.ahead is not None and cache.staging.ahead[0] == 1  # the span path filled ahead
    assert [[torch.equal(x, y) for x, y in zip(a, b)] for a, b in zip(got, want[0])] == [[True] * 3] * 2
    assert cache.misses == E


def test_a_short_piece_goes_span_by_span(monkeypatch):
    monkeypatch.setattr(Staging, "stage_rows", 4)  # pieces of at least 4 slots an expert
    cache = _cache("int4")
    want = _spans(cache, 0)  # slots=0: below the threshold, the span path
    assert cache.staging.stage is None
    got = [
        [getattr(buf, p)[:n].clone() for p in PROJECTIONS]
        for _, n, buf, _ in cache.stream(0, list(range(E)), slots=4 * E)
    ]
    assert cache.staging.stage is not None and cache.staging.stage.counts["at start"] == 1
    assert [[torch.equal(x, y) for x, y in zip(a, b)] for a, b in zip(got, want)] == [[True] * 3] * 2


def test_a_gate_tier_with_every_gate_resident_stages_up_down_only(monkeypatch):
    """Every gate in its tier (the usual int4 budget): a layer's stage holds no gate rows, only the absent up/down
    pairs, and gives the spans the span path gives."""
    cache = offload.ExpertCache(3, (E, I, H), torch.float32, torch.device("cpu"), int4="int4", mode="direct",
                                gate_slots=2 * E)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for layer in range(2):
        w = {p: quantize_as(torch.randn(E, I, H, generator=gen), "int4", p) for p in PROJECTIONS}
        cache.add_layer(layer, ExpertWeights(**w))
    cache.place_gates()
    cache.staging.kernel_on_cpu, cache.staging.span = True, 3
    monkeypatch.setattr(gather_dequant, "JOINED", True)
    launches = []
    real = gather_dequant._gather_dequant_kernel
    monkeypatch.setattr(gather_dequant, "_gather_dequant_kernel", _Counted(real, launches))
    monkeypatch.setattr(Staging, "stage_layers", False)
    want = [_spans(cache, layer) for layer in range(2)]
    monkeypatch.setattr(Staging, "stage_layers", True)
    got = [_spans(cache, layer) for layer in range(2)]
    assert len(launches) == 8  # one a span (three projections joined, the gates from their tier), either way
    assert [[[torch.equal(x, y) for x, y in zip(a, b)] for a, b in zip(g, w)] for g, w in zip(got, want)] == [
        [[True] * 3] * 2
    ] * 2
    stage = cache.staging.stage
    assert stage is not None and stage.ahead is None  # layer 1 was staged ahead and taken
    assert all(s < 0 for s in cache.sources(0)[1]) and all(g >= 0 for g in cache.sources(0)[0])


def test_spans_shrink_while_the_room_cannot_hold_two_layers_in_a_row(monkeypatch):
    """bf16 spans of 6 of 12 experts leave too little room for two layers in a row with every expert absent: the
    stage dequantizes spans of 3 (12 in four equal spans); with most experts resident, the next prompt piece's
    stage has spans of 6 again. Either way the layer's experts equal the span path's."""
    n = 12
    cache = offload.ExpertCache(20, (n, I, H), torch.bfloat16, torch.device("cpu"), int4="int4")
    gen = torch.Generator().manual_seed(0)
    for layer in range(2):
        w = {p: quantize_as(torch.randn(n, I, H, generator=gen), "int4", p) for p in PROJECTIONS}
        cache.add_layer(layer, ExpertWeights(**w))
    cache.staging.kernel_on_cpu, cache.staging.span = True, 6

    def layer_experts(layer):
        spans = [
            [getattr(buf, p)[:k].clone() for p in PROJECTIONS] for _, k, buf, _ in cache.stream(layer, [*range(n)])
        ]
        return [torch.cat(parts) for parts in zip(*spans)], len(spans)

    for resident, span in ((0, 3), (10, 6)):
        for layer in range(2):
            cache.fetch(layer, list(range(resident)))
        monkeypatch.setattr(Staging, "stage_layers", False)
        want = [layer_experts(layer) for layer in range(2)]
        monkeypatch.setattr(Staging, "stage_layers", True)
        got = [layer_experts(layer) for layer in range(2)]
        stage = cache.staging.stage
        assert stage.span == span and stage.need(cache, [0, 1]) <= stage.room
        assert [k for _, k in want] == [2, 2] and [k for _, k in got] == [n // span] * 2
        for (a, _), (b, _) in zip(got, want):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert stage.need(cache, [0, 1]) == 2 * sum(stage.sizes(((10, 11),) * 2))


def test_span_beside_is_the_largest_equal_span_that_leaves_the_slots_room():
    total = 6 * 64 * 6000  # two buffers of 64 experts of 6,000 bytes
    assert span_beside(256, 64, 6000, 100, total) == 64  # room to spare: the span path's span
    assert span_beside(256, 64, 6000, 2_060_000, total) == 37  # 256 in 7 spans (43, in 6, leaves too little)
    assert span_beside(256, 64, 6000, 2_300_000, total) == 16  # no room at any span: a quarter of it


def test_a_slot_takes_the_other_end_of_the_room_and_one_that_does_not_fit_is_staged_as_its_layer_starts(monkeypatch):
    cache = _cache("int4")
    want = [_spans(cache, layer) for layer in range(3)]
    _spans(cache, 0)  # layer 0 from the start of the room, layer 1 ahead at its end
    stage = cache.staging.stage
    first = sum(stage.sizes(((0, 2, 3, 5),) * 2))  # layer 0's absent experts (no gate tier): 1 and 4 resident
    assert stage.ahead.layer == 1 and stage.ahead.at == stage.room - stage.ahead.size >= first
    assert [_beside(0, 300, 100, 400), _beside(0, 300, 101, 400), _beside(300, 400, 300, 400)] == [300, None, 0]
    assert _beside(300, 400, 301, 400) is None
    whole = sum(stage.sizes((tuple(range(E)),) * 2))
    monkeypatch.setattr(stage, "room", whole)  # one layer at a time: none ahead, each staged as its layer starts
    stage.ahead = None
    stage.counts.clear()
    for layer in range(3):
        got = _spans(cache, layer)
        assert stage.ahead is None and cache.staging.ahead is None  # not the span path either
        assert [[torch.equal(x, y) for x, y in zip(a, b)] for a, b in zip(got, want[layer])] == [[True] * 3] * 2
    assert stage.counts == {"at start": 3}  # counted for bench/staging_ab.py


def test_a_layers_tables_are_one_upload_each_view_aligned(monkeypatch):
    """A layer's stage crosses its rows and ids in one upload: each view holds what it would alone, starting 16
    bytes aligned (the gather kernels keep their compiled variants); a gate tier's empty gate list is None."""
    uploads = []
    real = layer_stage.upload
    monkeypatch.setattr(layer_stage, "upload", lambda values, device: uploads.append(values) or real(values, device))
    for absent, n in [(((1, 2, 5), (0, 2, 3, 4, 5)), 6), (((), (2,)), 6), (((0, 3), (1,)), 9)]:
        rows, ids = layer_stage._tables(absent, n, torch.device("cpu"))
        for got, a in zip(rows, absent):
            want = [-1] * n
            for r, e in enumerate(a):
                want[e] = r
            assert got.tolist() == want and got.dtype == torch.int32
        assert [None if t is None else t.tolist() for t in ids] == [list(a) or None for a in absent]
        assert all(t.data_ptr() % 16 == 0 for t in (*rows, *ids) if t is not None)
    assert len(uploads) == 3
    cache = _cache("int4")
    uploads.clear()
    _spans(cache, 0)  # layer 0 staged as it starts, layer 1 ahead: one upload each
    assert len(uploads) == 2
