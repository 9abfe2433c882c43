"""OLMoE (`olmoe`): OLMoE-1B-7B. Per-expert checkpoint tensors (gate_proj, up_proj, down_proj) as wide as the
config's intermediate_size, no shared expert, top-k weights not renormalised; its MoE block is fused for decode."""

from localmoe.models.families.spec import FamilySpec, TinyModel

SPEC = FamilySpec(
    name="OLMoE",
    block_class="OlmoeSparseMoeBlock",
    model_types=("olmoe",),
    expert_names=("gate_proj", "up_proj", "down_proj"),
    expert_count_key="num_experts",
    expert_width_key="intermediate_size",
    tiny=TinyModel(config={"intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2}),
)
