"""The prefill chunk and staging span a VRAM budget holds (experts/prefill_budget.py, issue #29): the figures at
Qwen3.5-35B's real shapes stay inside their budgets by the documented formula, the plan sets the reserve aside, and
an offloaded tiny engine whose budget forces short pieces and spans prefills to the resident engine's logits and
greedy tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import repo_id

from localmoe.cli.run import _stats_json
from localmoe.engine.engine import Engine
from localmoe.events import GenerationSettings
from localmoe.experts import placement
from localmoe.experts import prefill_budget as pb
from localmoe.measure.benchmark import table
from localmoe.models.shapes import shape_config

GiB = 1 << 30
CONTEXT = 8192
_BENCH = {"model": "m", "device": "cpu", "dtype": "float32", "load_s": 0.0, "copy_gb_s": 0.0, "prompt_tokens": 1}
_BENCH = {**_BENCH, "decode_tokens": 1, "rows": []}


def _plan(config, fmt: str, budget: int) -> placement.OffloadPlan:
    """The plan of `config` at `budget` with the prefill reserve, as the loader makes it (non-expert weights: the
    config's parameters less the routed experts')."""
    s = pb.PrefillShapes.of(config, torch.bfloat16, fmt)
    layers = int(config.num_hidden_layers)
    H, V = s.hidden, s.vocab
    hk, dk, hv, dv = s.linear
    linear = 3 * 2 * H * (2 * hk * dk + hv * dv) // 6 + H * hv * dv + hv * dv * H  # in_proj_qkv, z, out
    attention = H * s.heads * s.head_dim * 2 + 2 * H * s.kv_heads * s.head_dim + s.heads * s.head_dim * H
    moe = H * s.experts + 3 * H * s.shared_width + H
    non_expert = 2 * (
        2 * V * H + s.linear_layers * linear + s.full_layers * attention + layers * moe
    )  # bf16, embeddings + lm_head
    workspace, least = pb.workspaces(config, torch.bfloat16, fmt, CONTEXT, budget)
    return placement.plan(
        budget_bytes=budget,
        non_expert_bytes=non_expert,
        state=placement.state_bytes(config, CONTEXT, torch.bfloat16),
        expert_bytes=s.stored,
        total_experts=s.experts * layers,
        top_k=s.top_k,
        workspace=workspace,
        resident_workspace=least,
    )


@pytest.mark.parametrize(("fmt", "gib"), [("int4", 16), ("full", 24)])
def test_qwen35_35b_chunk_and_span_fit_the_budget(fmt, gib):
    """At the issue's budgets the plan reserves the longest piece's peak; the fit from what the plan leaves is a
    2048-token piece with at least MIN_SPAN experts a buffer, and weights + cache + KV/state + the formula's peak stay
    within the budget. Without the reserve (the old 0.5 GiB) the fit takes shorter pieces, still within it."""
    config = shape_config("qwen3.5-35b")
    s = pb.PrefillShapes.of(config, torch.bfloat16, fmt)
    budget = gib * GiB
    plan = _plan(config, fmt, budget)
    assert plan.offloading and plan.workspace_bytes > placement.WORKSPACE_RESERVE
    used = plan.non_expert_bytes + plan.state_bytes + plan.slots * plan.expert_bytes
    fit = pb.fit(s, budget - used, CONTEXT, offloaded=True)
    assert fit.fits and fit.chunk == pb.MAX_CHUNK and pb.MIN_SPAN <= fit.span <= pb.default_span(s)
    assert used + pb.peak_bytes(s, fit.chunk, fit.span, CONTEXT) <= budget
    tight = pb.fit(s, int(placement.WORKSPACE_RESERVE), CONTEXT, offloaded=True)
    assert tight.fits and 1024 <= tight.chunk < pb.MAX_CHUNK and tight.peak_bytes <= placement.WORKSPACE_RESERVE
    # the formula's terms grow with the piece and the span; a short prompt's piece needs far less than the longest
    assert pb.peak_bytes(s, 256, fit.span, CONTEXT) < pb.peak_bytes(s, 2048, fit.span, CONTEXT)
    assert pb.peak_bytes(s, 2048, pb.MIN_SPAN, CONTEXT) < pb.peak_bytes(s, 2048, fit.span + 1, CONTEXT)


def test_spans_are_even():
    """A layer streams in as few spans as the staging bytes allow, of equal size: int4 experts staged dequantized
    are sized by their dequantized bytes alone (Qwen3.5-35B-A3B: 85 fit, four spans of 64, not five with a last of
    16); plain ones by their stored bytes (16 of 256: even already); a fit below the default is evened too."""
    config = shape_config("qwen3.5-35b")
    int4, full = (pb.PrefillShapes.of(config, torch.bfloat16, fmt) for fmt in ("int4", "full"))
    assert (pb.default_span(int4), pb.default_span(full)) == (64, 16)
    assert [pb.even(n, 256) for n in (1, 60, 64, 85, 86, 128, 200, 300)] == [1, 52, 64, 64, 86, 128, 128, 256]
    assert all(256 % pb.even(n, 256) == 0 or -(-256 // pb.even(n, 256)) == -(-256 // n) for n in range(1, 257))
    tight = pb.fit(int4, pb.peak_bytes(int4, 2048, 60, CONTEXT), CONTEXT, offloaded=True)
    assert tight.chunk == pb.MAX_CHUNK and tight.span == 52


def test_short_context_reserves_only_the_pieces_it_holds():
    """A prompt must leave room in the cache, so no piece reaches the context: at context 640, gpt-oss-120b's
    reserve is a 639-token piece's, less than a 2,048-token piece's at context 2112; the cache gets the difference.
    Its attention with sinks keeps no score matrix (decode/sinks.py), so at the chat's 8,192-token context a
    2,048-token piece needs ~1.2 GiB (eager's scores alone would be 8.6 GB)."""
    s = pb.PrefillShapes.of(shape_config("gpt-oss-120b"), torch.bfloat16, "mxfp4")
    assert s.sinks and not s.eager
    short, long, chat = (pb.fit(s, 3 * GiB, ctx, offloaded=True) for ctx in (640, 2112, CONTEXT))
    assert short.chunk == 639 and long.chunk == chat.chunk == pb.MAX_CHUNK and short.span == long.span
    assert pb.reserve_bytes(s, 640, 24 * GiB) < pb.reserve_bytes(s, 2112, 24 * GiB) < 1.5 * GiB
    assert chat.peak_bytes < 1.5 * GiB
    assert pb.fit(s, 3 * GiB, 100, offloaded=True).chunk == 99


def test_formula_terms_and_the_resident_plan():
    """Terms by hand at a small shape (DeltaNet, MoE dispatch, attention); a budget that holds every expert beside
    the shortest piece stays resident (shorter pieces), one that does not reserves the longest piece."""
    config = shape_config("qwen3.5-35b")
    s = pb.PrefillShapes.of(config, torch.bfloat16, "int4")
    hk, dk, hv, dv = s.linear
    C, Vd = 2 * hk * dk + hv * dv, hv * dv
    assert pb._deltanet(s, 64) == 64 * ((3 * C + Vd) * 2 + (7 * hv * dk + 3 * Vd + 3 * hv * 64) * 4)
    N, H, I = 64 * 8, s.hidden, s.width
    fixed = 64 * s.experts * 2 + 64 * H * 2 + 64 * 8 * 10 + 24 * N + N * H * 2
    # int4 spans are staged dequantized (the buffers are the GEMMs' weights); MXFP4 ones dequantized per span, two alive
    assert pb._moe(s, 64, 10) == fixed + max(N * H * 2 + 3 * N * I * 2, 3 * N * H * 2 + 64 * H * 2)
    assert pb.peak_bytes(s, 64, 11, 1024) - pb.peak_bytes(s, 64, 10, 1024) == 2 * s.dequantized
    mx = pb.PrefillShapes.of(config, torch.bfloat16, "mxfp4")
    deq = 2 * 10 * 3 * I * H * 2
    assert pb._moe(mx, 64, 10) == fixed + max(N * H * 2 + deq + 3 * N * I * 2, 3 * N * H * 2 + 64 * H * 2)
    assert pb.peak_bytes(mx, 64, 11, 1024) - pb.peak_bytes(mx, 64, 10, 1024) == 2 * mx.stored + 2 * mx.dequantized
    assert pb._attention(s, 64, 1024) > pb._attention(s, 64, 512)  # repeat_kv and the mask grow with the cache

    def plan(budget, state=0, **kw):  # 40 layers of Qwen3.5-35B's int4 experts, 1 GiB of other weights
        return placement.plan(
            budget_bytes=budget,
            non_expert_bytes=GiB,
            state=state,
            expert_bytes=s.stored,
            total_experts=s.experts * 40,
            top_k=8,
            workspace=2 * GiB,
            **kw,
        )

    roomy = plan(100 * GiB, state=GiB, resident_workspace=GiB)
    assert not roomy.offloading and roomy.workspace_bytes == GiB
    need = GiB + GiB + s.stored * s.experts * 40  # non-expert weights + the shortest piece + every expert
    assert not plan(need, resident_workspace=GiB).offloading  # with the longest piece's reserve it would offload
    assert plan(need).offloading


def test_resident_int4_dequantized_span_from_the_budget():
    """Resident 4-bit experts: the fit takes the largest dequantized span (DEQUANT_MAX_BYTES halved down to
    DEQUANT_BYTES) whose piece still fits, counted in the peak; a tight budget keeps the default; offloaded plans and
    plain experts have none. A resident int4 engine's layers take the fit's span."""
    config = shape_config("qwen3.5-35b")
    s = pb.PrefillShapes.of(config, torch.bfloat16, "int4")
    roomy = pb.fit(s, 8 * GiB, CONTEXT, offloaded=False)
    assert roomy.fits and roomy.span == 0 and roomy.dequant_bytes == pb.DEQUANT_MAX_BYTES
    assert roomy.peak_bytes == pb.peak_bytes(s, roomy.chunk, 0, CONTEXT, pb.DEQUANT_MAX_BYTES)
    assert f"{pb.DEQUANT_MAX_BYTES >> 20} MiB" in roomy.line()
    least = pb.peak_bytes(s, pb.MAX_CHUNK, 0, CONTEXT)
    mid = pb.peak_bytes(s, pb.MAX_CHUNK, 0, CONTEXT, pb.DEQUANT_MAX_BYTES // 2)
    assert least < mid < roomy.peak_bytes  # two dequantized spans alive: each step doubles twice the span's bytes
    assert pb.fit(s, mid, CONTEXT, offloaded=False).dequant_bytes == pb.DEQUANT_MAX_BYTES // 2
    assert pb.fit(s, least, CONTEXT, offloaded=False).dequant_bytes == pb.DEQUANT_BYTES
    assert pb.fit(s, 8 * GiB, CONTEXT, offloaded=True).dequant_bytes == 0
    plain = pb.PrefillShapes.of(config, torch.bfloat16, "full")
    assert pb.fit(plain, 8 * GiB, CONTEXT, offloaded=False).dequant_bytes == 0
    e = Engine.load(repo_id("qwen3_5_moe"), device="cpu", sparsity=0.0, vram_gib=64.0, experts="int4")
    assert e.loaded.cache is None and e.prefill_fit.dequant_bytes == pb.DEQUANT_MAX_BYTES
    assert {m.dequant_bytes for m in e.loaded.experts} == {pb.DEQUANT_MAX_BYTES}
    assert _stats_json(e.stats)["dequant_bytes"] == pb.DEQUANT_MAX_BYTES  # run --json


def _greedy(engine, ids, n=6):
    return [ev.token_id for ev in engine.generate(ids, GenerationSettings(max_new_tokens=n))]


def test_offloaded_engine_with_short_pieces_equals_resident():
    """An offloaded tiny engine whose bytes left force 16-token pieces (fit_prefill with the formula's own figure;
    the chosen chunk and span in the stats), staged 2 experts a span, prefills a prompt of several pieces to the
    resident engine's last logits and greedy tokens."""
    model = repo_id("qwen3_5_moe")
    resident = Engine.load(model, device="cpu", sparsity=0.0)
    probe = Engine.load(model, device="cpu", sparsity=0.0, vram_gib=64.0).loaded.offload
    slots = 3
    fixed = probe.non_expert_bytes + probe.state_bytes + placement.WORKSPACE_RESERVE
    e = Engine.load(model, device="cpu", sparsity=0.0, vram_gib=(fixed + slots * probe.expert_bytes + 1) / GiB)
    assert (
        e.loaded.cache is not None and e.prefill_fit is not None and e.prefill_chunk == min(pb.MAX_CHUNK, e.context - 1)
    )
    m0 = e.loaded.experts[0]
    s = pb.PrefillShapes.of(e.loaded.config, e.dtype, "full", experts=m0.num_experts, width=m0.intermediate_size)
    span = min(pb.MIN_SPAN, m0.num_experts)
    fit = e.fit_prefill(left_bytes=pb.peak_bytes(s, 16, span, e.context))
    assert fit.fits and (fit.chunk, fit.span, e.prefill_chunk, e.loaded.cache.staging.span) == (16, span, 16, span)
    assert _stats_json(e.stats)["prefill_chunk"] == 16 and _stats_json(e.stats)["staging_span"] == span  # run --json
    assert fit.line() in table({**_BENCH, "prefill_fit": fit.line()}).splitlines()[1]  # bench's line
    e.loaded.cache.staging.resize(2)  # several spans a layer (tiny layers have few experts)
    ids = resident.encode_raw("Offloaded prompts go piece by piece, a span of experts at a time. " * 2)
    assert len(ids) > 3 * fit.chunk
    x = torch.tensor([ids])
    with torch.inference_mode():
        want = resident._prefill(x)[1]
        got = e._prefill(x)[1]
    # pieces of 16 tokens take transformers' DeltaNet per piece: 1e-4 here, ~1e-3 with transformers 5.17's reference
    torch.testing.assert_close(got, want, rtol=1e-2, atol=5e-3)
    assert int(got.argmax()) == int(want.argmax())
    assert e.loaded.cache.staging.buffers[0].w_up.shape[0] == 2
    assert _greedy(e, ids) == _greedy(resident, ids)


def test_resident_int4_read_in_place_reserves_no_dequantized_span(monkeypatch):
    """With int4 read in place (`DensePath.int4_in_place`) a resident piece that routes to every expert dequantizes
    nothing: the fit sets no span and its peak drops by the dequantized span's bytes; a short call still dequantizes
    DEQUANT_BYTES spans (counted); NF4 is not read in place."""
    config = shape_config("qwen3.5-35b")
    before = pb.fit(pb.PrefillShapes.of(config, torch.bfloat16, "int4"), 8 * GiB, CONTEXT, offloaded=False)
    monkeypatch.setattr(pb.DensePath, "int4_in_place", True)
    s = pb.PrefillShapes.of(config, torch.bfloat16, "int4")
    assert s.in_place and not pb.PrefillShapes.of(config, torch.bfloat16, "nf4").in_place
    after = pb.fit(s, 8 * GiB, CONTEXT, offloaded=False)
    assert after.dequant_bytes == 0 and after.chunk == before.chunk == pb.MAX_CHUNK
    assert before.peak_bytes - after.peak_bytes >= pb.DEQUANT_MAX_BYTES  # 2.45 -> 0.62 GB at Qwen3.5-35B-A3B
    short = 16  # 16 tokens x 8 slots < 4 x 256 experts: dequantized spans of the default size
    dequantizing = dataclasses.replace(s, in_place=False)
    assert pb._moe(s, short, 0) == pb._moe(dequantizing, short, 0)
    assert pb._moe(s, pb.MAX_CHUNK, 0) < pb._moe(dequantizing, pb.MAX_CHUNK, 0)
