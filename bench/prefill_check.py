"""GPU check of offloaded prompt processing (not a test; run on the H200): tokens unchanged (issue #29).

Tiny random checkpoints of each family, bf16 on CUDA (the grouped GEMMs' dtype), with each expert format (full,
int4, nf4 when bitsandbytes imports): a prompt longer than the sparse-token limit, so an offloaded engine streams its
routed experts through the staging buffers (pinned master copies: filled by `gather_experts`). The offloaded engine
(room for ~1/3 of the experts; decode steps first, so its pools hold some; its sparse-token limit lowered under
the prompt) against the resident one: last-position
prefill logits (max abs difference; 0 expected: each expert's grouped GEMM is the same arithmetic whatever its span)
and greedy tokens at sparsity 0, and the staging path's own figures (spans filled by the kernel). The bundled
localmoe-tiny-deamoe too (its prompt staged a group of departments at a time: the bytes staged, the cache's mode).
Usage: PYTHONUNBUFFERED=1 python bench/prefill_check.py (bench/gpu_release_check.sh runs it; `--device cpu`: a CPU
smoke run, the staging spans filled by per-expert copies there). With `--host-spans` / `--int4-in-place` / `--deltanet
PREPARE/PRECISION` / `--prefill-norms` / `--prefill-block` / `--prefill-attention` the same check runs with
`DensePath.device_spans` off / `DensePath.int4_in_place` and `int4_staged_packed` on / the Gated DeltaNet prefill's
rule that way (e.g. triton/ieee: `FusedGatedDeltaNet.prefill_prepare`, `prefill_precision`) /
`FusedDecoderLayer.prefill_norms` / `FusedSparseMoeBlock.prefill_fused` / `FusedAttention.prefill_fused` on, in
both engines, before one becomes a default; `--cpu-share F`: `Staging.cpu_share` (a share of the offloaded full
experts computed on the CPU: its matmuls round differently, so the logits differ a little; the tokens must not);
`--stage`: `Staging.stage_layers` on for every piece (int4 / NF4 absent experts staged a layer
ahead, experts/layer_stage.py); `--stage-gather`: the layer stage filled by gather_experts, not the copy engines
(`LayerStage.by_copy_engines`); `--joined`: a span's three projections dequantized in one launch
(kernels/gather_dequant.py `JOINED`). The last column says "+ stage" where a layer went through the layer stage.
"""

import os
import sys
import tempfile
import traceback
from pathlib import Path

