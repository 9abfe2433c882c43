"""Mixtral (`mixtral`): Mixtral-8x7B. The checkpoint's MoE block is `block_sparse_moe` (transformers names it `mlp`)
and its experts are per-expert w1 (gate), w3 (up), w2 (down); num_local_experts experts of intermediate_size."""

from localmoe.models.families.spec import FamilySpec, TinyModel

SPEC = FamilySpec(
    name="Mixtral",
    block_class="MixtralSparseMoeBlock",
    model_types=("mixtral",),
    renames=((r"\.block_sparse_moe\.", ".mlp."),),
    expert_names=("w1", "w3", "w2"),
    expert_count_key="num_local_experts",
    expert_width_key="intermediate_size",
    tiny=TinyModel(config={"intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2}),
)
