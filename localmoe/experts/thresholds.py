"""Sparsity thresholds: calibration, and switching the experts' sparse path on/off (their file cache:
experts/threshold_files.py).

For a target sparsity S, τ[layer] is the S-quantile of |act(x·W_gate)| over the routed experts of that layer, measured
by running calibration text through the model (dense path). Results are cached as JSON under
`$XDG_CACHE_HOME/localmoe/thresholds/` with the metadata that produced them; a cache file is validated in full before
use, and anything else is recomputed and overwritten, with a notice (`engine.on_notice`). A cache that cannot be
written leaves the thresholds in memory for the run, with a notice. The default calibration text ships with the
package (works offline). The same pass counts the tokens routed to each expert (`routing_counts`, kept in the file):
an expert cache whose gate tier cannot hold every gate gives its slots to the most-routed experts' gates (`apply`).

DeaMoE's second threshold (`z_sparsity` Q > 0, DepartmentExperts only): after τ is set, a second pass over the same
text records |z| (what a department's down projection reads: z = Σ_j g_j · u P_j, with τ's mask on u) and τ_z[layer]
is its Q-quantile; the decode kernels then drop z entries under τ_z and skip the W_down rows no token keeps. The file
of a table with Q > 0 is its own (`-z{Q}` in its name) and holds `z_thresholds`, one per layer.

A `loaded` argument is the loader's LoadedModel, read through `.model`, `.config`, `.experts` and `.cache` only:
this module sits below the loader and does not import it.
"""

from __future__ import annotations

import codecs
from dataclasses import replace
from pathlib import Path

import torch

from localmoe.errors import RuntimeFailure, UsageError
from localmoe.events import ProgressFn
from localmoe.experts.gate_recorder import GateRecorder
from localmoe.experts.threshold_files import (
    ThresholdTable,
    cache_path,
    check_thresholds,
    file_meta,
    read_cache,
    write_cache,
)
from localmoe.kernels.tuning import crossover_tokens as measured_crossover
from localmoe.safe_text import for_line

DEFAULT_TEXT = Path(__file__).parent.parent / "data" / "calibration.txt"
DEFAULT_TOKENS = 4096
CHUNK = 512  # tokens per calibration forward


MODES = ("layer", "expert")  # one τ per layer (default: measured better, see README) or one per expert


def read_calibration_text(path: str | Path | None) -> tuple[str, str]:
    """(text, name) of the calibration set: UTF-8 text; a binary file (NUL bytes) or another encoding is refused."""
    p = Path(path) if path else DEFAULT_TEXT
    try:
        data = p.read_bytes()
    except OSError as e:
        if path:
            raise UsageError(f"cannot read calibration text {for_line(path)}: {e.strerror}") from None
        raise RuntimeFailure(f"the bundled calibration text is missing ({for_line(p)}); reinstall localmoe") from None
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise UsageError(
            f"calibration text {for_line(p)} is UTF-16 (or UTF-32) text, not UTF-8: convert it, e.g. "
            "`iconv -f utf-16 -t utf-8`"
        )
    if b"\0" in data:
        raise UsageError(
            f"calibration text {for_line(p)} is a binary file (it holds NUL bytes): give a UTF-8 text "
            "file of the kind of text the model will see"
        )
    try:
        text = data.decode("utf-8-sig")  # a UTF-8 byte-order mark is dropped
    except UnicodeDecodeError as e:
        raise UsageError(
            f"calibration text {for_line(p)} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
            f"{e.start}): convert it to UTF-8, e.g. `iconv -t utf-8`"
        ) from None
    if not text.strip():
        raise UsageError(f"calibration text {for_line(p)} is empty")
    return text, ("default" if not path else p.name)


