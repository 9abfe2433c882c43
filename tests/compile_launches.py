"""Compile every distinct Triton launch the tests recorded (tests/launch_recorder.py) for sm_90, sm_89 and sm_120
(`ARCHS`), no GPU needed: `python tests/compile_launches.py DIR`, with the divisibility hints the GPU's JIT
would give each launch and the launch parameters a GPU of that arch gets (`_as_on`). Prints one line per kernel, every
failure with its constexprs, and exits 1 if any launch does not compile or needs more shared memory a program than
the arch gives (`SHARED_LIMIT`: a desktop card has less than an H200)."""

from __future__ import annotations

import importlib
import os
import pickle
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the real compiler (before triton is imported)
# H100/H200, RTX 40xx, RTX 50xx (sm_86, RTX 30xx, has sm_89's shared memory and builds alike: all launches compiled
# for it in session 33; LOCALMOE_COMPILE_ARCHS="86" checks it again, or any other list)
ARCHS = (90, 89, 120)
if os.environ.get("LOCALMOE_COMPILE_ARCHS"):
    ARCHS = tuple(int(a) for a in os.environ["LOCALMOE_COMPILE_ARCHS"].split(","))


# the most shared memory one program may take (bytes, opt-in), by arch: a launch compiled for an arch is refused at
# run time beyond it ("out of resource: shared memory"), so what fits the H200 can fail on a desktop card
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}


def _as_on(arch: int, name: str, const: dict, options: dict) -> tuple[dict, dict]:
    """The recorded launch as a GPU of `arch` gets it, where the launcher decides by the device rather than by the
    test's shapes: mla_decode's fp32 products (`DOT_F32`) run under the interpreter only; programmatic dependent
    launch (`PDL`) on sm_90 and later; delta_rule_chunk's scan pipelines two stages only with >= 200 KiB of shared
    memory a program (`_scan_stages`), one on desktop cards."""
    if "DOT_F32" in const:
        const = dict(const, DOT_F32=False)
    if "PDL" in const and arch >= 90:  # kernels/pdl.py's pdl_kw on compute capability >= 9
        const, options = dict(const, PDL=True), dict(options, launch_pdl=True)
    if name == "_chunk_scan_kernel" and SHARED_LIMIT.get(arch, 1 << 30) < 200 * 1024:
        options = dict(options, num_stages=1)
    return const, options


def _compile(launch) -> tuple[str, str | None]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name, names, sig, const, options, aligned = launch
    fn = getattr(importlib.import_module(module), name)
    signature = {n: sig.get(n, "constexpr") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}  # as the JIT specialises them
    where = f"{module.rsplit('.', 1)[-1]}.{name}"
    for arch in ARCHS:
        c, o = _as_on(arch, name, const, options)
        try:
            constexprs = {(names.index(k),): v for k, v in c.items()}
            src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
            k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=o)
        except Exception as e:  # noqa: BLE001 (report every failing launch)
            return where, f"sm_{arch} {c} {o}: {type(e).__name__}: {str(e)[-800:]}"
        need, limit = k.metadata.shared, SHARED_LIMIT.get(arch, 1 << 30)
        if need > limit:
            return where, f"sm_{arch} {c} {o}: needs {need} B of shared memory a program, more than {limit}"
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
        f"compiled {len(launches)} distinct launches of {len(per_kernel)} kernels for "
        + ", ".join(f"sm_{a}" for a in ARCHS)
    )
    for f in failures:
        print("FAILED", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
