"""The on-disk cache of sparsity thresholds (experts/thresholds.py computes them): where a table's file lives, the
metadata that made it, the full validation of a file before it is used, and atomic writes.

A file sits under `$XDG_CACHE_HOME/localmoe/thresholds/<model>-<revision>/s<S>[-expert][-<experts>][-z<Q>].json` and
holds the metadata (model, revision, a fingerprint of the checkpoint's files, S, calibration set and its hash, token
count, localmoe version; DeaMoE's z sparsity), one finite threshold in [0, MAX_TAU] per layer or per expert (per
department for DeaMoE's DepartmentExperts: `tau_groups`), the routing counts, and with a z sparsity `z_thresholds`, one
per layer. `read_cache` says why a file cannot be used (invalid: not what it should be; stale: made from something
else); `write_atomically` never leaves half a file (the gate predictor's files use it too).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from localmoe import __version__
from localmoe.paths import cache_root, slug
from localmoe.safe_text import for_line


@dataclass(frozen=True)
class ThresholdTable:
    sparsity: float
    taus: tuple  # per MoE layer in layer order: a float (mode "layer") or a tuple of E floats (mode "expert")
    meta: dict
    path: Path | None = None  # the cache file holding it (None: calibrated for this run only, or random ids)
    taus_z: tuple | None = None  # DeaMoE's τ_z per MoE layer (meta "z_sparsity" > 0), else None


def cache_dir() -> Path:
    return cache_root() / "thresholds"


def cache_path(
    model_name: str, revision: str, sparsity: float, mode: str = "layer", experts: str = "full", z: float = 0.0
) -> Path:
    """int4 experts have their own thresholds (their gates' activations differ slightly); so has each z sparsity."""
    suffix = ("" if mode == "layer" else f"-{mode}") + ("" if experts == "full" else f"-{experts}")
    suffix += f"-z{z:.4f}" if z > 0 else ""
    return cache_dir() / f"{slug(model_name)}-{slug(revision)[:24]}" / f"s{sparsity:.4f}{suffix}.json"


# The fingerprint of a checkpoint folder's weights kept in a cache file's metadata: a checkpoint rewritten in place
# (same names and sizes, other values) gets new modification times, so its old thresholds are not reused whatever
# the revision the cache is keyed on (models/hub.py) makes of it: a hub snapshot's is its commit, whose blobs can be
# replaced by hand, and an engine keeps the revision it resolved at load.
FINGERPRINTED = ("config.json", "model.safetensors.index.json")


def checkpoint_fingerprint(path: Path) -> str:
    """A hash of the name, size and mtime_ns of every *.safetensors file, config.json and the index in `path`
    (stat only: cheap for any model; HF cache snapshots' symlinks are followed to their blobs)."""
    h = hashlib.sha256()
    for f in sorted(path.glob("*.safetensors")) + [path / n for n in FINGERPRINTED]:
        try:
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
        except OSError:
            h.update(f"{f.name}:-\n".encode())
    return h.hexdigest()[:16]


def file_meta(engine, sparsity: float, text: str, name: str, tokens: int, mode: str, z: float = 0.0) -> dict:
    return {
        "model": engine.model_name,
        "revision": engine.resolved.revision,
        "checkpoint": checkpoint_fingerprint(Path(engine.resolved.path)),
        "sparsity": round(float(sparsity), 6),
        "calibration_set": name,
        "calibration_sha256": hashlib.sha256(text.encode()).hexdigest()[:16],
        "tokens_requested": tokens,
        "mode": mode,
        "layers": len(engine.loaded.experts),
        "localmoe_version": __version__,
        **({} if engine.experts_format == "full" else {"experts": engine.experts_format}),
        **({"z_sparsity": round(float(z), 6)} if z > 0 else {}),
    }


# The largest threshold a cache file may hold. τ is an S-quantile (S < 1) of |act(x·W_gate)| over the tokens routed
# to a layer's experts, x being the RMS-normalised hidden state, so it is below the largest gate activation
# calibration saw, which is O(1): measured on 2048 tokens, localmoe-tiny's largest layer τ is 0.18 at 30%, 0.97 at
# 90% and 2.6 at 99%; the random-weight test checkpoints' 4.2 at 99%. 1e4 leaves three orders of magnitude above
# that while catching what breaks the sparse path: a huge τ skips every neuron (100% realised sparsity, garbage).
MAX_TAU = 1e4
MAX_CACHE_BYTES = 16 << 20  # a cache file is KBs (expert mode, 60 layers x 512 experts: ~0.5 MB); larger is not one
# Metadata that names the file (cache_path) or the model's shape: a mismatch means the file is not what it should be.
# Other metadata (calibration set, tokens, localmoe version, checkpoint fingerprint) only makes it stale.
_IDENTITY = ("model", "revision", "sparsity", "mode", "experts", "layers", "z_sparsity")


def _number_problem(x) -> str | None:
    """Why `x` is not a usable threshold, or None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return f"is {type(x).__name__}, not a number"
    if isinstance(x, float) and not math.isfinite(x):
        return f"is {x}"
    shown = f"{x:g}" if abs(x) < 1e300 else f"a {len(str(abs(x)))}-digit number"  # JSON integers can be huge
    if x < 0:
        return f"{shown} is negative"
    if x > MAX_TAU:
        return f"{shown} is above {MAX_TAU:g}, far beyond any calibrated threshold"
    return None


def check_thresholds(taus, mode: str, experts: list[int]) -> str | None:
    """Why `taus` (per MoE layer: a number, or in mode "expert" a list of one per expert) cannot be applied to a
    model whose MoE layers have `experts` experts each, or None when it can."""
    if not isinstance(taus, (list, tuple)):
        return f"thresholds are {type(taus).__name__}, not a list"
    if len(taus) != len(experts):
        return f"{len(taus)} layers of thresholds for a model with {len(experts)} MoE layers"
    for i, (t, n) in enumerate(zip(taus, experts)):
        if mode == "expert":
            if not isinstance(t, (list, tuple)):
                return f"layer {i} has {type(t).__name__}, not a list of {n} per-expert thresholds"
            if len(t) != n:
                return f"layer {i} has {len(t)} per-expert thresholds for {n} experts"
            for e, x in enumerate(t):
                if (why := _number_problem(x)) is not None:
                    return f"layer {i} expert {e} threshold {why}"
        elif (why := _number_problem(t)) is not None:
            return f"layer {i} threshold {why}"
    return None


def _check_counts(counts, experts: list[int]) -> str | None:
    if not isinstance(counts, list) or len(counts) != len(experts):
        return f"routing_counts is not a list of {len(experts)} layers"
    for i, (row, n) in enumerate(zip(counts, experts)):
        if not isinstance(row, list) or len(row) != n:
            return f"routing_counts of layer {i} is not a list of {n} experts"
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in row):
            return f"routing_counts of layer {i} holds something other than token counts"
    return None


def _cache_problem(saved, meta: dict, experts: list[int]) -> tuple[str, str] | None:
    """(kind, reason) when a parsed cache file cannot be used for `meta` (kind "invalid" or "stale"), else None."""
    if not isinstance(saved, dict):
        return "invalid", f"a JSON {type(saved).__name__}, not an object"
    z_keys = ("z_thresholds",) if "z_sparsity" in meta else ()
    for key in (*meta, "thresholds", "routing_counts", "tokens", *z_keys):
        if key not in saved:
            if key in ("checkpoint", "routing_counts"):  # files of older localmoe versions
                return "stale", f"made by an older localmoe: no {key!r}"
            return "invalid", f"no {key!r}"
    for key in _IDENTITY:
        default = "full" if key == "experts" else None  # full-precision experts' files carry no "experts" key
        got, want = saved.get(key, default), meta.get(key, default)
        if got != want:
            return "invalid", f"{key} is {for_line(repr(got))}, expected {for_line(repr(want))}"
    if saved["checkpoint"] != meta["checkpoint"]:
        return "stale", "the checkpoint's files changed since calibration"
    for key, want in meta.items():
        if saved[key] != want:
            return "stale", f"made with {key} {for_line(repr(saved[key]))}, this run has {for_line(repr(want))}"
    why = check_thresholds(saved["thresholds"], meta["mode"], experts) or _check_counts(
        saved["routing_counts"], experts
    )
    if why is None and z_keys:
        why = check_thresholds(saved["z_thresholds"], "layer", experts)
        why = None if why is None else f"z_thresholds: {why}"
    if why is None and (
        isinstance(saved["tokens"], bool) or not isinstance(saved["tokens"], int) or saved["tokens"] < 0
    ):
        why = "tokens is not a token count"
    return None if why is None else ("invalid", why)


def read_cache(path: Path, meta: dict, experts: list[int]) -> tuple[dict | None, str]:
    """(the saved table, "") when the cache file at `path` is valid for `meta`; (None, notice) when it exists but
    cannot be used; (None, "") when there is none."""
    try:
        if not path.exists():
            return None, ""
        if path.stat().st_size > MAX_CACHE_BYTES:
            raise ValueError(f"{path.stat().st_size} bytes, not a threshold file")
        saved = json.loads(path.read_bytes())
        problem = _cache_problem(saved, meta, experts)
    except OSError as e:
        problem = ("invalid", f"unreadable: {e.strerror or e}")
    except UnicodeDecodeError:
        problem = ("invalid", "not UTF-8 text")
    except json.JSONDecodeError as e:
        problem = ("invalid", f"not JSON, truncated or corrupt: {e.msg} at offset {e.pos}")
    except RecursionError:
        problem = ("invalid", "JSON nested too deeply")
    except ValueError as e:  # a number too long to convert, a file too large
        problem = ("invalid", str(e) or "not JSON")
    if problem is None:
        return saved, ""
    kind, why = problem
    were = "were invalid" if kind == "invalid" else "were stale"
    return None, f"cached thresholds at {for_line(path)} {were} ({for_line(why)}); recalibrated"


def write_cache(path: Path, table: ThresholdTable) -> str | None:
    """Write `table` to `path` atomically (a temporary file in the same folder, then os.replace: a crash leaves the
    old file or the new one, never half of one). None when written, else why not."""
    z = {} if table.taus_z is None else {"z_thresholds": list(table.taus_z)}
    body = json.dumps(
        {**table.meta, "thresholds": [list(t) if isinstance(t, tuple) else t for t in table.taus], **z},
        allow_nan=False,
    )
    return write_atomically(path, body.encode())


def write_atomically(path: Path, body: bytes) -> str | None:
    """`body` into `path` through a temporary file in the same folder and os.replace (also the gate predictor's
    cache, experts/predictor.py). None when written, else why not."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:
        return e.strerror or str(e)
    return None