def thresholds_for(
    engine,
    sparsity: float,
    *,
    progress: ProgressFn | None = None,
    text: str | Path | None = None,
    tokens: int = DEFAULT_TOKENS,
    force: bool = False,
    mode: str = "layer",
    z_sparsity: float = 0.0,
) -> ThresholdTable:
    """Cached thresholds for (model, revision, S, calibration set, mode[, DeaMoE's z sparsity: τ_z too, module
    doc]); calibrates when absent, stale or invalid
    (the file is validated in full: every value finite, non-negative, at most MAX_TAU, the shapes the model's) and
    overwrites the file, saying why through `engine.on_notice`. When the file cannot be written the thresholds
    serve this run only (a notice says so; the returned table's `path` is None)."""
    if mode not in MODES:
        raise UsageError(f"threshold mode must be one of {', '.join(MODES)}, got {mode!r}")
    if engine.tokenizer is None:  # random-weight bench engine: random ids, nothing cached
        gen = torch.Generator().manual_seed(0)
        n = min(tokens, 1024)  # random weights: a rough quantile is all a benchmark needs
        ids = torch.randint(0, engine.loaded.config.vocab_size, (n,), generator=gen).tolist()
        meta = {"calibration_set": "random ids", "mode": mode, **({"z_sparsity": z_sparsity} if z_sparsity else {})}
        return calibrate_ids(engine, sparsity, ids, progress=progress, meta=meta)
    notice = getattr(engine, "on_notice", None) or (lambda _text: None)
    body, name = read_calibration_text(text)
    meta = file_meta(engine, sparsity, body, name, tokens, mode, z_sparsity)
    path = cache_path(engine.model_name, engine.resolved.revision, sparsity, mode, engine.experts_format, z_sparsity)
    experts = [m.tau_groups for m in engine.loaded.experts]
    why = ""
    if not force:
        saved, why = read_cache(path, meta, experts)
        if saved is not None:
            taus = tuple(tuple(float(x) for x in t) if isinstance(t, list) else float(t) for t in saved["thresholds"])
            taus_z = tuple(float(t) for t in saved["z_thresholds"]) if "z_sparsity" in meta else None
            return ThresholdTable(sparsity, taus, saved, path, taus_z)
    table = calibrate(engine, sparsity, body, tokens=tokens, progress=progress, meta=meta)
    if why:
        notice(why)
    failed = write_cache(path, table)
    if failed is None:
        return replace(table, path=path)
    notice(f"could not save thresholds to {for_line(path)} ({for_line(failed)}); using them for this run only")
    return table


@torch.inference_mode()
def calibrate(
    engine, sparsity: float, text: str, *, tokens: int, progress: ProgressFn | None, meta: dict
) -> ThresholdTable:
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
    if not ids and text.strip():  # transformers builds an empty tokenizer for a folder without tokenizer files
        where = for_line(getattr(engine.resolved, "path", engine.model_name))
        raise UsageError(
            f"no tokenizer in {where}: its tokenizer encodes the calibration text as 0 tokens; copy "
            "the model's tokenizer files (tokenizer.json, tokenizer_config.json) into it"
        )
    return calibrate_ids(engine, sparsity, ids, progress=progress, meta=meta)


@torch.inference_mode()
def calibrate_ids(
    engine, sparsity: float, ids: list[int], *, progress: ProgressFn | None, meta: dict
) -> ThresholdTable:
    if len(ids) < 16:
        raise UsageError(f"calibration text is too short ({len(ids)} tokens); give at least a few hundred tokens")
    chunk = min(CHUNK, engine.max_positions or CHUNK)
    chunks = [ids[i : i + chunk] for i in range(0, len(ids), chunk)]
    experts = engine.loaded.experts
    recorders = [GateRecorder(seed=i) for i in range(len(experts))]
    for m, r in zip(experts, recorders):
        m.recorder = r
    try:
        _forward_chunks(engine, chunks, progress, "calibrate")
    finally:
        for m in experts:
            m.recorder = None
    if meta.get("mode") == "expert":
        taus = tuple(tuple(r.expert_quantiles(sparsity, m.tau_groups)) for r, m in zip(recorders, experts))
    else:
        taus = tuple(r.quantile(sparsity) for r in recorders)
    bad = check_thresholds(taus, "expert" if meta.get("mode") == "expert" else "layer", [m.tau_groups for m in experts])
    if bad is not None:  # NaN or inf gate activations: the weights are broken, not the calibration
        raise RuntimeFailure(
            f"calibrating {for_line(engine.model_name)} gave unusable thresholds ({bad}): the "
            "checkpoint's expert weights hold NaN/inf or absurd values; re-download it, or run dense "
            "with --sparsity 0"
        )
    counts = [[r.routed.get(e, 0) for e in range(m.tau_groups)] for r, m in zip(recorders, experts)]
    z = float(meta.get("z_sparsity", 0.0))
    taus_z = _calibrate_z(engine, taus, chunks, z, progress) if z > 0 else None
    return ThresholdTable(sparsity, taus, {**meta, "tokens": len(ids), "routing_counts": counts}, taus_z=taus_z)


def _forward_chunks(engine, chunks: list, progress: ProgressFn | None, stage: str) -> None:
    """The calibration text through the model a chunk at a time, for what the experts' recorders collect (only
    the last position's logits are computed)."""
    for i, c in enumerate(chunks):
        engine.model(input_ids=torch.tensor([c], device=engine._device), use_cache=False, **engine._logits_kw)
        if progress:
            progress(stage, i + 1, len(chunks))


