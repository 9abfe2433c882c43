"""A reply's figures (`EngineStats`): made at its start, the prefill's rate once the first token is read, the live
figures the status bar shows while decoding (every LIVE_STATS_EVERY tokens: realised sparsity, the expert cache's
hit rate and host→GPU bytes per token, an offloaded DeaMoE's department and private hit rates; the decode rate, time
to first token and wall time every token), and the final ones. Also the realised sparsity itself: the experts'
device counters plus what captured replays considered.
"""

from __future__ import annotations

import time

import torch

from localmoe.events import EngineStats

LIVE_STATS_EVERY = 8  # tokens between live updates of realised sparsity / cache hit rate


def reset_counters(experts, graph) -> None:
    """Realised sparsity counts from here (the experts' counters and the graph's replays)."""
    for m in experts:
        m.reset_counters()
    if graph is not None:
        graph.steps = 0


def realized_sparsity(experts, graph, device) -> float:
    """Fraction of routed-expert neurons skipped on the sparse path since the counters were reset (one device
    read). Every module counts kept neurons on the device; neurons considered are a host int (LocalExperts: captured
    replays do not run Python, so `graph.steps` adds theirs) or a device tensor (DepartmentExperts, which counts
    (token, department) pairs on the device, replays included)."""
    host = [m for m in experts if not isinstance(m.seen, torch.Tensor)]
    seen = sum(m.seen for m in host)
    if graph is not None and graph.steps:
        seen += graph.steps * graph.k * sum(m.intermediate_size for m in host if m.sparse_enabled)
    on_device = [m.seen.to(device) for m in experts if isinstance(m.seen, torch.Tensor)]
    if seen == 0 and not on_device:
        return 0.0
    zero = torch.zeros((), dtype=torch.int64, device=device)
    kept_t = torch.stack([m.kept.to(device) for m in experts]).sum()
    kept, seen_dev = torch.stack([kept_t, torch.stack(on_device).sum() if on_device else zero]).tolist()
    seen += seen_dev
    return 1.0 - kept / seen if seen else 0.0


def prefilled(stats: EngineStats, n_prompt: int, reused: int, seconds: float) -> None:
    stats.reused_prompt_tokens = reused
    stats.prefill_tok_s = (n_prompt - reused) / max(seconds, 1e-9)  # tokens computed, not those reused


def _cache_figures(stats: EngineStats, expert_cache, n: int) -> None:
    stats.cache_hit_rate, moved = expert_cache.figures()
    stats.h2d_bytes_per_token = moved / max(1, n - 1)
    pools = getattr(expert_cache, "department_figures", None)  # DeaMoE's department cache: two pools
    if pools is not None:
        d = pools()
        stats.department_hit_rate, stats.private_hit_rate = d["department_hit_rate"], d["private_hit_rate"]


def live(stats: EngineStats, sparsity, expert_cache, n: int, t_call: float, t_decode: float) -> None:
    """After the n-th token: its count, the rates and times, and every LIVE_STATS_EVERY tokens the figures that cost
    device reads (`sparsity()`: the realised sparsity)."""
    stats.generated_tokens = n
    if n % LIVE_STATS_EVERY == 0:  # live figures for the status bar (a few device reads)
        stats.sparsity_realized = sparsity()
        if expert_cache is not None:
            _cache_figures(stats, expert_cache, n)
    now = time.perf_counter()
    if n > 1:
        stats.decode_tok_s = (n - 1) / max(now - t_decode, 1e-9)
    else:
        stats.ttft_s = now - t_call
    stats.wall_s = now - t_call


def final(
    stats: EngineStats, sparsity, expert_cache, n: int, t_call: float, t_decode: float, finish: str, device
) -> None:
    """The reply's figures once it ended (`finish`: stop, length or cancelled)."""
    t_end = time.perf_counter()
    if n > 1:
        stats.decode_tok_s = (n - 1) / max(t_end - t_decode, 1e-9)
    stats.sparsity_realized = sparsity()
    if expert_cache is not None:
        _cache_figures(stats, expert_cache, n)
    if device.type == "cuda":
        stats.peak_gpu_mem_gb = torch.cuda.max_memory_allocated(device) / 1e9
    stats.wall_s = time.perf_counter() - t_call
    stats.finish_reason = finish
