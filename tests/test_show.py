"""`localmoe show MODEL`: what a model needs from its config alone, on each tiny family (cached as the hub caches),
a local folder, and registry aliases whose config is in localmoe/data/shapes.json (offline: no network here).

Choices where the issue was silent: the plan is for bf16 (the GPU's dtype) at `--vram`, else at what this machine's
card has free, else none (then what keeping everything resident takes); a budget too small is part of the answer
(`vram.fits` false, its reason), not an error; active parameters count every non-expert weight (embeddings and
lm_head included, as model cards do) and k experts per MoE layer; the download size is the files on disk when
downloaded, the hub's file list when reachable, else parameters x the checkpoint's dtype (`download_source`), the
routed experts in MXFP4 where the config says the checkpoint stores them so (GPT-OSS; `download_estimate` says which).
"""

from __future__ import annotations

import json
import math

import pytest
import tiny_models
from conftest import FAMILIES, repo_id

from localmoe.cli.main import main


def show(capsys, *argv):
    code = main(["show", *argv])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def _numbers(obj, path=""):
    """Every leaf of a JSON object that looks like a number is one (not a string)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            _numbers(v, f"{path}.{k}")
    elif isinstance(obj, str):
        assert not obj.replace(".", "", 1).isdigit(), f"{path} is a string number: {obj!r}"


def _checkpoint_params(folder, family) -> int:
    """Parameters of the checkpoint's text model, counted from its safetensors headers."""
    from safetensors import safe_open

    from localmoe.models.families import family_for_model_type

    fam = family_for_model_type(family)
    total = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            for key in h.keys():
                # MXFP4 experts (GPT-OSS): two weights per byte of blocks, a scale per 32; show counts the experts'
                # matrices, not their biases (0.001% of gpt-oss's parameters)
                if fam.rename(key) is None or key.endswith("_scales") or (".experts." in key and key.endswith("_bias")):
                    continue
                total += math.prod(h.get_slice(key).get_shape()) * (2 if key.endswith("_blocks") else 1)
    return total


@pytest.mark.parametrize("family", FAMILIES)
def test_show_each_family(hub_cache, src_dir, capsys, family):
    code, out, err = show(capsys, repo_id(family), "--vram", "1", "--json")
    obj = json.loads(out)
    assert code == 0 and err == ""
    _numbers(obj)
    assert obj["config_source"] == "cache" and obj["download_source"] == "disk"
    assert obj["params_total"] == _checkpoint_params(src_dir / family, family)
    assert obj["download_bytes"] == sum(f.stat().st_size for f in (src_dir / family).glob("*.safetensors"))
    k, E, I, H, L = (obj[n] for n in ("top_k", "experts", "expert_width", "hidden", "moe_layers"))
    assert obj["params_active"] == obj["params_total"] - L * (E - k) * 3 * I * H
    assert isinstance(obj["layers"], int) and obj["context_max"] == 512 and obj["context"] == 512
    v = obj["vram"]
    assert v["fits"] and not v["offloading"] and v["experts_cached"] == v["experts_total"] == L * E
    assert v["host_ram_bytes"] == 0 and v["budget_bytes"] == 1 << 30
    dense, sparse = obj["bytes_per_token"]["dense"], obj["bytes_per_token"]["sparse"]
    assert dense > sparse > 0 and obj["bytes_per_token"]["sparsity"] == 0.5
    code, out, _ = show(capsys, repo_id(family), "--vram", "1")
    assert code == 0 and "  parameters     " in out and out.rstrip().splitlines()[-1].startswith("  plan           ")


def test_byte_floor_is_the_bench_floor(hub_cache, capsys):
    """show's bytes per token (bf16) are the figure `bench` divides the copy bandwidth by, for the loaded model
    (float32 here: twice the bytes), and the engine's plan line carries the same."""
    from localmoe.engine.engine import Engine
    from localmoe.engine.plan import engine_plan
    from localmoe.measure.benchmark import step_bytes

    e = Engine.load(repo_id("olmoe"), device="cpu", dtype="float32", sparsity=0.0)
    code, out, _ = show(capsys, repo_id("olmoe"), "--json")
    obj = json.loads(out)
    assert 2 * obj["bytes_per_token"]["dense"] == step_bytes(e, 0.0) == engine_plan(e, 0.5).floor_dense
    assert 2 * obj["bytes_per_token"]["sparse"] == step_bytes(e, 0.5)
    assert e.plan_line.startswith(f"{repo_id('olmoe')}: ") and "on the CPU" in e.plan_line
    assert e.notes[0] == e.plan_line


def test_show_local_folder(src_dir, capsys):
    code, out, _ = show(capsys, str(src_dir / "qwen3_5_moe"), "--json", "--experts", "int4", "--vram", "2")
    obj = json.loads(out)
    assert code == 0 and obj["config_source"] == "local" and obj["family"] == "Qwen3.5-MoE"
    assert obj["experts_format"] == "int4" and obj["shared_expert_width"] == 16
    assert (
        obj["bytes_per_token"]["dense"]
        < json.loads(show(capsys, str(src_dir / "qwen3_5_moe"), "--json")[1])["bytes_per_token"]["dense"]
    )  # int4 experts read fewer bytes


