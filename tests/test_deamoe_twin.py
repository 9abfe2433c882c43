"""DeaMoE's Qwen3.5 twin (models/deamoe/qwen3_5.py) and DeaMoE's fused decode block; the DeaMoE bench shapes.

- The bench shapes (localmoe/data/shapes.json) hold what they claim: the twin has Qwen3.5-35B-A3B's routed-expert
  parameters and per-token multiply-adds within 2%, deamoe-7b its vanilla partner's within 3%.
- A tiny twin round-trips through a real HF cache (offline); the Engine's greedy tokens equal transformers' generate.
- Decode replacements (CPU, TRITON_INTERPRET=1): DeaMoE's block and the twin's layers are fused (group-limited
  router in one launch, router_topk's department mode), and greedy decode equals the unfused model's.
- Random weights (bench --shape) fill DepartmentExperts, resident and offloaded (the department cache's host master
  copies), and both decode the same tokens.
- A twin checkpoint missing a tensor is refused in one line naming it.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import test_fused  # noqa: E402
import test_fused_model  # noqa: E402
import tiny_models  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from localmoe.decode import moe_layer, replacements  # noqa: E402
from localmoe.errors import UsageError  # noqa: E402
from localmoe.experts.department_cache import DepartmentCache  # noqa: E402
from localmoe.experts.departments import DepartmentExperts  # noqa: E402
from localmoe.models.deamoe import DeaMoeConfig, DeaMoeForCausalLM, DeaMoeQwen35Config, DeaMoeQwen35ForCausalLM  # noqa: E402
from localmoe.models.deamoe.checkpoint import check_checkpoint  # noqa: E402
from localmoe.models.shapes import shape_config  # noqa: E402

DEV = test_fused.DEV
REPO = "localmoe-test/tiny-deamoe-qwen3_5"


def twin_config(**kw) -> DeaMoeQwen35Config:
    base = dict(
        vocab_size=tiny_models.VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        shared_expert_intermediate_size=32, num_departments=3, experts_per_department=4, department_size=32,
        num_experts_per_tok=4, topk_group=2, private_init_noise=0.05, pad_token_id=0, eos_token_id=2,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    )  # fmt: skip
    return DeaMoeQwen35Config(**{**base, **kw})


def _moe(cfg) -> tuple[int, int]:
    """(routed-expert parameters + router, multiply-adds per token) of one MoE layer."""
    H = cfg.hidden_size
    if hasattr(cfg, "num_departments"):
        D, n, h, k = cfg.num_departments, cfg.experts_per_department, cfg.department_size, cfg.num_experts_per_tok
        g = min(k, cfg.topk_group, D)
        return D * 3 * h * H + D * n * h * h + D * n * H, g * 3 * h * H + k * h * h + D * n * H
    E, I, k = cfg.num_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    return E * 3 * I * H + E * H, k * 3 * I * H + E * H


@pytest.mark.parametrize(
    "twin, vanilla, tol", [("qwen3.5-35b-deamoe", "qwen3.5-35b", 0.02), ("deamoe-7b", "deamoe-7b-vanilla", 0.03)]
)
def test_bench_shapes_match_their_vanilla_partner(twin, vanilla, tol):
    t, v = shape_config(twin), shape_config(vanilla)
    assert type(t).__name__ in ("DeaMoeQwen35Config", "DeaMoeConfig")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert getattr(t, key) == getattr(v, key), key
    (pt, mt), (pv, mv) = _moe(t), _moe(v)
    assert abs(pt / pv - 1) < tol and abs(mt / mv - 1) < tol
    if twin == "qwen3.5-35b-deamoe":
        assert t.layer_types == v.layer_types
        assert t.shared_expert_intermediate_size == v.shared_expert_intermediate_size


@pytest.fixture(scope="module")
def cached(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("twin") / "src"
    test_fused.nontrivial(DeaMoeQwen35ForCausalLM(twin_config()).eval()).save_pretrained(folder)
    tiny_models.char_tokenizer().save_pretrained(folder)
    return tiny_models.place_in_hf_cache(folder, Path(os.environ["HF_HUB_CACHE"]), REPO)


def test_twin_engine_tokens_equal_transformers_generate(cached):
    from transformers import AutoModelForCausalLM

    from localmoe.engine.engine import Engine
    from localmoe.events import GenerationSettings

    engine = Engine.load(REPO, device="cpu", sparsity=0.0)
    assert engine.loaded.family.key == "deamoe_qwen3_5_text"
    assert all(type(m) is DepartmentExperts for m in engine.loaded.experts) and len(engine.loaded.experts) == 4
    ids = engine.encode_raw("departments share weights")
    got = [e.token_id for e in engine.generate(ids, GenerationSettings(max_new_tokens=6, temperature=0.0))]
    ref = AutoModelForCausalLM.from_pretrained(REPO, dtype=torch.float32).eval()
    assert type(ref) is DeaMoeQwen35ForCausalLM
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, repetition_penalty=1.0)
    assert got == out[0, len(ids) :].tolist()[: len(got)] and len(got) > 1


def _tiny_deamoe():
    cfg = DeaMoeConfig(
        vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_departments=3, experts_per_department=3, department_size=32, num_experts_per_tok=3, topk_group=2,
        private_init_noise=0.05,
    )  # fmt: skip
    torch.manual_seed(1)
    return DeaMoeForCausalLM(cfg).eval()


@pytest.mark.parametrize("which", ["twin", "deamoe"])
@torch.no_grad()
def test_fused_decode_equals_unfused(which):
    """The fused block routes with router_topk's department mode and runs the department kernel; the twin's decoder
    layer is Qwen3.5's fused one. Greedy decode (static cache) equals the unfused model's, logits within fp32
    rounding."""
    torch.manual_seed(0)
    two = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])  # one of each: interpreter time
    ref = (
        test_fused.nontrivial(DeaMoeQwen35ForCausalLM(twin_config(**two))).eval() if which == "twin" else _tiny_deamoe()
    )
    ref = ref.to(DEV)
    for m in ref.modules():
        if isinstance(m, DepartmentExperts):
            m.kernel_on_cpu = DEV == "cpu"  # the decode kernel under the interpreter, as the fused model runs it
    prompt = torch.randint(3, 90, (1, 6), generator=torch.Generator().manual_seed(5)).to(DEV)
    want, want_toks = test_fused._run(ref, "static", prompt, steps=2)
    model = copy.deepcopy(ref)
    done = replacements.install(model, DEV, force=True)
    if which == "twin":
        assert done["DeaMoeQwen35DecoderLayer"] == 2 and done["DeaMoeQwen35SparseMoeBlock"] == 2
        assert done["DeaMoeQwen35TextModel"] == 1
    else:  # Qwen3-MoE's decoder and text model around the DeaMoE block
        assert done["DeaMoeSparseMoeBlock"] == 2 and done["DeaMoeDecoderLayer"] == 2 and done["DeaMoeModel"] == 1
    got, got_toks = test_fused._run(model, "static", prompt, steps=2)
    blocks = [m for m in model.modules() if type(m).__name__ == "FusedSparseMoeBlock"]
    assert blocks and all(b.decode_calls > 0 for b in blocks)  # the fused call was taken
    # the decoder layer's front: moe_front (group-limited, the slots) + the department kernel's tail
    assert all(b.front_calls > 0 for b in blocks)
    assert model.model.decode_calls == 2  # the text model's fused step too (its forward is Qwen3.5's / Qwen3-MoE's)
    assert got_toks == want_toks
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="counts Triton launches of the interpreter")
@torch.no_grad()
def test_twin_moe_block_launches(monkeypatch):
    """The twin's decoder layer from the mixer's output on (resident, sparsity 0.5): moe_front (residual add, norm,
    group-limited top-k, the shared expert into the workspace row, the department slots written by its routing
    program), the department kernel (both phases in one launch for one token) adding into the row and publishing
    residual + row: 2 launches (was 9: norm with the add, router, slotting, 3, cast, the shared expert's 2; 3 with
    the slotting's own launch, `slots_in_front` off)."""
    torch.manual_seed(0)
    model = (
        test_fused.nontrivial(DeaMoeQwen35ForCausalLM(twin_config(num_hidden_layers=1, layer_types=["full_attention"])))
        .eval()
        .to(DEV)
    )
    for m in model.modules():
        if isinstance(m, DepartmentExperts):
            m.kernel_on_cpu = DEV == "cpu"
            m.tau = torch.full((m.num_departments,), 0.05)
            m.sparse_enabled = True
    replacements.install(model, DEV, force=True)
    ops = test_fused_model._count_step(model, monkeypatch, warm=True, layer=0).ops
    print(f"\nlaunches of the twin's decoder layer: {ops}")
    moe = ops[ops.index("triton:_moe_front_kernel") :]
    assert moe == ["triton:_moe_front_kernel", "triton:_dept_one_kernel"]
    monkeypatch.setattr(moe_layer.FusedSparseMoeBlock, "slots_in_front", False)
    ops = test_fused_model._count_step(model, monkeypatch, warm=True, layer=0).ops
    moe = ops[ops.index("triton:_moe_front_kernel") :]
    assert moe == ["triton:_moe_front_kernel", "triton:_slots_kernel", "triton:_dept_one_kernel"]


def _greedy(model, ids, n=5):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, repetition_penalty=1.0)
    return out[0, len(ids) :].tolist()


