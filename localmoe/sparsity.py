"""Sparsity thresholds: calibration, the on-disk cache, and switching the experts' sparse path on/off.

For a target sparsity S, τ[layer] is the S-quantile of |act(x·W_gate)| over the routed experts of that
layer, measured by running calibration text through the model (dense path). Results are cached as JSON under
`$XDG_CACHE_HOME/localmoe/thresholds/` with the metadata that produced them (model, revision, S, calibration
set and its hash, token count, localmoe version); a file whose metadata does not match is recomputed,
never used. The default calibration text ships with the package (works offline). The same pass counts the
tokens routed to each expert (`routing_counts`, kept in the file): an expert cache whose gate tier cannot hold
every gate gives its slots to the most-routed experts' gates (`apply`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from localmoe import __version__
from localmoe.errors import RuntimeFailure, UsageError
from localmoe.events import ProgressFn
from localmoe.experts import GateRecorder
from localmoe.loader import LoadedModel

DEFAULT_TEXT = Path(__file__).with_name("data") / "calibration.txt"
DEFAULT_TOKENS = 4096
CHUNK = 512  # tokens per calibration forward


MODES = ("layer", "expert")  # one τ per layer (default: measured better, see README) or one per expert


@dataclass(frozen=True)
class ThresholdTable:
    sparsity: float
    taus: tuple  # per MoE layer in layer order: a float (mode "layer") or a tuple of E floats (mode "expert")
    meta: dict


def cache_root() -> Path:
    """`$XDG_CACHE_HOME/localmoe` (default `~/.cache/localmoe`): thresholds here, expert files (`store`) too."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "localmoe"


def cache_dir() -> Path:
    return cache_root() / "thresholds"


def slug(s: str) -> str:
    """A file-name-safe form of a model name or revision."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s).strip("_")[:80] or "model"


def cache_path(model_name: str, revision: str, sparsity: float, mode: str = "layer", experts: str = "full") -> Path:
    """int4 experts have their own thresholds (their gates' activations differ slightly)."""
    suffix = ("" if mode == "layer" else f"-{mode}") + ("" if experts == "full" else f"-{experts}")
    return cache_dir() / f"{slug(model_name)}-{slug(revision)[:24]}" / f"s{sparsity:.4f}{suffix}.json"


def read_calibration_text(path: str | Path | None) -> tuple[str, str]:
    """(text, name) of the calibration set."""
    p = Path(path) if path else DEFAULT_TEXT
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        if path:
            raise UsageError(f"cannot read calibration text {path}: {e.strerror}") from None
        raise RuntimeFailure(f"the bundled calibration text is missing ({p}); reinstall localmoe") from None
    if not text.strip():
        raise UsageError(f"calibration text {p} is empty")
    return text, ("default" if not path else p.name)


def _meta(engine, sparsity: float, text: str, name: str, tokens: int, mode: str) -> dict:
    return {
        "model": engine.model_name,
        "revision": engine.resolved.revision,
        "sparsity": round(float(sparsity), 6),
        "calibration_set": name,
        "calibration_sha256": hashlib.sha256(text.encode()).hexdigest()[:16],
        "tokens_requested": tokens,
        "mode": mode,
        "layers": len(engine.loaded.experts),
        "localmoe_version": __version__,
        **({} if engine.experts_format == "full" else {"experts": engine.experts_format}),
    }


def thresholds_for(engine, sparsity: float, *, progress: ProgressFn | None = None, text: str | Path | None = None,
                   tokens: int = DEFAULT_TOKENS, force: bool = False, mode: str = "layer") -> ThresholdTable:
    """Cached thresholds for (model, revision, S, calibration set, mode); calibrates when absent or stale."""
    if mode not in MODES:
        raise UsageError(f"threshold mode must be one of {', '.join(MODES)}, got {mode!r}")
    if engine.tokenizer is None:  # random-weight bench engine: random ids, nothing cached
        gen = torch.Generator().manual_seed(0)
        n = min(tokens, 1024)  # random weights: a rough quantile is all a benchmark needs
        ids = torch.randint(0, engine.loaded.config.vocab_size, (n,), generator=gen).tolist()
        return calibrate_ids(engine, sparsity, ids, progress=progress, meta={"calibration_set": "random ids", "mode": mode})
    body, name = read_calibration_text(text)
    meta = _meta(engine, sparsity, body, name, tokens, mode)
    path = cache_path(engine.model_name, engine.resolved.revision, sparsity, mode, engine.experts_format)
    if not force and path.is_file():
        try:
            saved = json.loads(path.read_text())
            saved_meta = {k: saved.get(k) for k in meta}
            # (files from before routing counts were kept are recomputed: the expert cache places gates by them)
            if saved_meta == meta and len(saved["thresholds"]) == meta["layers"] and "routing_counts" in saved:
                taus = tuple(tuple(float(x) for x in t) if isinstance(t, list) else float(t) for t in saved["thresholds"])
                return ThresholdTable(sparsity, taus, saved)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable or stale: recompute
    table = calibrate(engine, sparsity, body, tokens=tokens, progress=progress, meta=meta)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**table.meta, "thresholds": [list(t) if isinstance(t, tuple) else t for t in table.taus]}))
    tmp.replace(path)
    return table