SHAPE_CASES = [  # (id, argv, checks on the JSON)
    (
        "qwen3.5-35b-24GiB",
        ["qwen3.5-35b", "--vram", "24"],
        dict(layers=40, experts=256, top_k=8, expert_width=512, offloading=True, fits=True),
    ),
    (
        "qwen3.5-35b-int4-24GiB",
        ["qwen3.5-35b", "--vram", "24", "--experts", "int4"],
        dict(layers=40, experts=256, top_k=8, expert_width=512, offloading=False, fits=True),
    ),
    (
        "qwen3-30b-8GiB",
        ["qwen3-30b", "--vram", "8"],
        dict(layers=48, experts=128, top_k=8, expert_width=768, offloading=True, fits=True),
    ),
    (
        "qwen3.5-35b-too-small",
        ["qwen3.5-35b", "--vram", "1"],
        dict(layers=40, experts=256, top_k=8, expert_width=512, offloading=None, fits=False),
    ),
]


def test_show_estimates_mxfp4_experts_as_stored(capsys):
    """gpt-oss-20b ships its experts in MXFP4 (4-bit values, a byte of scale per 32): offline, the download estimate
    counts them so (about 13.8 GB, the size of openai's files), not as bf16 (about 42 GB)."""
    code, out, _ = show(capsys, "gpt-oss-20b", "--json")
    obj = json.loads(out)
    assert code == 0 and obj["download_source"] == "estimate"
    assert obj["download_estimate"] == "experts in MXFP4, the rest in bfloat16"
    L, E, I, H = obj["moe_layers"], obj["experts"], obj["expert_width"], obj["hidden"]
    experts = L * E * 3 * I * H
    assert obj["download_bytes"] == 2 * (obj["params_total"] - experts) + experts * (0.5 + 1 / 32)
    assert 13.5e9 < obj["download_bytes"] < 14e9
    assert "(estimated: experts in MXFP4, the rest in bfloat16)" in show(capsys, "gpt-oss-20b")[1]


@pytest.mark.parametrize(("argv", "want"), [c[1:] for c in SHAPE_CASES], ids=[c[0] for c in SHAPE_CASES])
def test_show_registry_alias_offline(capsys, argv, want):
    """Not downloaded and offline: the config of localmoe's table of shapes, the size estimated from parameters."""
    code, out, err = show(capsys, *argv, "--json")
    obj = json.loads(out)
    assert code == 0 and err == ""
    _numbers(obj)
    assert obj["config_source"] == "shapes" and obj["download_source"] == "estimate"
    assert obj["download_bytes"] == 2 * obj["params_total"] and obj["default_sparsity"] > 0.8
    assert obj["download_estimate"] == "parameters in bfloat16"
    assert {k: obj[k] for k in ("layers", "experts", "top_k", "expert_width")} == {
        k: want[k] for k in ("layers", "experts", "top_k", "expert_width")
    }
    v = obj["vram"]
    assert v["fits"] is want["fits"] and v.get("offloading") is want["offloading"]
    if want["offloading"]:
        assert 0 < v["experts_cached"] < v["experts_total"] and v["host_ram_bytes"] > 20 * 2**30
        assert v["direct_gates_cached"] > v["experts_cached"]  # gates first: more gates than whole experts
    if not want["fits"]:
        assert "cannot hold" in v["error"]
    text = show(capsys, *argv)[1]
    assert "offline and not downloaded: config from localmoe's table of shapes" in text.splitlines()[0]


@pytest.mark.parametrize(
    ("argv", "code", "says"),
    [
        (["someone/some-moe"], 1, "is not downloaded and its config.json cannot be fetched (HF_HUB_OFFLINE is set)"),
        (["qwen3.5-35"], 2, "did you mean qwen3.5-35b"),
        (["gpt-oss-20b"], 2, "GPT-OSS is not yet supported"),
        (["./no/such/dir"], 2, "does not exist"),
        ([repo_id("qwen3_moe"), "--context", "1024"], 2, "--context 1024 is more than"),
        ([repo_id("qwen3_moe"), "--vram", "nan"], 2, "--vram must be a finite number"),
        ([repo_id("qwen3_dense")], 2, "supported: Qwen3.5-MoE"),
    ],
    ids=[
        "offline-not-in-shapes",
        "unknown",
        "unsupported",
        "missing-folder",
        "context-too-long",
        "vram-nan",
        "not-moe",
    ],
)
def test_show_errors(hub_cache, capsys, monkeypatch, argv, code, says):
    if argv == ["gpt-oss-20b"]:  # every family runs: GPT-OSS marked unsupported for this test
        tiny_models.mark_unsupported(monkeypatch)
    got, out, err = show(capsys, *argv)
    assert got == code and out == "" and err.startswith("localmoe: error: ") and err.count("\n") == 1
    assert says in err


def test_every_supported_registry_model_has_a_real_shape(capsys):
    """`bench --shape` and `show` offline work for every registry model localmoe runs: its config is in
    localmoe/data/shapes.json, and the parameters built from it are the registry's published count (within 7%:
    Granite 1B-A400M's 1.3B is rounded down from 1.385B)."""
    from localmoe.models.families import family_for_model_type
    from localmoe.models.registry import load_registry

    for alias, spec in load_registry().models.items():
        fam = family_for_model_type(spec.family)
        if fam is None or fam.unsupported:
            continue
        code, out, err = show(capsys, alias, "--json")
        assert code == 0, (alias, err)
        obj = json.loads(out)
        assert obj["config_source"] in ("shapes", "bundled"), alias
        if obj["config_source"] == "shapes":
            assert abs(obj["params_total"] / 1e9 / spec.params_b - 1) < 0.07, (alias, obj["params_total"])
