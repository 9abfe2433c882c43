"""Programmatic dependent launch (kernels/pdl.py): off on CPU and under the interpreter, and every kernel launched
with it waits before touching activations.

A kernel launched with `launch_pdl=True` that never calls `gdc_wait()` would race the kernel before it, so this is
checked on the source of every Triton kernel in `kernels/`: a kernel with a `PDL` argument calls `gdc_wait()` inside
`if PDL:`, and every launch of it passes `**pdl_kw(...)`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from localmoe.kernels import pdl

KERNELS = Path(pdl.__file__).resolve().parent


def test_off_on_cpu_and_when_disabled():
    t = torch.zeros(1)
    assert pdl.pdl_kw(t) == {"PDL": False}
    pdl.set_enabled(True)
    try:
        assert pdl.pdl_kw(t) == {"PDL": False}  # forcing cannot turn it on off CUDA
    finally:
        pdl.set_enabled(None)


def _jit_kernels(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
            out[node.name] = node
    return out


def _pdl_kernels(path: Path) -> list[tuple[str, ast.FunctionDef, ast.Module]]:
    tree = ast.parse(path.read_text())
    return [(name, fn, tree) for name, fn in _jit_kernels(tree).items() if any(a.arg == "PDL" for a in fn.args.args)]


FILES = sorted(p for p in KERNELS.glob("*.py") if _pdl_kernels(p))


def test_the_decode_kernels_use_it():
    names = {p.stem for p in FILES}
    assert {
        "gemv",
        "rmsnorm",
        "router_topk",
        "shared_expert",
        "sparse_fused",
        "delta_rule_step",
        "decode_attention",
        "dense_experts",
    } <= names


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_every_pdl_kernel_waits_and_every_launch_passes_pdl_kw(path):
    for name, fn, tree in _pdl_kernels(path):
        waits = [
            n
            for n in ast.walk(fn)
            if isinstance(n, ast.If) and ast.unparse(n.test) == "PDL" and "gdc_wait()" in ast.unparse(n)
        ]
        assert waits, f"{path.name}: {name} takes PDL but never calls gdc_wait() under `if PDL:`"
        launches = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript) and ast.unparse(n.func.value) == name
        ]
        assert launches, f"{path.name}: {name} is never launched here"
        for call in launches:
            assert any(k.arg is None and "pdl_kw" in ast.unparse(k.value) for k in call.keywords), (
                f"{path.name}: a launch of {name} lacks **pdl_kw(...)"
            )