def _calibrate_z(engine, taus: tuple, chunks: list, z: float, progress: ProgressFn | None) -> tuple:
    """DeaMoE's τ_z per layer (module doc): the calibration text again with τ's mask on the dense path, |z|
    recorded, its z-quantile taken; the experts' state is restored after."""
    experts = engine.loaded.experts
    if not all(hasattr(m, "z_recorder") for m in experts):
        raise UsageError(f"a z sparsity is for DeaMoE models (departments); {for_line(engine.model_name)} has none")
    saved = [(m.tau, m.tau_z, m.sparse_enabled, m.mask_all_tokens) for m in experts]
    recorders = [GateRecorder(seed=100 + i) for i in range(len(experts))]
    try:
        for m, tau, r in zip(experts, taus, recorders):
            groups = torch.tensor(tau) if isinstance(tau, tuple) else torch.full((m.tau_groups,), float(tau))
            m.tau, m.tau_z, m.sparse_enabled, m.mask_all_tokens = groups.float(), None, True, True
            m.z_recorder = r
        _forward_chunks(engine, chunks, progress, "calibrate z")
    finally:
        for m, (tau, tau_z, on, mask) in zip(experts, saved):
            m.tau, m.tau_z, m.sparse_enabled, m.mask_all_tokens = tau, tau_z, on, mask
            m.z_recorder = None
    taus_z = tuple(r.quantile(z) for r in recorders)
    bad = check_thresholds(taus_z, "layer", [m.tau_groups for m in experts])
    if bad is not None:
        raise RuntimeFailure(f"calibrating z thresholds of {for_line(engine.model_name)} failed ({bad})")
    return taus_z


def crossover_tokens(loaded, device: torch.device) -> int:
    """Largest token count that takes the sparse path (measured per GPU and shape; 1 on CPU and for DeaMoE)."""
    if device.type != "cuda" or not hasattr(loaded.experts[0], "intermediate_size"):
        return 1  # DeaMoE: the department decode path's crossover against its dense path is not measured yet
    m = loaded.experts[0]
    k = int(getattr(loaded.config, "num_experts_per_tok", 8))
    return int(
        measured_crossover(torch.cuda.get_device_name(device), m.hidden_size, m.intermediate_size, m.num_experts, k)
    )


MAX_SPARSE_PIECE = 512  # offloaded prefill pieces past this take the dense path whatever the bytes say (s10c)


def sparse_token_limit(loaded, device: torch.device, sparsity: float = 0.0) -> int:
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


def gate_order(loaded, counts) -> list[tuple[int, int]] | None:
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


def apply(loaded, table: ThresholdTable, *, device: torch.device) -> None:
    """Thresholds into the experts modules; with an expert cache that cannot hold every gate (or up/down pair), the
    experts the calibration text routed to most take its slots (up/down ones only before any decode admitted
    others)."""
    cache = loaded.cache
    if cache is not None:
        total = cache.num_experts * len(cache.masters)
        gates = 0 < cache.gate_slots < total
        # up/down slots still as placed at load, no decode has admitted others (a DeaMoE department cache: no such)
        up_down = getattr(cache, "placed", False) and cache.slots < total
        order = gate_order(loaded, table.meta.get("routing_counts")) if gates or up_down else None
        if order is not None and gates:
            cache.place_gates(order)
        if order is not None and up_down:
            cache.place_experts(order)
    limit = sparse_token_limit(loaded, device, table.sparsity)
    for i, (m, tau) in enumerate(zip(loaded.experts, table.taus)):
        if isinstance(tau, (tuple, list)):
            m.tau = torch.tensor(tau, dtype=torch.float32, device=device)
        else:
            m.tau = torch.full((m.tau_groups,), tau, dtype=torch.float32, device=device)
        if hasattr(m, "tau_z"):  # DeaMoE: τ_z with a z sparsity, else none
            tz = None if table.taus_z is None else table.taus_z[i]
            m.tau_z = None if tz is None else torch.full((m.tau_groups,), tz, dtype=torch.float32, device=device)
        _counters_on(m, device)
        m.target_sparsity = float(table.sparsity)
        m.max_sparse_tokens = limit
        m.sparse_enabled = True


def disable(loaded, *, device: torch.device) -> None:
    limit = sparse_token_limit(loaded, device)
    for m in loaded.experts:
        m.sparse_enabled = False
        m.max_sparse_tokens = limit
        _counters_on(m, device)


def _counters_on(m, device: torch.device) -> None:
    """The module's realised-sparsity counters zeroed on `device`: `kept` always a device tensor; `seen` a host int
    (LocalExperts) or, for DepartmentExperts, a device tensor too."""
    m.kept = torch.zeros((), dtype=torch.int64, device=device)
    if isinstance(m.seen, torch.Tensor):
        m.seen = torch.zeros((), dtype=torch.int64, device=device)
    else:
        m.seen = 0