def test_random_weights_fill_departments_resident_and_offloaded():
    """build_random (bench --shape) on a tiny twin: every DepartmentExperts parameter drawn; under a budget that
    holds every department but few private parts, the department cache fronts host master copies, and greedy tokens
    equal the resident model's."""
    from localmoe.experts.placement import WORKSPACE_RESERVE
    from localmoe.models.loader import LoadOptions
    from localmoe.models.random_weights import build_random

    cfg, dev, dt = twin_config(), torch.device("cpu"), torch.float32
    resident = build_random(cfg, device=dev, dtype=dt, options=LoadOptions(vram_bytes=64 << 30))
    p = resident.offload
    assert not p.offloading and resident.cache is None
    assert all(type(m) is DepartmentExperts for m in resident.experts)
    assert all(t.abs().sum() > 0 and torch.isfinite(t).all() for m in resident.experts for t in m.parameters())
    budget = p.non_expert_bytes + p.state_bytes + WORKSPACE_RESERVE + p.departments_total * p.department_bytes
    offloaded = build_random(cfg, device=dev, dtype=dt, options=LoadOptions(vram_bytes=budget + 6 * p.private_bytes))
    assert offloaded.offload.offloading and isinstance(offloaded.cache, DepartmentCache)
    for a, b in zip(resident.experts, offloaded.experts):
        assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))  # same seed, same draw
    ids = list(range(5, 17))
    assert _greedy(offloaded.model, ids) == _greedy(resident.model, ids)


def test_twin_checkpoint_missing_shared_expert_refused(tmp_path):
    folder = tmp_path / "ckpt"
    DeaMoeQwen35ForCausalLM(twin_config()).save_pretrained(folder)
    name = "model.layers.2.mlp.shared_expert.up_proj.weight"
    path = next(folder.glob("*.safetensors"))
    tensors = load_file(path)
    del tensors[name]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(UsageError) as err:
        check_checkpoint(folder)
    msg = str(err.value)
    assert "\n" not in msg and f"tensor {name} is missing" in msg and msg.startswith("deamoe_qwen3_5_text checkpoint")
