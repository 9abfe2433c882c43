"""The tuned launch tables (kernels/tuned/*.json) hold only what code reads: every `decode_params` kernel is one a
decode path looks up with `tuned(x, KERNEL, shape)`, and every `launch_params` entry names the expert launches
`launch_params` returns ("dense", "fused", "fused_int4", "fused_pred") with keyword arguments of those launchers. An
entry under any other name is silently never used (session 28's sparse_fused sweeps sat under an unread
"sparse_tail" key for two sessions)."""

import inspect
import json
import re
from pathlib import Path

from localmoe.kernels import tuning
from localmoe.kernels.dense_experts import dense_experts
from localmoe.kernels.sparse_fused import sparse_fused

ROOT = Path(__file__).resolve().parent.parent
TABLES = sorted((ROOT / "kernels" / "tuned").glob("*.json"))


def _kernels_looked_up() -> set[str]:
    text = "\n".join(p.read_text() for d in ("localmoe", "kernels") for p in (ROOT / d).rglob("*.py"))
    return set(re.findall(r'\btuned(?:_at)?\(\s*[\w.]+\s*,\s*"(\w+)"', text))


def test_there_are_tables():
    assert TABLES, "kernels/tuned/ holds no table"


def test_every_decode_params_kernel_is_read():
    read = _kernels_looked_up()
    assert {"gemv", "moe_front", "decode_attention"} <= read  # the scan finds the decode paths' lookups
    for path in TABLES:
        kernels = set(json.loads(path.read_text()).get("decode_params", {}))
        assert kernels <= read, f"{path.name}: decode_params entries no code reads: {sorted(kernels - read)}"


def test_launch_params_entries_are_expert_launches():
    params = {
        "dense": set(inspect.signature(dense_experts).parameters),
        "fused": set(inspect.signature(sparse_fused).parameters),
    }
    params["fused_int4"] = params["fused_pred"] = params["fused"]
    for path in TABLES:
        for shape, entry in json.loads(path.read_text()).get("launch_params", {}).items():
            assert re.fullmatch(r"H\d+_I\d+_k\d+", shape), f"{path.name}: launch_params key {shape!r}"
            for launch, kw in entry.items():
                assert launch in params, f"{path.name}: {shape} has an unread launch {launch!r}"
                assert set(kw) <= params[launch], f"{path.name}: {shape} {launch} keywords {sorted(kw)}"


def test_an_entry_reaches_the_launch():
    """The H200 table's OLMoE entry is what the experts' launch gets (and an unknown device gets the defaults)."""
    assert tuning.launch_params("NVIDIA H200", 2048, 1024, 8)["fused"] == {"BLOCK_I": 16, "num_warps": 4}
    assert tuning.launch_params("no such device", 2048, 1024, 8)["fused"] == tuning.DEFAULT_PARAMS["fused"]
    # the gate predictor's launch: its own default, or the int4 launch with int4 experts
    assert tuning.launch_params("no such device", 2048, 512, 8)["fused_pred"] == tuning.PRED_FUSED
    int4 = tuning.launch_params("no such device", 2048, 512, 8, int4=True)
    assert int4["fused_pred"] == int4["fused"] == tuning.INT4_FUSED


def test_sparsity_bands():
    """`tuned_at`'s bands: "SHAPE_s{P}" from sparsity P / 100 on, the highest band at or below the sparsity."""
    entries = {"S": {"a": 1}, "S_s70": {"a": 2}, "S_s85": {"a": 3}, "T_s10": {"a": 4}, "S_s99x": {"a": 5}}
    assert tuning.sparsity_band(entries, "S", 0.5) is None  # below every band: SHAPE's own entry
    assert tuning.sparsity_band(entries, "S", 0.7) == "S_s70"
    assert tuning.sparsity_band(entries, "S", 0.84) == "S_s70"
    assert tuning.sparsity_band(entries, "S", 0.85) == "S_s85"
    assert tuning.sparsity_band(entries, "T", 0.05) is None and tuning.sparsity_band(entries, "U", 0.9) is None
