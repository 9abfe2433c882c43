"""The gate predictor's cache file (issue #23): one safetensors file per (model, revision, sparsity, N, r, method,
expert format) under `$XDG_CACHE_HOME/localmoe/predictors/`, with the metadata that made it (model, revision,
checkpoint fingerprint, sparsity, N, r, method, recall target, calibration set and its hash, tokens, layers, the maps'
format MAPS, localmoe version). `read` validates a file in full before use (metadata equal; every tensor present,
finite, of the model's shape and dtype; departments balanced; thresholds and scales non-negative) and says why it
cannot be used; `write` writes atomically (an error string when it cannot). Imports experts/predicted and the
threshold files' helpers only; localmoe.experts.predictor fits and calls this.

An `engine` argument is read through `.model_name`, `.resolved`, `.experts_format` and `.loaded.experts`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as save_tensors

from localmoe import __version__
from localmoe.experts.predicted import LayerPredictor
from localmoe.experts.threshold_files import checkpoint_fingerprint, write_atomically
from localmoe.paths import cache_root, slug
from localmoe.safe_text import for_line

# how B, C and the thresholds are stored (a cache file of another format is stale: fitted again)
MAPS = "int8 rows, fp32 scales, fp16 thresholds a neuron"
MAX_CACHE_BYTES = 4 << 30  # B and C of a large model: a file past this is not one of ours


def cache_path(model: str, revision: str, sparsity: float, departments: int, rank: int, method: str, experts: str):
    suffix = "" if experts == "full" else f"-{experts}"
    name = f"s{sparsity:.4f}-d{departments}-r{rank}-{method}{suffix}.safetensors"
    return cache_root() / "predictors" / f"{slug(model)}-{slug(revision)[:24]}" / name


def metadata(engine, sparsity, departments, rank, method, recall, text, name, tokens) -> dict:
    return {
        "model": engine.model_name,
        "revision": engine.resolved.revision,
        "checkpoint": checkpoint_fingerprint(Path(engine.resolved.path)),
        "experts": engine.experts_format,
        "sparsity": round(float(sparsity), 6),
        "departments": departments,
        "rank": rank,
        "method": method,
        "recall_target": recall,
        "calibration_set": name,
        "calibration_sha256": hashlib.sha256(text.encode()).hexdigest()[:16],
        "tokens_requested": tokens,
        "layers": len(engine.loaded.experts),
        "maps": MAPS,
        "localmoe_version": __version__,
    }


def _layer_problem(f, i: int, shape: tuple, departments: int, rank: int) -> str | None:
    E, I, H = shape
    want = {
        "B": ((departments, rank, H), torch.int8),
        "B_scale": ((departments, rank), torch.float32),
        "C": ((E, I, rank), torch.int8),
        "C_scale": ((E, I), torch.float32),
        "dept": ((E,), None),
        "tau_rows": ((E, I), torch.float16),
    }
    got = {}
    for key, (dims, dtype) in want.items():
        name = f"{i}.{key}"
        if name not in f.keys():
            return f"no tensor {name}"
        got[key] = f.get_tensor(name)
        if tuple(got[key].shape) != dims:
            return f"{name} is {tuple(got[key].shape)}, expected {dims}"
        if dtype is not None and got[key].dtype != dtype:
            return f"{name} is {got[key].dtype}, expected {dtype}"
    finite = all(torch.isfinite(got[k]).all() for k in ("B_scale", "C_scale", "tau_rows"))
    if not finite or any(float(got[k].min()) < 0 for k in ("B_scale", "C_scale", "tau_rows")):
        return f"layer {i} holds NaN, inf or a negative threshold or scale"
    sizes = torch.bincount(got["dept"].long().clamp(0, departments), minlength=departments + 1)
    if (
        int(got["dept"].min()) < 0
        or int(sizes[departments])
        or int(sizes[:departments].max() - sizes[:departments].min()) > 1
    ):
        return f"layer {i}'s departments are not {departments} balanced groups"
    return None


def read(path: Path, meta: dict, shapes: list[tuple]) -> tuple[list[LayerPredictor] | None, str]:
    """(the predictors, "") when the file at `path` is valid for `meta`; (None, notice) when it exists but cannot
    be used; (None, "") when there is none."""
    why = None
    try:
        if not path.exists():
            return None, ""
        if path.stat().st_size > MAX_CACHE_BYTES:
            raise ValueError(f"{path.stat().st_size} bytes, not a predictor file")
        with safe_open(str(path), "pt") as f:
            saved = json.loads((f.metadata() or {}).get("localmoe", "null"))
            if not isinstance(saved, dict):
                why = "no localmoe metadata"
            else:
                bad = [k for k in meta if saved.get(k) != meta[k]]
                if bad:
                    why = f"made with {bad[0]} {for_line(repr(saved.get(bad[0])))}, this run has {meta[bad[0]]!r}"
            N, r = meta["departments"], meta["rank"]
            for i, shape in enumerate(shapes):
                why = why or _layer_problem(f, i, shape, N, r)
            if why is None:
                preds = [
                    LayerPredictor(
                        f.get_tensor(f"{i}.B"),
                        f.get_tensor(f"{i}.B_scale"),
                        f.get_tensor(f"{i}.C"),
                        f.get_tensor(f"{i}.C_scale"),
                        f.get_tensor(f"{i}.dept").long(),
                        f.get_tensor(f"{i}.tau_rows"),
                        float(f.get_tensor(f"{i}.candidate_share")) if f"{i}.candidate_share" in f.keys() else None,
                    )
                    for i in range(len(shapes))
                ]
                return preds, ""
    except OSError as e:
        why = f"unreadable: {e.strerror or e}"
    except Exception as e:  # noqa: BLE001 - a corrupt header or tensor: safetensors' own errors, JSON's
        why = f"not a predictor file, truncated or corrupt ({type(e).__name__})"
    kind = "stale" if why.startswith("made with") else "invalid"  # metadata of another run, or a broken file
    return None, f"cached gate predictor at {for_line(path)} was {kind} ({for_line(why)}); fitted again"


def write(path: Path, preds: list[LayerPredictor], meta: dict) -> str | None:
    tensors = {}
    for i, p in enumerate(preds):
        tensors.update({f"{i}.B": p.B, f"{i}.B_scale": p.B_scale, f"{i}.C": p.C, f"{i}.C_scale": p.C_scale})
        tensors[f"{i}.dept"] = p.dept_of
        tensors[f"{i}.tau_rows"] = p.tau_rows
        if p.candidate_share is not None:
            tensors[f"{i}.candidate_share"] = torch.tensor(p.candidate_share, dtype=torch.float64)
    tensors = {k: v.contiguous().cpu() for k, v in tensors.items()}
    return write_atomically(path, save_tensors(tensors, metadata={"localmoe": json.dumps(meta)}))
