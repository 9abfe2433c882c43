"""Programmatic dependent launch (PDL) for the decode kernels: the next kernel of the step starts while this one
finishes, so its launch and its weight loads overlap the tail of the kernel before it.

A batch-1 decode step is ~600 short kernels; on the H200 each costs ~1 µs of launch gap plus a ramp in which its
first loads are in flight and nothing else is (bench/RESULTS.md, "Tried": kernel boundaries, `s5i` / `s6`). With
PDL (Hopper and later, captured into CUDA graphs as programmatic edges) a kernel launched with `launch_pdl=True` may
be scheduled once every program of the kernel before it has called `gdc_launch_dependents()`. It must then call
`gdc_wait()` before it reads anything the earlier kernels wrote and before it writes anything (the wait returns when
the kernel before has completed and its memory is visible; by induction, every earlier kernel too). What it reads
before the wait must be constant during the step: weights, never activations, caches or counters.

Every localmoe kernel follows one pattern, with a `PDL: tl.constexpr` argument:

    w = tl.load(weights ...)           # constants of the step: may be read before the wait
    if PDL:
        gdc_wait()                     # everything earlier kernels wrote is visible from here on
        gdc_launch_dependents()        # let the next kernel launch and prefetch its own weights
    x = tl.load(activations ...); ...; tl.store(...)

and its launcher passes `**pdl_kw(tensor)`: `{"PDL": True, "launch_pdl": True}` on a CUDA device of compute
capability >= 9 with Triton's GDC intrinsics, else `{"PDL": False}` (the interpreter and older GPUs: the `if PDL`
branches are compiled out). `LOCALMOE_PDL=0` in the environment, or `set_enabled(False)`, turns it off
(benchmarks compare both in one process).
"""

from __future__ import annotations

import functools
import os

import torch

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401  (re-exported)

    HAVE_GDC = True
except ImportError:  # pragma: no cover - Triton without GDC intrinsics (< 3.3)
    HAVE_GDC = False
    gdc_wait = gdc_launch_dependents = None

_override: bool | None = None


def set_enabled(on: bool | None) -> None:
    """Force PDL on/off for every later launch (None: back to the default). Kernels already captured in a CUDA
    graph keep the launch they were captured with."""
    global _override
    _override = on


@functools.cache
def _capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def enabled(t: torch.Tensor) -> bool:
    """Whether kernels launched for tensor `t`'s device use programmatic dependent launch."""
    if not (HAVE_GDC and t.is_cuda) or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    if _override is not None:
        return _override and _capable(t.device.index or 0)
    return os.environ.get("LOCALMOE_PDL", "1") != "0" and _capable(t.device.index or 0)


def pdl_kw(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel with a `PDL: tl.constexpr` argument, for tensor `t`'s device."""
    return {"PDL": True, "launch_pdl": True} if enabled(t) else {"PDL": False}