root = Path(tempfile.mkdtemp())
os.environ.update(HF_HUB_CACHE=str(root / "hub"), HF_HUB_OFFLINE="1", XDG_CACHE_HOME=str(root / "xdg"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import tiny_models  # noqa: E402
import torch  # noqa: E402

from localmoe.decode.attention import FusedAttention  # noqa: E402
from localmoe.decode.decoder_layer import FusedDecoderLayer  # noqa: E402
from localmoe.decode.deltanet import FusedGatedDeltaNet  # noqa: E402
from localmoe.decode.moe_layer import FusedSparseMoeBlock  # noqa: E402
from localmoe.engine.engine import Engine  # noqa: E402
from localmoe.events import GenerationSettings  # noqa: E402
from localmoe.experts.dense_path import DensePath  # noqa: E402
from localmoe.experts.layer_stage import LayerStage  # noqa: E402
from localmoe.experts.placement import WORKSPACE_RESERVE  # noqa: E402
from localmoe.experts.staging import Staging  # noqa: E402
from localmoe.kernels import gather_dequant  # noqa: E402

DEV = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cuda"
DEAMOE = "localmoe-tiny-deamoe"  # bundled: DeaMoE's departments staged instead of experts
try:
    import bitsandbytes  # noqa: F401

    FORMATS = ("full", "int4", "nf4")
except ImportError:
    FORMATS = ("full", "int4")


def third_budget(repo: str, fmt: str) -> float:
    """A VRAM budget (GiB) with room for about a third of the model's experts."""
    plan = Engine.load(repo, device=DEV, dtype="bfloat16", sparsity=0.0, experts=fmt, vram_gib=64.0).loaded.offload
    fixed = plan.non_expert_bytes + plan.state_bytes + (1 << 29)
    return (fixed + (plan.total_experts // 3) * plan.expert_bytes) / 2**30


def check(repo: str, fmt: str) -> tuple:
    resident = Engine.load(repo, device=DEV, dtype="bfloat16", sparsity=0.0, experts=fmt)
    off = Engine.load(repo, device=DEV, dtype="bfloat16", sparsity=0.0, experts=fmt, vram_gib=third_budget(repo, fmt))
    cache = off.loaded.cache
    s = GenerationSettings(max_new_tokens=16)
    warm = off.encode_raw("A few decode steps first, so the expert pools hold some experts.")
    for _ in off.generate(warm, s):
        pass
    ids = resident.encode_raw("Long prompts stream their experts through the staging buffers. " * 5)
    for m in off.loaded.experts:  # the tiny model's limit could pass the prompt: force the dense (staging) path
        m.max_sparse_tokens = min(m.max_sparse_tokens, 16)
    cache.reset_stats()
    diff, same = compare(resident, off, ids)
    gathered = sum(cache.staging.gathers.values())
    hits = f"{cache.hits}/{cache.hits + cache.misses}"
    staged = " + stage" if cache.staging.stage is not None else ""
    return len(ids), diff, same, hits, f"{gathered}/{len(cache.masters)}{staged}"


def compare(resident, off, ids: list[int]) -> tuple[float, bool]:
    """(max |last-position prefill logit difference|, greedy tokens equal) of the offloaded engine against the
    resident one on the prompt `ids`."""
    x = torch.tensor([ids], device=DEV)
    with torch.inference_mode():
        want = resident.model(input_ids=x, logits_to_keep=1).logits.float()
        got = off.model(input_ids=x, logits_to_keep=1).logits.float()
    s = GenerationSettings(max_new_tokens=16)
    same = [ev.token_id for ev in off.generate(ids, s)] == [ev.token_id for ev in resident.generate(ids, s)]
    return float((got - want).abs().max()), same


def check_deamoe() -> tuple:
    """The bundled localmoe-tiny-deamoe with room for half its departments' shared projections and a few private
    parts: the prompt takes the dense path through staged groups of departments (experts/department_dense.py). In
    fp32, where each department's GEMMs run alone in both engines: in bf16 torch's grouped GEMM rounds a department's
    rows differently when its group holds fewer departments (1 ulp of a layer's output on the H200, 0.094 in the
    logits after 8 layers), which says nothing about the staging."""
    resident = Engine.load(DEAMOE, device=DEV, dtype="float32", sparsity=0.0, vram_gib=64.0)
    p = resident.loaded.offload
    room = p.departments_total // 2 * p.department_bytes + 16 * p.private_bytes
    budget = (p.non_expert_bytes + p.state_bytes + WORKSPACE_RESERVE + room) / 2**30
    off = Engine.load(DEAMOE, device=DEV, dtype="float32", sparsity=0.0, vram_gib=budget)
    cache = off.loaded.cache
    ids = resident.encode_raw("Departments of experts share their projections; a prompt stages them in groups. " * 4)
    for m in off.loaded.experts:
        m.max_sparse_tokens = min(m.max_sparse_tokens, 8)
    cache.copied_bytes = 0
    diff, same = compare(resident, off, ids)
    return len(ids), diff, same, f"{cache.copied_bytes / 2**20:.0f} MiB", f"{cache.mode} mode"


def row(family: str, fmt: str, check_fn, *args) -> tuple:
    """The table row of one check, or an ERROR row (with the traceback printed) if it raised."""
    try:
        return (family, fmt, *check_fn(*args))
    except Exception as ex:  # noqa: BLE001 - one check's failure is a row, not the end of the table
        traceback.print_exc()
        return (family, fmt, "-", "ERROR", f"{type(ex).__name__}: {ex}"[:80], "-", "-")


def main() -> None:
    if "--host-spans" in sys.argv:
        DensePath.device_spans = False
    if "--int4-in-place" in sys.argv:  # int4 read in place, offloaded (staged packed) and resident
        DensePath.int4_in_place = DensePath.int4_staged_packed = True
    if "--deltanet" in sys.argv:
        way = sys.argv[sys.argv.index("--deltanet") + 1].split("/")
        FusedGatedDeltaNet.prefill_prepare, FusedGatedDeltaNet.prefill_precision = way
    if "--prefill-norms" in sys.argv:
        FusedDecoderLayer.prefill_norms = True
    if "--prefill-block" in sys.argv:
        FusedSparseMoeBlock.prefill_fused = True
    if "--prefill-attention" in sys.argv:
        FusedAttention.prefill_fused = True
    if "--cpu-share" in sys.argv:
        Staging.cpu_share = float(sys.argv[sys.argv.index("--cpu-share") + 1])
    if "--stage" in sys.argv or "--stage-gather" in sys.argv:
        Staging.stage_layers, Staging.stage_rows = True, 0  # the tiny prompts' pieces too
    if "--stage-gather" in sys.argv:
        LayerStage.by_copy_engines = False
    if "--joined" in sys.argv:
        gather_dequant.JOINED = True
    rule = f"{FusedGatedDeltaNet.prefill_prepare}/{FusedGatedDeltaNet.prefill_precision}"
    norms = FusedDecoderLayer.prefill_norms
    block, attention = FusedSparseMoeBlock.prefill_fused, FusedAttention.prefill_fused
    print(f"device_spans {DensePath.device_spans}, int4_in_place {DensePath.int4_in_place} (staged packed "
          f"{DensePath.int4_staged_packed}), DeltaNet prefill {rule}, prefill_norms {norms}, block {block}, "
          f"attention {attention}, cpu_share {Staging.cpu_share}, "
          f"stage_layers {Staging.stage_layers} (copy engines "
          f"{LayerStage.by_copy_engines}), joined dequant {gather_dequant.JOINED}")  # fmt: skip
    rows = [row("deamoe", "full", check_deamoe)]
    for fam in tiny_models.SUPPORTED:
        repo = f"{tiny_models.ORG}/tiny-{fam}"
        folder = tiny_models.save_checkpoint(fam, root / "src" / fam)
        tiny_models.place_in_hf_cache(folder, root / "hub", repo)
        for fmt in FORMATS if fam != "gpt_oss" else ("full",):  # GPT-OSS: its checkpoint's MXFP4 (int4/nf4 refused)
            rows.append(row(fam, fmt, check, repo, fmt))
    print("\nfamily        experts  prompt  max |logit diff|  tokens equal  staged hits  layers gathered")
    for fam, fmt, n, diff, same, hits, gathered in rows:
        d = f"{diff:.3g}" if isinstance(diff, float) else diff
        print(f"{fam:<13} {fmt:<8} {n!s:<7} {d:<17} {same!s:<13} {hits:<12} {gathered}")
    bad = [r for r in rows if r[4] is not True]
    print("PREFILL CHECK:", "FAILED" if bad else "passed")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
