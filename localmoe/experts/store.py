"""Expert master copies on disk, memory-mapped: the fallback when host RAM cannot hold them.

An offloaded model keeps every expert's master copy in host memory, pinned (experts/host_memory.py). Qwen3.5-35B
needs 60 GiB of it; a desktop with less RAM gets the copies as files in localmoe's layout instead (gate, up and
transposed down, each [E, I, H] per layer) under `$XDG_CACHE_HOME/localmoe/experts/<model>/`, mapped with
`torch.from_file(shared=True)`: the OS keeps the pages it has room for and reads the rest from disk on demand. The
first load writes the files (the checkpoint's experts pass through once); a layer is valid only once its marker
records the metadata that wrote it (model, revision, source shards' sizes and modification times, shape, dtype) and
its files have the size that shape needs, so later loads map it without reading the checkpoint, and an interrupted,
truncated or stale layer (a checkpoint rewritten in place at the same size) is rewritten. Markers are written
atomically. Mapped memory is pageable, so misses are served copy-then-compute (the GPU cannot read it in place).

Shape legend: E experts, I expert width, H hidden.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch

from localmoe.errors import RuntimeFailure
from localmoe.experts.expert_weights import ExpertWeights
from localmoe.paths import cache_root
from localmoe.paths import slug as _slug
from localmoe.safe_text import for_line

PARTS = ("gate", "up", "down_t")


def store_root() -> Path:
    return cache_root() / "experts"


def _source(path: Path) -> list:
    """A checkpoint file as the markers record it: name, size, mtime_ns (a file rewritten in place at the same size
    still changes its modification time)."""
    st = path.stat()
    return [path.name, st.st_size, st.st_mtime_ns]


class ExpertStore:
    """The memory-mapped expert files of one model revision (one directory)."""

    def __init__(self, model: str, revision: str, sources: list[Path], dtype: torch.dtype):
        self.dir = store_root() / _slug(f"{model}@{revision}")
        self.dtype = dtype
        self.meta = {
            "model": model,
            "revision": revision,
            "dtype": str(dtype).replace("torch.", ""),
            "sources": sorted(_source(p) for p in sources),
        }

    def _marker(self, prefix: str) -> Path:
        return self.dir / f"{_slug(prefix)}.json"

    def open(self, prefix: str, shape: tuple[int, int, int]) -> tuple[ExpertWeights, bool]:
        """(mapped [E, I, H] gate / up / down_t of the layer under `prefix`, whether they already hold its weights)."""
        marker = self._marker(prefix)
        want = {**self.meta, "shape": list(shape)}
        numel = shape[0] * shape[1] * shape[2]
        paths = [self.dir / f"{_slug(prefix)}.{part}.bin" for part in PARTS]
        size = numel * torch.empty((), dtype=self.dtype).element_size()
        try:
            ready = json.loads(marker.read_text()) == want and all(
                path.stat().st_size == size for path in paths
            )  # a truncated file would map as zeros
        except (OSError, ValueError, RecursionError):
            ready = False
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if not ready:
                marker.unlink(missing_ok=True)  # being (re)written: not valid until `done`
            parts = [
                torch.from_file(str(path), shared=True, size=numel, dtype=self.dtype).view(shape) for path in paths
            ]
        except (OSError, RuntimeError) as e:  # torch reports a failed open or mmap as RuntimeError
            raise self._failure(e) from None
        return ExpertWeights(*parts), ready

    def _failure(self, e: Exception) -> RuntimeFailure:
        why = getattr(e, "strerror", None) or str(e).strip().splitlines()[0]
        return RuntimeFailure(
            f"cannot write the memory-mapped expert files under {for_line(self.dir)} "
            f"({for_line(why)}): free disk space or fix the folder's permissions, or keep them in "
            "RAM with --host-storage pinned"
        )

    def done(self, prefix: str, shape: tuple[int, int, int]) -> None:
        """Mark the layer under `prefix` complete (after its weights were written)."""
        marker = self._marker(prefix)
        tmp = marker.with_name(marker.name + ".tmp")
        try:
            tmp.write_text(json.dumps({**self.meta, "shape": list(shape)}))
            os.replace(tmp, marker)  # a crash leaves no marker or a whole one
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise self._failure(e) from None

    def bytes_needed(self, layers: int, shape: tuple[int, int, int]) -> int:
        return layers * len(PARTS) * shape[0] * shape[1] * shape[2] * (torch.finfo(self.dtype).bits // 8)


def needs_files(master_bytes: int, ram: int | None, headroom: int = 8 << 30) -> bool:
    """Whether expert master copies of `master_bytes` should be memory-mapped files: the machine's RAM (`ram`,
    physical) cannot hold them with `headroom` to spare for the OS, the model's other weights and the user."""
    return ram is not None and master_bytes + headroom > ram
