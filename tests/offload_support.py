"""What the offloading tests share: a --vram budget that leaves a given number of expert slots, greedy tokens, an
engine with few slots, and a small expert cache over random master copies (no model)."""

from __future__ import annotations

import torch
from conftest import repo_id

from localmoe.engine.engine import Engine
from localmoe.events import GenerationSettings
from localmoe.experts import cache as offload
from localmoe.experts import placement
from localmoe.experts.expert_weights import ExpertWeights

GiB = 1 << 30


def budget_for(model: str, slots: int, experts: str = "full") -> float:
    """--vram (GiB) that leaves exactly `slots` expert slots."""
    probe = Engine.load(model, device="cpu", sparsity=0.0, vram_gib=64.0, experts=experts).loaded.offload
    fixed = probe.non_expert_bytes + probe.state_bytes + placement.WORKSPACE_RESERVE
    return (fixed + slots * probe.expert_bytes + probe.expert_bytes // 2) / GiB


def tokens(engine, prompt="Sparse experts skip most neurons.", n=24):
    return [ev.token_id for ev in engine.generate(engine.encode_raw(prompt), GenerationSettings(max_new_tokens=n))]


def few_slots_engine(mode: str, n: int) -> tuple[Engine, list[int], int]:
    """qwen3_moe at sparsity 0.5 offloaded with miss `mode` and a few slots (direct: every gate resident and a few
    up/down slots; else 3 whole-expert slots): (the engine, all-resident greedy tokens of `n`, experts in all)."""
    model = repo_id("qwen3_moe")
    resident = Engine.load(model, device="cpu", sparsity=0.5)
    want = tokens(resident, n=n)
    total = sum(m.num_experts for m in resident.loaded.experts)
    slots = total // 3 + 2 if mode == "direct" else 3
    e = Engine.load(model, device="cpu", sparsity=0.5, vram_gib=budget_for(model, slots), offload_miss=mode)
    return e, want, total


def small_cache(slots=3, layers=2, E=6, I=4, H=5):
    """An ExpertCache of `slots` slots over `layers` layers of random fp32 master copies [E, I, H]: (cache, masters)."""
    cache = offload.ExpertCache(slots, (E, I, H), torch.float32, torch.device("cpu"))
    masters = {}
    for layer in range(layers):
        masters[layer] = ExpertWeights(*(torch.randn(E, I, H) for _ in range(3)))
        cache.add_layer(layer, masters[layer])
    return cache, masters
