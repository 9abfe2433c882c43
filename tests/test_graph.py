"""The CUDA-graph decode step (GPU only): greedy tokens chosen inside the graph (graph.py `step_greedy`) equal the
tokens chosen outside it and eager decoding, across generate calls; sampling still runs outside the graph."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("CUDA graphs need a GPU (and compiled Triton kernels)", allow_module_level=True)

from conftest import repo_id  # noqa: E402

from localmoe.engine.engine import Engine  # noqa: E402
from localmoe.events import GenerationSettings  # noqa: E402


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe"])
@pytest.mark.parametrize("depth", [0, 2])
def test_greedy_in_graph_equals_outside_and_eager(hub_cache, family, depth):
    e = Engine.load(repo_id(family), device="cuda", dtype="float32", sparsity=0.0)
    e.eos_ids = set()
    e.pipeline_depth = depth
    s = GenerationSettings(max_new_tokens=20)
    ids = e.encode_raw("Sparse experts skip most neurons.")
    inside = [ev.token_id for ev in e.generate(ids, s)]
    assert e._graph is not None and e._graph.chooses
    again = [ev.token_id for ev in e.generate(ids[:-2], s)]  # a new chain: the copies run again
    inside2 = [ev.token_id for ev in e.generate(ids, s)]
    e.graph_greedy = False
    outside = [ev.token_id for ev in e.generate(ids, s)]
    outside_again = [ev.token_id for ev in e.generate(ids[:-2], s)]
    e.graph_greedy, e.use_graphs, e._graph = True, False, None
    eager = [ev.token_id for ev in e.generate(ids, s)]
    assert inside == inside2 == outside == eager and len(inside) == 20
    assert again == outside_again


def test_sampling_with_a_graph_is_seeded(hub_cache):
    e = Engine.load(repo_id("qwen3_moe"), device="cuda", dtype="float32", sparsity=0.0)
    s = GenerationSettings(max_new_tokens=12, temperature=1.0, top_k=20, seed=5)
    ids = e.encode_raw("abc")
    a = [ev.token_id for ev in e.generate(ids, s)]
    b = [ev.token_id for ev in e.generate(ids, s)]
    assert e._graph is not None and a == b


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe"])
def test_chat_turns_reuse_the_static_cache(hub_cache, family):
    """Prompt reuse with the CUDA-graph decoder: its StaticCache rewound in place between turns (the graph replays
    against the same addresses) gives the tokens of prefilling every turn whole."""
    from test_prefix import conversation

    e = Engine.load(repo_id(family), device="cuda", dtype="float32", sparsity=0.0)
    e.eos_ids = set()
    with_reuse = conversation(e)
    assert e._graph is not None and [t[2] for t in with_reuse][1:] == [t[1] for t in with_reuse][:-1]
    e.reuse_prompts = False
    assert [t[0] for t in conversation(e)] == [t[0] for t in with_reuse]


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe"])
def test_prepare_next_turn_with_the_graph(hub_cache, family):
    """The reply prefilled after its turn (the chat app's prepare_next_turn) into the graph decoder's StaticCache: the
    next turn prefills only its new message and gives the tokens of prefilling whole."""
    from test_prefix import reply

    e = Engine.load(repo_id(family), device="cuda", dtype="float32", sparsity=0.0)
    e.eos_ids = set()
    msgs = [{"role": "user", "content": "what is a mixture of experts?"}]
    first = reply(e, msgs)
    p1 = e.stats.prompt_tokens
    msgs = msgs + [{"role": "assistant", "content": e.tokenizer.decode(first, skip_special_tokens=True)}]
    added = e.prepare_next_turn(msgs)
    assert added > 0
    turn2 = msgs + [{"role": "user", "content": "and sparsity?"}]
    got = reply(e, turn2)
    assert e.stats.reused_prompt_tokens == p1 + added
    e.reuse_prompts = False
    assert reply(e, turn2) == got


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_moe"])
@pytest.mark.parametrize("depth", [0, 2])
def test_repetition_penalty_in_graph_equals_eager(hub_cache, family, depth):
    """The penalised greedy step chooses its token inside the graph (the argmax reads and marks the seen mask on the
    device): the tokens of choosing outside the graph and of eager decoding, and the same captured graph serves
    penalty off and on; seeded sampling with the penalty (outside the graph, on the device) repeats."""
    e = Engine.load(repo_id(family), device="cuda", dtype="float32", sparsity=0.0)
    e.eos_ids = set()
    e.pipeline_depth = depth
    ids = e.encode_raw("the cat the cat sat on the mat")

    def toks(s):
        return [ev.token_id for ev in e.generate(ids, s)]

    pen = GenerationSettings(max_new_tokens=24, repetition_penalty=1.5)
    sampled = GenerationSettings(max_new_tokens=24, repetition_penalty=1.5, temperature=1.0, top_k=20, seed=3)
    inside = toks(pen)
    graph = e._graph
    assert graph is not None and graph.chooses and graph.penalizes
    plain = toks(GenerationSettings(max_new_tokens=24))
    inside2 = toks(pen)
    s1, s2 = toks(sampled), toks(sampled)
    assert e._graph is graph  # one capture for all of them
    e.graph_greedy = False
    outside = toks(pen)
    e.graph_greedy, e.use_graphs, e._graph = True, False, None
    eager = toks(pen)
    eager_plain = toks(GenerationSettings(max_new_tokens=24))
    assert inside == inside2 == outside == eager and len(inside) == 24
    assert plain == eager_plain and s1 == s2


def test_recapture_after_set_sparsity_keeps_the_graph(hub_cache):
    """set_sparsity drops the captured decoder and the next reply captures again: that capture succeeds (no fallback
    notice, the graph used) and its tokens equal eager decoding at the new sparsity. A Python collection inside a
    capture would destroy graphs held by garbage cycles there (cudaGraphExecDestroy is not permitted while a stream
    captures: the capture failed so on qwen3_moe in gpu_engine_check.py), so the collector is made eager, cyclic
    garbage holding a CUDA graph is left behind, and no collection may start while the step is captured."""
    import gc

    e = Engine.load(repo_id("qwen3_moe"), device="cuda", dtype="float32", sparsity=0.0)
    notes = []
    e.on_notice = notes.append
    e.eos_ids = set()
    s = GenerationSettings(max_new_tokens=20)
    ids = e.encode_raw("Sparse experts skip most neurons.")
    toks = [ev.token_id for ev in e.generate(ids, s)]
    first = e._graph
    assert first is not None and first.graph is not None and len(toks) == 20

    x = torch.zeros(4, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        x.add_(1)
    cycle = [g]
    cycle.append(cycle)  # garbage only the collector frees
    del g, cycle

    during_capture = []

    def watch(phase, info):
        if phase == "start" and torch.cuda.is_current_stream_capturing():
            during_capture.append(info["generation"])

    threshold = gc.get_threshold()
    gc.callbacks.append(watch)
    gc.set_threshold(10, 2, 2)
    try:
        e.set_sparsity(0.5)
        assert first.graph is None  # released at once, not left to the collector
        graph5 = [ev.token_id for ev in e.generate(ids, s)]
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(watch)
    assert not during_capture, f"collections while capturing: generations {during_capture}"
    assert notes == [] and e.use_graphs and e._graph is not None and e._graph.graph is not None
    assert e._graph.chooses
    e.use_graphs = False
    e._drop_graph()
    eager = [ev.token_id for ev in e.generate(ids, s)]
    assert graph5 == eager and len(graph5) == 20
