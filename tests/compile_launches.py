"""Compile every distinct Triton launch the tests recorded (tests/launch_recorder.py) for sm_90, sm_89 and sm_120
(`ARCHS`), no GPU needed: `python tests/compile_launches.py DIR`, with the divisibility hints the GPU's JIT
would give each launch and the launch parameters a GPU of that arch gets (`_as_on`). Prints one line per kernel, every
failure with its constexprs, and exits 1 if any launch does not compile or needs more shared memory a program than
the arch gives (`SHARED_LIMIT`: a desktop card has less than an H200).

`python tests/compile_launches.py DIR --report [--arch 90] [--kernel NAME] [--set K=V ...]` instead prints, per
distinct launch, what the compiler made of it: registers and spilled stack bytes a thread (Triton's bundled
cuobjdump), shared memory a program, layout conversions in the TTGIR, `bar.sync` in the PTX and static SASS
instructions (a program's issue count where the kernel has no loops). `--set` overrides
constexprs (and num_warps / num_stages), so a launch recorded at a test's shape compiles at a real model's (H=2048,
BLOCK_N=8, ...). These are compiler figures, not timings: what a kernel change does to them, before a GPU times it.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import pickle
import re
import subprocess
import sys
import tempfile
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


def _build(launch, arch: int, override: dict | None = None):
    """(the launch's short name, the constexprs and options compiled, the compiled kernel) for `arch`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name, names, sig, const, options, aligned = launch
    over = override or {}
    const = const | {k: v for k, v in over.items() if k in const}
    options = options | {k: v for k, v in over.items() if k in ("num_warps", "num_stages")}
    fn = getattr(importlib.import_module(module), name)
    signature = {n: sig.get(n, "constexpr") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}  # as the JIT specialises them
    c, o = _as_on(arch, name, const, options)
    constexprs = {(names.index(k),): v for k, v in c.items()}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return (
        f"{module.rsplit('.', 1)[-1]}.{name}",
        c,
        o,
        triton.compile(src, target=GPUTarget("cuda", arch, 32), options=o),
    )


def _compile(launch) -> tuple[str, str | None]:
    module, name = launch[:2]
    where = f"{module.rsplit('.', 1)[-1]}.{name}"
    for arch in ARCHS:
        try:
            where, c, o, k = _build(launch, arch)
        except Exception as e:  # noqa: BLE001 (report every failing launch)
            c, o = _as_on(arch, name, launch[4], launch[5])
            return where, f"sm_{arch} {c} {o}: {type(e).__name__}: {str(e)[-800:]}"
        need, limit = k.metadata.shared, SHARED_LIMIT.get(arch, 1 << 30)
        if need > limit:
            return where, f"sm_{arch} {c} {o}: needs {need} B of shared memory a program, more than {limit}"
    return where, None


def _report(job) -> str:
    """One line: the launch's upper-case constexprs and options, then registers, stack, shared, conversions, syncs."""
    launch, arch, override = job
    import triton

    where, c, o, k = _build(launch, arch, override)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
    # static SASS instructions (`/*0a10*/  FFMA R1, ...`): what a program issues where the kernel has no loops, the
    # proxy for an issue-bound launch (times its programs: warp-instructions a call); the BRA and NOPs padding the code
    # after its last EXIT count too (10 at gpt-oss's 4 / 4 sparse_mxfp4: 2704, of which 2694 can issue)
    n_sass = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+[A-Z@]", sass, flags=re.M))
    reg, stack = (re.search(rf"{key}:(\d+)", usage) for key in ("REG", "STACK"))
    shown = {n: v for n, v in c.items() if n.isupper()} | o
    return (
        f"{where} {shown}: {reg.group(1) if reg else '?'} registers, {stack.group(1) if stack else '?'} B stack, "
        f"{k.metadata.shared} B shared, {k.asm['ttgir'].count('ttg.convert_layout')} layout conversions, "
        f"{k.asm['ptx'].count('bar.sync')} bar.sync, {n_sass} SASS instructions"
    )


def _launches(directory: str) -> dict:
    launches = {}
    for path in sorted(Path(directory).glob("launches-*.pkl")):
        for launch in pickle.loads(path.read_bytes()):
            module, name, _, sig, const, options, aligned = launch
            key = (module, name, repr(sig), repr(sorted(const.items())), repr(options), aligned)
            launches.setdefault(key, launch)
    return launches


def report(directory: str, arch: int, kernel: str | None, override: dict) -> int:
    jobs = [(v, arch, override) for v in _launches(directory).values() if kernel in (None, v[1])]
    if not jobs:
        print(f"no launches of {kernel or 'any kernel'} recorded in {directory}", file=sys.stderr)
        return 1
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        for line in sorted(pool.map(_report, jobs)):
            print(line)
    return 0


def main(directory: str) -> int:
    launches = _launches(directory)
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


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("directory", help="LOCALMOE_RECORD_LAUNCHES's folder")
    p.add_argument("--report", action="store_true", help="registers, spills, shared memory, conversions per launch")
    p.add_argument("--arch", type=int, default=90, help="--report's compute capability (default 90)")
    p.add_argument("--kernel", help="--report only this kernel (its function name, e.g. _sparse_fused_kernel)")
    p.add_argument("--set", action="append", default=[], metavar="K=V", help="--report with a constexpr overridden")
    a = p.parse_args()
    if not a.report:
        sys.exit(main(a.directory))
    sys.exit(report(a.directory, a.arch, a.kernel, {k: _value(v) for k, v in (x.split("=", 1) for x in a.set)}))
