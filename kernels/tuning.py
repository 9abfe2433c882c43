"""Loader for tuned launch parameters of the decode kernels (data in `kernels/tuned/*.json`).

One JSON file per device, merged from the sweeps' outputs (`bench/bench_moe_block.py`, `bench/tune_decode.py`,
`bench/gemv_sweep.py`, `bench/decode_attention_sweep.py`):

    {"device": "NVIDIA H200",
     "launch_params":   {"H2048_I512_k8": {"dense": {"BLOCK_N": 4, "num_warps": 8},
                                           "fused": {"BLOCK_I": 8, "num_warps": 8}}},
     "crossover_tokens": {"H2048_I512_E256_k8": 8},
     "decode_params":   {"router_topk": {"H2048_E256_k8": {"block_e": 1, ...}}, "shared_expert": {...},
                         "gated_deltanet_step": {...}}}

The `launch_params` dicts are keyword arguments of `dense_experts` and `sparse_fused` ("fused"; "fused_int4" with int4
experts; "fused_pred" with the gate predictor, resident experts); `decode_params` holds keyword arguments of the
fused decode launchers (router_topk, moe_front, shared_expert, gated_deltanet_step, gemv, decode_attention,
department_experts) and of the prefill's grouped GEMMs (grouped_gate_up, grouped_gemm: `bench/tune_prefill.py`),
looked up by `tuned(x, kernel, shape)`;
tests/test_tuned_tables.py checks that every entry is one the code reads. `launch_params(device_name, H, I, k)`
returns the entry for that shape (or the defaults); `crossover_tokens(device_name, H, I, E, k)` returns the largest
token count at which the sparse kernels beat the dense grouped path (1 when unmeasured). Device names match
`torch.cuda.get_device_name()` case-insensitively.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path

import torch

_TUNED_DIR = Path(__file__).resolve().parent / "tuned"

DEFAULT_PARAMS = {
    "dense": {"BLOCK_N": 4, "num_warps": 8},
    "fused": {"BLOCK_I": 8, "num_warps": 8},
}
INT4_FUSED = {"BLOCK_I": 4, "num_warps": 8}  # sparse_fused with int4 experts (launch_params)
# sparse_fused with the gate predictor (launch_params' "fused_pred"): with ~30% of the gate rows read, smaller blocks
# win (H100, untuned, bench/predictor_check.py --launches: Qwen3.5-35B 11.8 µs at 4 / 4 against 12.4 at 8 / 8)
PRED_FUSED = {"BLOCK_I": 4, "num_warps": 4}


def _norm(name: str) -> str:
    return " ".join(str(name).lower().split())


@functools.cache
def _tables() -> dict:
    """device name (normalised) -> parsed JSON; unreadable files are skipped."""
    out = {}
    if _TUNED_DIR.is_dir():
        for path in sorted(_TUNED_DIR.glob("*.json")):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and "device" in data:
                out[_norm(data["device"])] = data
    return out


def _device_table(device_name: str) -> dict:
    tables = _tables()
    key = _norm(device_name)
    if key in tables:
        return tables[key]
    for name, data in tables.items():  # e.g. "NVIDIA H200 NVL" falls back to "NVIDIA H200"
        if key.startswith(name) or name.startswith(key):
            return data
    return tables.setdefault(key, {"device": device_name})  # unmeasured: an empty table of its own (a bench's A/B
    # may add entries to it, as to a measured device's)


def launch_params(device_name: str, H: int, I: int, k: int, int4: bool = False) -> dict:
    """Launch parameters {"dense": {...}, "fused": {...}, "fused_pred": {...}} for one shape on one device.

    int4 experts: sparse_fused's unpacked tiles need about twice the registers per element, so its untuned rule
    allows 32 tile elements per thread instead of 64 (H 2048: BLOCK_I 4 / 8 warps; on the H200 at ~20% kept 14.2 µs
    against 16.4 for 8 / 8, dense 18.2 against 17.9); a tuned entry's "fused_int4" overrides it. "fused_pred" (the
    predictor's launch): PRED_FUSED or a tuned entry's; with int4 experts the int4 launch."""
    params = copy.deepcopy(DEFAULT_PARAMS)
    entry = _device_table(device_name).get("launch_params", {}).get(f"H{H}_I{I}_k{k}", {})
    for kernel, kw in entry.items():
        if kernel in params and isinstance(kw, dict):
            params[kernel].update(kw)
    fused_key = "fused_int4" if int4 else "fused"
    if int4:
        params["fused"] = dict(INT4_FUSED, **entry.get("fused_int4", {}))
    if fused_key not in entry:  # untuned: keep sparse_fused's BLOCK_I x H tile within the registers (no spills)
        per_thread = 32 if int4 else 64
        f, h_p2 = params["fused"], 1 << max(0, int(H) - 1).bit_length()
        while f["BLOCK_I"] * h_p2 > per_thread * 32 * f["num_warps"] and f["num_warps"] < 16:
            f["num_warps"] *= 2
        while f["BLOCK_I"] * h_p2 > per_thread * 32 * f["num_warps"] and f["BLOCK_I"] > 1:
            f["BLOCK_I"] //= 2
    params["fused_pred"] = dict(params["fused"]) if int4 else dict(PRED_FUSED, **entry.get("fused_pred", {}))
    return params


def crossover_tokens(device_name: str, H: int, I: int, E: int, k: int) -> int:
    """Largest T at which the sparse path beat the dense path for this shape (1 when unmeasured)."""
    val = _device_table(device_name).get("crossover_tokens", {}).get(f"H{H}_I{I}_E{E}_k{k}")
    return int(val) if isinstance(val, (int, float)) and val >= 1 else 1


def decode_params(device_name: str, kernel: str, shape_key: str) -> dict:
    """Tuned keyword arguments of a fused decode launcher (`router_topk`, `gemv`, `decode_attention`, ...) for one
    shape key (e.g. "H2048_E256_k8"); {} (the launcher's defaults) when unmeasured."""
    kw = _device_table(device_name).get("decode_params", {}).get(kernel, {}).get(shape_key, {})
    return dict(kw) if isinstance(kw, dict) else {}


def tuned(x: torch.Tensor, kernel: str, shape_key: str) -> dict:
    """`decode_params` for the device x is on; {} off CUDA or when unmeasured. Looked up once per (device, kernel,
    shape), so the decode paths may ask on every eager call. Read-only."""
    return _tuned_on(x.device.index or 0, kernel, shape_key) if x.is_cuda else {}


@functools.cache
def _tuned_on(device_index: int, kernel: str, shape_key: str) -> dict:
    return decode_params(torch.cuda.get_device_name(device_index), kernel, shape_key)


def tuned_at(x: torch.Tensor, kernel: str, shape_key: str, sparsity: float) -> dict:
    """`tuned` for a launch whose best parameters depend on how much of the experts it reads: an entry
    "SHAPE_s{P}" (P a percentage) applies from sparsity P / 100 on, the highest such P <= `sparsity` wins; below
    every band (or with none) SHAPE's own entry. E.g. sparse_mxfp4's one-warp programs win at high sparsity only."""
    return _tuned_at(x.device.index or 0, kernel, shape_key, round(float(sparsity), 4)) if x.is_cuda else {}


@functools.cache
def _tuned_at(device_index: int, kernel: str, shape_key: str, sparsity: float) -> dict:
    entries = _device_table(torch.cuda.get_device_name(device_index)).get("decode_params", {}).get(kernel, {})
    band = sparsity_band(entries, shape_key, sparsity)
    return dict(entries[band]) if band else _tuned_on(device_index, kernel, shape_key)


def sparsity_band(entries: dict, shape_key: str, sparsity: float) -> str | None:
    """The key of `entries` ("SHAPE_s{P}") whose band holds `sparsity` (the highest P <= 100 * sparsity), or None."""
    bands = [(int(m.group(1)), k) for k in entries if (m := re.fullmatch(re.escape(shape_key) + r"_s(\d+)", k))]
    below = [b for b in bands if b[0] <= 100 * sparsity + 1e-6 and isinstance(entries[b[1]], dict)]
    return max(below)[1] if below else None
