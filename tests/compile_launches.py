"""Compile every distinct Triton launch the tests recorded (tests/launch_recorder.py) for sm_90 and sm_89, no GPU
needed: `python tests/compile_launches.py DIR`, with the divisibility hints the GPU's JIT would give each launch.
Prints one line per kernel, every failure with its constexprs, and exits 1 if any launch does not compile."""

from __future__ import annotations

import importlib
import os
import pickle
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the real compiler (before triton is imported)
ARCHS = (90, 89)  # H100/H200, RTX 40xx


def _compile(launch) -> tuple[str, str | None]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name, names, sig, const, options, aligned = launch
    fn = getattr(importlib.import_module(module), name)
    signature = {n: sig.get(n, "constexpr") for n in names}
    constexprs = {(names.index(k),): v for k, v in const.items()}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}  # as the JIT specialises them
    where = f"{module.rsplit('.', 1)[-1]}.{name}"
    for arch in ARCHS:
        try:
            src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
            triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(options))
        except Exception as e:  # noqa: BLE001 (report every failing launch)
            return where, f"sm_{arch} {const} {options}: {type(e).__name__}: {str(e)[-800:]}"
    return where, None


def main(directory: str) -> int:
    launches = {}
    for path in sorted(Path(directory).glob("launches-*.pkl")):
        for launch in pickle.loads(path.read_bytes()):
            module, name, _, sig, const, options, aligned = launch
            key = (module, name, repr(sig), repr(sorted(const.items())), repr(options), aligned)
            launches.setdefault(key, launch)
    if not launches:
        print(f"no launches recorded in {directory}", file=sys.stderr)
        return 1
    per_kernel: dict[str, int] = {}
    failures = []
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        for where, error in pool.map(_compile, launches.values(), chunksize=4):
            per_kernel[where] = per_kernel.get(where, 0) + 1
            if error:
                failures.append(f"{where} {error}")
    for where, n in sorted(per_kernel.items()):
        print(f"  {where}: {n} launches")
    print(
        f"compiled {len(launches)} distinct launches of {len(per_kernel)} kernels for sm_{ARCHS[0]} and sm_{ARCHS[1]}"
    )
    for f in failures:
        print("FAILED", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
