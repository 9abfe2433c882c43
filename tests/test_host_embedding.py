"""Token embeddings in host memory (models/host_embedding.py, `--embeddings`): a tiny untied checkpoint loaded with
its table in host memory and in VRAM gives the same greedy tokens (resident, and with non-expert units spilling
through accelerate); the VRAM plan counts the table as host bytes and gives them to the expert cache; `show`'s plan
says so; a tied table stays; the flag on every loading command. On the CPU, `embeddings="host"` is asked for (the
default moves the table on CUDA only); on a GPU the default is checked, read in place by the Triton kernel from
pinned memory, inside the CUDA-graph decode step."""

from __future__ import annotations

import pytest
import torch
from conftest import repo_id
from kernel_cases import DEV

from localmoe.cli.parser import build_parser
from localmoe.engine import plan
from localmoe.engine.engine import Engine
from localmoe.events import GenerationSettings
from localmoe.experts import placement
from localmoe.models.host_embedding import HostEmbedding, install
from localmoe.models.skeleton import build_skeleton, units

GiB = 1 << 30
HOST = "host" if DEV == "cpu" else None  # on a GPU: the default


def tokens(engine, n=12):
    ids = engine.encode_raw("Sparse experts skip most neurons.")
    return [ev.token_id for ev in engine.generate(ids, GenerationSettings(max_new_tokens=n))]


@pytest.fixture(scope="module")
def pair(hub_cache):
    """qwen3_moe loaded with the table in VRAM and in host memory, a budget that keeps everything resident."""
    kw = dict(device=DEV, sparsity=0.0, vram_gib=64.0)
    return Engine.load(repo_id("qwen3_moe"), embeddings="gpu", **kw), Engine.load(
        repo_id("qwen3_moe"), **kw, embeddings=HOST
    )


def test_host_table_gives_the_same_tokens(pair):
    gpu, host = pair
    emb = host.model.get_input_embeddings()
    assert isinstance(emb, HostEmbedding) and emb.weight.device.type == "cpu"
    assert emb.pinned == (DEV == "cuda")  # the GPU reads only pinned host memory
    assert type(gpu.model.get_input_embeddings()) is torch.nn.Embedding
    assert emb.weight.shape == gpu.model.get_input_embeddings().weight.shape
    assert emb.weight.dtype == gpu.model.get_input_embeddings().weight.dtype
    assert tokens(host) == tokens(gpu)  # on a GPU: prefill and the graph-captured decode step read host memory
    if DEV == "cuda":
        assert any("token embeddings" in n and "pinned host memory" in n for n in host.notes)


def test_plan_counts_the_table_as_host_bytes(pair):
    gpu, host = pair
    w = gpu.model.get_input_embeddings().weight
    table = w.numel() * w.element_size()
    g, h = gpu.loaded.offload, host.loaded.offload
    assert g.non_expert_bytes - h.non_expert_bytes == table
    p = plan.engine_plan(host, 0.5)
    assert p.vram()["host_embedding_bytes"] == table and plan.engine_plan(gpu, 0.5).vram()["host_embedding_bytes"] == 0
    assert "in host memory)" in p.line() and "token embeddings" in p.line()
    # a budget with a few expert slots beside the table in VRAM: the table's bytes become expert slots in host mode
    fixed = g.non_expert_bytes + g.state_bytes + placement.WORKSPACE_RESERVE
    budget = (fixed + 3 * g.expert_bytes + g.expert_bytes // 2) / GiB
    kw = dict(device=DEV, sparsity=0.0, vram_gib=budget)
    small_gpu = Engine.load(repo_id("qwen3_moe"), embeddings="gpu", **kw)
    small_host = Engine.load(repo_id("qwen3_moe"), embeddings=HOST, **kw)
    assert small_gpu.loaded.offload.slots == 3
    room = int(budget * GiB) - (fixed - table)
    assert small_host.loaded.offload.slots == min(g.total_experts, room // g.expert_bytes) > 3
    assert tokens(small_host) == tokens(small_gpu)


def test_spilled_units_leave_the_host_table_alone(hub_cache):
    """A budget where accelerate keeps only some non-expert units on the device: the host table is no unit of its
    map (no hook copies it to the GPU), it stays in host memory, and the tokens are those of the same budget with the
    table in VRAM."""
    model = repo_id("qwen3_moe")
    probe = Engine.load(model, device=DEV, sparsity=0.0, vram_gib=64.0, embeddings=HOST).loaded
    k, p = probe.config.num_experts_per_tok, probe.offload
    largest = max(v for name, v in units(probe.model).items() if name != "model.embed_tokens")
    share = p.non_expert_bytes - largest // 2  # not all of them: the plan spills
    vram = (p.state_bytes + placement.WORKSPACE_RESERVE + k * p.expert_bytes + share) / GiB
    e = Engine.load(model, device=DEV, sparsity=0.0, vram_gib=vram, embeddings=HOST)
    assert e.loaded.offload.spills
    emb = e.model.get_input_embeddings()
    assert isinstance(emb, HostEmbedding) and emb.weight.device.type == "cpu" and not hasattr(emb, "_hf_hook")
    want = Engine.load(model, device=DEV, sparsity=0.0, vram_gib=vram, embeddings="gpu")  # the same modules run
    assert want.loaded.offload.spills and tokens(e, 6) == tokens(want, 6)


def test_show_plans_the_table_in_host_memory():
    """`show` plans a GPU load: gpt-oss's untied table (its shape table's config) is host bytes, not VRAM."""
    from localmoe.models.shapes import shape_config

    cfg = shape_config("gpt-oss-20b")
    kw = dict(budget_bytes=None, context=4096, dtype=torch.bfloat16, experts_format="full", sparsity=0.5)
    host = plan.from_config("gpt-oss-20b", cfg, **kw)
    gpu = plan.from_config("gpt-oss-20b", cfg, **kw, embeddings="gpu")
    table = cfg.vocab_size * cfg.hidden_size * 2
    assert host.host_embedding_bytes == table and gpu.host_embedding_bytes == 0
    assert gpu.all_resident_bytes - host.all_resident_bytes == table
    assert host.facts.total_params == gpu.facts.total_params  # still the model's parameters
    assert "token embeddings" in host.line()


def test_a_tied_table_stays():
    from localmoe.models.shapes import shape_config

    cfg = shape_config("gpt-oss-20b")
    cfg.tie_word_embeddings = True
    model = build_skeleton(cfg, torch.bfloat16)
    assert install(model, cfg) is None and type(model.get_input_embeddings()) is torch.nn.Embedding


@pytest.mark.parametrize("command", ["run", "chat", "serve", "eval", "bench", "calibrate"])
def test_flag_on_every_loading_command(command):
    args = {"run": ["m", "hi"], "chat": [], "serve": [], "eval": ["m"], "bench": ["m"], "calibrate": ["m"]}[command]
    extra = ["--sparsity", "0.5"] if command == "calibrate" else []
    parser = build_parser()
    assert parser.parse_args([command, *args, *extra]).embeddings is None  # the default: host memory on CUDA
    assert parser.parse_args([command, *args, *extra, "--embeddings", "gpu"]).embeddings == "gpu"
    with pytest.raises(Exception, match="invalid choice"):
        parser.parse_args([command, *args, *extra, "--embeddings", "disk"])
