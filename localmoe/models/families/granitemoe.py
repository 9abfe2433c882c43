"""GraniteMoE (`granitemoe`): Granite 3.1 1B-A400M and 3B-A800M. The checkpoint stores each layer's experts fused
as `input_linear` (gate|up) and `output_linear` (down), and its router as `router.layer`: renamed to transformers'
`experts.gate_up_proj`, `experts.down_proj` and `router.weight`."""

from localmoe.models.families.spec import FamilySpec, TinyModel

SPEC = FamilySpec(
    name="GraniteMoE",
    block_class="GraniteMoeMoE",
    model_types=("granitemoe",),
    renames=(
        (r"block_sparse_moe\.input_linear\.weight$", "block_sparse_moe.experts.gate_up_proj"),
        (r"block_sparse_moe\.output_linear\.weight$", "block_sparse_moe.experts.down_proj"),
        (r"block_sparse_moe\.router\.layer\.weight$", "block_sparse_moe.router.weight"),
    ),
    expert_count_key="num_local_experts",
    expert_width_key="intermediate_size",
    tiny=TinyModel(config={"intermediate_size": 16, "num_local_experts": 4, "num_experts_per_tok": 2}),
)
