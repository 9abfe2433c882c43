"""Offloaded prompt processing on CPU with a small cache (experts/staging.py, the dense path's spans): the logits
and tokens equal the resident model's in every miss mode and expert format, spans are streamed and counted, the layer
ahead is filled early, and the sparse path takes pieces only while it reads fewer host bytes."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import repo_id
from offload_support import budget_for, small_cache, tokens

from localmoe.engine.engine import Engine
from localmoe.experts import cache as offload
from localmoe.experts import dense_path
from localmoe.experts.expert_weights import ExpertWeights
from localmoe.experts.layer_stage import LayerStage
from localmoe.experts.staging import Staging


def test_sparse_piece_tokens_follow_host_bytes():
    """Direct misses: the longest prefill piece for the sparse path is where its per-token host reads (absent gates,
    kept rows of absent up/down) reach the dense path's per-piece copies (every absent expert's up/down)."""
    E, I, H, layers, k = 16, 4, 8, 4, 2

    def piece(slots, gate_slots, sparsity):
        cache = offload.ExpertCache(
            slots, (E, I, H), torch.float32, torch.device("cpu"), mode="direct", gate_slots=gate_slots
        )
        for layer in range(layers):
            cache.add_layer(layer, ExpertWeights(*(torch.zeros(E, I, H) for _ in range(3))))
        return cache.sparse_piece_tokens(k, sparsity)

    total = layers * E
    # gates all resident, no up/down slot: per token k kept fractions of up+down per layer, per piece all up/down
    assert piece(0, total, 0.85) == int(total * 2 / (layers * k * 2 * 0.15))
    assert piece(0, total, 0.85) > piece(0, total, 0.5) > piece(0, total, 0.0)
    assert piece(0, total // 2, 0.85) < piece(0, total, 0.85)  # absent gates are read whole for every token
    assert piece(total, total, 0.85) >= 1 << 20  # everything resident: no host bytes either way, no limit by them


@pytest.mark.parametrize("experts", ["full", "int4"])
def test_offloaded_prefill_streams_spans_of_experts(experts):
    """A prompt on an offloaded model takes the grouped path, its routed experts staged a few at a time
    (experts/staging.py; spans of 2 here, so every layer takes several): the logits equal the resident model's,
    each routed expert is counted once per layer as a hit or a miss, and prefill admits nothing into the cache."""
    model = repo_id("qwen3_moe")
    resident = Engine.load(model, device="cpu", sparsity=0.0, experts=experts)
    e = Engine.load(model, device="cpu", sparsity=0.0, experts=experts, vram_gib=budget_for(model, 3, experts))
    cache = e.loaded.cache
    assert cache is not None and cache.slots == 3
    cache.staging.span = 2
    cache.reset_stats()
    placed = dict(cache.lru)  # the load filled the slots (place_experts): layers interleaved, in id order
    assert list(placed) == [(0, 1), (1, 0), (0, 0)] and cache.placed
    ids = torch.tensor([resident.encode_raw("Departments share weights, experts keep their own. " * 2)])
    with torch.no_grad():
        want = resident.model(input_ids=ids).logits
        got = e.model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert dict(cache.lru) == placed and cache.misses > 2 * len(e.loaded.experts) and cache.copied_bytes > 0
    assert cache.hits > 0  # the placed experts serve the prompt from their slots
    assert cache.staging.buffers is not None and cache.staging.buffers[0].w_up.shape[0] == 2
    part = cache.row_bytes * cache.width  # a pass over every expert copies every part of all but the 3 placed
    assert cache.absent_bytes() == 3 * part * (sum(m.num_experts for m in e.loaded.experts) - 3)


@pytest.mark.parametrize("mode", ["copy", "direct", "cpu"])
def test_offloaded_prefill_equals_the_resident_model_in_every_miss_mode(mode):
    """However decode serves its misses (copy-then-compute, direct reads, the CPU), a prompt streams its experts
    through the staging buffers: prompt logits and greedy tokens equal the resident model's."""
    model = repo_id("qwen3_moe")
    resident = Engine.load(model, device="cpu", sparsity=0.0)
    e = Engine.load(model, device="cpu", sparsity=0.0, vram_gib=budget_for(model, 3), offload_miss=mode)
    cache = e.loaded.cache
    assert cache is not None and cache.mode == mode
    cache.staging.span = 2
    ids = torch.tensor([resident.encode_raw("Departments share weights, experts keep their own. " * 2)])
    with torch.no_grad():
        want = resident.model(input_ids=ids).logits
        got = e.model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert cache.staging.buffers is not None and cache.staging.buffers[0].w_up.shape[0] == 2
    assert tokens(e, n=8) == tokens(resident, n=8)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the kernel on CPU tensors needs the interpreter")