@torch.inference_mode()
def calibrate(engine, sparsity: float, text: str, *, tokens: int, progress: ProgressFn | None, meta: dict) -> ThresholdTable:
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
    return calibrate_ids(engine, sparsity, ids, progress=progress, meta=meta)


@torch.inference_mode()
def calibrate_ids(engine, sparsity: float, ids: list[int], *, progress: ProgressFn | None, meta: dict) -> ThresholdTable:
    if len(ids) < 16:
        raise UsageError(f"calibration text is too short ({len(ids)} tokens); give at least a few hundred tokens")
    chunk = min(CHUNK, engine.max_positions or CHUNK)
    chunks = [ids[i:i + chunk] for i in range(0, len(ids), chunk)]
    experts = engine.loaded.experts
    recorders = [GateRecorder(seed=i) for i in range(len(experts))]
    for m, r in zip(experts, recorders):
        m.recorder = r
    try:
        for i, c in enumerate(chunks):
            engine.model(input_ids=torch.tensor([c], device=engine._device), use_cache=False,
                         **engine._logits_kw)  # only the experts' gate values are wanted, not every position's logits
            if progress:
                progress("calibrate", i + 1, len(chunks))
    finally:
        for m in experts:
            m.recorder = None
    if meta.get("mode") == "expert":
        taus = tuple(tuple(r.expert_quantiles(sparsity, m.num_experts)) for r, m in zip(recorders, experts))
    else:
        taus = tuple(r.quantile(sparsity) for r in recorders)
    counts = [[r.routed.get(e, 0) for e in range(m.num_experts)] for r, m in zip(recorders, experts)]
    return ThresholdTable(sparsity, taus, {**meta, "tokens": len(ids), "routing_counts": counts})


def crossover_tokens(loaded: LoadedModel, device: torch.device) -> int:
    """Largest token count that takes the sparse path (measured per GPU and shape; 1 on CPU)."""
    if device.type != "cuda":
        return 1
    try:
        from localmoe.kernels.tuning import crossover_tokens as measured
    except ImportError:
        return 1
    m = loaded.experts[0]
    k = int(getattr(loaded.config, "num_experts_per_tok", 8))
    return int(measured(torch.cuda.get_device_name(device), m.hidden_size, m.intermediate_size, m.num_experts, k))


MAX_SPARSE_PIECE = 512  # offloaded prefill pieces past this take the dense path whatever the bytes say (s10c)


def sparse_token_limit(loaded: LoadedModel, device: torch.device, sparsity: float = 0.0) -> int:
    """The longest call that takes the sparse path: the measured crossover; offloaded with copied misses, capped so
    one call's experts fit the cache; offloaded with direct misses (on CUDA), where the dense path copies nearly
    every absent expert in for any piece of a prompt, as long as the sparse path reads fewer host bytes (a chat
    turn's new tokens after prompt reuse: 0.35 s for 64 tokens, 1.28 s for 256 against 1.9-3.2 s dense at 24 GiB)."""
    limit = crossover_tokens(loaded, device)
    cache = loaded.cache
    k = int(getattr(loaded.config, "num_experts_per_tok", 1))
    if cache is not None and cache.mode == "copy":
        limit = max(1, min(limit, cache.slots // k))
    elif cache is not None and cache.mode == "direct" and device.type == "cuda":
        limit = max(limit, min(cache.sparse_piece_tokens(k, sparsity), MAX_SPARSE_PIECE))
    return limit


def gate_order(loaded: LoadedModel, counts) -> list[tuple[int, int]] | None:
    """(layer, expert) pairs, most routed first in calibration (`routing_counts`: per MoE module, tokens per
    expert), for the expert cache's gate tier; ties keep every layer's share even. None when counts do not fit."""
    if not isinstance(counts, list) or len(counts) != len(loaded.experts):
        return None
    ranked = []
    for m, row in zip(loaded.experts, counts):
        if not isinstance(row, list) or len(row) != m.num_experts:
            return None
        ranked += [(-int(c), e, m.layer_idx) for e, c in enumerate(row)]
    return [(layer, e) for _, e, layer in sorted(ranked)]


def apply(loaded: LoadedModel, table: ThresholdTable, *, device: torch.device) -> None:
    """Thresholds into the experts modules; with an expert cache whose gate tier cannot hold every gate, the gates
    the calibration text routed to most take its slots."""
    cache = loaded.cache
    if cache is not None and cache.gate_slots and cache.gate_slots < cache.num_experts * len(cache.masters):
        order = gate_order(loaded, table.meta.get("routing_counts"))
        if order is not None:
            cache.place_gates(order)
    limit = sparse_token_limit(loaded, device, table.sparsity)
    for m, tau in zip(loaded.experts, table.taus):
        if isinstance(tau, (tuple, list)):
            m.tau = torch.tensor(tau, dtype=torch.float32, device=device)
        else:
            m.tau = torch.full((m.num_experts,), tau, dtype=torch.float32, device=device)
        m.kept = torch.zeros((), dtype=torch.int64, device=device)
        m.max_sparse_tokens = limit
        m.sparse_enabled = True


def disable(loaded: LoadedModel, *, device: torch.device) -> None:
    limit = sparse_token_limit(loaded, device)
    for m in loaded.experts:
        m.sparse_enabled = False
        m.max_sparse_tokens = limit
        m.kept = torch.zeros((), dtype=torch.int64, device=device)
