"""Many rows of pinned host stacks copied to the device by the copy engines, in one driver call where it can.

Offloaded prefill's layer stage (experts/layer_stage.py) moves a layer's absent int4 experts: at Qwen3.5-35B-A3B's
shapes ~77 experts a layer, laid expert-major (kernels/int4.py `expert_major`): a piece a run of absent experts and
projection, ~170 a layer (~700 when each of an expert's 9 parts was its own piece). Copied by the copy engines they
leave the SMs to the grouped GEMMs beside them (an SM gather of the same bytes slows those GEMMs 1.19x;
bench/RESULTS.md), but each piece costs host time: torch's `copy_` 7-16 µs, the driver's `cuMemcpyHtoDAsync` ~3 µs, and
CUDA 12.8's `cuMemcpyBatchAsync` takes them all in one call. `copy_rows` merges runs of consecutive rows into one piece
and issues the pieces through the batch call, else one driver call each, else (no CUDA driver library, a source that is
not pinned, the CPU) torch copies. `upload` moves a small list of ids the same way (pinned, no host sync), for the
staging spans and the layer stage.

Imports: ctypes and torch only.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

_STREAM_ORDER = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: the source is read in stream order
_HOST, _DEVICE = 2, 1  # CUmemLocationType
FLAGS = 0  # CUmemcpyFlags of the batch (1: CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE)


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):  # CUmemcpyAttributes (CUDA 12.8)
    _fields_ = [("order", ctypes.c_int), ("src", _Location), ("dst", _Location), ("flags", ctypes.c_uint)]


class _Driver:
    """The CUDA driver's copy entry points (libcuda), loaded once; `batch` None where the driver has no batch call
    or it failed once."""

    def __init__(self, lib: ctypes.CDLL):
        self.one = lib.cuMemcpyHtoDAsync_v2
        self.one.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        self.one.restype = ctypes.c_int
        self.batch = getattr(lib, "cuMemcpyBatchAsync", None)
        if self.batch is not None:
            self.batch.restype = ctypes.c_int

    def issue(self, pieces: list[tuple[int, int, int]], stream: int, device: int) -> None:
        """Each (destination address, source address, bytes) on `stream`, in one batch call when the driver takes it."""
        if self.batch is not None:
            n = len(pieces)
            dsts, srcs, sizes = (ctypes.c_uint64 * n)(), (ctypes.c_uint64 * n)(), (ctypes.c_size_t * n)()
            dsts[:], srcs[:], sizes[:] = (list(column) for column in zip(*pieces))
            attrs = _Attributes(_STREAM_ORDER, _Location(_HOST, 0), _Location(_DEVICE, device), FLAGS)
            first, failed = (ctypes.c_size_t * 1)(0), ctypes.c_size_t(0)
            code = self.batch(
                dsts, srcs, sizes, ctypes.c_size_t(n), ctypes.byref(attrs), first, ctypes.c_size_t(1),
                ctypes.byref(failed), ctypes.c_void_p(stream),
            )  # fmt: skip
            if code == 0:
                return
            self.batch = None  # an older ABI or a refusal: one call a piece from now on (the pieces are idempotent)
        for dst, src, size in pieces:
            code = self.one(dst, src, size, ctypes.c_void_p(stream))
            if code != 0:
                raise RuntimeError(f"cuMemcpyHtoDAsync failed with CUDA driver error {code}")


_driver: _Driver | None | bool = None  # None: not loaded yet; False: no driver library


def driver() -> _Driver | None:
    """The CUDA driver's copy calls, or None where its library does not load."""
    global _driver
    if _driver is None:
        try:
            _driver = _Driver(ctypes.CDLL("libcuda.so.1"))
        except (OSError, AttributeError):
            _driver = False
    return _driver or None


def upload(values: list[int], device: torch.device) -> torch.Tensor:
    """`values` as int32 on `device`; on CUDA from pinned memory, non-blocking: a copy from pageable memory waits
    for the stream, and one per span drained the GPU several times a layer (365 host syncs in a 2048-token int4
    prefill at Qwen3.5-35B-A3B shapes, 240 of its 632 profiled ms idle)."""
    t = torch.tensor(values, dtype=torch.int32)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def runs(rows: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first source row, first destination row, rows) for each run of consecutive source rows in `rows` (the
    destination rows are 0, 1, 2, ...)."""
    out: list[list[int]] = []
    for k, r in enumerate(rows):
        if out and out[-1][0] + out[-1][2] == r:
            out[-1][2] += 1
        else:
            out.append([r, k, 1])
    return [tuple(run) for run in out]


def _row_bytes(t: torch.Tensor, name: str) -> tuple[int, int]:
    """(bytes of one row of stack t [n, ...], bytes from one row to the next); each row must be contiguous."""
    if t.dim() < 1 or t.shape[0] == 0 or not t[0].is_contiguous():
        raise ValueError(f"{name} must hold each row contiguous; got {tuple(t.shape)}, strides {t.stride()}")
    return t[0].numel() * t.element_size(), t.stride(0) * t.element_size()


def copy_rows(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], rows: Sequence[int]) -> None:
    """dst[k] = src[rows[k]] for k < len(rows), for each (dst, src) stack pair, on the current stream: by the copy
    engines where dst is on a CUDA device and src in pinned host memory (module doc), else by torch copies; a run of
    consecutive rows in one piece where both stacks hold their rows back to back. No rows: nothing (a layer whose
    gates are all resident stages none)."""
    if not rows:
        return
    pieces, device = [], None
    merged, single = runs(rows), [(r, k, 1) for k, r in enumerate(rows)]
    for dst, src in pairs:
        if dst.dtype != src.dtype or dst.shape[1:] != src.shape[1:] or dst.shape[0] < len(rows):
            raise ValueError(
                f"dst {dst.dtype} {tuple(dst.shape)} cannot take rows of src {src.dtype} {tuple(src.shape)}"
            )
        row, step = _row_bytes(src, "src")
        dst_step = _row_bytes(dst, "dst")[1]
        if max(rows) >= src.shape[0]:
            raise ValueError(f"row {max(rows)} is past src's {src.shape[0]}")
        spans = merged if step == dst_step == row else single
        if dst.device.type == "cuda" and src.is_pinned() and driver() is not None:
            device = dst.device
            a, b = dst.data_ptr(), src.data_ptr()
            pieces += [(a + k * dst_step, b + r * step, (n - 1) * step + row) for r, k, n in spans]
            continue
        for r, k, n in spans:
            dst[k : k + n].copy_(src[r : r + n], non_blocking=True)
    if pieces:
        stream = torch.cuda.current_stream(device)
        with torch.cuda.device(device):
            driver().issue(pieces, stream.cuda_stream, device.index or 0)
