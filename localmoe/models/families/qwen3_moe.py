"""Qwen3-MoE (`qwen3_moe`): Qwen3-30B-A3B and localmoe-tiny. Per-expert checkpoint tensors (gate_proj, up_proj,
down_proj), no shared expert, top-k weights renormalised (norm_topk_prob); its MoE block is fused for decode."""

from localmoe.models.families.spec import FamilySpec, TinyModel

SPEC = FamilySpec(
    name="Qwen3-MoE",
    block_class="Qwen3MoeSparseMoeBlock",
    model_types=("qwen3_moe",),
    expert_names=("gate_proj", "up_proj", "down_proj"),
    expert_count_key="num_experts",
    expert_width_key="moe_intermediate_size",
    tiny=TinyModel(
        config={
            "head_dim": 8,
            "moe_intermediate_size": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 48,
            "norm_topk_prob": True,
        }
    ),
)
