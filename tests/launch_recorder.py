"""The Triton launches the tests make, recorded so that each distinct one can be compiled for real GPUs here.

Under TRITON_INTERPRET=1 a kernel runs as Python, so a kernel the interpreter runs may still not compile: a name
rebound to another type across a runtime `if`, a value made under a runtime `if` used after it, shared memory
beyond a GPU's. With LOCALMOE_RECORD_LAUNCHES=DIR (tests/conftest.py installs this) every launch's kernel, argument
types, constexpr values, num_warps / num_stages and which arguments a GPU launch would specialise as divisible by 16
are recorded, one file per pytest process;
`python tests/compile_launches.py DIR` then compiles each distinct launch for sm_90 and sm_89 without a GPU (.ci/run
does, after the pinned pass). Test tooling only: nothing here is imported by localmoe.
"""

from __future__ import annotations

import inspect
import os
import pickle
from pathlib import Path

import torch

TYPES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float64: "fp64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
}
OPTIONS = ("num_warps", "num_stages", "maxnreg")
_SEEN: dict[tuple, tuple] = {}
_CONSTEXPRS: dict[object, set[str]] = {}


def _type(v) -> str | None:
    """The Triton signature type of a runtime argument; None: a constexpr (None)."""
    if v is None:
        return None
    if hasattr(v, "data_ptr") and hasattr(v, "dtype"):  # tensors, kernels/checks.HostPointer
        return "*" + TYPES[v.dtype]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i64" if not -(2**31) <= v < 2**31 else "i32"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"unrecorded argument type {type(v).__name__}")


def _record(fn, names: list[str], args: tuple, kwargs: dict) -> None:
    if fn not in _CONSTEXPRS:
        params = inspect.signature(fn).parameters.values()
        _CONSTEXPRS[fn] = {p.name for p in params if "constexpr" in str(p.annotation)}
    constexprs = _CONSTEXPRS[fn]
    bound = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    sig, const, aligned = {}, {}, []
    for name in names:
        if name not in bound:
            continue  # a constexpr left to its default
        v = bound[name]
        t = None if name in constexprs else _type(v)
        if t is None:
            const[name] = v
        else:
            sig[name] = t
            if _divisible(v):
                aligned.append(name)
    options = {k: kwargs[k] for k in OPTIONS if kwargs.get(k) is not None}
    key = (
        fn.__module__, fn.__qualname__, tuple(sig.items()), repr(sorted(const.items())), tuple(options.items()),
        tuple(aligned),
    )  # fmt: skip
    _SEEN.setdefault(key, (fn.__module__, fn.__name__, names, sig, const, options, tuple(aligned)))


def _divisible(v) -> bool:
    """Whether a GPU launch would specialise this argument as divisible by 16, as Triton's JIT does: a pointer aligned
    to 16 bytes, an integer that is a multiple of 16 (bools never). The compile check passes the same `tt.divisibility`
    hints, so it builds the vectorised loads the GPU builds (without them every load compiles scalar)."""
    if hasattr(v, "data_ptr"):
        return v.data_ptr() % 16 == 0
    return isinstance(v, int) and not isinstance(v, bool) and v % 16 == 0


def install() -> None:
    """Record every interpreted launch from now on (the launch itself runs unchanged)."""
    from triton.runtime import interpreter

    run = interpreter.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        try:
            _record(self.fn, self.arg_names, args, kwargs)
        except Exception as e:  # noqa: BLE001 (a launch the recorder cannot read must not fail the test)
            _SEEN.setdefault(("unrecorded", self.fn.__qualname__, str(e)), None)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = recording_run


def save(directory: str) -> None:
    """Write this process's distinct launches to DIRECTORY/launches-<pid>.pkl."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    with open(Path(directory) / f"launches-{os.getpid()}.pkl", "wb") as f:
        pickle.dump([v for v in _SEEN.values() if v is not None], f)