@pytest.mark.parametrize("experts", ["full", "int4"])
def test_offloaded_prefill_gathers_spans_with_the_kernel(experts):
    """With master copies the device can read (pinned on CUDA; here the CPU under the interpreter) a span fills by
    one gather_experts launch per part (int4: one gather_dequant launch per projection): resident experts from their
    pool slots, the others from the host copies; the logits equal the resident model's and the cache's figures count
    the same hits, misses and bytes."""
    model = repo_id("qwen3_moe")
    resident = Engine.load(model, device="cpu", sparsity=0.0, experts=experts)
    e = Engine.load(model, device="cpu", sparsity=0.0, experts=experts, vram_gib=budget_for(model, 3, experts))
    cache = e.loaded.cache
    tokens(e, n=4)  # decode admits experts: the pools hold some
    assert len(cache.lru) == 3
    ids = torch.tensor([resident.encode_raw("Departments share weights, experts keep their own. " * 2)])
    figures = []
    for kernel in (False, True):
        cache.staging.kernel_on_cpu, cache.staging.span = kernel, 2
        cache.reset_stats()
        with torch.inference_mode():  # as the engine runs (its buffers are inference tensors)
            got = e.model(input_ids=ids).logits
            want = resident.model(input_ids=ids).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        figures.append((cache.hits, cache.misses, cache.copied_bytes))
    assert cache.staging.gathers and all(cache.staging.gathers.values())
    assert figures[0] == figures[1] and figures[1][0] > 0


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the kernels on CPU tensors need the interpreter")
@pytest.mark.parametrize(
    "experts",
    [
        "full",
        "int4",
        "int4-plainspans",
        "int4-dequantized",
        "int4-layerstage",
        "int4-layerstagegather",
    ],  # fmt: skip
)
def test_device_spans_prefill_equals_the_resident_model(experts, monkeypatch):
    """The dense path with no host read of the routing (`DensePath.device_spans`: every expert in fixed spans, the
    group ends read by kernels/grouped_gate_up.py and grouped_gemm.py): an offloaded prompt (spans of 2 staged) and a
    resident one give the resident model's logits; the offloaded one stages every expert of every layer once. The
    span launches are counted (the kernel still runs) to show the path was taken. int4 experts are read in place
    (`DensePath.int4_staged_packed` offloaded, `int4_in_place` resident: spans staged packed, in the staging buffers'
    memory, as many experts as it holds) or dequantized (staged so), or through the layer stage
    (experts/layer_stage.py: a layer's absent experts staged packed ahead, by copies or by the gather kernel, each
    span dequantized from the pool or that stage)."""
    in_place = experts in ("int4", "int4-plainspans")
    layer_stage = "layerstage" in experts
    monkeypatch.setattr(Staging, "stage_layers", layer_stage)
    monkeypatch.setattr(LayerStage, "by_copy_engines", experts != "int4-layerstagegather")
    monkeypatch.setattr(Staging, "packed_fill", experts != "int4-plainspans")  # packed spans as many as the plain
    experts = experts.split("-")[0]
    monkeypatch.setattr(dense_path.DensePath, "int4_in_place", in_place)
    monkeypatch.setattr(dense_path.DensePath, "int4_staged_packed", in_place)
    launches = []
    real = dense_path.grouped_gate_up
    monkeypatch.setattr(dense_path, "grouped_gate_up", lambda *a, **kw: launches.append(a[4]) or real(*a, **kw))
    model = repo_id("qwen3_moe")
    resident = Engine.load(model, device="cpu", sparsity=0.0, experts=experts)
    ids = torch.tensor([resident.encode_raw("Departments share weights, experts keep their own. " * 2)])
    with torch.inference_mode():
        want = resident.model(input_ids=ids).logits
    e = Engine.load(model, device="cpu", sparsity=0.0, experts=experts, vram_gib=budget_for(model, 3, experts))
    cache = e.loaded.cache
    cache.staging.span = 4 if layer_stage else 2  # the stage's slots: a half of the second buffer each
    E = e.loaded.experts[0].num_experts
    monkeypatch.setattr(Staging, "stage_rows", ids.shape[1] * 2 // E)  # the piece's slots an expert (top-2): taken
    cache.staging.kernel_on_cpu = layer_stage
    for engine in (resident, e):
        for m in engine.loaded.experts:
            m.device_spans = m.kernel_on_cpu = True
            assert m._device_ok(torch.zeros(1, m.hidden_size), torch.zeros(ids.shape[1], 2, dtype=torch.long))
    cache.reset_stats()
    with torch.inference_mode():
        got_resident = resident.model(input_ids=ids).logits
        got = e.model(input_ids=ids).logits
    torch.testing.assert_close(got_resident, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert cache.hits + cache.misses == sum(m.num_experts for m in e.loaded.experts)  # every expert, once a layer
    layers = len(e.loaded.experts)
    assert launches.count(0) == 2 * layers  # each engine's first span of every layer
    span = cache.staging.packed_span if in_place else cache.staging.span  # packed spans: as the memory holds
    assert set(range(0, E, span)) <= set(launches)  # the offloaded spans
    assert (cache.staging.packed_buffers is not None) == in_place
    assert (cache.staging.stage is not None) == layer_stage
    if layer_stage:  # every layer's absent experts fit a slot: staged whole
        assert cache.staging.stage.fits((tuple(range(E)),) * 2)
    if in_place:  # fp32 buffers hold ~7x as many int4 experts
        assert min(E, 6) <= span <= E if Staging.packed_fill else span == 2


def test_a_layer_routing_every_expert_fills_the_next_layers_first_spans_ahead():
    """experts/staging.py: after a layer that routed every expert, the next layer's first two spans are filled
    ahead; `stream` takes the leading ones that match its spans (a routing without expert 2 takes the first only)
    and refills the rest; every span it yields holds its experts' weights, counted once when used."""
    cache, masters = small_cache(slots=3, layers=3, E=6)
    cache.staging.span = 2

    def staged(layer, experts):
        out = []
        for first, n, buf, ids in cache.stream(layer, experts):
            assert ids.tolist() == experts[first : first + n]
            for i, e in enumerate(experts[first : first + n]):
                for name in ("w_gate", "w_up", "w_down_t"):
                    assert torch.equal(getattr(buf, name)[i], getattr(masters[layer], name)[e]), (layer, e, name)
            out.append(experts[first : first + n])
        return out

    assert staged(0, list(range(6))) == [[0, 1], [2, 3], [4, 5]]
    assert cache.staging.ahead[0] == 1 and cache.staging.ahead[1] == [[0, 1], [2, 3]]
    taken = cache.staging._take_ahead(1, [[0, 1], [3, 4]])
    assert taken.keys() == {0}
    staged(0, list(range(6)))
    cache.reset_stats()
    assert staged(1, [0, 1, 3, 4, 5]) == [[0, 1], [3, 4], [5]]  # span 0 filled ahead, the others refilled
    assert cache.misses == 5 and cache.staging.ahead is None  # not every expert routed: nothing filled ahead
    staged(1, list(range(6)))
    assert cache.staging.ahead[0] == 2
    cache.fetch(2, [0])  # decode admits into the pools: what was filled ahead is dropped
    assert cache.staging.ahead is None
